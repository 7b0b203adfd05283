"""Loads a decoder-only causal LM and its tokenizer through transformers, wired to our
paged attention (``attn_implementation=ATTENTION_NAME``), and refuses what cannot run on it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.engine.engine_config import EngineConfig
from actors.engine.model.attention import ATTENTION_NAME, STEP_KWARG, register_attention
from actors.engine.model.attention.base import CURRENT_STEP, LayerSpec, capture_step_kwarg
from actors.engine.model.attention.probe import UnsupportedAttentionError, probe_layers
from actors.engine.model.kv_cache import resolve_kv_dtype
from actors.engine.model.lm_head import ModelHead, check_head
from actors.engine.model.model_support import (
    UnsupportedModelError,
    architecture_name,
    check_architecture,
    check_model_class,
)

__all__ = ["ATTENTION_NAME", "LoadedModel", "UnsupportedModelError", "check_architecture",
           "check_model_class", "import_transformers", "load_model"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """The model, its tokenizer and the facts the engine sizes itself from.

    ``num_kv_heads``, ``head_dim`` (key width) and ``value_dim`` are what the attention modules
    really pass (recorded by the load-time probe, ``layer_specs``); ``head`` computes logits
    through the model's own head path (``actors.engine.model.lm_head``).
    """

    model: torch.nn.Module
    base_model: torch.nn.Module
    head: ModelHead
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
    value_dim: int = 0
    layer_specs: dict[int, LayerSpec] = field(default_factory=dict)
    attention_route: str = "registry"
    # seconds of each loading phase: transformers_import, model_config (config + architecture
    # checks, which import the model's module), cuda_init (device context, CUDA only),
    # model_weights (from_pretrained onto the device), quantization (fp8 only), tokenizer
    phases: dict[str, float] = field(default_factory=dict)
    # what quantization did (``quantize_decoder``'s summary), None without quantization
    quantization: dict[str, Any] | None = None
    # the KV pool's dtype (``kv_cache_dtype``); None: ``dtype``
    kv_dtype: torch.dtype | None = None


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


def import_transformers() -> tuple[Any, Any, Any]:
    """Imports the transformers modules every load needs: the Auto classes (returned:
    ``AutoConfig``, ``AutoModelForCausalLM``, ``AutoTokenizer``) and ``modeling_utils`` (which
    brings ``torch.distributed.tensor``, ``torch._dynamo`` and scipy with it), the
    "transformers_import" phase of a process's first load. A caller may run it ahead of the
    load (``GenerationActor`` does, with the cyclic collector paused)."""
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    return AutoConfig, AutoModelForCausalLM, AutoTokenizer


def resolve_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def load_model(model: str, config: EngineConfig, *, on_host: bool = False) -> LoadedModel:
    """Loads ``model`` (local directory or hub id) for ``config.device`` / ``config.dtype``.
    ``on_host`` leaves the weights in host memory (a tensor-parallel rank moves only its
    shard to the device).

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
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, device)  # refused here too

    AutoConfig, AutoModelForCausalLM, AutoTokenizer = import_transformers()

    mark("transformers_import")  # the first load in a process pays for it
    register_attention()
    common = dict(trust_remote_code=config.trust_remote_code, revision=config.revision)
    hf_config = AutoConfig.from_pretrained(model, **common)
    name = architecture_name(hf_config)
    _, route = check_architecture(hf_config, config.trust_remote_code)
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
    attn = ATTENTION_NAME if route == "registry" else "sdpa"
    kwargs = dict(dtype=dtype, attn_implementation=attn, **common)
    hf_model = None
    if device.type == "cuda" and not on_host:  # weights straight onto the GPU
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(model, device_map=str(device),
                                                            **kwargs)
        except (ImportError, TypeError, ValueError) as exc:
            logger.info("loading with device_map=%s failed (%s); loading on the host", device,
                        exc)
    if hf_model is None:
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        except KeyError as exc:  # built before any weight is read
            if attn not in str(exc):
                raise
            raise UnsupportedModelError(
                f"{name}: its modeling code picks attention classes by implementation name "
                f"and has none for {attn!r}") from None
    route = check_model_class(type(hf_model), name)
    hf_model.to("cpu" if on_host else device).eval().requires_grad_(False)
    capture_step_kwarg(hf_model.base_model)
    if route == "sdpa":
        from actors.engine.model.attention.sdpa_adapter import install_sdpa_adapter

        install_sdpa_adapter(hf_model)
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
    try:
        head = ModelHead(hf_model)
    except ValueError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from None
    # a rank that loads on the host probes there (its shard moves to the device later)
    specs = _probe(hf_model, head, text.num_hidden_layers, name,
                   torch.device("cpu") if on_host else device)
    first = specs[0]
    loaded = LoadedModel(
        model=hf_model,
        base_model=hf_model.base_model,
        head=head,
        tokenizer=tokenizer,
        architecture=name,
        num_layers=text.num_hidden_layers,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.key_dim,
        value_dim=first.value_dim,
        layer_specs=specs,
        attention_route=route,
        vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        dtype=dtype,
        device=device,
        phases=phases.seconds,
        quantization=quantization,
        kv_dtype=kv_dtype,
    )
    logger.info("loaded %s from %s: %d layers, %d/%d heads, key/value width %d/%d, vocab %d, "
                "%s on %s (attention via %s)", name, model, loaded.num_layers, first.num_heads,
                first.num_kv_heads, first.key_dim, first.value_dim, loaded.vocab_size, dtype,
                device, route)
    return loaded


def _probe(hf_model: torch.nn.Module, head: ModelHead, num_layers: int, name: str,
           device: torch.device) -> dict[int, LayerSpec]:
    """The attention probe, plus a check that the head path on the base model's output
    reproduces the full CausalLM forward's logits for the same token."""
    base = hf_model.base_model
    outputs = []

    def forward(ids, positions, ctx):
        out = base(input_ids=ids[None], position_ids=positions[None], attention_mask=None,
                   use_cache=False, **{STEP_KWARG: ctx})
        outputs.append(out[0][0])
        return out

    def full(ids, positions, ctx):
        token = CURRENT_STEP.set(ctx)  # CausalLMs need not pass extra keywords down
        try:
            out = hf_model(input_ids=ids[None], position_ids=positions[None],
                           attention_mask=None, use_cache=False)
        finally:
            CURRENT_STEP.reset(token)
        outputs.append(out.logits[0])
        return out

    try:
        specs = probe_layers(forward, num_layers, name, device)
        probe_layers(full, num_layers, name, device)
    except UnsupportedAttentionError as exc:
        raise UnsupportedModelError(str(exc)) from None
    err = check_head(hf_model, head, outputs[0], outputs[1])
    if err is not None:
        raise UnsupportedModelError(
            f"{name}: logits through its head path differ from its own forward's by {err:.3g}"
            " (its CausalLM does more than project the base model's output)")
    head.use_output_embeddings_if_equal(hf_model.get_output_embeddings())
    return specs


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
