"""The actor process's own settings."""

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
