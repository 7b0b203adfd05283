"""Sleep and wake-up of an idle engine: give device memory back between RL rounds.

- level 1 frees the KV pages (their contents are lost; the prefix cache is reset);
- level 2 also frees the weights' memory: after waking, the weights must be loaded again with
  ``update_weights`` (nothing is read from disk) before the engine generates.

CUDA graphs captured for decode read the KV pages (and the weights) at fixed addresses, so
they are dropped at sleep (with their memory pool) and captured again at wake-up, once both
the weights and the KV pages are back.
"""

from __future__ import annotations

import gc
import logging
from typing import Iterable

import torch

from actors.engine.model.kv_cache import KVCache
from actors.engine.weights import WeightLoader

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


class SleepController:
    """Frees and restores an engine's device memory.

    Args:
        kv_cache: the paged KV pool.
        loader: the weight loader of the model.
        runner: the model runner (its ``graphs`` are dropped and re-captured).
    """

    def __init__(self, kv_cache: KVCache, loader: WeightLoader, runner) -> None:
        self.kv_cache = kv_cache
        self.loader = loader
        self.runner = runner
        self.level = 0
        self._graph_spec: tuple[list[int], int, int] | None = None

    @property
    def is_sleeping(self) -> bool:
        return self.kv_cache.is_released or self.loader.discarded

    def blocked_reason(self) -> str | None:
        """Why the engine cannot run a step now (None when it can)."""
        if self.is_sleeping:
            return "the engine is asleep; call wake_up() first"
        if self.loader.missing:
            names = self.loader.missing_names()
            return (f"{len(names)} weight tensor(s) were discarded by sleep(level=2) and not "
                    f"loaded since, e.g. {names[0]!r}; load them with update_weights()")
        return None

    def sleep(self, level: int) -> dict[str, int]:
        """Frees the KV pages (level 1) and the weights (level 2); returns the bytes freed
        ``{"kv_cache": ..., "weights": ...}`` (0 for what was already free)."""
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 (KV cache) or 2 (KV cache and weights), "
                             f"got {level!r}")
        self._drop_graphs()
        freed = {"kv_cache": self.kv_cache.release(), "weights": 0}
        if level == 2:
            freed["weights"] = self.loader.discard()
        self.level = max(self.level, level)
        gc.collect()
        device = self.kv_cache.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        logger.info("engine asleep (level %d): freed %.1f MiB of KV cache, %.1f MiB of weights",
                    level, freed["kv_cache"] / 2**20, freed["weights"] / 2**20)
        return freed

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Re-allocates what ``sleep`` freed: ``tags`` ⊆ {"weights", "kv_cache"} (None: both;
        waking the weights first lets them be loaded before the KV pages take memory)."""
        wanted = TAGS if tags is None else tuple(tags)
        bad = [t for t in wanted if t not in TAGS]
        if bad or isinstance(tags, str):
            raise ValueError(f"tags: must be a list drawn from {list(TAGS)}, got {tags!r}")
        if "weights" in wanted:
            self.loader.restore()
        if "kv_cache" in wanted:
            self.kv_cache.restore()
        if not self.is_sleeping:
            self.level = 0
            self._capture_graphs()

    def _drop_graphs(self) -> None:
        graphs = self.runner.graphs
        if graphs is None:
            return
        self._graph_spec = (list(graphs.buckets), graphs.scratch_page, graphs.max_pages)
        self.runner.graphs = None

    def _capture_graphs(self) -> None:
        if self._graph_spec is None:
            return
        from actors.engine.model.cuda_graphs import DecodeGraphs

        buckets, scratch_page, max_pages = self._graph_spec
        graphs = DecodeGraphs(self.runner, buckets, scratch_page)
        graphs.capture(max_pages)
        self.runner.graphs = graphs
        self._graph_spec = None
