"""The torch backend's soft-capped, sink and MLA (keys wider than values) attention against a
per-sequence dense reference written from the definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engine.model.attention.torch_backend import TorchAttentionBackend
from actors.engine.model.kv_cache import KVCache
from tests.actors.engine.model.test_attention import BS, HEADS, KV_HEADS, LAYOUTS, _metadata


def _dense(q, k, v, scaling, window, softcap, sinks):
    """One sequence: q [n, H, Dk] at positions ctx..ctx+n-1 over k [ctx+n, Hkv, Dk] and
    v [ctx+n, Hkv, Dv]; softmax over the kept keys plus each head's sink logit."""
    n, total = q.shape[0], k.shape[0]
    rep = HEADS // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(total - n, total)[:, None]
    j = torch.arange(total)[None, :]
    keep = (j <= i) & ((j > i - window) if window else True)
    weights = scores.masked_fill(~keep, float("-inf")).exp()           # [H, n, total]
    denom = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + sinks.exp()[:, None, None]
    return torch.einsum("hqk,khd->qhd", weights / denom, v)


VARIANTS = {  # (key width, value width, kv heads, softcap, sinks)
    "softcap": (8, 8, KV_HEADS, 1.5, False),
    "sinks": (8, 8, KV_HEADS, None, True),
    "mla": (12, 8, HEADS, None, False),
    "mla_sinks_softcap": (12, 8, KV_HEADS, 2.0, True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_dense(variant, window, layout):
    torch.manual_seed(0)
    dk, dv, kv_heads, softcap, with_sinks = VARIANTS[variant]
    cache = KVCache(1, 32, BS, kv_heads, max(dk, dv), torch.float32, "cpu",
                    key_dim=dk, value_dim=dv)
    backend = TorchAttentionBackend(cache, HEADS, kv_heads, dk)
    context_lens, query_lens = LAYOUTS[layout]
    tables = [[3, 7], [12, 1, 30], [5, 6, 9], [20]]
    total = [c + q for c, q in zip(context_lens, query_lens)]
    keys = [torch.randn(n, kv_heads, dk) * 2 for n in total]
    values = [torch.randn(n, kv_heads, dv) for n in total]
    layer = cache.layer(0)
    for s, table in enumerate(tables):  # the cached prefix is already in the pages
        for p in range(context_lens[s]):
            layer[table[p // BS], 0, p % BS, :, :dk] = keys[s][p]
            layer[table[p // BS], 1, p % BS, :, :dv] = values[s][p]
    md = _metadata(context_lens, query_lens, tables)
    q = torch.randn(md.num_tokens, HEADS, dk)
    sinks = torch.randn(HEADS) if with_sinks else None
    k_new = torch.cat([keys[s][context_lens[s]:] for s in range(4)])
    v_new = torch.cat([values[s][context_lens[s]:] for s in range(4)])
    out = backend.forward(backend.plan(md), 0, q, k_new, v_new, scaling=0.4,
                          sliding_window=window, softcap=softcap, sinks=sinks)
    assert out.shape == (md.num_tokens, HEADS, dv)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    for s in range(4):
        sl = slice(starts[s], starts[s + 1])
        expected = _dense(q[sl], keys[s], values[s], 0.4, window, softcap, sinks)
        torch.testing.assert_close(out[sl], expected, atol=1e-5, rtol=1e-5)
    if dv < cache.head_dim:  # value rows keep their padding zero
        assert layer[:, 1, ..., dv:].abs().max() == 0
