"""The background engine loop: concurrent callers share one engine, failures reach them all."""

from __future__ import annotations

import threading
import time

import pytest

from actors.contract.task import EngineFailure
from actors.serving import EngineServer
from sampler import SamplingParams
from tests.jobs.fakes import FakeEngine


class _RecordingEngine(FakeEngine):
    """Records how many requests were running at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.running: list[int] = []

    def step(self):
        self.running.append(len(self.active))
        time.sleep(0.005)
        return super().step()


def _reqs(prefix: str, count: int, max_tokens: int, n: int = 1):
    return [(f"{prefix}{i}", f"prompt {i}", SamplingParams(max_tokens=max_tokens, n=n, seed=i))
            for i in range(count)]


def test_second_caller_joins_the_running_batch():
    engine = _RecordingEngine()
    server = EngineServer(engine)
    results: dict[str, list] = {}
    done_order: list[str] = []

    def call(name, reqs):
        results[name] = server.run(reqs)
        done_order.append(name)

    long = threading.Thread(target=call, args=("long", _reqs("L", 3, 40)))
    long.start()
    while not engine.running:  # the long shard is being decoded
        time.sleep(0.001)
    short = threading.Thread(target=call, args=("short", _reqs("S", 4, 2, n=2)))
    short.start()
    long.join(timeout=30)
    short.join(timeout=30)
    assert sorted(o.id for o in results["short"]) == sorted(f"S{i}" for i in range(4)
                                                          for _ in range(2))
    assert len(results["long"]) == 3
    assert max(engine.running) == 7  # both callers' requests ran in the same steps
    assert done_order == ["short", "long"]  # no barrier at the shard boundary


def test_error_outputs_complete_a_request():
    server = EngineServer(FakeEngine())
    outs = server.run([("e", "", SamplingParams(n=3, seed=1)), ("ok", "x", SamplingParams(
        max_tokens=1, seed=1))])
    assert sorted((o.id, o.finish_reason) for o in outs) == [
        ("e", "error"), ("e", "error"), ("e", "error"), ("ok", "length")]
    assert server.run([]) == []


def test_engine_failure_reaches_every_caller_and_later_ones():
    server = EngineServer(FakeEngine())
    with pytest.raises(EngineFailure, match="fake engine broke"):
        server.run([("r", "RAISE", SamplingParams(seed=1))])
    with pytest.raises(EngineFailure, match="engine failed earlier"):
        server.run([("r2", "fine", SamplingParams(seed=1))])


class _ForgetfulEngine(FakeEngine):
    """Drops requests silently (a contract violation the loop must not hang on)."""

    def add_request(self, request_id, prompt, params):
        pass


def test_lost_requests_fail_instead_of_hanging():
    server = EngineServer(_ForgetfulEngine())
    with pytest.raises(EngineFailure, match="engine finished without outputs"):
        server.run([("lost", "x", SamplingParams(seed=1))])


def test_exclusive_callers_run_alone_on_an_idle_engine_in_arrival_order():
    engine = _RecordingEngine()
    server = EngineServer(engine)
    results: dict[str, list] = {}
    done_order: list[str] = []

    def call(name, reqs, exclusive=True):
        results[name] = server.run(reqs, exclusive=exclusive)
        done_order.append(name)

    first = threading.Thread(target=call, args=("first", _reqs("A", 3, 30)))
    first.start()
    while not engine.running:
        time.sleep(0.001)
    second = threading.Thread(target=call, args=("second", _reqs("B", 4, 2, n=2)))
    second.start()
    time.sleep(0.02)  # the second caller waits while the first one runs
    shared = threading.Thread(target=call, args=("shared", _reqs("C", 2, 2), False))
    shared.start()
    for t in (first, second, shared):
        t.join(timeout=30)
    assert done_order == ["first", "second", "shared"]
    assert max(engine.running) == 4  # never more than one caller's requests at once
    assert sorted(o.id for o in results["second"]) == sorted(f"B{i}" for i in range(4)
                                                           for _ in range(2))
    assert engine.cache_resets == 2  # one fresh prefix cache per exclusive caller
    # every step ran exactly one caller's requests: 3 for 30 steps, then 4 for 2, then 2
    assert [n for n in engine.running if n] == [3] * 30 + [4] * 2 + [2] * 2


class _LosesSomeEngine(FakeEngine):
    """Drops the requests whose prompt is "lost" (the rest run normally)."""

    def add_request(self, request_id, prompt, params):
        if prompt != "lost":
            super().add_request(request_id, prompt, params)


def test_lost_requests_do_not_block_exclusive_callers():
    server = EngineServer(_LosesSomeEngine())
    errors: list[BaseException] = []

    def stuck():
        try:
            server.run([("lost", "lost", SamplingParams(seed=1))], exclusive=True)
        except EngineFailure as exc:
            errors.append(exc)

    t = threading.Thread(target=stuck)
    t.start()
    outs = server.run([("ok", "x", SamplingParams(max_tokens=3, seed=1))], exclusive=True)
    t.join(timeout=30)
    assert [o.finish_reason for o in outs] == ["length"]
    assert len(errors) == 1 and "engine finished without outputs for ['lost']" in str(errors[0])
