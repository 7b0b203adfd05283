"""FlashInfer paged attention against the torch reference backend on the same pages (GPU).

Run on a CUDA machine with flashinfer installed: ``pytest -m gpu tests/actors``. Shapes follow
Qwen2-0.5B (14 query heads, 2 KV heads, head_dim 64, bf16). Tolerance: bf16 inputs and
outputs; the reference attends in float32 over the same bf16 pages, so the relative L2 error
of the FlashInfer output is bounded by bf16 rounding of the output (~4e-3); we allow 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engine.model.attention import AttentionMetadata
from actors.engine.model.attention.csr import build_csr
from actors.engine.model.kv_cache import KVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, KV_HEADS, DIM, BS = 14, 2, 64, 16
SCALE = DIM ** -0.5


def _metadata(context_lens, query_lens, tables, device):
    context_lens, query_lens = np.array(context_lens), np.array(query_lens)
    seq_lens = (context_lens + query_lens).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    positions = np.concatenate([np.arange(c, s) for c, s in zip(context_lens, seq_lens)])
    seq_of = np.repeat(np.arange(len(tables)), query_lens)
    slots = bt[seq_of, positions // BS].astype(np.int64) * BS + positions % BS
    d = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return AttentionMetadata(
        num_seqs=len(tables), num_tokens=int(cu[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), query_start_loc=d(cu), seq_lens=d(seq_lens),
        block_tables=d(bt), slot_mapping=d(slots), positions=d(positions.astype(np.int64)),
        query_start_loc_host=cu, seq_lens_host=seq_lens, block_tables_host=bt,
        block_size=BS)


def _backends(window):
    from actors.engine.model.attention.flashinfer_backend import FlashInferBackend
    from actors.engine.model.attention.torch_backend import TorchAttentionBackend

    cache = KVCache(1, 64, BS, KV_HEADS, DIM, torch.bfloat16, "cuda", num_scratch_blocks=1)
    fi = FlashInferBackend(cache, HEADS, KV_HEADS, DIM, layer_specs={0: (window, SCALE)},
                           max_model_len=4096)
    ref = TorchAttentionBackend(cache, HEADS, KV_HEADS, DIM)
    return cache, fi, ref


def _random_pages(cache, gen):
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen, device="cuda"))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _reference(ref, md, q, k, v, window):
    """The torch backend in float32 over a float32 copy of the same pages."""
    pages32 = ref.kv_cache.pool.float()
    saved = ref.kv_cache.pool
    ref.kv_cache.pool = pages32
    try:
        out = ref.forward(ref.plan(md), 0, q.float(), k.float(), v.float(), scaling=SCALE,
                          sliding_window=window)
    finally:
        ref.kv_cache.pool = saved
    return out


def _tables(context, query, num_blocks):
    """Distinct pages, out of order, for each sequence."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables, at = [], 0
    for c, n in zip(context, query):
        pages = -(-(c + n) // BS)
        tables.append(perm[at:at + pages])
        at += pages
    return tables


LAYOUTS = {
    # fresh prefill, a chunk after a cached prefix, decodes with long contexts
    "mixed": ([0, 37, 70, 3], [45, 20, 1, 1]),
    "decodes": ([130, 1, 63, 200, 16], [1, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 24])
def test_flashinfer_matches_reference(layout, window):
    gen = torch.Generator("cuda").manual_seed(0)
    cache, fi, ref = _backends(window)
    _random_pages(cache, gen)
    context, query = LAYOUTS[layout]
    tables = _tables(context, query, cache.num_blocks)
    md = _metadata(context, query, tables, "cuda")
    t = md.num_tokens
    q = torch.randn(t, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    k = torch.randn(t, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    v = torch.randn(t, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    outs = []
    for _ in range(2):  # the official plan, then the direct re-plan of later steps
        plan = fi.plan(md)
        fi.begin_forward(plan)
        outs.append(fi.forward(plan, 0, q, k, v, scaling=SCALE, sliding_window=window))
    out = outs[0]
    expected = _reference(ref, md, q, k, v, window)
    assert _rel(out, expected) < 1e-2
    assert torch.equal(outs[0], outs[1])
    if window is not None:  # the window matters for these lengths
        full = _reference(ref, md, q, k, v, None)
        assert _rel(out, full) > 5e-2


def test_graph_bucket_plan_matches_reference_and_spares_other_pages():
    """A decode bucket padded from 5 to 8 rows: real rows match the reference, padding rows
    write only the scratch page (the graph path, run without capture)."""
    gen = torch.Generator("cuda").manual_seed(2)
    cache, fi, ref = _backends(None)
    _random_pages(cache, gen)
    context, query = LAYOUTS["decodes"]
    tables = _tables(context, query, cache.num_blocks)
    md = _metadata(context, query, tables, "cuda")
    bucket, scratch = 8, cache.scratch_page
    fi.prepare_graphs(bucket, max_pages=64)
    static_slots = torch.full((bucket,), scratch * BS, dtype=torch.int64, device="cuda")
    plan = fi.graph_plan(bucket, static_slots, scratch)
    static_slots[:5].copy_(md.slot_mapping)
    csr = build_csr(md.seq_lens_host, md.block_tables_host, BS, pad_to=bucket,
                    scratch_page=scratch)
    assert fi.update_graph_plan(plan, csr)
    q = torch.randn(bucket, HEADS, DIM, generator=gen, device="cuda").bfloat16()
    k = torch.randn(bucket, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    v = torch.randn(bucket, KV_HEADS, DIM, generator=gen, device="cuda").bfloat16()
    before = cache.pool.clone()
    fi.begin_forward(plan)
    out = fi.forward(plan, 0, q, k, v, scaling=SCALE)
    changed = (cache.pool[0] != before[0]).flatten(1).any(-1)      # [pages]
    pages_written = set(torch.nonzero(changed).flatten().tolist())
    real_pages = {t[(c // BS)] for t, c in zip(tables, context)}
    assert pages_written <= real_pages | {scratch}
    assert scratch in pages_written
    expected = _reference(ref, md, q[:5], k[:5], v[:5], None)
    assert _rel(out[:5], expected) < 1e-2
