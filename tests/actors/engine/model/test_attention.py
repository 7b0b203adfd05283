"""The torch paged-attention backend against a per-sequence dense reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.engine.model.attention import (
    AttentionMetadata,
    StepContext,
    get_attention_backend,
    paged_attention_forward,
)
from actors.engine.model.kv_cache import KVCache

HEADS, KV_HEADS, DIM, BS = 4, 2, 8, 4


def _metadata(context_lens, query_lens, tables):
    context_lens, query_lens = np.array(context_lens), np.array(query_lens)
    seq_lens = context_lens + query_lens
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    positions = np.concatenate([np.arange(c, s) for c, s in zip(context_lens, seq_lens)])
    seq_of = np.repeat(np.arange(len(tables)), query_lens)
    slots = bt[seq_of, positions // BS].astype(np.int64) * BS + positions % BS
    t = torch.from_numpy
    return AttentionMetadata(
        num_seqs=len(tables), num_tokens=int(cu[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), query_start_loc=t(cu),
        seq_lens=t(seq_lens.astype(np.int32)), block_tables=t(bt), slot_mapping=t(slots),
        positions=t(positions.astype(np.int64)), query_start_loc_host=cu,
        seq_lens_host=seq_lens.astype(np.int32), block_tables_host=bt, block_size=BS)


def _dense(q, k, v, scaling, window):
    """One sequence: q [n, H, D] at positions ctx..ctx+n-1 over k/v [ctx+n, Hkv, D]."""
    n, total = q.shape[0], k.shape[0]
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    i = torch.arange(total - n, total)[:, None]
    j = torch.arange(total)[None, :]
    keep = j <= i
    if window:
        keep &= j > i - window
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


LAYOUTS = {
    # a fresh prefill, a chunk after a cached prefix, two decodes
    "mixed": ([0, 5, 9, 2], [7, 4, 1, 1]),
    # decodes only: the packed order is already the [B, 1] grid
    "decodes": ([6, 1, 9, 3], [1, 1, 1, 1]),
}


def paged_step(cache: KVCache, layout: str, scale: float = 1.0) -> SimpleNamespace:
    """A step of ``LAYOUTS[layout]`` over layer 1 of ``cache``: four sequences on pages out
    of order (``tables``), their ``keys`` / ``values`` (random, times ``scale``) with each
    cached prefix already in the pages (in the pool's dtype), the metadata ``md``, the
    queries ``q``, the new tokens' ``k_new`` / ``v_new`` and each sequence's query ``rows``."""
    context_lens, query_lens = LAYOUTS[layout]
    tables = [[3, 7], [12, 1, 30], [5, 6, 9], [20]]
    total = [c + q for c, q in zip(context_lens, query_lens)]
    keys = [torch.randn(n, KV_HEADS, DIM) * scale for n in total]
    values = [torch.randn(n, KV_HEADS, DIM) * scale for n in total]
    layer = cache.layer(1)
    for s, table in enumerate(tables):
        for p in range(context_lens[s]):
            layer[table[p // BS], 0, p % BS] = keys[s][p].to(layer.dtype)
            layer[table[p // BS], 1, p % BS] = values[s][p].to(layer.dtype)
    md = _metadata(context_lens, query_lens, tables)
    q = torch.randn(md.num_tokens, HEADS, DIM)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    return SimpleNamespace(
        tables=tables, keys=keys, values=values, layer=layer, md=md, q=q,
        k_new=torch.cat([keys[s][context_lens[s]:] for s in range(4)]),
        v_new=torch.cat([values[s][context_lens[s]:] for s in range(4)]),
        rows=[slice(starts[s], starts[s + 1]) for s in range(4)])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 3, 6])
def test_paged_attention_matches_dense(window, layout):
    torch.manual_seed(0)
    cache = KVCache(2, 32, BS, KV_HEADS, DIM, torch.float32, "cpu")
    backend = get_attention_backend("torch", cache, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                    head_dim=DIM)
    case = paged_step(cache, layout)
    out = backend.forward(backend.plan(case.md), 1, case.q, case.k_new, case.v_new,
                          scaling=0.3, sliding_window=window)
    assert out.shape == case.q.shape
    keys, values, layer, tables = case.keys, case.values, case.layer, case.tables
    for s, sl in enumerate(case.rows):
        expected = _dense(case.q[sl], keys[s], values[s], 0.3, window)
        torch.testing.assert_close(out[sl], expected, atol=1e-5, rtol=1e-5)
        for p in range(len(keys[s])):  # new K/V landed in their slots
            torch.testing.assert_close(layer[tables[s][p // BS], 0, p % BS], keys[s][p])
    assert cache.layer(0).abs().sum() == 0  # other layers untouched


def test_attention_without_step_metadata_raises():
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, HEADS, 3, DIM)
    kv = torch.zeros(1, KV_HEADS, 3, DIM)
    with pytest.raises(RuntimeError, match="without step metadata"):
        paged_attention_forward(module, q, kv, kv, None)


def test_step_context_reaches_the_backend():
    cache = KVCache(1, 4, BS, KV_HEADS, DIM, torch.float32, "cpu")
    backend = get_attention_backend("auto", cache, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                    head_dim=DIM)
    md = _metadata([0], [3], [[2]])
    module = torch.nn.Module()
    module.layer_idx = 0
    ctx = StepContext(backend, md, backend.plan(md), layers_called=[])
    q, kv = torch.randn(1, HEADS, 3, DIM), torch.randn(1, KV_HEADS, 3, DIM)
    out, weights = paged_attention_forward(module, q, kv, kv, None, raygen_step=ctx)
    assert out.shape == (1, 3, HEADS, DIM) and weights is None
    assert ctx.layers_called == [0]
    torch.testing.assert_close(cache.layer(0)[2, 0, :3], kv[0].transpose(0, 1))
