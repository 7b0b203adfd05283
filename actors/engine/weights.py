"""In-place weight updates of a loaded model (RL: push the trainer's weights, never reload).

Names are those of the Hugging Face state dict (``model.state_dict()``; the names
``save_pretrained`` writes), so a trainer's state dict, or the tensors of a sharded checkpoint
read file by file, load as they are. Tied weights (``lm_head.weight`` and
``model.embed_tokens.weight``) are one tensor reachable under both names. Every tensor is
checked (name, shape, dtype) before anything of its batch is copied, and copied into the
existing parameter storage, so CUDA graphs that read the weights stay valid. The e4m3 weights
of FP8 projections (``quantization: fp8``) take floating-point tensors of the model's dtype
and re-quantize them in place (``Fp8Linear.load_weight``: the weight and its scales).

``WeightPayload`` carries tensors through Ray's object store as numpy arrays (bf16 as int16
bits), which Ray hands to every reader without a copy.
"""

from __future__ import annotations

import difflib
import logging
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: tensors per validate-then-copy batch when an update arrives as an iterator
DEFAULT_BATCH_BYTES = 1 << 30

_BITS = {torch.bfloat16: torch.int16}


@dataclass(slots=True)
class WeightPayload:
    """Named tensors as numpy arrays (pickles out-of-band: zero-copy through Ray)."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    arrays: list[np.ndarray] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def __len__(self) -> int:
        return len(self.names)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs; the tensors share the arrays' memory (read them only)."""
        for name, dtype, array in zip(self.names, self.dtypes, self.arrays):
            with warnings.catch_warnings():  # arrays from the object store are read-only
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(array)
            yield name, tensor.view(getattr(torch, dtype))


def pack_weights(items: Iterable[tuple[str, torch.Tensor]]) -> WeightPayload:
    """Host copies of ``(name, tensor)`` pairs as a :class:`WeightPayload`."""
    payload = WeightPayload()
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights[{name!r}]: expected a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        host = tensor.detach().to("cpu").contiguous()
        bits = _BITS.get(host.dtype)
        payload.names.append(str(name))
        payload.dtypes.append(str(host.dtype).replace("torch.", ""))
        payload.arrays.append((host.view(bits) if bits is not None else host).numpy())
    return payload


def check_tensor(name: str, value: Any, shape: tuple[int, ...], dtype: torch.dtype
                 ) -> torch.Tensor:
    """``value`` as a tensor that can be loaded into a ``shape``/``dtype`` target.

    Raises:
        TypeError: not a tensor (numpy arrays are accepted).
        ValueError: another shape, or a dtype that is not a floating-point one castable to
            ``dtype`` (non-floating dtypes must match).
    """
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"weights[{name!r}]: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"weights[{name!r}]: shape {tuple(value.shape)} does not match "
                         f"the model's {tuple(shape)}")
    if value.dtype != dtype and not (value.is_floating_point() and dtype.is_floating_point):
        raise ValueError(f"weights[{name!r}]: dtype {value.dtype} cannot be loaded into the "
                         f"model's {dtype} (floating-point tensors are cast, others must match)")
    return value


def unknown_names_error(names: list[str], known: Iterable[str]) -> ValueError:
    """The error for names that are not in the model's state dict (with a close match)."""
    known = list(known)
    hints = difflib.get_close_matches(names[0], known, n=1)
    hint = f" (did you mean {hints[0]!r}?)" if hints else ""
    return ValueError(
        f"weights: {len(names)} name(s) not in the model's state dict, e.g. "
        f"{', '.join(map(repr, names[:5]))}{hint}; names are those of the Hugging Face "
        f"state dict, e.g. {known[0]!r}")


def iter_weights(weights: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs of a mapping, a :class:`WeightPayload` or an iterable of pairs."""
    if isinstance(weights, WeightPayload):
        return weights.items()
    if isinstance(weights, Mapping):
        return iter(weights.items())
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise TypeError("weights: expected a state dict, a WeightPayload or an iterable of "
                        f"(name, tensor) pairs, got {type(weights).__name__}")
    return iter(weights)


def as_tensor_pairs(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of any accepted ``weights`` (numpy arrays as tensors), all
    read at once (a tensor-parallel engine sends each of them to every rank)."""
    return [(name, torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
            for name, v in iter_weights(weights)]


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a ``shape``/``stride`` view spans from its offset."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


class WeightLoader:
    """Loads named tensors into a model's parameters and persistent buffers, in place.

    Args:
        model: the loaded ``transformers`` model.
        shards: with tensor parallelism, ``{name: ShardSlice}`` of the tensors this rank
            holds a slice of (``actors.engine.parallel.sharding``): those names take the full
            HF tensor, checked against the full shape, and keep this rank's slice.
    """

    def __init__(self, model: torch.nn.Module, shards: Mapping[str, Any] | None = None):
        self.model = model
        self.shards = dict(shards or {})
        from actors.engine.model.quantization.fp8_linear import Fp8Linear

        self.targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        # "<module>.weight" of each FP8 projection -> the layer that re-quantizes into it
        self.quantized: dict[str, Fp8Linear] = {
            f"{name}.weight": module for name, module in model.named_modules()
            if isinstance(module, Fp8Linear)}
        self.missing: set[int] = set()  # id() of parameters that hold no weights (sleep 2)
        self.discarded = False           # parameters freed (between discard and restore)
        self._shapes: dict[int, tuple[torch.Size, torch.dtype, torch.device]] = {}
        # (device, dtype, storage) -> [(parameter, stride, storage offset)] of discarded views
        self._storages: dict[tuple, list[tuple[torch.Tensor, tuple, int]]] = {}

    # ------------------------------------------------------------------ checks
    def spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, dtype name)}`` of every loadable tensor (for checks elsewhere)."""
        return {name: (self._full_shape(name), str(self._dtype(name, t)).replace("torch.", ""))
                for name, t in self.targets.items()}

    def _full_shape(self, name: str) -> tuple[int, ...]:
        shard = self.shards.get(name)
        return shard.full_shape if shard is not None else tuple(self._shape(self.targets[name]))

    def _dtype(self, name: str, tensor: torch.Tensor) -> torch.dtype:
        """The dtype a tensor is given in: an FP8 weight takes its layer's compute dtype."""
        layer = self.quantized.get(name)
        return tensor.dtype if layer is None else layer.out_dtype

    def _shape(self, tensor: torch.Tensor) -> torch.Size:
        saved = self._shapes.get(id(tensor)) if self.discarded else None
        return saved[0] if saved is not None else tensor.shape

    def _unknown(self, names: list[str]) -> ValueError:
        return unknown_names_error(names, self.targets)

    def _check(self, name: str, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.targets[name]
        dtype = self._dtype(name, target)
        shard = self.shards.get(name)
        if shard is None:
            return target, check_tensor(name, value, tuple(target.shape), dtype)
        value = check_tensor(name, value, shard.full_shape, dtype)
        return target, shard.take(value)

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def load(self, weights: Any, *, batch_bytes: int = DEFAULT_BATCH_BYTES) -> dict[str, Any]:
        """Copies the given tensors into the model (floating-point ones cast to its dtype).

        A mapping or payload is checked whole before the first copy (all or nothing); an
        iterator is checked and copied in batches of about ``batch_bytes`` (an error in a
        later batch leaves the earlier ones loaded).

        Returns:
            ``{"num_tensors", "num_bytes", "seconds"}`` of this update.

        Raises:
            ValueError: an unknown name, a wrong shape or dtype, a name given twice, or tied
                names given different values.
            TypeError: a value that is not a tensor.
        """
        if self.discarded:
            raise RuntimeError("weights: the model's weights were discarded by sleep(level=2); "
                               "wake_up() before loading weights")
        t0 = time.perf_counter()
        seen: dict[int, str] = {}
        num = num_bytes = 0
        if isinstance(weights, (Mapping, WeightPayload)):
            items = list(iter_weights(weights))
            unknown = [name for name, _ in items if name not in self.targets]
            if unknown:
                raise self._unknown(unknown)
            batches: Iterable[list] = [[(name, *self._check(name, v)) for name, v in items]]
        else:
            batches = self._batches(iter_weights(weights), batch_bytes)
        for batch in batches:
            self._copy(batch, seen)
            num += len(batch)
            num_bytes += sum(v.numel() * v.element_size() for _, _, v in batch)
        device = next(iter(self.targets.values())).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats = {"num_tensors": num, "num_bytes": num_bytes,
                 "seconds": time.perf_counter() - t0}
        logger.info("weights updated: %d tensors, %.1f MiB in %.3f s", num, num_bytes / 2**20,
                    stats["seconds"])
        return stats

    def _batches(self, pairs: Iterator[tuple[str, Any]], batch_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor, torch.Tensor]]]:
        batch, size = [], 0
        for name, value in pairs:
            if name not in self.targets:
                raise self._unknown([name])
            target, value = self._check(name, value)
            batch.append((name, target, value))
            size += value.numel() * value.element_size()
            if size >= batch_bytes:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    def _copy(self, batch: list[tuple[str, torch.Tensor, torch.Tensor]],
              seen: dict[int, str]) -> None:
        """Checks names given twice and tied pairs, then copies (the first value of each
        tensor; a tied second name must carry the same values)."""
        first: dict[int, tuple[str, torch.Tensor]] = {}
        for name, target, value in batch:
            key = id(target)
            other = first.get(key)
            earlier = seen.get(key)
            if name in (earlier, other[0] if other else None):
                raise ValueError(f"weights[{name!r}]: given twice in one update")
            if other is not None or earlier is not None:
                reference = other[1] if other is not None else target
                if not torch.equal(reference.to(target.device, target.dtype),
                                   value.to(target.device, target.dtype)):
                    raise ValueError(
                        f"weights[{name!r}]: tied to {(other or (earlier,))[0]!r} in this "
                        "model, but the two were given different values")
                continue
            first[key] = (name, value)
        for key, (name, value) in first.items():
            layer = self.quantized.get(name)
            if layer is not None:
                layer.load_weight(value)
            else:
                self.targets[name].copy_(value)
            self.missing.discard(key)
            seen[key] = name

    # ------------------------------------------------------------------ sleep level 2
    def discard(self) -> int:
        """Frees every parameter's memory (the tensors keep their shape metadata elsewhere);
        returns the bytes released. ``restore`` re-allocates them, ``load`` refills them."""
        if self.discarded:
            return 0
        freed = 0
        self._shapes = {}
        self._storages = {}
        for param in self.model.parameters():  # unique parameters (tied ones once)
            self._shapes[id(param)] = (param.shape, param.dtype, param.device)
            # parameters that are views of one storage (fused projections) get one back
            key = (param.device, param.dtype, param.untyped_storage().data_ptr()
                   if param.numel() else -id(param))
            self._storages.setdefault(key, []).append(
                (param, param.stride(), param.storage_offset()))
            freed += param.numel() * param.element_size()
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self.missing.add(id(param))
        self.discarded = True
        return freed

    def restore(self) -> None:
        """Re-allocates the parameters ``discard`` freed (contents undefined until loaded);
        parameters that were views of one storage are views of one new storage, at the same
        offsets and strides."""
        if not self.discarded:
            return
        for (device, dtype, _), views in self._storages.items():
            start = min(offset for _, _, offset in views)
            end = max(offset + _extent(self._shapes[id(p)][0], stride)
                      for p, stride, offset in views)
            base = torch.empty(end - start, dtype=dtype, device=device)
            for param, stride, offset in views:
                param.data = base.as_strided(self._shapes[id(param)][0], stride, offset - start)
        self._storages = {}
        self.discarded = False

    def missing_names(self) -> list[str]:
        """State-dict names of parameters that hold no loaded weights (after a level-2
        sleep), one name per tensor."""
        out, done = [], set()
        for name, tensor in self.targets.items():
            if id(tensor) in self.missing and id(tensor) not in done:
                done.add(id(tensor))
                out.append(name)
        return out
