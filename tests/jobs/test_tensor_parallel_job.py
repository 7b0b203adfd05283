"""Jobs whose replicas run the model over two tensor-parallel ranks (CPU, gloo): the same
token ids as one rank, and a rank killed mid-job replaces its whole replica with the shards
retried and the output identical to a clean run."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import pytest
import ray.cloudpickle

from actors.actor import GenerationActor
from jobs.runner import run_job
from tests.jobs.acceptance_data import acceptance_rows
from tests.jobs.helpers import assert_identical, read_output, write_jsonl

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENGINE = {"max_num_seqs": 16, "max_model_len": 128, "num_kv_blocks": 128}


def recording_actor(run_dir: str, kill_at_step: int | None) -> type:
    """A GenerationActor that writes its worker ranks' pids to ``<run_dir>/ranks-<pid>`` and,
    if it claims ``<run_dir>/kill-token`` first, SIGKILLs its rank 1 at its
    ``kill_at_step``-th engine step (one kill per job)."""

    class RecordingActor(GenerationActor):
        def __init__(self, model, engine_config=None, *, first_shard=None):
            super().__init__(model, engine_config, first_shard=first_shard)
            pids = self.engine.replica.pids
            with open(os.path.join(run_dir, f"ranks-{os.getpid()}"), "w") as f:
                f.write(" ".join(map(str, pids)))
            if kill_at_step is None:
                return
            step, counter = self.engine.step, itertools.count(1)
            token = os.path.join(run_dir, "kill-token")

            def step_or_kill():
                if next(counter) == kill_at_step:
                    try:
                        os.rename(token, f"{token}.claimed-by-{os.getpid()}")
                    except FileNotFoundError:
                        pass
                    else:
                        os.kill(pids[0], signal.SIGKILL)
                return step()

            self.engine.step = step_or_kill

    return RecordingActor


@pytest.fixture(scope="module")
def tp_job(ray_local, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-job")
    write_jsonl(root / "in" / "rows.jsonl", acceptance_rows(48))

    def config(output, **engine) -> dict:
        return {"model": tiny_llama, "input": str(root / "in"), "output": str(output),
                "num_actors": 1, "num_gpus_per_actor": 0, "rows_per_shard": 8, "seed": 5,
                "sampling_params": {"max_tokens": 6, "temperature": 0.9},
                "engine": {**ENGINE, **engine}}

    return root, config


def _pids(run_dir) -> list[int]:
    return [int(p) for f in run_dir.glob("ranks-*") for p in f.read_text().split()]


def _gone(pids: list[int], wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_two_ranks_write_the_token_ids_of_one_and_a_killed_rank_is_retried(tp_job, tmp_path):
    root, config = tp_job
    run_job(config(root / "one"), progress=False)
    one = read_output(root / "one")
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    result = run_job(config(root / "two", tensor_parallel_size=2), progress=False,
                     actor_cls=recording_actor(str(clean_dir), None))
    two = read_output(root / "two")
    assert result.errors == 0 and two.num_rows == one.num_rows
    for name in ("id", "sample_index", "output_token_ids", "finish_reason"):
        assert two.column(name).to_pylist() == one.column(name).to_pylist(), name
    assert _pids(clean_dir) and _gone(_pids(clean_dir))  # no rank left behind

    kill_dir = tmp_path / "kill"
    kill_dir.mkdir()
    (kill_dir / "kill-token").write_text("one rank kill")
    result = run_job(config(tmp_path / "out", tensor_parallel_size=2), progress=False,
                     actor_cls=recording_actor(str(kill_dir), 3))
    assert list(kill_dir.glob("kill-token.claimed-by-*")), "no rank was killed"
    assert len(list(kill_dir.glob("ranks-*"))) == 2  # the replica was replaced whole
    assert result.shards_retried >= 1 and result.shards_failed == 0 and result.errors == 0
    assert_identical(read_output(tmp_path / "out"), two)
    assert _gone(_pids(kill_dir))


def test_heads_checked_before_any_actor_starts(tiny_llama, tmp_path):
    write_jsonl(tmp_path / "in" / "rows.jsonl", acceptance_rows(2))
    config = {"model": tiny_llama, "input": str(tmp_path / "in"), "output": str(tmp_path / "o"),
              "num_gpus_per_actor": 0, "engine": {"tensor_parallel_size": 3}}
    with pytest.raises(ValueError, match=r"config\.engine\.tensor_parallel_size: must divide "
                                         r"the model's 4 attention heads, got 3"):
        run_job(config, progress=False)
