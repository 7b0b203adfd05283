"""Fused MoE layers swapped into a loaded transformers model.

:func:`install_fused_moe` gives two kinds of modules a new ``forward``, each only after it
matched the module's own code on random inputs of the model's dtype:

- an *experts* module (transformers' fused experts: 3-D ``gate_up_proj`` / ``down_proj``
  parameters, optional biases, SiLU-and-mul or gpt-oss's clamped SwiGLU) runs
  :func:`~actors.engine.model.kernels.moe_gemm.fused_experts` (CUDA) or its torch oracle;
- a *router* of a known class (:data:`ROUTERS`) runs one routing kernel
  (:mod:`~actors.engine.model.kernels.moe_routing`) after its own logits projection.

The MoE block around them (shared experts and their gate, reshapes) stays the model's code.
Parameters are read from the modules at every call, never copied: ``update_weights`` and
sleep address them by their Hugging Face names as before. A module that does not fit, or
whose check fails, keeps its own forward; the reason is logged and listed in
:meth:`FusedMoE.describe`.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from actors.engine.model.kernels.moe_routing import RoutingSpec

logger = logging.getLogger(__name__)

__all__ = ["ROUTERS", "FusedMoE", "experts_layout", "install_fused_moe"]

Backend = Literal["triton", "torch"]


def _spec_topk_norm(m: Any) -> RoutingSpec:  # Qwen2-MoE, Qwen3-MoE, OLMoE
    return RoutingSpec(m.top_k, renormalize=bool(m.norm_topk_prob))


def _spec_mixtral(m: Any) -> RoutingSpec:
    return RoutingSpec(m.top_k, renormalize=True)


def _spec_on_logits(m: Any) -> RoutingSpec:  # GraniteMoe, gpt-oss
    return RoutingSpec(m.top_k, choose_on_logits=True)


def _spec_deepseek_v2(m: Any) -> RoutingSpec:
    grouped = m.topk_method == "group_limited_greedy"
    if m.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method {m.topk_method!r}")
    return RoutingSpec(m.top_k, scale=float(m.routed_scaling_factor),
                       num_groups=int(m.num_group or 1) if grouped else 1,
                       topk_groups=int(m.topk_group or 1) if grouped else 1)


def _spec_deepseek_v3(m: Any) -> RoutingSpec:
    return RoutingSpec(m.top_k, scoring="sigmoid", has_bias=True,
                       renormalize=bool(m.norm_topk_prob), renorm_eps=1e-20,
                       scale=float(m.routed_scaling_factor), num_groups=int(m.num_group),
                       topk_groups=int(m.topk_group), group_score="top2_sum",
                       masked_value=float("-inf"))


#: router class -> (its rule, how it computes the logits: "native" (the model's dtype),
#: "cast" (then to float32) or "fp32" (float32 operands), whether the projection has a bias,
#: the dtype of the returned weights: "logits", "float32" or "input")
ROUTERS: dict[str, tuple[Callable[[Any], RoutingSpec], str, bool, str]] = {
    "Qwen2MoeTopKRouter": (_spec_topk_norm, "native", False, "logits"),
    "Qwen3MoeTopKRouter": (_spec_topk_norm, "native", False, "logits"),
    "OlmoeTopKRouter": (_spec_topk_norm, "native", False, "logits"),
    "MixtralTopKRouter": (_spec_mixtral, "native", False, "float32"),
    "GraniteMoeTopKRouter": (_spec_on_logits, "cast", False, "input"),
    "GptOssTopKRouter": (_spec_on_logits, "native", True, "logits"),
    "DeepseekV2TopkRouter": (_spec_deepseek_v2, "fp32", False, "float32"),
    "DeepseekV3TopkRouter": (_spec_deepseek_v3, "fp32", False, "float32"),
}


@dataclass(frozen=True, slots=True)
class _RouterPlan:
    spec: RoutingSpec
    logits: str
    has_bias: bool
    out_dtype: str
    backend: Backend
    ids_first: bool = False  # returns (ids, weights, logits) (transformers 5.17's GraniteMoe)


def _router_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    from actors.engine.model.kernels import moe_routing

    plan: _RouterPlan = self._fused_moe_plan
    x = hidden_states.reshape(-1, self.weight.shape[-1])
    if plan.logits == "fp32":
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
    else:
        logits = torch.nn.functional.linear(x, self.weight, self.bias if plan.has_bias else None)
        if plan.logits == "cast":
            logits = logits.float()
    bias = self.e_score_correction_bias if plan.spec.has_bias else None
    dtype = {"logits": logits.dtype, "float32": torch.float32, "input": x.dtype}[plan.out_dtype]
    if plan.backend == "triton":
        weights, ids = moe_routing.route(logits, plan.spec, bias, dtype)
    else:
        weights, ids = moe_routing.route_torch(logits, plan.spec, bias)
        weights = weights.to(dtype)
    return (ids, weights, logits) if plan.ids_first else (logits, weights, ids)


def experts_layout(m: torch.nn.Module) -> tuple[Any, bool] | str:
    """``(ExpertLayout, has_bias)`` of a fused experts module, or why it is not covered."""
    from actors.engine.model.kernels.moe_gemm import ExpertLayout

    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]):
        return "no 3-D gate_up_proj / down_proj parameters"
    if getattr(m, "has_gate", True) is False or getattr(m, "has_post_expert_norm", False):
        return "experts without a gate or with a post-expert norm"
    if getattr(m, "_is_expert_parallel", False):
        return "expert-parallel experts"
    standard = gate_up.shape[2] == down.shape[1] and gate_up.shape[1] == 2 * down.shape[2]
    flipped = gate_up.shape[1] == down.shape[2] and gate_up.shape[2] == 2 * down.shape[1]
    transposed = getattr(m, "is_transposed", None)
    if transposed is None:
        if standard == flipped:
            return f"ambiguous expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)}"
        transposed = flipped
    if not (flipped if transposed else standard):
        return f"unexpected expert shapes {tuple(gate_up.shape)} / {tuple(down.shape)}"
    concatenated = getattr(m, "is_concatenated", None)
    gate_up_bias = getattr(m, "gate_up_proj_bias", None)
    has_bias = isinstance(gate_up_bias, torch.nn.Parameter)
    if has_bias != isinstance(getattr(m, "down_proj_bias", None), torch.nn.Parameter):
        return "only one of the two projections has a bias"
    gate_fn = type(m).__dict__.get("_apply_gate")  # transformers' default is set on the class
    own_gate = gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate"
    act = getattr(m, "act_fn", None)
    if isinstance(getattr(m, "limit", None), (int, float)) \
            and isinstance(getattr(m, "alpha", None), (int, float)) and act is None:
        # gpt-oss's clamped SwiGLU (its gate and up rows interleave unless it says otherwise)
        return ExpertLayout(transposed, concatenated is not True, "swiglu_oai", float(m.alpha),
                            float(m.limit)), has_bias
    if own_gate:
        return f"{type(m).__name__} has its own gating function"
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(act).__name__} is not covered"
    return ExpertLayout(transposed, concatenated is False), has_bias


def _experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    from actors.engine.model.kernels import moe_gemm

    layout, has_bias, backend = self._fused_moe_plan
    fn = moe_gemm.fused_experts if backend == "triton" else moe_gemm.fused_experts_torch
    biases = (self.gate_up_proj_bias, self.down_proj_bias) if has_bias else (None, None)
    return fn(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
              layout, *biases)


@dataclass
class FusedMoE:
    """What :func:`install_fused_moe` swapped into one model."""

    backend: Backend
    experts: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # class -> why its forward stayed

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "experts": len(self.experts),
                "routers": len(self.routers), "kept": dict(sorted(self.kept.items()))}


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    theirs = theirs.float()
    return float((ours.float() - theirs).norm() / theirs.norm().clamp_min(1e-30))


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


class _Checker:
    """Random inputs on the model's device and dtype, and the agreement tests."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator().manual_seed(seed)

    def rand(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(self.device, self.dtype)

    def experts(self, module: torch.nn.Module, original: Callable, tokens: int = 48) -> str | None:
        num_experts = module.gate_up_proj.shape[0]
        hidden = module.gate_up_proj.shape[1 if module._fused_moe_plan[0].transposed else 2]
        top_k = min(4, num_experts)
        x = self.rand(tokens, hidden)
        ids = torch.rand(tokens, num_experts, generator=self.gen).topk(top_k, -1)[1]
        weights = torch.rand(tokens, top_k, generator=self.gen).softmax(-1)
        ids, weights = ids.to(self.device), weights.to(self.device, self.dtype)
        want, got = original(x, ids, weights), _experts_forward(module, x, ids, weights)
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"output {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
        err = _relative_error(got, want)
        return None if err <= _tolerance(self.dtype) else f"relative error {err:.2e}"

    def ids_first(self, module: torch.nn.Module, original: Callable) -> bool:
        """Whether the router returns its expert ids first (else its logits)."""
        return not original(self.rand(2, module.weight.shape[-1]))[0].is_floating_point()

    def router(self, module: torch.nn.Module, original: Callable, tokens: int = 64) -> str | None:
        x = self.rand(tokens, module.weight.shape[-1])
        want, got = original(x), _router_forward(module, x)
        if module._fused_moe_plan.ids_first:
            want, got = want[::-1], got[::-1]
        _, want_w, want_ids = want
        _, got_w, got_ids = got
        if got_w.dtype != want_w.dtype or got_ids.dtype != want_ids.dtype \
                or got_w.shape != want_w.shape:
            return "weights or ids of another dtype or shape"
        # ties between equal scores may pick other experts: compare the sorted weights and
        # require the same expert sets on nearly every row
        err = float((got_w.float().sort(-1)[0] - want_w.float().sort(-1)[0]).abs().max())
        same = (got_ids.sort(-1)[0] == want_ids.sort(-1)[0]).all(-1).float().mean()
        bound = max(float(want_w.float().abs().max()), 1.0) * _tolerance(want_w.dtype)
        if err > bound or float(same) < 0.95:
            return f"weights differ by {err:.2e}, same experts on {float(same):.0%} of rows"
        return None


def _run_check(check: Callable, module: torch.nn.Module, original: Callable) -> str | None:
    try:
        return check(module, original)
    except Exception as exc:  # noqa: BLE001 - a kernel or module that cannot run stays out
        return f"the check raised {exc!r}"


@torch.no_grad()
def install_fused_moe(model: torch.nn.Module, backend: Backend = "triton",
                      seed: int = 0) -> FusedMoE:
    """Swaps the fused MoE forwards into ``model`` (in place) where they match its code.

    Args:
        model: a loaded transformers model (weights on their device).
        backend: "triton" (the kernels; CUDA, or the interpreter) or "torch" (the oracles).
        seed: of the random check inputs.

    Returns:
        The :class:`FusedMoE` record (also logged).
    """
    param = next(model.parameters())
    check = _Checker(param.device, param.dtype, seed)
    fused = FusedMoE(backend)
    verdict: dict[type, str | None] = {}
    ids_first: dict[type, bool] = {}
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__name__ in ROUTERS:
            rule, logits, has_bias, out_dtype = ROUTERS[cls.__name__]
            original = module.forward
            try:
                if cls not in ids_first:
                    ids_first[cls] = check.ids_first(module, original)
                module._fused_moe_plan = _RouterPlan(rule(module), logits, has_bias, out_dtype,
                                                     backend, ids_first[cls])
            except Exception as exc:  # noqa: BLE001 - a router we cannot read stays out
                fused.kept[cls.__name__] = f"router attributes not understood ({exc!r})"
                continue
            if cls not in verdict:
                verdict[cls] = _run_check(check.router, module, original)
            if verdict[cls] is None:
                module.forward = types.MethodType(_router_forward, module)
                fused.routers.append(name)
            else:
                fused.kept[cls.__name__] = f"router check failed: {verdict[cls]}"
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            layout = experts_layout(module)
            if isinstance(layout, str):
                fused.kept[cls.__name__] = layout
                continue
            module._fused_moe_plan = (*layout, backend)
            original = module.forward
            if cls not in verdict:
                verdict[cls] = _run_check(check.experts, module, original)
            if verdict[cls] is None:
                module.forward = types.MethodType(_experts_forward, module)
                fused.experts.append(name)
            else:
                fused.kept[cls.__name__] = f"experts check failed: {verdict[cls]}"
    for cls_name, reason in fused.kept.items():
        logger.warning("fused MoE: %s keeps its own forward: %s", cls_name, reason)
    logger.info("fused MoE: %s", fused.describe())
    return fused
