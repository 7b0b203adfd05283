"""The attention backend interface and the function registered with transformers.

A model loaded with ``attn_implementation=ATTENTION_NAME`` calls ``paged_attention_forward``
in every attention layer with the new tokens' projected, rotated q/k/v. The step's state comes
through one keyword argument of the top-level forward, ``STEP_KWARG``, holding a
``StepContext`` (backend + its plan for this step); nothing is kept in module globals.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from actors.engine.model.attention.metadata import AttentionMetadata

#: Name under which the attention function is registered (a plain name: docs/engine.md §1).
ATTENTION_NAME = "raygen_paged"
#: The forward keyword that carries the StepContext down to every attention layer.
STEP_KWARG = "raygen_step"


class AttentionBackend(abc.ABC):
    """Paged attention over a ``KVCache``: ``plan`` once per step, ``forward`` per layer.

    The contract of ``forward``: write the new tokens' K/V into the layer's pages at
    ``metadata.slot_mapping``, then attend causally (query i of a sequence sees keys
    ``j <= position(i)`` of the same sequence; with a sliding window ``w`` only
    ``position(i) - w < j``), GQA by head groups, scores multiplied by ``scaling``.
    """

    name: str = "base"
    #: whether ``graph_plan`` / ``update_graph_plan`` exist (CUDA-graph decode buckets)
    supports_graphs: bool = False

    def __init__(self, kv_cache: Any, num_heads: int, num_kv_heads: int, head_dim: int):
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @abc.abstractmethod
    def plan(self, metadata: AttentionMetadata) -> Any:
        """Prepares everything the layers of this step share; returns the plan object."""

    def begin_forward(self, plan: Any) -> None:
        """Per-step device work shared by the layers, run at the start of the forward (so a
        CUDA graph captures it); nothing by default."""

    @abc.abstractmethod
    def forward(
        self,
        plan: Any,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """query ``[T, heads, D]``, key/value ``[T, kv_heads, D]`` -> out ``[T, heads, D]``."""


@dataclass(slots=True)
class StepContext:
    """What the registered attention function needs for one step."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    plan: Any
    layers_called: list[int] | None = None  # filled only by the load-time probe
    # {layer: (sliding_window, scaling)} as the model passed them (load-time probe only)
    layer_specs: dict[int, tuple[int | None, float]] | None = None


_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with ``transformers.AttentionInterface``.

    query ``[1, heads, T, D]`` and key/value ``[1, kv_heads, T, D]`` (new tokens only) ->
    ``([1, T, heads, D], None)``.
    """
    ctx = kwargs.get(STEP_KWARG)
    if not isinstance(ctx, StepContext):
        raise RuntimeError(
            f"{ATTENTION_NAME} attention called without step metadata: models loaded for the "
            f"raygen engine can only run through its model runner (pass {STEP_KWARG}=...)"
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{ATTENTION_NAME}: attention argument {name!r} is not "
                                      "supported by the paged backends")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME}: expected a packed batch of 1, got {query.shape}")
    layer_idx = module.layer_idx
    if ctx.layers_called is not None:
        ctx.layers_called.append(layer_idx)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if ctx.layer_specs is not None:
        ctx.layer_specs[layer_idx] = (kwargs.get("sliding_window"), float(scaling))
    out = ctx.backend.forward(
        ctx.plan,
        layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling=scaling,
        sliding_window=kwargs.get("sliding_window"),
    )
    return out.unsqueeze(0), None


_registered = False


def register_attention() -> None:
    """Registers ``paged_attention_forward`` under ``ATTENTION_NAME`` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    _registered = True
