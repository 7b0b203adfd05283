"""A CPU engine's intra-op threads: the process's CPU share, OMP_NUM_THREADS as a ceiling,
the explicit option, a Ray worker's num_cpus, and the count set on each stepping thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from actors.engine import cpu_threads
from actors.engine.cpu_threads import cpu_share, resolve_cpu_threads
from actors.engine.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "cpu_share", lambda: (4, "test"))


def test_share_per_rank_and_the_omp_ceiling(four_cpus, monkeypatch):
    assert resolve_cpu_threads("cpu", None)[0] == 4
    assert resolve_cpu_threads("cpu", None, tensor_parallel_size=2)[0] == 2
    assert resolve_cpu_threads("cpu", None, tensor_parallel_size=8)[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_cpu_threads("cpu", None) == (3, "OMP_NUM_THREADS=3, below 4 CPUs (test)")
    monkeypatch.setenv("OMP_NUM_THREADS", "16")  # a ceiling, not a target
    assert resolve_cpu_threads("cpu", None)[0] == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert resolve_cpu_threads("cpu", None)[0] == 4


def test_explicit_option_and_gpu_engines(four_cpus):
    assert resolve_cpu_threads("cpu", 7) == (7, "engine.cpu_threads")
    assert resolve_cpu_threads("cuda:0", None) == (None, "a GPU engine")
    assert resolve_cpu_threads("cuda", 3)[0] == 3


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_option_is_checked(value):
    with pytest.raises(ValueError, match="engine.cpu_threads"):
        EngineConfig(device="cpu", cpu_threads=value)


@pytest.mark.parametrize("assigned, expected", [({"CPU": 2.5}, 2), ({"CPU": 0.5}, 1), ({}, 1)])
def test_a_ray_workers_share_is_its_num_cpus(monkeypatch, assigned, expected):
    context = types.SimpleNamespace(get_assigned_resources=lambda: assigned)
    fake = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert cpu_share() == (expected, "the Ray worker's num_cpus")


def test_a_ray_driver_uses_the_cpus_it_may_run_on(monkeypatch):
    def driver_context():
        raise AssertionError("This method is only available when the process is a worker")

    context = types.SimpleNamespace(get_assigned_resources=driver_context)
    fake = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert cpu_share() == (len(os.sched_getaffinity(0)), "the CPUs this process may use")


_CHILD = """
import ctypes, json, os, sys, threading
import torch
torch.set_num_threads(3)  # a caller's count: the engine's policy decides
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # a share of one CPU
from actors.engine.llm_engine import Engine

# this thread's OpenMP count, asked of the runtime torch loaded (torch.get_num_threads() is
# process-wide, and torch's own queries set the asking thread's count)
_omp = next(line.split()[-1] for line in open("/proc/self/maps") if "omp" in line.split("/")[-1])
omp_threads = ctypes.CDLL(_omp).omp_get_max_threads

out = {}
ran, built = threading.Event(), threading.Event()

def step_on_a_thread():  # a thread that ran torch work before the engine existed
    torch.ones(1 << 16).add_(1)  # its first parallel op: torch gives this thread 3 threads
    out["thread_before"] = omp_threads()
    ran.set()
    built.wait()
    engine.generate([(0, [5, 6, 7], {"max_tokens": 2, "seed": 1})])
    out["thread_after"] = omp_threads()

t = threading.Thread(target=step_on_a_thread)
t.start()
ran.wait()
engine = Engine(sys.argv[1], {"device": "cpu", "max_num_seqs": 2, "max_model_len": 64,
                              "num_kv_blocks": 16})
out.update(main=torch.get_num_threads(), info=engine.info()["cpu_threads"])
built.set()
t.join()
print(json.dumps(out))
"""


def test_engine_takes_its_share_on_every_stepping_thread(tiny_llama):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run([sys.executable, "-c", _CHILD, tiny_llama], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"main": 1, "info": 1, "thread_before": 3, "thread_after": 1}
