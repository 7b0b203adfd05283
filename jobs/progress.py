"""Progress of a running job (a tqdm bar on the driver) and its summary (:class:`JobResult`)."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class JobResult:
    """What a finished job reports.

    ``rows``, ``errors``, ``tokens`` and ``prompt_tokens`` count the whole output (resumed
    shards included); ``seconds`` and ``tokens_per_second`` cover this run only.
    ``actor_share`` maps each actor slot of this run's pool to its share of the input rows run
    in this run; a slot that ran no shard (it was still loading when the others took them all)
    is listed with 0.
    """

    output: str
    rows: int
    input_rows: int
    errors: int
    tokens: int
    prompt_tokens: int
    seconds: float
    tokens_per_second: float
    shards: int
    shards_skipped: int
    shards_retried: int = 0
    shards_failed: int = 0
    actor_share: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        """A few human-readable lines."""
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(self.actor_share.items()))
        lines = [
            f"output:  {self.output}",
            f"rows:    {self.rows} output rows for {self.input_rows} input rows, "
            f"{self.errors} errors",
            f"tokens:  {self.tokens} output, {self.prompt_tokens} prompt",
            f"time:    {self.seconds:.1f} s, {self.tokens_per_second:.1f} output tokens/s",
            f"shards:  {self.shards} ({self.shards_skipped} already committed, "
            f"{self.shards_retried} retried, {self.shards_failed} failed)",
        ]
        if shares:
            lines.append(f"actors:  {shares}")
        return "\n".join(lines)


class Progress:
    """Counts committed shards; draws a bar (rows done / total, output tok/s, ETA) on a TTY and
    logs a line every ~10% otherwise. While the actors start, the bar's label (or a logged
    line per actor) says how many are ready: ``starting actors 1/4``."""

    def __init__(self, total_rows: int, done_rows: int = 0, *, enabled: bool = True) -> None:
        self.started = time.perf_counter()
        self.total_rows = total_rows
        self.done_rows = done_rows
        self.tokens = 0
        self.rows_by_actor: dict[str, int] = {}
        self.ready: set[str] = set()
        self._next_log = 0.1
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_rows, initial=done_rows, unit="row", desc="raygen",
                             dynamic_ncols=True, file=sys.stderr)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def add_actors(self, names) -> None:
        """Lists the pool's actor slots, so that one which commits nothing still shows as 0%,
        and shows that they are starting."""
        for name in names:
            self.rows_by_actor.setdefault(name, 0)
        self._show_startup()

    def actor_ready(self, name: str) -> None:
        """One actor's model is loaded (a replaced actor counts once)."""
        self.ready.add(name)
        self._show_startup()

    def _show_startup(self) -> None:
        total = len(self.rows_by_actor)
        if not total:
            return
        text = (f"starting actors {len(self.ready)}/{total}" if len(self.ready) < total
                else f"actors ready {total}/{total}")
        if self._bar is not None:
            self._bar.set_description_str("raygen" if len(self.ready) >= total
                                          else f"raygen ({text})")
        else:
            logger.info("%s", text)

    def update(self, rows: int, tokens: int, actor: str) -> None:
        """Records one committed shard of ``rows`` input rows and ``tokens`` output tokens."""
        self.done_rows += rows
        self.tokens += tokens
        self.rows_by_actor[actor] = self.rows_by_actor.get(actor, 0) + rows
        rate = self.tokens / max(self.seconds, 1e-9)
        if self._bar is not None:
            self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
            self._bar.update(rows)
        elif self.total_rows and self.done_rows / self.total_rows >= self._next_log:
            self._next_log = int(self.done_rows * 10 / self.total_rows) / 10 + 0.1
            logger.info("%d/%d rows, %.1f output tok/s", self.done_rows, self.total_rows, rate)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def actor_share(self) -> dict[str, float]:
        total = sum(self.rows_by_actor.values())
        return {k: v / total for k, v in self.rows_by_actor.items()} if total else {}


def totals(committed: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Sums the per-shard counts recorded in the manifest."""
    keys = ("rows", "output_rows", "errors", "output_tokens", "prompt_tokens")
    return {k: sum(int(e.get(k, 0)) for e in committed.values()) for k in keys}
