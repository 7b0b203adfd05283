"""MoE routing: router logits ``[T, E]`` to each token's top-k experts and their weights, in
one kernel (one program per token), for the routers of the transformers MoE models.

:class:`RoutingSpec` names the variant: softmax or sigmoid scores, top-k on the scores or on
the logits (then a softmax over the chosen logits), a correction bias that only steers the
choice (DeepSeek-V3's ``e_score_correction_bias``), renormalisation of the chosen weights, a
routed scaling factor, and grouped (device-limited) top-k. :func:`route_torch` is the oracle;
grouped top-k runs through it on every device (a handful of torch ops, no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from actors.engine.model.kernels.rounding import round_to


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """One router's top-k rule.

    Attributes:
        top_k: experts per token.
        scoring: "softmax" (over all experts) or "sigmoid" (per expert).
        choose_on_logits: pick the top-k logits, then softmax over them (GraniteMoe, gpt-oss);
            the scoring is then "softmax".
        renormalize: divide the chosen weights by their sum (+ ``renorm_eps``).
        renorm_eps: added to that sum (DeepSeek-V3: 1e-20).
        scale: routed scaling factor multiplying the final weights.
        has_bias: a per-expert bias added to the scores for the choice only.
        num_groups, topk_groups: grouped top-k: keep the ``topk_groups`` best of
            ``num_groups`` expert groups, then pick the top-k inside them.
        group_score: a group's score: its best expert ("max") or its two best ("top2_sum").
        masked_value: what experts outside the kept groups score (0 or -inf).
    """

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    choose_on_logits: bool = False
    renormalize: bool = False
    renorm_eps: float = 0.0
    scale: float = 1.0
    has_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: Literal["max", "top2_sum"] = "max"
    masked_value: float = 0.0

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1 and self.topk_groups < self.num_groups


def route_torch(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: ``(weights [T, k] float32, ids [T, k] int64)`` from ``logits [T, E]``."""
    logits = logits.float()
    if spec.choose_on_logits:
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        scores = logits.sigmoid() if spec.scoring == "sigmoid" else logits.softmax(-1)
        choice = scores + bias.float() if spec.has_bias else scores
        if spec.grouped:
            tokens, experts = choice.shape
            groups = choice.view(tokens, spec.num_groups, experts // spec.num_groups)
            if spec.group_score == "top2_sum":
                group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = groups.max(dim=-1).values
            keep = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
            mask = mask.unsqueeze(-1).expand_as(groups).reshape(tokens, experts)
            choice = choice.masked_fill(~mask, spec.masked_value)
        ids = torch.topk(choice, spec.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + spec.renorm_eps)
    if spec.scale != 1.0:
        weights = weights * spec.scale
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_l, scale, eps,
                  K: tl.constexpr, SIGMOID: tl.constexpr, ON_LOGITS: tl.constexpr,
                  RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=0.0).to(tl.float32)
    if ON_LOGITS:
        scores = x
    elif SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        e = tl.exp(x - tl.max(tl.where(valid, x, float("-inf")), 0))
        e = tl.where(valid, e, 0.0)
        scores = e / tl.sum(e, 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    kcols = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(K):
        best = tl.max(choice, 0)
        idx = tl.min(tl.where(choice == best, cols, BLOCK_E), 0)
        value = tl.sum(tl.where(cols == idx, scores, 0.0), 0)
        picked = tl.where(kcols == i, value, picked)
        picked_ids = tl.where(kcols == i, idx.to(tl.int64), picked_ids)
        choice = tl.where(cols == idx, float("-inf"), choice)
    kvalid = kcols < K
    if ON_LOGITS:
        e = tl.exp(picked - tl.max(tl.where(kvalid, picked, float("-inf")), 0))
        e = tl.where(kvalid, e, 0.0)
        picked = e / tl.sum(e, 0)
    if RENORM:
        picked = picked / (tl.sum(tl.where(kvalid, picked, 0.0), 0) + eps)
    dt = w_ptr.dtype.element_ty
    picked = round_to(picked * scale, dt).to(dt)
    tl.store(w_ptr + row * K + kcols, picked, mask=kvalid)
    tl.store(ids_ptr + row * K + kcols, picked_ids, mask=kvalid)


def route(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None = None,
          out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_torch` in one kernel (grouped top-k goes to the torch function).

    Args:
        logits: ``[T, E]`` router logits (any float dtype; read as float32).
        spec: the router's rule.
        bias: ``[E]`` choice bias when ``spec.has_bias``.
        out_dtype: of the weights (rounded from float32).

    Returns:
        ``(weights [T, k], ids [T, k] int64)``; ties pick the lowest expert id.
    """
    if spec.grouped or logits.dim() != 2:
        weights, ids = route_torch(logits, spec, bias)
        return weights.to(out_dtype), ids
    if spec.has_bias and (bias is None or bias.shape != (logits.shape[1],)):
        raise ValueError(f"bias: expected shape ({logits.shape[1]},) for this router")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    tokens, experts = logits.shape
    weights = torch.empty(tokens, spec.top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(tokens, spec.top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, bias if spec.has_bias else logits, weights, ids, experts, logits.stride(0),
            float(spec.scale), float(spec.renorm_eps), K=spec.top_k,
            SIGMOID=spec.scoring == "sigmoid", ON_LOGITS=spec.choose_on_logits,
            RENORM=spec.renormalize, HAS_BIAS=spec.has_bias,
            BLOCK_E=triton.next_power_of_2(experts), BLOCK_K=triton.next_power_of_2(spec.top_k),
            num_warps=1 if experts <= 128 else 4)
    return weights, ids
