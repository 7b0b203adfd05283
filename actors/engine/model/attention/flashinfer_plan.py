"""Re-planning a FlashInfer wrapper without its Python ``plan`` (checked on 0.6.4).

After a wrapper's first official ``plan`` (which builds or loads the kernel module and sets
every attribute ``run`` reads), a new step only changes the work split: the module's own
``plan`` (C++) recomputes it from host indptr arrays and copies it to the wrapper's int
workspace with one asynchronous copy. The official Python method around it also iterates
host tensors with the builtin ``max`` (about 6 ms for 1,024 rows on a slow host) and makes
pageable, blocking copies; this helper skips both. The caller sets the per-step attributes
(page-table buffers, batch size, max lengths) where ``run`` reads them.
"""

from __future__ import annotations

from typing import Any

import torch

from actors.engine.model.attention.csr import PagedCSR


def replan(wrapper: Any, qo_indptr_host: torch.Tensor, csr: PagedCSR, *, num_rows: int,
           causal: bool, window_left: int, heads: tuple[int, int, int, int, int]) -> None:
    """Recomputes ``wrapper._plan_info`` for a new step.

    Args:
        wrapper: a FlashInfer paged prefill wrapper, or a tensor-core decode wrapper, that
            went through its official ``plan`` once with the same heads, dtypes and window.
        qo_indptr_host: ``[B+1]`` int32 CPU query offsets.
        csr: the step's page table (host arrays).
        num_rows: total query rows (T; the batch size for decode).
        causal, window_left: the mask, as in the first plan (made with
            ``use_cuda_graph=False`` and ``disable_split_kv=True``, which this plan keeps).
        heads: ``(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size)``.
    """
    module = getattr(wrapper, "_cached_module", None)
    if module is None:
        raise RuntimeError("replan: the wrapper was never planned (call its plan() first)")
    num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size = heads
    args = [
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
        qo_indptr_host,
        torch.from_numpy(csr.indptr),
        torch.from_numpy(csr.kv_lens),
        num_rows,
        csr.num_rows,
        num_qo_heads,
        num_kv_heads,
        page_size,
        False,  # enable_cuda_graph: the wrappers are built without it (see flashinfer_backend)
        head_dim_qk,
        head_dim_vo,
        causal,
        window_left,
    ]
    if wrapper._backend == "fa2":
        args += [-1, True, 0]  # fixed_split_size, disable_split_kv, num_colocated_ctas
    wrapper._plan_info = module.plan(*args)
