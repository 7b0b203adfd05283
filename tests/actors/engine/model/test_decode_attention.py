"""The Triton paged decode attention against its float32 torch oracle (TRITON_INTERPRET=1 on
CPU, the GPU otherwise): grouped heads, pages out of order, contexts of one chunk and of
several (the combine), bf16 and e4m3 pages; a row's result is the same alone and in a batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from actors.engine.model.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    decode_chunk,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS = 4  # tokens per page


def _batch(lengths, heads, kv_heads, dim, dtype, seed=0):
    """Queries ``[B, heads, dim]`` (a strided view, as the model hands them over), a pool of
    pages in shuffled order and the rows' CSR page table."""
    g = torch.Generator().manual_seed(seed)
    pages_of = [(n + BS - 1) // BS for n in lengths]
    total = sum(pages_of)
    order = torch.randperm(total + 3, generator=g)[:total].to(torch.int32)
    pool = torch.randn(total + 3, 2, BS, kv_heads, dim, generator=g)
    if dtype == torch.float8_e4m3fn:
        pool = (pool * 3).clamp(-448, 448)
    pool = pool.to(dtype)
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, dim, generator=g).to(torch.bfloat16)
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages_of), 0)
    last = torch.tensor([(n - 1) % BS + 1 for n in lengths], dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (qkv, pool, indptr, order, last)]
    return dev[0][:, :heads], *dev[1:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (4, 4)])
def test_equals_the_reference(dtype, heads, kv_heads):
    lengths = [1, 3, 4, 5, 16, 17, 40, 63]
    q, pool, indptr, indices, last = _batch(lengths, heads, kv_heads, 16, dtype)
    scale = 16 ** -0.5
    ref = decode_attention_reference(q, pool, indptr, indices, last, scale).float()
    out = decode_attention(q, pool, indptr, indices, last, scale, chunk=16, max_splits=4,
                           block_n=16)
    assert out.dtype == q.dtype and out.shape == q.shape
    # bf16 probabilities, values and output (as FlashInfer's kernels): a few bf16 steps
    tol = 1e-2 * max(1.0, ref.abs().max().item())
    err = (out.float() - ref).abs().max().item()
    assert err < tol, (err, tol)
    # one chunk holds every context: no partials, the same function
    whole = decode_attention(q, pool, indptr, indices, last, scale, chunk=64, max_splits=1,
                             block_n=16)
    assert (whole.float() - ref).abs().max().item() < tol


def test_a_row_is_the_same_alone_as_in_a_batch():
    lengths = [37, 5, 50, 12]
    q, pool, indptr, indices, last = _batch(lengths, 4, 2, 16, torch.bfloat16, seed=1)
    scale = 0.25
    batch = decode_attention(q, pool, indptr, indices, last, scale, chunk=16, max_splits=4,
                             block_n=16)
    for b in range(len(lengths)):
        rows = indices[int(indptr[b]):int(indptr[b + 1])]
        alone = decode_attention(q[b:b + 1], pool, torch.tensor([0, len(rows)], dtype=torch.int32,
                                 device=DEVICE), rows, last[b:b + 1], scale, chunk=16,
                                 max_splits=4, block_n=16)
        assert torch.equal(alone[0], batch[b]), b


def test_decode_chunk_bounds_the_splits():
    assert decode_chunk(264) == decode_chunk(520) == 512
    for max_len in (1000, 4096, 32768, 131072):
        chunk = decode_chunk(max_len)
        assert chunk & (chunk - 1) == 0 and -(-max_len // chunk) <= 16


def test_wide_heads_of_a_wide_group_equal_the_reference():
    # Qwen3-30B-A3B's attention shape (8 query heads a KV head, heads of 128), the kernel's
    # default tiles, contexts of one chunk and of several
    lengths = [1, 130, 257, 700]
    q, pool, indptr, indices, last = _batch(lengths, 16, 2, 128, torch.bfloat16, seed=5)
    scale = 128 ** -0.5
    ref = decode_attention_reference(q, pool, indptr, indices, last, scale).float()
    out = decode_attention(q, pool, indptr, indices, last, scale, chunk=512, max_splits=2)
    tol = 1e-2 * max(1.0, ref.abs().max().item())
    assert (out.float() - ref).abs().max().item() < tol


def test_which_decode_steps_run_the_kernel():
    from actors.engine.model.attention.flashinfer_backend import triton_decodes

    assert triton_decodes(torch.bfloat16, 64, 7)  # Qwen2-0.5B
    assert not triton_decodes(torch.bfloat16, 128, 4)  # Llama-3-8B: FlashInfer's
    assert triton_decodes(torch.bfloat16, 128, 8)  # Qwen3-30B-A3B
    assert not triton_decodes(torch.bfloat16, 256, 8)
    assert triton_decodes(torch.float8_e4m3fn, 128, 4)
    assert not triton_decodes(torch.bfloat16, 8, 8)
