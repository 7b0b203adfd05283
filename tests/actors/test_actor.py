"""The actor process's own settings."""

import contextlib
import gc
import sys

import pytest

from actors import actor


def test_an_actor_process_shortens_the_gil_switch_interval(monkeypatch):
    """The loop thread must not wait the default 5 ms for the GIL after each device wait
    while a shard thread builds a part; a shorter setting already in force is kept."""
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    seen = []
    monkeypatch.setattr(sys, "setswitchinterval", seen.append)
    actor.shorten_switch_interval()
    assert seen == [actor.SWITCH_INTERVAL_S] and actor.SWITCH_INTERVAL_S <= 0.001
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.0001)
    seen.clear()
    actor.shorten_switch_interval()
    assert seen == []


def test_the_interval_is_set_only_inside_a_ray_actor(monkeypatch):
    """A caller's process (``toolkit.generate``, a test) keeps its own interval."""
    calls = []
    monkeypatch.setattr(actor, "shorten_switch_interval", lambda: calls.append(1))
    monkeypatch.setattr(actor, "_in_ray_actor", lambda: False)
    with pytest.raises(OSError):  # no such model: only the settings before the load matter
        actor.GenerationActor("/nonexistent-model-dir", {"device": "cpu"})
    assert calls == []
    monkeypatch.setattr(actor, "_in_ray_actor", lambda: True)
    monkeypatch.setattr(actor, "cache_bytecode", lambda: None)
    with pytest.raises(OSError):
        actor.GenerationActor("/nonexistent-model-dir", {"device": "cpu"})
    assert calls == [1]


def test_collector_paused_freezes_what_the_block_made():
    """The block runs without the cyclic collector; what it made is frozen afterwards (no
    later collection walks it) and the collector is on again, also when the block raises."""
    gc.unfreeze()
    try:
        before = gc.get_freeze_count()
        with actor.collector_paused():
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)
        with pytest.raises(KeyError), actor.collector_paused():
            raise KeyError("x")
        assert gc.isenabled()
        gc.disable()  # a caller that runs without the collector keeps it off
        with actor.collector_paused():
            pass
        assert not gc.isenabled()
        gc.enable()
        gc.unfreeze()
        with actor.collector_paused(enabled=False):
            assert gc.isenabled()
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_collector_is_paused_only_inside_a_ray_actor(monkeypatch):
    """The actor's imports run with the collector paused in its own process only."""
    seen = []

    @contextlib.contextmanager
    def paused(enabled=True):
        seen.append(enabled)
        yield

    monkeypatch.setattr(actor, "collector_paused", paused)
    monkeypatch.setattr(actor, "shorten_switch_interval", lambda: None)
    monkeypatch.setattr(actor, "cache_bytecode", lambda: None)
    for in_ray in (False, True):
        monkeypatch.setattr(actor, "_in_ray_actor", lambda: in_ray)
        with pytest.raises(OSError):  # no such model: only the settings before the load matter
            actor.GenerationActor("/nonexistent-model-dir", {"device": "cpu"})
    assert seen == [False, True]
