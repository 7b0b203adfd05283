"""Fused Triton layers swapped into a loaded transformers model (CUDA engines).

Under CUDA graphs a small model's decode step is dominated by the elementwise kernels around
its GEMMs: transformers' RMSNorm is ~8 kernels (casts, pow, mean, add, rsqrt, two muls), the
rotary embedding ~12 per layer (muls, neg, cat, add for q and k), the gated MLP a SiLU and a
mul. :func:`install_fused_layers` replaces them with one kernel each (``actors.engine.model.kernels``):

- every ``*RMSNorm`` module with a 1-D ``weight`` and ``variance_epsilon``/``eps`` gets a
  one-kernel ``forward``;
- every ``*MLP`` module with ``gate_proj``/``up_proj``/``down_proj`` and a SiLU ``act_fn``
  gets ``down_proj(silu_mul(gate_proj(x), up_proj(x)))``;
- with ``quantization: fp8`` (the decoder projections are ``Fp8Linear``), the two norms of
  each Llama-shaped decoder layer also quantize their output per token in the same kernel and
  hand it to q/k/v (gate/up) with the output (``attach_fp8_input``), and the MLP quantizes
  ``silu(gate) * up`` in the SiLU kernel for ``down_proj``: no separate quantization pass;
- the ``apply_rotary_pos_emb`` function of each attention class's modeling module is replaced
  while the engine's forward runs (:meth:`FusedLayers.active`), so the model stays plain
  transformers code outside the engine.

Nothing is swapped on trust: each replacement is first run next to the model's own code on
random inputs of the model's dtype, and a module class or modeling module whose results
disagree (another norm formula, another rotary convention) keeps its own code. The rotary
kernel is bit-identical to transformers' in bf16/fp16; the norm and SiLU kernels can differ in
the last bit of a float32 intermediate (sum order, ``exp``), i.e. at most one bf16 ulp.
"""

from __future__ import annotations

import logging
import sys
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)

__all__ = ["FusedLayers", "install_fused_layers"]


def _agree(ours: torch.Tensor, theirs: torch.Tensor, ulps: float = 4.0) -> bool:
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False
    eps = torch.finfo(theirs.dtype).eps
    scale = float(theirs.float().abs().max()) or 1.0
    return float((ours.float() - theirs.float()).abs().max()) <= ulps * eps * scale


def _norm_eps(module: torch.nn.Module) -> float | None:
    if not type(module).__name__.endswith("RMSNorm"):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    from actors.engine.model.kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, self.weight, self._fused_eps)


def _rms_norm_fp8_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    from actors.engine.model.kernels.rms_norm import rms_norm_fp8
    from actors.engine.model.quantization.fp8_linear import attach_fp8_input

    return attach_fp8_input(*rms_norm_fp8(hidden_states, self.weight, self._fused_eps))


def _is_linear(module: Any) -> bool:
    from actors.engine.model.quantization.fp8_linear import Fp8Linear

    return isinstance(module, (torch.nn.Linear, Fp8Linear))


def _is_fp8(module: Any) -> bool:
    from actors.engine.model.quantization.fp8_linear import Fp8Linear

    return isinstance(module, Fp8Linear)


def _is_silu_mlp(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (type(module).__name__.endswith("MLP")
            and all(_is_linear(getattr(module, n, None))
                    for n in ("gate_proj", "up_proj", "down_proj"))
            and type(act).__name__ in ("SiLU", "SiLUActivation"))


def _silu_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    from actors.engine.model.kernels.silu_mul import silu_mul

    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _silu_mlp_fp8_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    from actors.engine.model.kernels.silu_mul import silu_mul_fp8

    inner = self.down_proj.in_features
    gate = self.gate_proj(x).reshape(-1, inner)
    q, scale = silu_mul_fp8(gate, self.up_proj(x).reshape(-1, inner))
    return self.down_proj.matmul(q, scale).view(*x.shape[:-1], self.down_proj.out_features)


_NORM_CONSUMERS = {"input_layernorm": ("self_attn", ("q_proj", "k_proj", "v_proj", "qkv_proj")),
                   "post_attention_layernorm": ("mlp", ("gate_proj", "up_proj",
                                                        "gate_up_proj"))}


def fp8_fed_norms(model: torch.nn.Module) -> set[int]:
    """``id()`` of the norms whose output only FP8 projections read: the two norms of a
    decoder layer shaped like Llama's (no other norm among its children, so each norm feeds
    the block named here) whose projections there are all ``Fp8Linear``."""
    fed = set()
    for layer in model.modules():
        children = dict(layer.named_children())
        norms = {n for n, m in children.items() if type(m).__name__.endswith("Norm")}
        if norms != set(_NORM_CONSUMERS):
            continue
        for norm, (block, names) in _NORM_CONSUMERS.items():
            projections = [getattr(children.get(block), n, None) for n in names]
            projections = [p for p in projections if p is not None]
            if projections and all(_is_fp8(p) for p in projections):
                fed.add(id(children[norm]))
    return fed


def _fused_rotary(original: Callable) -> Callable:
    from actors.engine.model.kernels.rotary import apply_rotary, supported

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if args or any(n != "unsqueeze_dim" or v != 1 for n, v in kwargs.items()) \
                or not supported(q, k, cos, sin):
            return original(q, k, cos, sin, *args, **kwargs)
        return apply_rotary(q, k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


class FusedLayers:
    """The fused layers installed in one model (see the module docstring)."""

    def __init__(self) -> None:
        self.norms: list[str] = []
        self.mlps: list[str] = []
        self.fp8_norms: list[str] = []  # norms that also quantize for FP8 projections
        self.rotary: dict[str, tuple[types.ModuleType, Callable, Callable]] = {}
        self.kept: list[str] = []  # classes / modules left alone because a check failed

    def describe(self) -> dict[str, Any]:
        return {"rms_norm": len(self.norms), "silu_mul": len(self.mlps),
                "fp8_rms_norm": len(self.fp8_norms),
                "rotary": sorted(self.rotary), "kept": sorted(set(self.kept))}

    @contextmanager
    def active(self) -> Iterator[None]:
        """The model's forward inside this block uses the fused rotary embedding."""
        swapped = []
        try:
            for module, original, fused in self.rotary.values():
                if module.apply_rotary_pos_emb is original:
                    module.apply_rotary_pos_emb = fused
                    swapped.append((module, original))
            yield
        finally:
            for module, original in swapped:
                module.apply_rotary_pos_emb = original


@torch.no_grad()
def install_fused_layers(model: torch.nn.Module, seed: int = 0) -> FusedLayers:
    """Swaps the fused layers into ``model`` (in place) where they agree with its code."""
    from actors.engine.model.kernels.rotary import apply_rotary

    fused = FusedLayers()
    gen = torch.Generator().manual_seed(seed)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 2).to(device=device, dtype=dtype)

    verdict: dict[Any, bool] = {}
    fp8_norms = fp8_fed_norms(model)
    for name, module in model.named_modules():
        cls = type(module)
        eps = _norm_eps(module)
        if eps is not None:
            module._fused_eps = eps
            if cls not in verdict:
                x = rand(5, module.weight.shape[0])
                verdict[cls] = _agree(_rms_norm_forward(module, x), module(x))
            if verdict[cls]:
                forward = _rms_norm_fp8_forward if id(module) in fp8_norms else _rms_norm_forward
                module.forward = types.MethodType(forward, module)
                fused.norms.append(name)
                if id(module) in fp8_norms:
                    fused.fp8_norms.append(name)
            else:
                fused.kept.append(cls.__name__)
        elif _is_silu_mlp(module):
            fp8 = _is_fp8(module.down_proj)
            forward = _silu_mlp_fp8_forward if fp8 else _silu_mlp_forward
            if (cls, fp8) not in verdict:
                x = rand(5, module.gate_proj.in_features) / 4
                verdict[cls, fp8] = _agree(forward(module, x), module(x), ulps=16)
            if verdict[cls, fp8]:
                module.forward = types.MethodType(forward, module)
                fused.mlps.append(name)
            else:
                fused.kept.append(cls.__name__)
        elif cls.__name__.endswith("Attention"):
            home = sys.modules.get(cls.__module__)
            original = getattr(home, "apply_rotary_pos_emb", None)
            if original is None or cls.__module__ in fused.rotary:
                continue
            dim = getattr(module, "head_dim", None)
            if not isinstance(dim, int) or dim % 2:
                continue
            q, k = rand(1, 6, 3, dim).transpose(1, 2), rand(1, 6, 2, dim).transpose(1, 2)
            angle = torch.rand(1, 6, dim // 2, generator=gen).to(device) * 6
            cos = torch.cat([angle.cos()] * 2, -1).to(dtype)
            sin = torch.cat([angle.sin()] * 2, -1).to(dtype)
            try:
                want = original(q, k, cos, sin)
            except (RuntimeError, TypeError, ValueError):  # another layout (gpt-oss: half-width
                fused.kept.append(f"{cls.__module__}.apply_rotary_pos_emb")  # cos / sin)
                continue
            got = apply_rotary(q, k, cos, sin)
            if _agree(got[0], want[0], 1) and _agree(got[1], want[1], 1):
                fused.rotary[cls.__module__] = (home, original, _fused_rotary(original))
            else:
                fused.kept.append(f"{cls.__module__}.apply_rotary_pos_emb")
    logger.info("fused layers: %s", fused.describe())
    return fused
