"""RequestIntake: a step takes queued requests in order, as many as asked, with the aborts
queued among them; the rest stay queued."""

from __future__ import annotations

from actors.engine.intake import BuiltRequests, RequestIntake


def _intake(items):
    intake = RequestIntake(inputs=None, sampler=None)  # built items only: nothing to build
    for item in items:
        intake.put(item)
    return intake


def test_take_with_a_limit_keeps_the_rest_in_order():
    items = [("built", 0, "r0"), ("reject", 1, None, "bad"), ("abort", 9, None, None),
             ("built", 2, "r2"), ("built", 3, "r3"), ("built", 4, "r4")]
    intake = _intake(items)
    assert intake.take(limit=2) == items[:3]  # two requests (a reject is one) and the abort
    assert intake.pending()
    assert intake.take(limit=1) == items[3:4]
    assert intake.take(limit=5) == items[4:]
    assert not intake.pending() and intake.take() == []


def test_an_abort_takes_what_is_queued_before_it():
    items = [("built", 0, "r0"), ("built", 1, "r1"), ("abort", 0, None, None),
             ("built", 2, "r2")]
    intake = _intake(items)
    assert intake.take(limit=0) == items[:3]  # no room for requests, but the abort goes
    assert intake.take(limit=0) == []  # no abort queued: nothing
    assert intake.take(limit=1) == items[3:]
    intake = _intake(items)
    assert intake.take(limit=1) == items[:3]
    assert intake.take(limit=1) == items[3:]


def test_take_without_a_limit_empties_the_queue():
    items = [("abort", 1, None, None), ("built", 1, "r1")]
    intake = _intake(items)
    assert intake.take() == items and not intake.pending()
    intake = RequestIntake(inputs=None, sampler=None)
    intake.extend(BuiltRequests([("built", 2, "r2"), ("reject", 3, None, "bad")]))
    assert intake.take(limit=1) == [("built", 2, "r2")]
    assert intake.take() == [("reject", 3, None, "bad")]
