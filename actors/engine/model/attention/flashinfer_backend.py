"""FlashInfer paged attention: one plan per step, one kernel call per layer.

Per distinct (sliding window, scale) of the model's layers: a causal
``BatchPrefillWithPagedKVCacheWrapper`` (FA2) for prefill and mixed steps, and a tensor-core
``BatchDecodeWithPagedKVCacheWrapper`` for pure-decode steps, eager or captured in a CUDA graph
(one wrapper per graph bucket, whose page-table buffers are static). Both wrappers run the same
FA2 kernel module, so one JIT build per (dtype, head_dim, window flag) serves every step.

Split-KV is disabled everywhere: each query row is reduced by one thread block over its whole
context, so a row's output does not depend on its batch-mates, the batch size or the plan.
That is what makes graph and eager decode steps (and seeded sampling with and without graphs)
bit-identical. It also makes the decode plan's launch layout depend only on the batch size, so
the graph buckets use FlashInfer's ordinary (non-``use_cuda_graph``) plan over pointer-stable
buffers: ``use_cuda_graph=True`` without split-KV launches a padded grid whose extra blocks
recompute stale rows. A re-plan whose layout differs from the captured one makes that step
run eagerly (``update_graph_plan`` returns False).

Layers with attention sinks (gpt-oss) use FlashInfer's ``BatchAttentionWithAttentionSinkWrapper``
(a paged prefill wrapper with the sink variant; 0.6.4's default FA2 module ignores ``sinks``),
and layers whose keys and values differ in width (MLA: ``head_dim_qk`` 192, ``head_dim_vo``
128) a paged prefill wrapper planned with both widths; for these the decode steps (eager and
graph buckets) use that prefill-kind wrapper too (queries of one token), since the decode
wrapper has one head_dim and no sink variant. Soft-capping (gemma2) is ``logits_soft_cap``.

New K/V rows are written at the step's slot mapping (``store_kv``: keys and values in one
Triton kernel, which for an FP8 pool clamps and casts them), then the kernel reads the pages
(KV layout NHD: ``[pages, 2, block_size, kv_heads, head_dim]``, as ``KVCache`` keeps it). An
FP8 pool is planned with ``kv_data_type=float8_e4m3fn``, queries stay in the model's dtype,
and ``run`` gets no ``k_scale`` / ``v_scale`` (the scale is 1.0). Over an FP8 pool, and over
any pool for heads up to ``TRITON_DECODE_MAX_HEAD_DIM`` (heads of 16 or more either way), or
up to 128 when ``TRITON_DECODE_MIN_GROUP`` query heads share a KV head (:func:`triton_decodes`),
the decode steps of full-attention layers without soft-capping or sinks run
:mod:`actors.engine.model.kernels.decode_attention` instead (eager and in graphs, over the same
page-table buffers; no decode wrapper is built for them): FlashInfer's FA2 decode over e4m3
pages runs at ~3x its read floor, slower than over bf16 pages, and the kernel is the faster
over narrow heads and wide groups. Its chunks are fixed by position, so it is batch-invariant
like the rest. After each wrapper's first (official) ``plan``, later plans call its compiled
module's ``plan`` directly
(``flashinfer_plan.replan``): the official Python ``plan`` iterates over host tensors with the
builtin ``max`` (milliseconds at 1,000 sequences) and makes blocking copies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from actors.engine.model.attention.base import AttentionBackend, LayerSpec, as_layer_spec
from actors.engine.model.attention.csr import PagedCSR, build_csr
from actors.engine.model.attention.flashinfer_plan import replan
from actors.engine.model.attention.metadata import AttentionMetadata
from actors.engine.model.kernels.decode_attention import decode_attention, decode_chunk
from actors.engine.model.kv_cache import store_kv, store_rows

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20
#: decode steps of full-attention layers (no soft-capping or sinks, one head width) run the
#: Triton decode kernel rather than FlashInfer's over e4m3 pages, and over bf16/fp16 pages of
#: heads up to this width (heads of 16 or more either way: ``tl.dot``'s least), where it was
#: the faster on an H200 (docs/benchmarks.md, run CA)
TRITON_DECODE_MAX_HEAD_DIM = 64
#: ... and of heads up to 128 wide when this many query heads share a KV head (one matrix
#: product a KV head and key block): the faster on an H200 at Qwen3-30B-A3B's 32 / 4 heads
#: (run CK); at 4 (Llama-3-8B, run CA) FlashInfer's was
TRITON_DECODE_MIN_GROUP = 8


def triton_decodes(kv_dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether plain full-attention decode steps over ``kv_dtype`` pages of ``head_dim``-wide
    heads, ``group`` query heads a KV head, run the Triton kernel."""
    if head_dim < 16:
        return False
    return (kv_dtype == torch.float8_e4m3fn or head_dim <= TRITON_DECODE_MAX_HEAD_DIM
            or (head_dim <= 128 and group >= TRITON_DECODE_MIN_GROUP))
#: (window_left, scale, soft cap (0: none), has sinks) of a layer; window_left -1 is full
#: causal attention.
LayerKey = tuple[int, float, float, bool]
Uploader = Callable[[np.ndarray, torch.Tensor | None], torch.Tensor]


def _default_upload(array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    src = torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
    if out is None:
        return src.to("cuda", non_blocking=True)
    return out.copy_(src, non_blocking=True)


@dataclass(slots=True)
class FlashInferPlan:
    """What every layer of one step shares."""

    slot_mapping: torch.Tensor                      # [T] int64 (device)
    wrappers: dict[LayerKey, Any]
    bucket: int = 0                                 # graph bucket size (0: eager)
    plan_infos: dict[LayerKey, list[int]] = field(default_factory=dict)
    k_rows: torch.Tensor | None = None              # [T] rows of the flattened layer pages
    v_rows: torch.Tensor | None = None
    # a decode step's page table on the device (indptr, indices, last page lengths), for the
    # layers whose decode runs the Triton kernel
    csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer (bf16/fp16 on CUDA).

    Args:
        kv_cache: the paged pool (NHD pages; keys ``kv_cache.key_dim`` wide, values
            ``kv_cache.value_dim``).
        num_heads, num_kv_heads, head_dim: attention shape (``head_dim``: the key width).
        layer_specs: ``{layer: LayerSpec}`` (or ``(sliding_window, scaling)`` pairs) as the
            model calls attention (recorded by the load-time probe).
        max_model_len: windows at least this long are full attention.
    """

    name = "flashinfer"
    supports_graphs = True

    def __init__(self, kv_cache: Any, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 layer_specs: dict[int, LayerSpec | tuple], max_model_len: int):
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim)
        import flashinfer

        self._fi = flashinfer
        self.dtype = getattr(kv_cache, "compute_dtype", kv_cache.pool.dtype)  # queries
        self.kv_dtype = kv_cache.pool.dtype                                   # pages
        self.device = kv_cache.pool.device
        self.block_size = kv_cache.block_size
        self.key_dim = getattr(kv_cache, "key_dim", head_dim)
        self.value_dim = getattr(kv_cache, "value_dim", head_dim)
        self.layer_keys: dict[int, LayerKey] = {}
        for layer, raw in layer_specs.items():
            spec = as_layer_spec(raw)
            window = spec.sliding_window
            full = window is None or window <= 0 or window >= max_model_len
            key = (-1 if full else int(window) - 1, float(spec.scaling),
                   float(spec.softcap or 0.0), bool(spec.has_sinks))
            if key[2] and key[3]:
                raise ValueError(f"flashinfer backend: layer {layer} has both soft-capping and "
                                 "sinks (no FlashInfer variant has both)")
            self.layer_keys[layer] = key
        self.keys = sorted(set(self.layer_keys.values()))
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = {key: self._prefill_wrapper(key) for key in self.keys}
        # decode steps of plain layers over e4m3 pages, of narrow heads or of wide groups: the
        # Triton kernel (FlashInfer 0.6.4's FA2 decode dequantizes e4m3 pages at ~3x the read
        # floor, slower than over bf16 pages; triton_decodes)
        plain = (self.key_dim == self.value_dim == kv_cache.layer(0).shape[-1]
                 and triton_decodes(self.kv_dtype, self.key_dim, num_heads // num_kv_heads))
        self.triton_decode = {key for key in self.keys
                              if plain and key[0] == -1 and not key[2] and not key[3]}
        self.decode_chunk = decode_chunk(max_model_len)
        self.decode_splits = -(-max_model_len // self.decode_chunk)
        self._decode = {key: self._decode_wrapper(key) for key in self.keys
                        if key not in self.triton_decode}
        self._planned: set[int] = set()   # id() of wrappers that went through plan() once
        self.upload: Uploader = _default_upload
        self._graph_buffers: dict[str, torch.Tensor] = {}
        self._range_host: dict[int, torch.Tensor] = {}
        logger.info("flashinfer %s: %d layer kind(s) %s, head_dim %d, %d/%d heads, KV %s",
                    getattr(flashinfer, "__version__", "?"), len(self.keys), self.keys,
                    head_dim, num_heads, num_kv_heads, self.kv_dtype)

    def _prefill_kind_decode(self, key: LayerKey) -> bool:
        """Whether decode steps of ``key`` need the prefill-kind wrapper (sinks, or keys and
        values of different widths)."""
        return key[3] or self.key_dim != self.value_dim

    def _prefill_wrapper(self, key: LayerKey) -> Any:
        if key[3]:  # attention sinks: the sink variant of the paged prefill wrapper
            return self._fi.BatchAttentionWithAttentionSinkWrapper(
                self.workspace, "NHD", backend="fa2", q_data_type=self.dtype,
                kv_data_type=self.kv_dtype, head_dim_qk=self.key_dim,
                head_dim_vo=self.value_dim, window_left=key[0])
        return self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                            backend="fa2")

    def _decode_wrapper(self, key: LayerKey) -> Any:
        if self._prefill_kind_decode(key):
            return self._prefill_wrapper(key)
        # fa2 named (what "auto" picks for bf16, and for bf16 queries over FP8 pages on 0.6.4):
        # ``replan`` passes the fa2 module's plan arguments
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend="fa2")

    def _is_prefill_kind(self, wrapper: Any) -> bool:
        return isinstance(wrapper, self._fi.BatchPrefillWithPagedKVCacheWrapper)

    def _heads(self) -> tuple[int, int, int, int, int]:
        return (self.num_heads, self.num_kv_heads, self.key_dim, self.value_dim,
                self.block_size)

    def _first_plan(self, wrapper: Any, key: LayerKey, qo_host: torch.Tensor | None,
                    indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        """The official plan (builds or loads the kernel module, sets every attribute);
        ``qo_host`` None: one query per row."""
        window_left, scale, softcap, sinks = key
        common = dict(window_left=window_left, sm_scale=scale, q_data_type=self.dtype,
                      kv_data_type=self.kv_dtype, disable_split_kv=True)
        if softcap:
            common["logits_soft_cap"] = softcap
        if not self._is_prefill_kind(wrapper):  # decode wrapper
            wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads,
                         self.key_dim, self.block_size, **common)
        else:
            if qo_host is None:
                qo_host = torch.arange(len(last) + 1, dtype=torch.int32)
            wrapper.plan(qo_host, indptr, indices, last, self.num_heads, self.num_kv_heads,
                         self.key_dim, self.block_size, head_dim_vo=self.value_dim,
                         causal=True, **common)
        self._planned.add(id(wrapper))

    # ------------------------------------------------------------------ eager steps
    def plan(self, metadata: AttentionMetadata) -> FlashInferPlan:
        csr = build_csr(metadata.seq_lens_host, metadata.block_tables_host, self.block_size)
        indptr_d = self.upload(csr.indptr, None)
        indices_d = self.upload(csr.indices, None)
        last_d = self.upload(csr.last_page_len, None)
        qo_host = torch.from_numpy(metadata.query_start_loc_host)
        decode = metadata.max_query_len == 1
        wrappers = self._decode if decode else self._prefill
        csr_d = (indptr_d, indices_d, last_d) if decode and self.triton_decode else None
        shape = self._heads()
        for key, wrapper in wrappers.items():
            if id(wrapper) not in self._planned:
                self._first_plan(wrapper, key, qo_host, torch.from_numpy(csr.indptr),
                                 indices_d, torch.from_numpy(csr.last_page_len))
                continue
            wrapper._qo_indptr_buf = metadata.query_start_loc
            wrapper._paged_kv_indptr_buf = indptr_d
            wrapper._paged_kv_indices_buf = indices_d
            wrapper._paged_kv_last_page_len_buf = last_d
            wrapper._batch_size = metadata.num_seqs
            wrapper._max_q_len = metadata.max_query_len
            wrapper._max_kv_len = metadata.max_seq_len
            replan(wrapper, qo_host, csr, num_rows=metadata.num_tokens,
                   causal=self._is_prefill_kind(wrapper), window_left=key[0], heads=shape)
        return FlashInferPlan(metadata.slot_mapping, wrappers, csr=csr_d)

    def begin_forward(self, plan: FlashInferPlan) -> None:
        """Rows of the new tokens' K/V in a layer's flattened pages (captured in graphs)."""
        bs = self.block_size
        slots = plan.slot_mapping
        plan.k_rows = torch.div(slots, bs, rounding_mode="floor") * (2 * bs) + slots % bs
        plan.v_rows = plan.k_rows + bs

    def forward(self, plan: FlashInferPlan, layer_idx: int, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, *, scaling: float,
                sliding_window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        layer_key = self.layer_keys[layer_idx]
        pages = self.kv_cache.layer(layer_idx)                  # [N, 2, bs, Hkv, D]
        dk, dv = self.key_dim, self.value_dim
        flat = pages.view(-1, self.num_kv_heads, pages.shape[-1])
        if dk == dv == pages.shape[-1]:
            store_kv(flat, plan.k_rows, plan.v_rows, key, value)
            kv = pages
        else:  # keys and values as two strided views of equal strides (FlashInfer checks)
            store_rows(flat[:, :, :dk], plan.k_rows, key)
            store_rows(flat[:, :, :dv], plan.v_rows, value)
            kv = (pages[:, 0, :, :, :dk], pages[:, 1, :, :, :dv])
        if plan.csr is not None and layer_key in self.triton_decode:
            return decode_attention(query.contiguous(), kv, *plan.csr, layer_key[1],
                                    chunk=self.decode_chunk, max_splits=self.decode_splits)
        wrapper = plan.wrappers[layer_key]
        if layer_key[3]:  # the sink variant takes the sinks [heads] (float32) and the scale
            return wrapper.run(query.contiguous(), kv, sinks.float(), layer_key[1])
        return wrapper.run(query.contiguous(), kv)  # FP8 pages: k_scale = v_scale = 1.0

    # ------------------------------------------------------------------ graph buckets
    def prepare_graphs(self, max_bucket: int, max_pages: int) -> None:
        """Static page-table buffers shared by every bucket (indices sized for the worst
        case: ``max_pages`` pages for the real rows plus one per padding row)."""
        dev = self.device
        self._graph_buffers = {
            "indptr": torch.zeros(max_bucket + 1, dtype=torch.int32, device=dev),
            "indices": torch.zeros(max_pages + max_bucket, dtype=torch.int32, device=dev),
            "last": torch.ones(max_bucket, dtype=torch.int32, device=dev),
        }

    def graph_plan(self, bucket: int, slot_mapping: torch.Tensor, scratch_page: int
                   ) -> FlashInferPlan:
        """A decode plan of ``bucket`` rows over the static buffers (dummy rows: one token on
        ``scratch_page``), planned once officially; ``update_graph_plan`` re-plans it."""
        buf = self._graph_buffers
        csr = build_csr(np.zeros(0, np.int64), np.zeros((0, 0), np.int32), self.block_size,
                        pad_to=bucket, scratch_page=scratch_page)
        indptr, last = buf["indptr"][:bucket + 1], buf["last"][:bucket]
        indptr.copy_(torch.from_numpy(csr.indptr))
        buf["indices"][:len(csr.indices)].copy_(torch.from_numpy(csr.indices))
        last.copy_(torch.from_numpy(csr.last_page_len))
        plan = FlashInferPlan(slot_mapping, {}, bucket=bucket)
        if self.triton_decode:
            plan.csr = (indptr, buf["indices"], last)
        for key in self.keys:
            if key in self.triton_decode:
                continue
            wrapper = plan.wrappers[key] = self._decode_wrapper(key)
            # device tensors: the wrapper keeps these very buffers (pointers the graph bakes in)
            self._first_plan(wrapper, key, None, indptr, buf["indices"], last)
            plan.plan_infos[key] = [int(x) for x in wrapper._plan_info]
        return plan

    def update_graph_plan(self, plan: FlashInferPlan, csr: PagedCSR) -> bool:
        """Uploads this step's page table into the static buffers and re-plans every
        wrapper of the bucket; False if a plan's launch layout left the captured one."""
        buf = self._graph_buffers
        bucket = plan.bucket
        assert csr.num_rows == bucket
        self.upload(csr.indptr, buf["indptr"][:bucket + 1])
        self.upload(csr.indices, buf["indices"][:len(csr.indices)])
        self.upload(csr.last_page_len, buf["last"][:bucket])
        qo_host = self._range_host.get(bucket)
        if qo_host is None:
            qo_host = self._range_host[bucket] = torch.arange(bucket + 1, dtype=torch.int32)
        shape = self._heads()
        ok = True
        for key, wrapper in plan.wrappers.items():
            replan(wrapper, qo_host, csr, num_rows=bucket, causal=self._is_prefill_kind(wrapper),
                   window_left=key[0], heads=shape)
            ok = ok and [int(x) for x in wrapper._plan_info] == plan.plan_infos[key]
        return ok
