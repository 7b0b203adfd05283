"""Jobs whose replicas run the model over two tensor-parallel ranks (CPU, gloo): a placement
group per replica, rank 0 the generation actor, rank 1 a Ray actor. The same token ids as one
rank; a rank actor killed mid-job replaces its whole replica with the shards retried and the
output identical to a clean run; no rank, actor or placement group is left after a job."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time

import pytest
import ray.cloudpickle

from actors.actor import GenerationActor
from actors.engine.parallel.rank_actors import ActorRanks
from jobs.runner import run_job
from tests.jobs.acceptance_data import acceptance_rows
from tests.jobs.helpers import (
    alive_actor_classes,
    assert_identical,
    processes_gone,
    read_output,
    write_jsonl,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENGINE = {"max_num_seqs": 16, "max_model_len": 128, "num_kv_blocks": 128}


def recording_actor(run_dir: str, kill_at_step: int | None) -> type:
    """A GenerationActor that writes its ranks' pids (its own, then those its rank actors
    report) and its placement group to ``<run_dir>/ranks-<pid>`` and, if it claims
    ``<run_dir>/kill-token`` first, SIGKILLs its rank 1 actor's process at its
    ``kill_at_step``-th engine step (one kill per job)."""

    class RecordingActor(GenerationActor):
        def __init__(self, model, engine_config=None, *, first_shard=None):
            super().__init__(model, engine_config, first_shard=first_shard)
            ranks = self.engine.replica.ranks
            pids = self.engine.replica.pids  # from the rank actors (RankActor.describe)
            group = ray.util.get_current_placement_group()
            with open(os.path.join(run_dir, f"ranks-{os.getpid()}"), "w") as f:
                json.dump({"pids": [os.getpid(), *pids], "actors": isinstance(ranks, ActorRanks),
                           "group": group.id.hex() if group else None}, f)
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


def _replicas(run_dir) -> list[dict]:
    return [json.loads(f.read_text()) for f in run_dir.glob("ranks-*")]


def _pids(run_dir) -> list[int]:
    return [p for replica in _replicas(run_dir) for p in replica["pids"]]


def _assert_nothing_left(run_dir) -> None:
    """Every rank's process ended, every replica's placement group removed, no rank actor
    or generation actor alive."""
    replicas = _replicas(run_dir)
    assert replicas and all(r["actors"] and r["group"] for r in replicas), replicas
    assert processes_gone(_pids(run_dir))
    table = ray.util.placement_group_table()
    assert {table[r["group"]]["state"] for r in replicas} == {"REMOVED"}
    deadline = time.monotonic() + 10
    while {"RankActor", "RecordingActor"} & set(alive_actor_classes()) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not {"RankActor", "RecordingActor"} & set(alive_actor_classes())


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
    assert len(_pids(clean_dir)) == 2
    _assert_nothing_left(clean_dir)

    kill_dir = tmp_path / "kill"
    kill_dir.mkdir()
    (kill_dir / "kill-token").write_text("one rank kill")
    result = run_job(config(tmp_path / "out", tensor_parallel_size=2), progress=False,
                     actor_cls=recording_actor(str(kill_dir), 3))
    assert list(kill_dir.glob("kill-token.claimed-by-*")), "no rank was killed"
    replicas = _replicas(kill_dir)
    # the replica was replaced whole: a new rank 0, rank actor and placement group
    assert len(replicas) == 2 and len(set(_pids(kill_dir))) == 4
    assert len({r["group"] for r in replicas}) == 2
    assert result.shards_retried >= 1 and result.shards_failed == 0 and result.errors == 0
    assert_identical(read_output(tmp_path / "out"), two)
    _assert_nothing_left(kill_dir)


def test_heads_checked_before_any_actor_starts(tiny_llama, tmp_path):
    write_jsonl(tmp_path / "in" / "rows.jsonl", acceptance_rows(2))
    config = {"model": tiny_llama, "input": str(tmp_path / "in"), "output": str(tmp_path / "o"),
              "num_gpus_per_actor": 0, "engine": {"tensor_parallel_size": 3}}
    with pytest.raises(ValueError, match=r"config\.engine\.tensor_parallel_size: must divide "
                                         r"the model's 4 attention heads, got 3"):
        run_job(config, progress=False)
