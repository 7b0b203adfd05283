"""FlashInfer's soft-capped, sink and MLA (key 192 / value 128 wide) paged attention against
the torch reference backend on the same pages (GPU), eager and through a graph-bucket plan.

Run on a CUDA machine with flashinfer (0.6.4 or later): ``pytest -m gpu tests/actors``.
Tolerance as in ``test_gpu_attention``: relative L2 error of the bf16 output against the
float32 reference over the same bf16 pages below 1e-2; each feature changes the output by more
than 5e-2 (so the comparison would catch it being ignored).
"""

from __future__ import annotations

import pytest
import torch

from actors.engine.model.attention.base import LayerSpec
from actors.engine.model.attention.csr import build_csr
from actors.engine.model.kv_cache import KVCache
from tests.actors.engine.model.test_gpu_attention import BS, LAYOUTS, _metadata, _rel, _tables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, KV_HEADS = 8, 2
#: name: (key width, value width, kv heads, window, softcap, sinks)
VARIANTS = {
    "softcap": (128, 128, KV_HEADS, 24, 2.0, False),      # gemma2-like
    "sinks": (64, 64, KV_HEADS, 24, None, True),           # gpt-oss-like
    "mla": (192, 128, HEADS, None, None, False),           # deepseek-v3-like
}


def _setup(variant):
    from actors.engine.model.attention.flashinfer_backend import FlashInferBackend
    from actors.engine.model.attention.torch_backend import TorchAttentionBackend

    dk, dv, kv_heads, window, softcap, sinks = VARIANTS[variant]
    scale = dk ** -0.5
    cache = KVCache(1, 64, BS, kv_heads, max(dk, dv), torch.bfloat16, "cuda",
                    num_scratch_blocks=1, key_dim=dk, value_dim=dv)
    spec = LayerSpec(window, scale, softcap, sinks, HEADS, kv_heads, dk, dv)
    fi = FlashInferBackend(cache, HEADS, kv_heads, dk, layer_specs={0: spec},
                           max_model_len=4096)
    ref = TorchAttentionBackend(cache, HEADS, kv_heads, dk)
    return cache, fi, ref, spec


def _reference(ref, md, q, k, v, spec, **override):
    """The torch backend in float32 over a float32 copy of the same pages."""
    args = dict(scaling=spec.scaling, sliding_window=spec.sliding_window,
                softcap=spec.softcap, sinks=override.pop("sink_values", None))
    args.update(override)
    saved = ref.kv_cache.pool
    ref.kv_cache.pool = saved.float()
    try:
        return ref.forward(ref.plan(md), 0, q.float(), k.float(), v.float(), **args)
    finally:
        ref.kv_cache.pool = saved


def _inputs(t, spec, gen):
    q = torch.randn(t, HEADS, spec.key_dim, generator=gen, device="cuda").bfloat16()
    k = torch.randn(t, spec.num_kv_heads, spec.key_dim, generator=gen, device="cuda").bfloat16()
    v = torch.randn(t, spec.num_kv_heads, spec.value_dim, generator=gen,
                    device="cuda").bfloat16()
    # sink logits around 4: comparable to the summed weight of a few hundred keys, so they
    # change the output visibly also for long contexts
    sinks = (torch.randn(HEADS, generator=gen, device="cuda") + 4).bfloat16() \
        if spec.has_sinks else None
    return q, k, v, sinks


def _random_pages(cache, spec, gen):
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen, device="cuda"))
    cache.pool[:, :, 1, ..., spec.value_dim:] = 0  # value rows are value_dim wide


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_reference(variant, layout):
    gen = torch.Generator("cuda").manual_seed(0)
    cache, fi, ref, spec = _setup(variant)
    _random_pages(cache, spec, gen)
    context, query = LAYOUTS[layout]
    md = _metadata(context, query, _tables(context, query, cache.num_blocks), "cuda")
    q, k, v, sinks = _inputs(md.num_tokens, spec, gen)
    outs = []
    for _ in range(2):  # the official plan, then the direct re-plan of later steps
        plan = fi.plan(md)
        fi.begin_forward(plan)
        outs.append(fi.forward(plan, 0, q, k, v, scaling=spec.scaling,
                               sliding_window=spec.sliding_window, softcap=spec.softcap,
                               sinks=sinks))
    out = outs[0]
    assert out.shape == (md.num_tokens, HEADS, spec.value_dim)
    expected = _reference(ref, md, q, k, v, spec, sink_values=sinks)
    assert _rel(out, expected) < 1e-2
    assert torch.equal(outs[0], outs[1])
    if spec.softcap:
        assert _rel(out, _reference(ref, md, q, k, v, spec, softcap=None)) > 5e-2
    if spec.has_sinks:
        assert _rel(out, _reference(ref, md, q, k, v, spec)) > 5e-2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_graph_bucket_plan_matches_reference(variant):
    """A decode bucket padded from 5 to 8 rows through the graph-bucket plan (no capture)."""
    gen = torch.Generator("cuda").manual_seed(2)
    cache, fi, ref, spec = _setup(variant)
    _random_pages(cache, spec, gen)
    context, query = LAYOUTS["decodes"]
    md = _metadata(context, query, _tables(context, query, cache.num_blocks), "cuda")
    bucket, scratch = 8, cache.scratch_page
    fi.prepare_graphs(bucket, max_pages=64)
    static_slots = torch.full((bucket,), scratch * BS, dtype=torch.int64, device="cuda")
    plan = fi.graph_plan(bucket, static_slots, scratch)
    static_slots[:5].copy_(md.slot_mapping)
    csr = build_csr(md.seq_lens_host, md.block_tables_host, BS, pad_to=bucket,
                    scratch_page=scratch)
    assert fi.update_graph_plan(plan, csr)
    q, k, v, sinks = _inputs(bucket, spec, gen)
    fi.begin_forward(plan)
    out = fi.forward(plan, 0, q, k, v, scaling=spec.scaling,
                     sliding_window=spec.sliding_window, softcap=spec.softcap, sinks=sinks)
    expected = _reference(ref, md, q[:5], k[:5], v[:5], spec, sink_values=sinks)
    assert _rel(out[:5], expected) < 1e-2
