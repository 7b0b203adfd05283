"""The attention backend interface and the function registered with transformers.

A model loaded with ``attn_implementation=ATTENTION_NAME`` calls ``paged_attention_forward``
in every attention layer with the new tokens' projected, rotated q/k/v. The step's state comes
through one keyword argument of the top-level forward, ``STEP_KWARG``, holding a
``StepContext`` (backend + its plan for this step); nothing is kept in module globals. For
models whose decoder does not pass extra keywords down to its layers, ``capture_step_kwarg``
makes the base model's forward also hold the context in a context variable for its duration.
"""

from __future__ import annotations

import abc
import contextvars
from dataclasses import dataclass
from typing import Any, Union

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
    ``position(i) - w < j``), GQA by head groups, scores multiplied by ``scaling``, then
    soft-capped (``cap * tanh(score / cap)``) when ``softcap`` is given; ``sinks`` ``[heads]``
    adds one key-less logit per head to the softmax's denominator (gpt-oss). Keys are
    ``kv_cache.key_dim`` wide, values ``kv_cache.value_dim`` (they differ for MLA).
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
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, heads, Dk]``, key ``[T, kv_heads, Dk]``, value ``[T, kv_heads, Dv]``
        -> out ``[T, heads, Dv]``."""


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """How one layer calls attention, as recorded by the load-time probe."""

    sliding_window: int | None
    scaling: float
    softcap: float | None = None
    has_sinks: bool = False
    num_heads: int = 0
    num_kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0


#: ``{layer: LayerSpec}``; a ``(sliding_window, scaling)`` pair is accepted for a LayerSpec.
LayerSpecs = dict[int, Union[LayerSpec, tuple]]


def as_layer_spec(spec: LayerSpec | tuple) -> LayerSpec:
    return spec if isinstance(spec, LayerSpec) else LayerSpec(*spec)


@dataclass(slots=True)
class StepContext:
    """What the registered attention function needs for one step."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    plan: Any
    layers_called: list[int] | None = None  # filled only by the load-time probe
    # {layer: LayerSpec} as the model called attention (load-time probe only)
    layer_specs: dict[int, LayerSpec] | None = None
    # keyword arguments with a value the backends would ignore (load-time probe only)
    unknown_kwargs: set[str] | None = None


#: keywords that reach the attention function without changing what it must compute here
#: (HF's flash/paged bookkeeping, flags for other implementations), or that we apply
_KNOWN_KWARGS = frozenset({
    STEP_KWARG, "sliding_window", "softcap", "s_aux", "sinks", "position_ids", "cache_position",
    "output_attentions", "use_cache", "layer_idx", "head_mask", "position_embeddings",
    "return_dict", "output_hidden_states", "past_key_values", "cache", "layer_head_mask",
    "dropout_p", "attention_dropout", "use_flash_attention", "output_router_logits",
    "logits_to_keep", "labels",
})


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

    query ``[1, heads, T, Dk]``, key ``[1, kv_heads, T, Dk]`` and value
    ``[1, kv_heads, T, Dv]`` (new tokens only) -> ``([1, T, heads, Dv], None)``. Applies the
    module's ``softcap`` and ``s_aux`` / ``sinks`` keywords; the load-time probe records what
    each layer passes and which keywords no backend would apply.
    """
    ctx = kwargs.get(STEP_KWARG)
    if ctx is None:
        ctx = CURRENT_STEP.get()
    if not isinstance(ctx, StepContext):
        raise RuntimeError(
            f"{ATTENTION_NAME} attention called without step metadata: models loaded for the "
            f"raygen engine can only run through its model runner (pass {STEP_KWARG}=...)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME}: expected a packed batch of 1, got {query.shape}")
    layer_idx = module.layer_idx
    if ctx.layers_called is not None:
        ctx.layers_called.append(layer_idx)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    softcap = float(softcap) if softcap else None  # 0 / None: no capping
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if ctx.layer_specs is not None:
        ctx.layer_specs[layer_idx] = LayerSpec(
            kwargs.get("sliding_window"), float(scaling), softcap, sinks is not None,
            query.shape[1], key.shape[1], key.shape[-1], value.shape[-1])
        if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
            ctx.unknown_kwargs.add("is_causal=False")
        for name, val in kwargs.items():
            if name not in _KNOWN_KWARGS and val is not None and name != "is_causal" \
                    and not name.startswith(("cu_seq_lens", "max_length", "max_seqlen")):
                ctx.unknown_kwargs.add(name)
        if dropout:
            ctx.unknown_kwargs.add("dropout")
    out = ctx.backend.forward(
        ctx.plan,
        layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling=scaling,
        sliding_window=kwargs.get("sliding_window"),
        softcap=softcap,
        sinks=sinks,
    )
    return out.unsqueeze(0), None


#: the StepContext of the base-model forward running in this context (see capture_step_kwarg)
CURRENT_STEP: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "raygen_step", default=None)


def capture_step_kwarg(base_model: torch.nn.Module) -> None:
    """Makes ``base_model``'s forward set ``CURRENT_STEP`` to its ``STEP_KWARG`` argument
    (when given) while it runs (forward hooks; in place)."""

    def enter(module, args, kwargs):
        step = kwargs.get(STEP_KWARG)
        module._raygen_step_token = CURRENT_STEP.set(step if step is not None
                                                     else CURRENT_STEP.get())

    def leave(module, args, kwargs, output):
        token = module.__dict__.pop("_raygen_step_token", None)
        if token is not None:
            CURRENT_STEP.reset(token)

    base_model.register_forward_pre_hook(enter, with_kwargs=True)
    base_model.register_forward_hook(leave, with_kwargs=True, always_call=True)


_registered = False


def register_attention() -> None:
    """Registers ``paged_attention_forward`` under ``ATTENTION_NAME`` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    _registered = True
