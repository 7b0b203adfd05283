"""Actor death (issue 8): actors of a 2,000-row job killed 3 times at random points, by
``ray.kill`` from the driver and by a process exit from inside the actor. The job finishes
with rows one-to-one with its input and bit-identical to a clean run; no shard is tried more
than ``max_shard_attempts`` times.

(A shard that keeps killing its actor until it runs out of attempts is written as error rows:
``test_dispatch.py::test_poison_shards_become_error_rows_and_bystanders_do_not``.)
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray.cloudpickle

import jobs.cluster
from actors.actor import GenerationActor
from jobs.manifest import FAULTS_ENV, SUCCESS, read_manifest
from jobs.runner import run_job
from tests.jobs.helpers import assert_identical, read_output, temporaries

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def faulty_actor(run_dir: str, die_at_step: int) -> type:
    """A GenerationActor that writes ``<run_dir>/actor-<id>.pid`` once loaded, and whose
    process exits (``os._exit``) at its ``die_at_step``-th engine step if it is the first
    actor to claim the file ``<run_dir>/exit-token``: one exit from inside per job."""

    class FaultyActor(GenerationActor):
        def __init__(self, model, engine_config=None, *, first_shard=None):
            super().__init__(model, engine_config, first_shard=first_shard)
            actor_id = ray.get_runtime_context().get_actor_id()
            with open(os.path.join(run_dir, f"actor-{actor_id}.pid"), "w") as f:
                f.write(str(os.getpid()))
            step, counter = self.engine.step, itertools.count(1)
            token = os.path.join(run_dir, "exit-token")

            def step_or_exit():
                if next(counter) == die_at_step:
                    try:
                        os.rename(token, f"{token}.claimed-by-{os.getpid()}")
                    except FileNotFoundError:
                        pass  # another actor already died for this token
                    else:
                        os._exit(1)
                return step()

            self.engine.step = step_or_exit

    return FaultyActor


class _Killer(threading.Thread):
    """``ray.kill``s a loaded, live actor at random moments, ``kills`` times: the first one
    1-4 s after the first actor has loaded, the next ones 0.5-3 s apart."""

    def __init__(self, handles: list, run_dir: Path, kills: int, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.handles, self.run_dir, self.kills, self.rng = handles, run_dir, kills, rng
        self.killed: list = []
        self.stop = threading.Event()

    def _pid(self, handle) -> int | None:
        """The process of a loaded actor that is still running and has not claimed the exit
        token, else None: killing an actor that is exiting by itself would make one death of
        two."""
        path = self.run_dir / f"actor-{handle._actor_id.hex()}.pid"
        try:
            pid = int(path.read_text())
        except (OSError, ValueError):
            return None  # still loading
        if (self.run_dir / f"exit-token.claimed-by-{pid}").exists():
            return None
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None  # gone
        return pid if state not in ("Z", "X") else None  # a zombie has exited already

    def run(self) -> None:
        while not self.stop.is_set() and not list(self.run_dir.glob("actor-*.pid")):
            time.sleep(0.05)
        delay = self.rng.uniform(1.0, 4.0)
        while not self.stop.wait(delay) and len(self.killed) < self.kills:
            live = [h for h in list(self.handles) if h not in self.killed and self._pid(h)]
            if live:
                victim = self.rng.choice(live)
                ray.kill(victim, no_restart=True)
                self.killed.append(victim)
                delay = self.rng.uniform(0.5, 3.0)
            else:
                delay = 0.05


def test_actors_killed_three_times_job_matches_clean_run(reliability_job, tmp_path,
                                                         monkeypatch, caplog):
    rng = random.Random(20240808)
    handles: list = []
    real_factory = jobs.cluster.actor_factory

    def recording_factory(*args, **kwargs):
        start = real_factory(*args, **kwargs)

        def start_and_record(**kwargs):
            handle = start(**kwargs)
            handles.append(handle)
            return handle

        return start_and_record

    monkeypatch.setattr(jobs.cluster, "actor_factory", recording_factory)
    # commits paced at one per 0.5 s (the driver's RAYGEN_TEST_FAULTS=slow-commits), so the
    # 20 shards take ~10 s and both kills land mid-job: unpaced, the tiny model's job can end
    # ~1 s after the first actor is up, before the first kill
    monkeypatch.setenv(FAULTS_ENV, "slow-commits")
    token = tmp_path / "exit-token"
    token.write_text("one process exit")
    out = tmp_path / "out"
    killer = _Killer(handles, tmp_path, kills=2, rng=rng)
    killer.start()
    attempts = 4  # 3 deaths can never exhaust it, so every row must come out right
    caplog.set_level(logging.WARNING, logger="jobs.dispatch")
    try:
        result = run_job(reliability_job.config(out, max_shard_attempts=attempts),
                         actor_cls=faulty_actor(str(tmp_path), rng.randint(3, 25)),
                         progress=False)
    finally:
        killer.stop.set()
        killer.join(timeout=30)
    assert len(killer.killed) == 2, "the job ended before both ray.kill deaths"
    assert not token.exists() and list(tmp_path.glob("exit-token.claimed-by-*")), \
        "no actor exited from inside"
    # Every death the driver saw got one replacement. A death it never saw needs none: an
    # actor killed while idle at the end of the job (its slot got no further shard).
    seen = [r.getMessage() for r in caplog.records if r.name == "jobs.dispatch"
            and (" lost (" in r.getMessage() or "died while starting" in r.getMessage())]
    assert 1 <= len(seen) <= 3, seen
    assert len(handles) == 2 + len(seen), seen

    table = read_output(out)
    clean = reliability_job.table
    assert_identical(table, clean)
    expected = Counter(clean.column("id").to_pylist())
    assert len(expected) == 2000 and Counter(table.column("id").to_pylist()) == expected
    assert result.errors == 0 and result.shards_failed == 0 and result.input_rows == 2000
    assert result.shards_retried >= 1
    committed = read_manifest(out)["committed"]
    assert sorted(map(int, committed)) == list(range(20))
    assert all(1 <= e["attempt"] <= attempts for e in committed.values())
    assert any(e["attempt"] > 1 for e in committed.values())
    assert (out / SUCCESS).exists()
    assert not temporaries(out)  # temporaries cleaned
