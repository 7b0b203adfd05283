"""What the engine can run, decided from the config and the model class before any weight is
loaded: a decoder-only causal LM whose attention reaches the paged backends (through
transformers' attention registry, or through torch's SDPA via ``actors.engine.model.attention.sdpa_adapter``)
and whose configuration asks for nothing the engine does not honour.

``check_architecture`` raises ``UnsupportedModelError`` naming the model type and the attribute;
the load-time probe (``actors.engine.model.attention.probe``) then checks what the loaded layers really do.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Literal

#: How a model's attention reaches the paged backends.
Route = Literal["registry", "sdpa"]

_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "global",
                          "local", "sliding"}


class UnsupportedModelError(ValueError):
    """The model cannot run on the raygen engine (the message names the architecture)."""


def architecture_name(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return f"{archs[0] if archs else type(config).__name__} (model_type={config.model_type!r})"


def attention_route(cls: type) -> Route | None:
    """How ``cls`` (a transformers CausalLM class) calls attention: "registry" when its
    attention calls the registered attention function (declared by
    ``_supports_attention_backend``, or read from its modeling module), "sdpa" when it calls
    torch's SDPA itself, None when neither (its own kernels, recurrent layers, ...)."""
    if getattr(cls, "_supports_attention_backend", False):
        return "registry"
    module = sys.modules.get(cls.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    if "ALL_ATTENTION_FUNCTIONS" in source:
        return "registry"
    if getattr(cls, "_supports_sdpa", False) and "scaled_dot_product_attention(" in source:
        return "sdpa"
    return None


def _value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def unsupported_attribute(config: Any) -> tuple[str, str] | None:
    """``(attribute, why)`` for the first configuration attribute the engine cannot honour,
    None when there is none. ``config`` is the text config."""
    if getattr(config, "alibi", False):
        return "alibi", "ALiBi position biases are not applied by the paged attention"
    attn = getattr(config, "attn_config", None)
    if attn is not None and _value(attn, "alibi"):
        return "attn_config.alibi", "ALiBi position biases are not applied by the paged attention"
    if getattr(config, "position_embedding_type", None) == "alibi":
        return "position_embedding_type", "ALiBi position biases are not applied"
    if getattr(config, "attention_chunk_size", None):
        return "attention_chunk_size", "chunked attention is not applied by the paged attention"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention", "the paged attention is causal"
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({str(t) for t in layer_types} - _ATTENTION_LAYER_TYPES)
        if other:
            return "layer_types", (f"layers of type {other} are not dense attention over the "
                                   "paged KV cache (recurrent, linear or sparse attention)")
    for key in ("rope_scaling", "rope_parameters"):
        rope = getattr(config, key, None)
        if isinstance(rope, dict) and (rope.get("mrope_section") is not None
                                       or rope.get("rope_type") == "mrope"):
            return f"{key}.mrope_section", "multimodal (3-D) rotary positions are not supported"
    return None


def check_architecture(config: Any, trust_remote_code: bool) -> tuple[type | None, Route]:
    """Raises ``UnsupportedModelError`` unless ``config`` is a decoder-only causal LM the engine
    can run. Returns the model class (None for remote code) and how its attention is routed."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    name = architecture_name(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; the raygen engine runs decoder-only causal LMs"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES \
            and not getattr(config, "is_decoder", False):
        raise UnsupportedModelError(
            f"{name}: config.is_decoder=False: an encoder architecture attends bidirectionally "
            "unless configured as a decoder; the paged attention is causal")
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        check_config(config, name)
        return None, "registry"
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise UnsupportedModelError(
            f"{name} is not a causal LM that transformers' AutoModelForCausalLM can load"
        ) from None
    route = check_model_class(cls, name)
    check_config(config, name)
    return cls, route


def check_config(config: Any, name: str) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = unsupported_attribute(text)
    if found is not None:
        attribute, why = found
        raise UnsupportedModelError(
            f"{name}: config.{attribute}={getattr(text, attribute.split('.')[0], None)!r}: "
            f"{why}")


def check_model_class(cls: type, name: str) -> Route:
    """Refuses a class whose attention never reaches a paged backend; returns its route."""
    route = attention_route(cls)
    if route is None:
        raise UnsupportedModelError(
            f"{name}: {cls.__name__} does not route attention through transformers' "
            "attention-function registry (_supports_attention_backend is False) nor through "
            "torch's scaled_dot_product_attention, so it cannot run on the paged KV cache"
        )
    return route
