"""An engine inside a Ray actor that runs in a placement group of a bundle per rank starts its
other ranks as Ray actors in those bundles (CPU, gloo): the token ids of one rank, a dead rank
actor reported at the next step, and no rank actor left once the engine is closed or its
actor's process is killed."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray.cloudpickle

from actors.engine.llm_engine import Engine
from tests.actors.engine.parallel.test_tensor_parallel import CONFIG, _alive, _requests
from tests.jobs.helpers import local_ray_session

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class travels

pytestmark = [pytest.mark.ray, pytest.mark.slow]


class Rank0:
    """Holds a two-rank engine in a Ray actor (the role of a job's GenerationActor)."""

    def __init__(self, model: str):
        self.engine = Engine(model, {**CONFIG, "tensor_parallel_size": 2})

    def launcher(self) -> tuple[str, list[int]]:
        return type(self.engine.replica.ranks).__name__, self.engine.replica.pids

    def pid(self) -> int:
        return os.getpid()

    def token_ids(self, requests) -> list[list[int]]:
        return [o.output_token_ids for o in self.engine.generate(requests)]

    def step_after_rank_death(self) -> str:
        """Waits until Ray reports the killed rank actor dead, then steps."""
        deadline = time.monotonic() + 30
        while self.engine.replica.ranks.all_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.engine.add_request("x", [1, 2, 3], dict(max_tokens=2))
        try:
            self.engine.step()
        except RuntimeError as exc:
            return str(exc)
        return "stepped"

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="session")
def ray_session():
    yield from local_ray_session()  # the one Ray of the session (tests/jobs' ray_local too)


@pytest.fixture(scope="module")
def group(ray_session):
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready())
    yield pg
    remove_placement_group(pg)


def _rank0(group, model):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return ray.remote(Rank0).options(num_cpus=1, max_restarts=0, scheduling_strategy=(
        PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0))).remote(model)


def test_rank_actor_matches_one_rank_and_ends_with_the_engine(group, tiny_llama):
    one = Engine(tiny_llama, CONFIG)
    requests = _requests(one.loaded.vocab_size)
    expected = [o.output_token_ids for o in one.generate(requests)]
    actor = _rank0(group, tiny_llama)
    launcher, (pid,) = ray.get(actor.launcher.remote())
    assert launcher == "ActorRanks" and _alive(pid)
    assert ray.get(actor.token_ids.remote(requests)) == expected
    ray.get(actor.close.remote())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    ray.kill(actor)


def test_dead_rank_actor_fails_the_next_step(group, tiny_llama):
    actor = _rank0(group, tiny_llama)
    _, (pid,) = ray.get(actor.launcher.remote())
    os.kill(pid, signal.SIGKILL)
    message = ray.get(actor.step_after_rank_death.remote())
    assert message.startswith(f"tensor-parallel rank 1 (pid {pid}) ended"), message
    ray.get(actor.close.remote())
    ray.kill(actor)


def test_rank_actors_end_with_rank_0s_process(group, tiny_llama):
    actor = _rank0(group, tiny_llama)
    _, (pid,) = ray.get(actor.launcher.remote())
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)  # the rank actor belonged to the dead process
