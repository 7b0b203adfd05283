"""An FP8 (e4m3) KV pool: the clamped cast of new rows, the halved block size, page copies,
release / restore, and the torch backend's attention over dequantized pages."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from actors.engine.model.attention import get_attention_backend
from actors.engine.model.kv_cache import (
    FP8_MAX,
    KVCache,
    bytes_per_block,
    compute_num_blocks,
    resolve_kv_dtype,
    store_rows,
)
from tests.actors.engine.model.test_attention import BS, DIM, HEADS, KV_HEADS, LAYOUTS, \
    _dense, _metadata, paged_step

E4M3 = torch.float8_e4m3fn


def _round(x: torch.Tensor) -> torch.Tensor:
    """What an FP8 page gives back for ``x``: clamp to +-448, cast to e4m3, cast back."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(E4M3).to(x.dtype)


def _fp8_cache(num_layers=2, num_blocks=32, **kwargs) -> KVCache:
    return KVCache(num_layers, num_blocks, BS, KV_HEADS, DIM, E4M3, "cpu",
                   compute_dtype=torch.float32, **kwargs)


def test_new_rows_are_clamped_then_cast_and_never_become_nan_or_inf():
    flat = torch.zeros(6, KV_HEADS, DIM, dtype=E4M3)
    values = torch.randn(3, KV_HEADS, DIM) * 100
    values[0, 0, :4] = torch.tensor([1e6, -1e6, float("inf"), -float("inf")])
    store_rows(flat, torch.tensor([4, 0, 2]), values)
    back = flat.float()
    assert torch.isfinite(back).all()
    assert back[4, 0, :4].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, -FP8_MAX]
    torch.testing.assert_close(back[[4, 0, 2]], _round(values), atol=0, rtol=0)
    assert back[[1, 3, 5]].abs().sum() == 0  # rows not in the mapping untouched
    rel = ((back[[0, 2]] - values[1:]).abs() / values[1:].abs().clamp_min(1)).max()
    assert 0 < rel < 2 ** -3  # e4m3 keeps 3 mantissa bits


def test_a_model_dtype_pool_stores_exactly_as_before():
    flat = torch.zeros(4, KV_HEADS, DIM)
    values = torch.randn(2, KV_HEADS, DIM) * 1000
    store_rows(flat, torch.tensor([3, 1]), values)
    assert torch.equal(flat[[3, 1]], values)  # no clamp off FP8


def test_fp8_blocks_are_half_the_bytes_and_twice_as_many_fit_one_budget():
    args = (4, BS, KV_HEADS, DIM)
    fp32, bf16, fp8 = (bytes_per_block(*args, dt) for dt in (torch.float32, torch.bfloat16,
                                                             E4M3))
    assert bf16 == 2 * fp8 and fp32 == 4 * fp8
    budget = 1000 * bf16
    sized = {dt: compute_num_blocks(per_block=bytes_per_block(*args, dt),
                                    device=torch.device("cpu"), block_size=BS,
                                    max_model_len=64, max_num_seqs=10_000,
                                    kv_cache_memory=budget, gpu_memory_utilization=0.9)
             for dt in (torch.bfloat16, E4M3)}
    assert sized[E4M3] == 2 * sized[torch.bfloat16] == 2000
    cache = _fp8_cache(num_layers=4, num_blocks=sized[E4M3])
    assert cache.pool.dtype == E4M3 and cache.nbytes == budget


def test_copy_blocks_release_and_restore_keep_the_fp8_pool():
    cache = _fp8_cache(num_scratch_blocks=1)
    cache.pool.view(torch.uint8)[:, 3].random_(0, 0x7F)  # finite e4m3 bytes
    before = cache.pool[:, 3].float().clone()
    cache.copy_blocks(torch.tensor([3]), torch.tensor([9]))
    assert torch.equal(cache.pool[:, 9].float(), before)
    freed = cache.release()
    assert freed == cache.nbytes and cache.pool.dtype == E4M3 and cache.is_released
    cache.restore()
    assert cache.pool.dtype == E4M3 and cache.pool.device.type == "cpu"
    assert cache.pool.float().abs().sum() == 0 and cache.scratch_page == 32


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 3])
def test_torch_backend_attends_over_the_dequantized_pages(window, layout):
    """The reference: dense attention over K/V rounded through e4m3 (prefix and new rows)."""
    torch.manual_seed(0)
    cache = _fp8_cache()
    backend = get_attention_backend("torch", cache, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                    head_dim=DIM)
    case = paged_step(cache, layout, scale=3.0)
    q = case.q
    out = backend.forward(backend.plan(case.md), 1, q, case.k_new, case.v_new, scaling=0.3,
                          sliding_window=window)
    assert out.dtype == torch.float32
    for s, sl in enumerate(case.rows):
        keys, values = case.keys[s], case.values[s]
        expected = _dense(q[sl], _round(keys), _round(values), 0.3, window)
        torch.testing.assert_close(out[sl], expected, atol=1e-5, rtol=1e-5)
        exact = _dense(q[sl], keys, values, 0.3, window)
        assert (out[sl] - exact).abs().max() > 1e-4  # the rounding is really there
    assert cache.layer(0).float().abs().sum() == 0


def test_the_kv_dtype_resolves_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.float32, cpu) == E4M3
    with pytest.raises(ValueError, match=r"engine\.kv_cache_dtype: must be 'auto' or 'fp8'"):
        resolve_kv_dtype("int8", torch.float32, cpu)
    with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)), \
            mock.patch("torch.cuda.get_device_name", return_value="NVIDIA A100"), \
            pytest.raises(ValueError, match=r"engine\.kv_cache_dtype: 'fp8' needs a CUDA GPU of "
                                            r"compute capability >= 8\.9 \(FlashInfer.*A100\) "
                                            r"has 8\.0"):
        resolve_kv_dtype("fp8", torch.bfloat16, cuda)
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        assert resolve_kv_dtype("fp8", torch.bfloat16, cuda) == E4M3


def test_keys_wider_than_values_with_sinks_and_softcap_over_fp8_pages():
    """MLA's two widths in one FP8 pool: each written into its slice, read back rounded."""
    from actors.engine.model.attention.torch_backend import TorchAttentionBackend
    from tests.actors.engine.model.test_attention_variants import _dense as variant_dense

    torch.manual_seed(1)
    dk, dv = 12, 8
    cache = KVCache(1, 32, BS, KV_HEADS, dk, E4M3, "cpu", key_dim=dk, value_dim=dv,
                    compute_dtype=torch.float32)
    backend = TorchAttentionBackend(cache, HEADS, KV_HEADS, dk)
    query_lens = [5, 1, 3]
    tables = [[3, 7], [12], [5]]
    keys = [torch.randn(n, KV_HEADS, dk) * 2 for n in query_lens]
    values = [torch.randn(n, KV_HEADS, dv) for n in query_lens]
    md = _metadata([0, 0, 0], query_lens, tables)
    q = torch.randn(md.num_tokens, HEADS, dk)
    sinks = torch.randn(HEADS)
    out = backend.forward(backend.plan(md), 0, q, torch.cat(keys), torch.cat(values),
                          scaling=0.4, softcap=2.0, sinks=sinks)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    for s in range(3):
        sl = slice(starts[s], starts[s + 1])
        expected = variant_dense(q[sl], _round(keys[s]), _round(values[s]), 0.4, None, 2.0,
                                 sinks)
        torch.testing.assert_close(out[sl], expected, atol=1e-5, rtol=1e-5)
    assert cache.layer(0)[:, 1, ..., dv:].float().abs().max() == 0  # value padding stays 0
