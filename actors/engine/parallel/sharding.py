"""Splits a loaded transformers model over the ranks of a replica, following the model's own
``base_model_tp_plan`` (module-name patterns -> "colwise" / "rowwise" / replicated styles).

- colwise ``nn.Linear`` (q/k/v, gate/up): this rank's slice of the output features; when the
  model has fewer KV heads than ranks, k/v are *replicated by head* (rank r keeps KV head
  ``r * kv_heads // tp``, as vLLM does);
- rowwise ``nn.Linear`` (o/down): this rank's slice of the input features, then an all-reduce
  of the output (a forward hook); the bias stays on rank 0 only (zeros elsewhere), so it is
  added once;
- MoE experts stored as 3D parameters (``[experts, out, in]``): "packed_colwise" gate_up
  keeps this rank's slice of the gate half and of the up half, "rowwise" down its slice of
  the input features, and the experts module ("moe_tp_experts") all-reduces its output; the
  router is replicated (expert parallelism is not done). Where the plan leaves such a module
  out (transformers after 5.17 names experts only in ``base_model_ep_plan``), these three
  entries are added for it when its weights are ``[E, 2I, H]`` / ``[E, H, I]`` with gate and
  up as halves and no biases; other experts modules are refused;
- the input embedding and the LM head are split over the vocabulary
  (``actors.engine.parallel.vocab``: an all-reduced lookup, all-gathered logits), whatever
  style the plan gives them (``embedding_rowwise`` in some transformers releases);
- styles that only matter for training (``replicated_with_grad_allreduce``) keep the module
  whole; any other style (fused MoE experts, sequence parallel, ...) is refused.

Returns the slicers of the sharded state-dict names so ``update_weights`` can take full HF
tensors and keep each rank's slice.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

import torch

from actors.engine.engine_config import check_tensor_parallel
from actors.engine.model.loader import LoadedModel, UnsupportedModelError
from actors.engine.parallel.comm import TPComm
from actors.engine.parallel.vocab import shard_vocab

_REPLICATED = ("replicated_with_grad_allreduce", "replicate", "replicated")


@dataclass(slots=True)
class ShardSlice:
    """How a full HF tensor of one state-dict name becomes this rank's tensor."""

    full_shape: tuple[int, ...]
    take: Callable[[torch.Tensor], torch.Tensor]


def _fail(rule: str, value: int) -> ValueError:
    return ValueError(f"engine.tensor_parallel_size: {rule}, got {value}")


def compile_plan(plan: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    """``base_model_tp_plan`` patterns (``layers.*.mlp.up_proj``) as regular expressions."""
    return [(re.compile(re.escape(key).replace(r"\*", r"[^.]+")), style)
            for key, style in plan.items()]


def _relative(name: str, prefix: str) -> str:
    """A module's name as the plan spells it (without the base model's prefix)."""
    return name[len(prefix):] if name.startswith(prefix) else name


def _rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[start:stop].contiguous()


def _cols(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[:, start:stop].contiguous()


def _zeros_unless(keep: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda t: t.contiguous()) if keep else (lambda t: torch.zeros_like(t))


def shard_model(loaded: LoadedModel, comm: TPComm) -> tuple[LoadedModel, dict[str, ShardSlice]]:
    """Shards ``loaded.model`` in place for ``comm``'s rank; returns the facts of this rank
    (its head counts) and the slicers keyed by full state-dict name."""
    tp, rank = comm.world_size, comm.rank
    heads, kv_heads, head_dim = loaded.num_heads, loaded.num_kv_heads, loaded.head_dim
    check_tensor_parallel(tp, heads, kv_heads)
    model = loaded.model
    text = model.config.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not plan:
        raise UnsupportedModelError(
            f"{loaded.architecture}: its config has no base_model_tp_plan; it cannot run "
            "with tensor_parallel_size > 1")
    prefix = model.base_model_prefix + "."
    patterns = compile_plan(plan)
    patterns += compile_plan(_experts_plan(model, patterns, prefix, loaded.architecture))
    replicate_kv = kv_heads < tp
    local_kv = 1 if replicate_kv else kv_heads // tp
    slices: dict[str, ShardSlice] = {}
    embed = model.get_input_embeddings()
    for name, module in model.named_modules():
        rel = _relative(name, prefix)
        style = next((s for p, s in patterns if p.fullmatch(rel)), None)
        if style is None or style in _REPLICATED or module is embed:
            continue  # the input embedding: split over the vocabulary below, whatever its style
        if style == "moe_tp_experts":
            module.register_forward_hook(lambda _m, _i, out: comm.all_reduce(out))
            if hasattr(module, "intermediate_dim"):
                module.intermediate_dim //= tp
            continue
        if style not in ("colwise", "rowwise") or not isinstance(module, torch.nn.Linear):
            raise UnsupportedModelError(
                f"{loaded.architecture}: module {name!r} has tensor-parallel style {style!r} "
                f"({type(module).__name__}); only colwise / rowwise nn.Linear are supported")
        weight = module.weight
        out_features, in_features = weight.shape
        parts = {}
        if style == "colwise":
            if replicate_kv and out_features == kv_heads * head_dim and kv_heads != heads:
                head = rank * kv_heads // tp
                take = _rows(head * head_dim, (head + 1) * head_dim)
            else:
                if out_features % tp:
                    raise _fail(f"must divide the output features ({out_features}) of "
                                f"{name!r}", tp)
                step = out_features // tp
                take = _rows(rank * step, (rank + 1) * step)
            parts["weight"] = take
            if module.bias is not None:
                parts["bias"] = take
        else:
            if in_features % tp:
                raise _fail(f"must divide the input features ({in_features}) of {name!r}", tp)
            step = in_features // tp
            parts["weight"] = _cols(rank * step, (rank + 1) * step)
            if module.bias is not None:
                parts["bias"] = _zeros_unless(rank == 0)
            module.register_forward_hook(lambda _m, _i, out: comm.all_reduce(out))
        for pname, take in parts.items():
            param = getattr(module, pname)
            slices[f"{name}.{pname}"] = ShardSlice(tuple(param.shape), take)
            param.data = take(param.data)
        module.in_features, module.out_features = module.weight.shape[1], module.weight.shape[0]
    _shard_expert_parameters(model, patterns, prefix, rank, tp, slices, loaded.architecture)
    for name, (full_shape, take) in shard_vocab(loaded, comm).items():
        slices[name] = ShardSlice(full_shape, take)
    local_heads = heads // tp
    for module in model.modules():  # eager-style code reads the group size
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = local_heads // local_kv
    return dataclasses.replace(loaded, num_heads=local_heads, num_kv_heads=local_kv), slices


def _experts_plan(model, patterns, prefix: str, architecture: str) -> dict[str, str]:
    """Plan entries for the fused experts modules (3-D ``gate_up_proj`` / ``down_proj``) that
    ``patterns`` leave out: the module all-reduces, gate/up is packed colwise, down rowwise."""
    from actors.engine.model.moe import experts_layout

    extra: dict[str, str] = {}
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3):
            continue  # no fused experts (a 2-D gate_up_proj is a dense MLP's)
        rel = _relative(name, prefix)
        names = (rel, f"{rel}.gate_up_proj", f"{rel}.down_proj")
        if any(p.fullmatch(n) for p, _ in patterns for n in names):
            continue
        layout = experts_layout(module)
        if isinstance(layout, str) or layout[1] or layout[0].transposed or layout[0].interleaved:
            why = layout if isinstance(layout, str) else "transposed, interleaved or biased"
            raise UnsupportedModelError(
                f"{architecture}: experts module {name!r} is not in the model's tensor-parallel "
                f"plan and cannot be sharded by the engine ({why})")
        extra.update({rel: "moe_tp_experts", f"{rel}.gate_up_proj": "packed_colwise",
                      f"{rel}.down_proj": "rowwise"})
    return extra


def _packed_halves(rank: int, tp: int, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """dim 1 of ``[E, 2 * width, in]`` (gate then up): this rank's rows of each half."""
    step = width // tp
    lo = slice(rank * step, (rank + 1) * step)
    hi = slice(width + rank * step, width + (rank + 1) * step)
    return lambda t: torch.cat([t[:, lo], t[:, hi]], dim=1).contiguous()


def _shard_expert_parameters(model, patterns, prefix: str, rank: int, tp: int,
                             slices: dict[str, ShardSlice], architecture: str) -> None:
    """The plan's entries that name parameters (fused MoE experts), not modules."""
    for name, param in list(model.named_parameters()):
        rel = _relative(name, prefix)
        style = next((s for p, s in patterns if p.fullmatch(rel)), None)
        if style is None or style in _REPLICATED:
            continue
        if param.dim() != 3 or style not in ("packed_colwise", "rowwise"):
            raise UnsupportedModelError(
                f"{architecture}: parameter {name!r} {tuple(param.shape)} has tensor-parallel "
                f"style {style!r}; only 3-D expert weights (packed_colwise / rowwise) are "
                "supported")
        if style == "packed_colwise":
            width = param.shape[1] // 2
            if param.shape[1] % 2 or width % tp:
                raise _fail(f"must divide the expert width ({width}) of {name!r}", tp)
            take = _packed_halves(rank, tp, width)
        else:
            width = param.shape[2]
            if width % tp:
                raise _fail(f"must divide the expert width ({width}) of {name!r}", tp)
            step = width // tp
            take = (lambda lo, hi: lambda t: t[:, :, lo:hi].contiguous())(
                rank * step, (rank + 1) * step)
        slices[name] = ShardSlice(tuple(param.shape), take)
        param.data = take(param.data)


def load_shard(model: str, config, comm: TPComm) -> tuple[LoadedModel, dict[str, ShardSlice]]:
    """Loads ``model`` in host memory, keeps this rank's shard and moves it to the device."""
    from actors.engine.model.loader import load_model

    loaded = load_model(model, config, on_host=True)
    loaded, slices = shard_model(loaded, comm)
    loaded.model.to(loaded.device)
    return loaded, slices
