"""The paged KV pool: one tensor, per-layer pages in FlashInfer's NHD layout.

Layer ``l`` is ``pool[l]`` of shape ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values), which ``BatchPrefill/DecodeWithPagedKVCacheWrapper.run`` takes as
is. When keys and values differ in width (MLA: ``key_dim`` > ``value_dim``), ``head_dim`` is the
wider one and each layer uses the first ``key_dim`` / ``value_dim`` entries of its key / value
rows (the rest stays zero). Which block belongs to which sequence is the block manager's business.

The pool is in the model's dtype, or in ``float8_e4m3fn`` (``kv_cache_dtype: fp8``): then new
K/V rows are clamped to +-448 (e4m3's largest finite value) and cast, with a per-tensor scale of
1.0, and readers cast the pages back to the compute dtype (``store_rows``; docs/fp8.md).
"""

from __future__ import annotations

import logging
import math

import torch

# e4m3 and its largest finite value: an FP8 pool's rows are clamped to +-FP8_MAX, then cast
from actors.engine.model.quantization.fp8_math import FP8_DTYPE, FP8_MAX, check_capability

logger = logging.getLogger(__name__)

_CPU_DEFAULT_BYTES = 1 << 30


class KVCache:
    """Owns the KV pages of every layer.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: the pool's shape.
        dtype, device: of the pages (``dtype`` ``float8_e4m3fn``: an FP8 pool).
        num_scratch_blocks: extra pages after the ``num_blocks`` the block manager hands out
            (CUDA-graph padding rows write their K/V to the first of them).
        key_dim, value_dim: widths of keys and values (default ``head_dim``; at most it).
        compute_dtype: the dtype K/V arrive in and readers compute in (default ``dtype``).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_scratch_blocks: int = 0,
        *,
        key_dim: int | None = None,
        value_dim: int | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        self.key_dim = key_dim or head_dim
        self.value_dim = value_dim or head_dim
        if max(self.key_dim, self.value_dim) != head_dim:
            raise ValueError(f"head_dim: {head_dim} must be the wider of key_dim "
                             f"{self.key_dim} and value_dim {self.value_dim}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_scratch_blocks = num_scratch_blocks
        self.compute_dtype = compute_dtype or dtype
        # zeros, not empty: padded table entries are read (and masked), never NaN garbage
        self.pool = torch.zeros(
            (num_layers, num_blocks + num_scratch_blocks, 2, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )
        self.device = self.pool.device

    @property
    def scratch_page(self) -> int:
        """The first page no sequence owns (-1 when there is none)."""
        return self.num_blocks if self.num_scratch_blocks else -1

    def layer(self, layer_idx: int) -> torch.Tensor:
        """``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` view of one layer."""
        return self.pool[layer_idx]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies pages ``src[i] -> dst[i]`` in every layer (device index tensors)."""
        if src.numel():
            pool = as_bytes(self.pool)
            pool[:, dst] = pool[:, src]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool when allocated (also while released)."""
        return self.pool.numel() * self.pool.element_size()

    # ------------------------------------------------------------------ sleep / wake
    @property
    def is_released(self) -> bool:
        return self.pool.device.type == "meta"

    def release(self) -> int:
        """Frees the pages (the pool becomes a shape-only placeholder, so a stray read fails
        loudly); returns the bytes released. Their contents are lost."""
        if self.is_released:
            return 0
        freed = self.nbytes
        self.pool = torch.empty(self.pool.shape, dtype=self.pool.dtype, device="meta")
        logger.info("KV cache released (%.1f MiB)", freed / 2**20)
        return freed

    def restore(self) -> None:
        """Allocates the pages again (zeros, as at construction) on their device."""
        if self.is_released:
            self.pool = torch.zeros(self.pool.shape, dtype=self.pool.dtype, device=self.device)


def as_bytes(pages: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes (``uint8``, same shape: torch's index kernels do not all
    take float8); any other tensor as it is."""
    return pages.view(torch.uint8) if pages.dtype == FP8_DTYPE else pages


def store_rows(flat: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[rows[i]] = values[i]`` in ``flat``'s dtype (``index_copy_`` along dim 0). Into an
    FP8 pool the values are clamped to +-``FP8_MAX`` first (scale 1.0), so the cast never makes
    NaN or inf out of a large finite value."""
    if flat.dtype == FP8_DTYPE:
        quantized = values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        flat.view(torch.uint8).index_copy_(0, rows, quantized.view(torch.uint8))
    else:
        flat.index_copy_(0, rows, values.to(flat.dtype))


def store_kv(flat: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor) -> None:
    """A step's new keys and values into their rows of ``flat`` (:func:`store_rows` each); on
    CUDA, into an FP8 pool or one of the rows' dtype, in one kernel (``kernels.kv_store``, the
    same values)."""
    if flat.is_cuda and flat.stride(-1) == 1 and (
            flat.dtype == FP8_DTYPE or flat.dtype == key.dtype == value.dtype):
        from actors.engine.model.kernels.kv_store import store_kv_rows

        store_kv_rows(flat, k_rows, v_rows, key, value)
        return
    store_rows(flat, k_rows, key)
    store_rows(flat, v_rows, value)


def gather_pages(pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``pages[index]`` (advanced indexing on dim 0), FP8 pages gathered as bytes."""
    if pages.dtype == FP8_DTYPE:
        return pages.view(torch.uint8)[index].view(FP8_DTYPE)
    return pages[index]


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's dtype for ``EngineConfig.kv_cache_dtype``: "auto" is the model's, "fp8"
    ``float8_e4m3fn`` (on CPU through the torch backend; on CUDA from compute capability 8.9).
    Raises ``ValueError`` naming ``engine.kv_cache_dtype`` on an older GPU."""
    if name == "auto":
        return model_dtype
    if name != "fp8":
        raise ValueError(f"engine.kv_cache_dtype: must be 'auto' or 'fp8', got {name!r}")
    if device.type == "cuda":
        check_capability(device, "engine.kv_cache_dtype: 'fp8'",
                         "FlashInfer's FP8 KV cache kernels; Ada, Hopper")
    return FP8_DTYPE


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def compute_num_blocks(
    *,
    per_block: int,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    reserved: int = 0,
) -> int:
    """How many blocks to allocate when the config does not fix it.

    Budget: ``kv_cache_memory`` bytes if given; on CUDA, ``gpu_memory_utilization`` of the
    device memory minus what is in use now (weights are loaded first) and minus ``reserved``
    (the peak a step needs, measured by a warm-up forward, plus workspaces); on CPU 1 GiB.
    Never more than what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.
    """
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - (total - free) - reserved
    else:
        budget = _CPU_DEFAULT_BYTES
    blocks_per_seq = math.ceil(max_model_len / block_size)
    cap = max_num_seqs * blocks_per_seq + max_num_seqs
    num_blocks = min(budget // per_block, cap)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"engine: KV cache budget of {budget} bytes holds {max(num_blocks, 0)} blocks of "
            f"{block_size} tokens, fewer than one sequence of max_model_len={max_model_len} "
            "needs; lower max_model_len or raise the KV memory"
        )
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, block_size,
                num_blocks * per_block / 2**20)
    return int(num_blocks)
