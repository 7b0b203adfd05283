"""Routes the attention of models that call torch's SDPA themselves (not transformers' attention
registry, e.g. falcon) to the paged backends.

Such a model is loaded with ``attn_implementation="sdpa"`` and, while the engine runs it, every
``torch.nn.functional.scaled_dot_product_attention`` call made inside one of its attention
modules (a module with an integer ``layer_idx``) becomes a call of the registered paged
attention function with that module, the new tokens' q/k/v and the step's ``StepContext``
(``CURRENT_STEP``, set from the base model's ``STEP_KWARG`` by ``capture_step_kwarg``). The model's own mask is ignored: it is the causal
mask of the packed step, which the paged attention applies per sequence. Outside an engine step
(no ``StepContext``) the call is torch's own. Configurations whose mask carries more than
causality (ALiBi) are refused before loading (``actors.engine.model.model_support``).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from actors.engine.model.attention.base import CURRENT_STEP, STEP_KWARG, paged_attention_forward

_LAYER: contextvars.ContextVar[Any] = contextvars.ContextVar("raygen_sdpa_layer", default=None)
_original_sdpa = None


def _routed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
    module, ctx = _LAYER.get(), CURRENT_STEP.get()
    if module is None or ctx is None:
        return _original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                              **kwargs)
    token = _LAYER.set(None)  # the torch backend's own SDPA call is torch's
    try:
        out, _ = paged_attention_forward(module, query, key, value, None, dropout=dropout_p,
                                         scaling=scale, **{STEP_KWARG: ctx})  # [1, T, H, Dv]
    finally:
        _LAYER.reset(token)
    return out.transpose(1, 2)  # [1, heads, T, Dv], as SDPA returns


def _install_patch() -> None:
    global _original_sdpa
    if _original_sdpa is None:
        _original_sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = _routed_sdpa


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that are one layer's attention (an integer ``layer_idx``
    and a class name ending in ``Attention``)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx",
                                                                              None), int)]


def install_sdpa_adapter(model: torch.nn.Module) -> int:
    """Routes ``model``'s SDPA calls to the paged attention during engine steps (in place);
    returns the number of attention modules routed."""
    _install_patch()

    def enter_layer(module, args):
        module._raygen_layer_token = _LAYER.set(module)

    def leave_layer(module, args, output):
        token = module.__dict__.pop("_raygen_layer_token", None)
        if token is not None:
            _LAYER.reset(token)

    modules = attention_modules(model)
    for m in modules:
        m.register_forward_pre_hook(enter_layer)
        m.register_forward_hook(leave_layer, always_call=True)
    return len(modules)
