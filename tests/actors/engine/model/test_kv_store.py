"""The KV store kernel (``kernels.kv_store``) against ``kv_cache.store_rows`` (clamp, cast,
``index_copy_``): the same bytes at the same rows, nothing else written, into FP8 pools and
pools of the rows' dtype (TRITON_INTERPRET=1 on CPU, the GPU otherwise)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.model.kernels.kv_store import store_kv_rows
from actors.engine.model.kv_cache import store_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("heads,dim", [(2, 16), (3, 24), (8, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_rows_writes_what_store_rows_writes_into_fp8(heads, dim, dtype):
    gen = torch.Generator().manual_seed(heads * dim)
    tokens, pool_rows = 7, 40
    rows = torch.randperm(pool_rows, generator=gen)[:2 * tokens].to(DEVICE)
    k_rows, v_rows = rows[:tokens], rows[tokens:]
    # wide values (beyond +-448 clamp), small ones (subnormals), and a ties sweep
    kv = torch.randn(2, tokens, heads, dim, generator=gen) * 200
    kv[0, 0] = torch.linspace(-0.02, 0.02, heads * dim).reshape(heads, dim)
    kv[1, 1, 0] = 1e6
    key, value = (t.to(DEVICE, dtype) for t in kv)
    start = torch.randn(pool_rows, heads, dim, generator=gen).to(DEVICE, FP8)
    ours, want = start.clone(), start.clone()
    store_kv_rows(ours, k_rows, v_rows, key, value)
    store_rows(want, k_rows, key)
    store_rows(want, v_rows, value)
    assert torch.equal(ours.view(torch.uint8), want.view(torch.uint8))
    assert float(ours.float().abs().max()) <= 448.0


def test_store_kv_rows_takes_strided_heads_and_refuses_other_pools():
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 3, 2, 16, generator=gen).to(DEVICE, torch.bfloat16)
    key, value = qkv[:, 1], qkv[:, 2]  # views of one q/k/v output
    pool = torch.zeros(12, 2, 16, device=DEVICE, dtype=FP8)
    want = pool.clone()
    rows = torch.arange(10, device=DEVICE)
    store_kv_rows(pool, rows[:5], rows[5:], key, value)
    store_rows(want, rows[:5], key)
    store_rows(want, rows[5:], value)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="flat"):
        store_kv_rows(pool.to(torch.float32), rows[:5], rows[5:], key, value)
    with pytest.raises(ValueError, match="flat"):
        store_kv_rows(pool.to(torch.bfloat16)[:, :, ::2], rows[:5], rows[5:], key[..., :8],
                      value[..., :8])


@pytest.mark.parametrize("heads,dim", [(2, 64), (3, 24)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_rows_copies_into_a_pool_of_the_rows_dtype(heads, dim, dtype):
    gen = torch.Generator().manual_seed(heads + dim)
    tokens, pool_rows = 6, 30
    rows = torch.randperm(pool_rows, generator=gen)[:2 * tokens].to(DEVICE)
    qkv = (torch.randn(tokens, 3, heads, dim, generator=gen) * 1e3).to(DEVICE, dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # strided views, as a fused q/k/v output gives them
    start = torch.randn(pool_rows, heads, dim, generator=gen).to(DEVICE, dtype)
    ours, want = start.clone(), start.clone()
    store_kv_rows(ours, rows[:tokens], rows[tokens:], key, value)
    store_rows(want, rows[:tokens], key)
    store_rows(want, rows[tokens:], value)
    assert torch.equal(ours, want)
    untouched = torch.ones(pool_rows, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert torch.equal(ours[untouched.to(DEVICE)], start[untouched.to(DEVICE)])
