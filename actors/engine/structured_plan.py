"""The plan of an ahead fill (:mod:`actors.engine.structured`): the constrained rows of a
step it takes, in the order of their matcher templates (so that each fill thread takes a run
of one template), the lists its llguidance calls take, and what tells whether a later step
samples the same rows again (then the plan's order and lists serve that step as they are).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from actors.engine.sequence import Sequence
from actors.engine.structured_masks import Masks
from actors.engine.structured_sequence import SequenceGrammar

_GROUP = attrgetter("group")


@dataclass(slots=True)
class AheadPlan:
    """An ahead fill to run: ``grammars`` in template order (the order of its llguidance
    calls), the step's row of each (``rows``), the fill's number and its buffers, and the
    lists its llguidance calls take (built before the sampled ids are known): the matchers,
    and each with its row of the masks (the rank of its step row, :func:`mask_slots`, so
    that the masks lie in step order); and what tells whether the next step samples the same
    rows (:func:`continues`)."""

    grammars: list
    rows: np.ndarray
    turn: int
    masks: Masks
    matchers: list
    targets: list
    accepted: threading.Event  # set once the sampled ids are accepted (or the fill failed)
    seqs: list  # the step's sampling sequences (the scheduler's list)
    pos: np.ndarray  # the position of each one's sampled token
    # the step rows of the masks ascending (mask j is row step_rows[j]); None when some
    # constrained row of the step is not in the fill
    step_rows: np.ndarray | None
    ok: bool = False  # every row took its token (set before ``accepted``)


def continues(plan: AheadPlan, seqs: list[Sequence]) -> bool:
    """Whether a step of sampling sequences ``seqs`` samples exactly the rows of ``plan``'s
    step, in order, the fill took every constrained row of that step and each took its
    token: then each row's mask from the fill is the one for its state now (one token on;
    no row finished, none came or went, none was preempted), and row ``r`` is ``plan``'s row
    ``r`` (the list compares by identity: ``Sequence`` has no ``__eq__``)."""
    return plan.step_rows is not None and plan.ok and seqs == plan.seqs


def mask_slots(rows: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """``rows`` (distinct) ascending, and the rank of each among them: the mask row of each,
    so that the masks lie in the order of their step rows and the sampler takes them as they
    are (no gather)."""
    if rows.size < 2 or bool((rows[1:] > rows[:-1]).all()):
        return rows, list(range(rows.size))
    order = np.argsort(rows, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rows[order], rank.tolist()


def template_order(grammars: list[SequenceGrammar]) -> list[int] | None:
    """The positions of ``grammars`` in the order of their templates (``group``), stably;
    None when they are in it already."""
    keys = np.fromiter(map(_GROUP, grammars), dtype=np.int64, count=len(grammars))
    if keys.size < 2 or bool((keys[1:] >= keys[:-1]).all()):
        return None
    return np.argsort(keys, kind="stable").tolist()
