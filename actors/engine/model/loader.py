"""Loads a decoder-only causal LM and its tokenizer through transformers, wired to our
paged attention (``attn_implementation=ATTENTION_NAME``), and refuses what cannot run on it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.engine.config import EngineConfig
from actors.engine.model.attention import ATTENTION_NAME, register_attention

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The model cannot run on the raygen engine (the message names the architecture)."""


@dataclass(slots=True)
class LoadedModel:
    """The model, its tokenizer and the facts the engine sizes itself from."""

    model: torch.nn.Module
    base_model: torch.nn.Module
    lm_head: torch.nn.Module
    tokenizer: Any
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None
    eos_token_ids: list[int]
    dtype: torch.dtype
    device: torch.device
    final_logit_softcapping: float | None = None
    logit_scale: float | None = None
    # seconds of each loading phase: transformers_import, model_config (config + architecture
    # checks, which import the model's module), cuda_init (device context, CUDA only),
    # model_weights (from_pretrained onto the device), quantization (fp8 only), tokenizer
    phases: dict[str, float] = field(default_factory=dict)
    # what quantization did (``quantize_decoder``'s summary), None without quantization
    quantization: dict[str, Any] | None = None


def _architecture_name(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return f"{archs[0] if archs else type(config).__name__} (model_type={config.model_type!r})"


def check_architecture(config: Any, trust_remote_code: bool) -> type | None:
    """Raises ``UnsupportedModelError`` unless ``config`` is a decoder-only causal LM whose
    class routes attention through transformers' attention-function registry. Returns the
    model class when it is known before loading (None for remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    name = _architecture_name(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; the raygen engine runs decoder-only causal LMs"
        )
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        return None
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise UnsupportedModelError(
            f"{name} is not a causal LM that transformers' AutoModelForCausalLM can load"
        ) from None
    check_model_class(cls, name)
    return cls


def check_model_class(cls: type, name: str) -> None:
    """Refuses a class whose attention never calls a registered attention function."""
    if not getattr(cls, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name}: {cls.__name__} does not route attention through transformers' "
            "attention-function registry (_supports_attention_backend is False), so it cannot "
            "run on the paged KV cache"
        )


class PhaseTimer:
    """Seconds between successive ``mark(name)`` calls (the first from construction)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now

    def add(self, parts: dict[str, float]) -> None:
        """Records phases timed elsewhere, which ran up to now."""
        self.seconds.update(parts)
        self._last = time.perf_counter()


def resolve_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def load_model(model: str, config: EngineConfig) -> LoadedModel:
    """Loads ``model`` (local directory or hub id) for ``config.device`` / ``config.dtype``.

    Raises:
        UnsupportedModelError: the architecture cannot run on the engine.
        OSError / ValueError from transformers: the model cannot be found or read.
    """
    phases = PhaseTimer()
    mark = phases.mark
    dtype = resolve_dtype(config.dtype)
    device = torch.device(config.device)
    if config.quantization == "fp8":  # refused here, before anything loads
        from actors.engine.model.quantization.fp8_model import check_fp8_device

        check_fp8_device(device, dtype)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    mark("transformers_import")  # the first load in a process pays for it
    register_attention()
    common = dict(trust_remote_code=config.trust_remote_code, revision=config.revision)
    hf_config = AutoConfig.from_pretrained(model, **common)
    name = _architecture_name(hf_config)
    check_architecture(hf_config, config.trust_remote_code)
    fp8_format = None
    if config.quantization == "fp8":
        from actors.engine.model.quantization.fp8_checkpoint import checkpoint_format

        fp8_format = checkpoint_format(hf_config)
        if fp8_format is not None:  # our layers take its scales, not transformers' quantizer
            del hf_config.quantization_config
            common["config"] = hf_config
    mark("model_config")

    if device.type == "cuda":
        torch.empty(1, device=device)  # the device context, apart from the weights' time
        mark("cuda_init")
    kwargs = dict(dtype=dtype, attn_implementation=ATTENTION_NAME, **common)
    hf_model = None
    if device.type == "cuda":  # weights straight onto the GPU (no full host copy)
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(model, device_map=str(device),
                                                            **kwargs)
        except (ImportError, TypeError, ValueError) as exc:
            logger.info("loading with device_map=%s failed (%s); loading on the host", device,
                        exc)
    if hf_model is None:
        hf_model = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    check_model_class(type(hf_model), name)
    hf_model.to(device).eval().requires_grad_(False)
    mark("model_weights")
    quantization = None
    if config.quantization == "fp8":
        from actors.engine.model.quantization.fp8_checkpoint import read_weight_scales
        from actors.engine.model.quantization.fp8_model import quantize_decoder

        scales = (None if fp8_format is None
                  else read_weight_scales(model, config.revision, fp8_format))
        quantization = quantize_decoder(hf_model, hf_model.base_model, fmt=fp8_format,
                                        scales=scales)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 weights' memory back to the device
        mark("quantization")
    common.pop("config", None)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or model, **common)
    mark("tokenizer")

    text = hf_config.get_text_config()
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    loaded = LoadedModel(
        model=hf_model,
        base_model=hf_model.base_model,
        lm_head=hf_model.get_output_embeddings(),
        tokenizer=tokenizer,
        architecture=name,
        num_layers=text.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        dtype=dtype,
        device=device,
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        logit_scale=getattr(text, "logit_scale", None),
        phases=phases.seconds,
        quantization=quantization,
    )
    if loaded.lm_head is None:
        raise UnsupportedModelError(f"{name}: the model has no output embeddings (LM head)")
    logger.info("loaded %s from %s: %d layers, %d/%d heads, head_dim %d, vocab %d, %s on %s",
                name, model, loaded.num_layers, num_heads, loaded.num_kv_heads, head_dim,
                loaded.vocab_size, dtype, device)
    return loaded


def _eos_ids(hf_model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    sources = (
        getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None),
        getattr(hf_model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    )
    for value in sources:
        for tok in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tok, int) and tok not in ids:
                ids.append(tok)
    return ids
