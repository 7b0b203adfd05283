"""The ahead fill's plan helpers: the rows in template order, the step rows sorted with their
row map, and the test for a step that samples the plan's rows again."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from actors.engine.structured_plan import AheadPlan, continues, mask_slots, template_order


def test_template_order_is_stable_and_none_when_in_order():
    grammars = [SimpleNamespace(group=g) for g in (1, 0, 1, 0, 2)]
    assert template_order(grammars) == [1, 3, 0, 2, 4]
    assert template_order([SimpleNamespace(group=g) for g in (0, 0, 1, 3)]) is None
    assert template_order([]) is None


def test_mask_slots_put_each_rows_mask_in_step_order():
    rows = np.array([5, 1, 7, 2])  # the fill's j-th matcher is step row rows[j]
    ascending, slots = mask_slots(rows)
    assert ascending.tolist() == [1, 2, 5, 7] and slots == [2, 0, 3, 1]
    assert [int(ascending[s]) for s in slots] == rows.tolist()  # mask slots[j] is row rows[j]
    ascending, slots = mask_slots(np.array([0, 3, 4]))
    assert ascending.tolist() == [0, 3, 4] and slots == [0, 1, 2]


def _plan(seqs, step_rows=np.array([0, 1]), ok=True) -> AheadPlan:
    return AheadPlan([], np.array([0, 1]), 1, None, [], [], threading.Event(), seqs,
                     np.array([3, 4]), step_rows, ok)


def test_a_step_continues_the_plan_only_with_its_very_rows_all_taken_and_accepted():
    a, b, c = object(), object(), object()
    assert continues(_plan([a, b]), [a, b])
    assert not continues(_plan([a, b]), [b, a])  # rows moved
    assert not continues(_plan([a, b]), [a, b, c])  # a row came
    assert not continues(_plan([a, b]), [a])  # a row went
    assert not continues(_plan([a, b], ok=False), [a, b])  # a row refused its token
    assert not continues(_plan([a, b], step_rows=None), [a, b])  # not every row in the fill
