"""Fused q/k/v and gate/up projections: one GEMM where transformers' modules run three (two).

:func:`install_fused_projections` finds each module whose ``q_proj``/``k_proj``/``v_proj``
(``gate_proj``/``up_proj``) are all plain ``nn.Linear`` or all ``Fp8Linear`` layers of one
input width, dtype and device, with biases all or none, and whose ``forward`` calls them on
one and the same argument (read from its source: a cross-attention ``k_proj(states)`` keeps
its own code). Other layer types, mixed groups and hooked layers are left alone. An FP8 group
runs one ``_scaled_mm`` over the input's one quantization, with the layers' per-channel weight
scales side by side in one buffer (each layer's ``weight_scale`` a view of its columns).

The weights stay addressable by their Hugging Face names: the rows of the group are
concatenated into one storage and each layer's ``weight`` (``bias``) parameter, the same
``Parameter`` object as before, becomes a view of its rows. ``update_weights`` copying into
``q_proj.weight`` writes the fused storage; ``sleep(level=2)`` frees it (every view dropped)
and ``WeightLoader.restore`` gives parameters that shared a storage one storage again, with
the same offsets. Nothing holds the fused weight itself: each call derives it from the views
(after checking that they still tile one storage; if not, every layer runs its own GEMM).

Each layer keeps its module and is called as before; its ``forward`` is the group's: the first
layer called with an input runs the group's GEMM and returns its columns as a view, and the
others called with the *same* tensor object (same shape, data pointer and version counter,
so an in-place write in between would miss) take their columns of that result. A call with
another input runs the group's GEMM again, so results never depend on the call order. Nothing
is swapped on trust: each group's GEMM is first run next to its layers' own on random inputs.
The concatenated GEMM can round differently in the last bits (another tiling of N).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["FusedProjections", "install_fused_projections"]

#: the layer groups fused into one GEMM, by their names in the parent module
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_CALL = re.compile(r"self\.(\w+)\(\s*([A-Za-z_][\w.]*)\s*\)")


def _version(x: torch.Tensor) -> int:
    return -1 if x.is_inference() else x._version


class ProjectionGroup:
    """Linear layers of one input fused into one GEMM (see the module docstring)."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.layers = layers
        self.sizes = [m.out_features for m in layers]
        self.rows = sum(self.sizes)
        self.in_features = layers[0].in_features
        self.has_bias = layers[0].bias is not None
        self.fp8 = _is_fp8(layers[0])
        self.attrs = ("weight",) + (("weight_scale",) if self.fp8 else ()) \
            + (("bias",) if self.has_bias else ())
        self._key: tuple | None = None  # (input, shape, data_ptr, version) of the cached result
        # (storage pointer, storage bytes, tensor pointers) found tiling one storage
        self._tiled: dict[str, tuple[int, ...]] = {}
        self._bounds = [(sum(self.sizes[:i]), sum(self.sizes[:i + 1]))
                        for i in range(len(layers))]
        self._outs: tuple[torch.Tensor, ...] = ()
        self._left: set[int] = set()

    # ------------------------------------------------------------------ storage
    def fuse(self) -> None:
        """Moves the layers' weights (biases, FP8 weight scales) into one storage, each
        layer's tensor a view of its rows (of its columns: the ``[1, N]`` scales)."""
        for attr in self.attrs:
            tensors = [getattr(m, attr) for m in self.layers]
            dim = 1 if attr == "weight_scale" else 0
            fused = torch.cat([t.data for t in tensors], dim)
            for tensor, view in zip(tensors, fused.split(self.sizes, dim)):
                tensor.data = view

    def unfuse(self) -> None:
        """Gives each layer its own storage again (and its own forward)."""
        for m in self.layers:
            for attr in self.attrs:
                tensor = getattr(m, attr)
                tensor.data = tensor.data.clone()
            m.__dict__.pop("forward", None)

    def _fused(self, attr: str) -> torch.Tensor | None:
        """The group's ``[rows, in]`` weight (``[rows]`` bias) as a view of the layers'
        storage, or None when the layers' tensors no longer tile one storage in order."""
        tensors = [getattr(m, attr) for m in self.layers]
        first = tensors[0]
        storage = first.untyped_storage()
        pointers = (storage.data_ptr(), storage.nbytes(), *(t.data_ptr() for t in tensors))
        if pointers != self._tiled.get(attr):  # checked once per storage and layout
            if not self._tile(tensors, attr):
                return None
            self._tiled[attr] = pointers
        if attr == "weight":
            return first.as_strided((self.rows, self.in_features), (self.in_features, 1))
        if attr == "weight_scale":
            return first.as_strided((1, self.rows), (self.rows, 1))
        return first.as_strided((self.rows,), (1,))

    def _tile(self, tensors: list[torch.Tensor], attr: str) -> bool:
        """Whether ``tensors`` lie one after the other, each of its layer's shape, in one
        storage."""
        first = tensors[0]
        if first.numel() == 0:
            return False
        base, offset = first.untyped_storage().data_ptr(), first.storage_offset()
        for t, size in zip(tensors, self.sizes):
            shape = {"weight": (size, self.in_features), "weight_scale": (1, size)}.get(
                attr, (size,))
            if (t.untyped_storage().data_ptr() != base or t.storage_offset() != offset
                    or tuple(t.shape) != shape or not t.is_contiguous()
                    or t.dtype != first.dtype):
                return False
            offset += t.numel()
        return True

    # ------------------------------------------------------------------ forward
    def compute(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """All layers' outputs for ``x`` from one GEMM (views of its result), or None."""
        fused = [self._fused(attr) for attr in self.attrs]
        if any(t is None for t in fused):
            return None
        weight, bias = fused[0], fused[-1] if self.has_bias else None
        if self.fp8:
            from actors.engine.model.quantization.fp8_linear import fp8_input, fp8_matmul

            y = fp8_matmul(*fp8_input(x, self.in_features), weight, fused[1], bias,
                           self.layers[0].out_dtype).view(*x.shape[:-1], self.rows)
        else:
            y = F.linear(x, weight, bias)
        return tuple(y[..., a:b] for a, b in self._bounds)

    def project(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s output for ``x`` (its ``forward``)."""
        key = self._key
        if (key is not None and key[0] is x and index in self._left and key[1] == x.shape
                and key[2] == x.data_ptr() and key[3] == _version(x)):
            out = self._outs[index]
            self._left.discard(index)
            if not self._left:
                self.clear()
            return out
        outs = self.compute(x)
        if outs is None:  # the storage was changed under us: each layer on its own
            layer = self.layers[index]
            if self.fp8:
                return type(layer).forward(layer, x)
            return F.linear(x, layer.weight, layer.bias)
        self._key = (x, x.shape, x.data_ptr(), _version(x))
        self._outs, self._left = outs, set(range(len(self.layers))) - {index}
        return outs[index]

    def clear(self) -> None:
        self._key, self._outs, self._left = None, (), set()


class FusedProjections:
    """The projection groups fused in one model."""

    def __init__(self) -> None:
        self.groups: dict[str, ProjectionGroup] = {}  # "<module>.q_proj+k_proj+v_proj"
        self.kept: list[str] = []  # "<class>.<layers>: why" of the groups left alone

    def describe(self) -> dict[str, Any]:
        qkv = sum(len(g.layers) == 3 for g in self.groups.values())
        return {"qkv": qkv, "gate_up": len(self.groups) - qkv, "kept": sorted(set(self.kept))}


def _is_fp8(layer: Any) -> bool:
    from actors.engine.model.quantization.fp8_linear import Fp8Linear

    return type(layer) is Fp8Linear


def _fusable(layers: list[Any]) -> str | None:
    """Why these layers cannot be fused (None when they can)."""
    if not (all(type(m) is torch.nn.Linear for m in layers)
            or all(_is_fp8(m) for m in layers)):
        return "not all nn.Linear or all Fp8Linear"
    if _is_fp8(layers[0]) and any(m.out_dtype != layers[0].out_dtype for m in layers):
        return "FP8 layers of different output dtypes"
    if any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
           for m in layers):  # a layer of another group too
        return "hooked or replaced forward"
    first = layers[0].weight
    if any(m.weight.dtype != first.dtype or m.weight.device != first.device
           or m.in_features != layers[0].in_features for m in layers):
        return "different dtype, device or input width"
    biases = [m.bias is not None for m in layers]
    if any(biases) and not all(biases):
        return "biases on some layers only"
    if all(biases) and any(m.bias.dtype != layers[0].bias.dtype for m in layers):
        return "bias of another dtype"
    return None


@functools.lru_cache(maxsize=None)
def _one_input(forward: Any, names: tuple[str, ...]) -> bool:
    """Whether ``forward``'s source calls every layer of ``names`` on one same argument."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    args: dict[str, set[str]] = {}
    for name, arg in _CALL.findall(source):
        args.setdefault(name, set()).add(arg)
    called = [args.get(n, set()) for n in names]
    return all(len(a) == 1 for a in called) and len(set().union(*called)) == 1


def _agree(ours: torch.Tensor, theirs: torch.Tensor, ulps: float) -> bool:
    eps = torch.finfo(theirs.dtype).eps
    scale = float(theirs.float().abs().max()) or 1.0
    return ours.shape == theirs.shape and \
        float((ours.float() - theirs.float()).abs().max()) <= ulps * eps * scale


@torch.no_grad()
def install_fused_projections(model: torch.nn.Module, seed: int = 0) -> FusedProjections:
    """Fuses the q/k/v and gate/up projections of ``model`` (in place) where they qualify.

    Args:
        model: a loaded ``transformers`` model (after sharding and quantization).
        seed: seeds the random inputs of the install-time check.

    Returns:
        the fused groups (``describe()``: counts and what was kept and why).

    Example:
        >>> fused = install_fused_projections(model)
        >>> fused.describe()  # {"qkv": 24, "gate_up": 24, "kept": []}
    """
    fused = FusedProjections()
    gen = torch.Generator().manual_seed(seed)
    for name, module in list(model.named_modules()):
        for names in GROUPS:
            layers = [getattr(module, n, None) for n in names]
            if any(m is None for m in layers):
                continue
            why = _fusable(layers)
            if why is None and not _one_input(getattr(module.forward, "__func__",
                                                      module.forward), names):
                why = "forward does not call them on one input"
            label = f"{type(module).__name__}.{'+'.join(names)}"
            if why is not None:
                fused.kept.append(f"{label}: {why}")
                continue
            group = ProjectionGroup(layers)
            first = layers[0].weight
            x = torch.randn(5, group.in_features, generator=gen).to(first.device, first.dtype)
            want = [m(x) for m in layers]
            group.fuse()
            got = group.compute(x)
            if got is None or not all(_agree(g, w, 8) for g, w in zip(got, want)):
                group.unfuse()
                fused.kept.append(f"{label}: the fused GEMM disagrees")
                continue
            for index, m in enumerate(layers):
                m.forward = functools.partial(group.project, index)
            fused.groups[f"{name}.{'+'.join(names)}"] = group
    logger.info("fused projections: %s", fused.describe())
    return fused
