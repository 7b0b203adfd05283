"""Host-side pieces of the GPU path, checked on CPU: page tables in CSR form, the block-table
mirror, the staging arena's CPU behaviour, graph buckets and the backend choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.engine.model.attention import get_attention_backend, resolve_backend_name
from actors.engine.model.attention.csr import build_csr
from actors.engine.model.block_table import BlockTableMirror
from actors.engine.engine_config import EngineConfig
from actors.engine.model.cuda_graphs import default_buckets
from actors.engine.model.kv_cache import KVCache
from actors.engine.model.staging import Staging


def _naive_csr(seq_lens, tables, bs):
    indptr, indices, last = [0], [], []
    for n, table in zip(seq_lens, tables):
        pages = -(-n // bs)
        indices += list(table[:pages])
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * bs)
    return indptr, indices, last


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_csr_matches_a_per_sequence_loop(bs):
    rng = np.random.default_rng(bs)
    seq_lens = rng.integers(1, 70, 9)
    width = int(-(-seq_lens.max() // bs)) + 2
    tables = rng.permutation(9 * width).reshape(9, width).astype(np.int32)
    csr = build_csr(seq_lens, tables, bs)
    indptr, indices, last = _naive_csr(seq_lens.tolist(), tables.tolist(), bs)
    assert csr.indptr.tolist() == indptr
    assert csr.indices.tolist() == indices
    assert csr.last_page_len.tolist() == last
    assert csr.kv_lens.tolist() == seq_lens.tolist()
    assert csr.indptr.dtype == csr.indices.dtype == csr.last_page_len.dtype == np.int32


def test_csr_padding_rows_use_one_scratch_token():
    csr = build_csr(np.array([5, 17]), np.array([[3, 9], [4, 8]]), 16, pad_to=5,
                    scratch_page=99)
    assert csr.num_rows == 5
    assert csr.indptr.tolist() == [0, 1, 3, 4, 5, 6]
    assert csr.indices.tolist() == [3, 4, 8, 99, 99, 99]
    assert csr.last_page_len.tolist() == [5, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="scratch_page"):
        build_csr(np.array([5]), np.array([[3]]), 16, pad_to=2)
    with pytest.raises(ValueError, match="block_tables"):
        build_csr(np.array([40]), np.array([[3]]), 16)


def test_block_table_mirror_follows_growth_replacement_and_shrinking():
    mirror = BlockTableMirror(4, 2)
    a, b = [5, 6], [7]
    mirror.update([0, 2], [a, b])
    assert mirror.gather(np.array([2, 0]), 3).tolist() == [[7, 0, 0], [5, 6, 0]]
    a.extend([1, 2, 3])  # grows in place, beyond the initial width
    mirror.update([0, 2], [a, b])
    assert mirror.gather(np.array([0]), 5).tolist() == [[5, 6, 1, 2, 3]]
    mirror.update([0], [[9]])  # a new list (preempted and readmitted): stale pages cleared
    assert mirror.gather(np.array([0]), 5).tolist() == [[9, 0, 0, 0, 0]]
    del b[:]  # shrunk in place
    mirror.update([2], [b])
    assert mirror.gather(np.array([2]), 2).tolist() == [[0, 0]]
    mirror.update([6], [[1, 2]])  # a slot past the initial count
    assert mirror.gather(np.array([6]), 2).tolist() == [[1, 2]]


def test_staging_on_cpu_shares_the_array():
    staging = Staging(torch.device("cpu"))
    staging.begin_uploads()
    array = np.arange(6, dtype=np.int64)
    tensor = staging.upload(array)
    assert tensor.data_ptr() == array.__array_interface__["data"][0]
    out = torch.zeros(6, dtype=torch.int64)
    staging.upload(array * 2, out)
    staging.end_uploads()
    assert out.tolist() == [0, 2, 4, 6, 8, 10]


@pytest.mark.parametrize("max_batch", [1, 7, 64, 100, 256, 1024])
def test_default_buckets(max_batch):
    buckets = default_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch and buckets[0] == 1
    assert all(b <= max_batch for b in buckets)
    gaps = np.diff(buckets) / np.array(buckets[1:])
    assert (gaps <= 0.5).all()  # padding wastes at most half a bucket


def test_backend_choice_on_cpu_and_bad_requests():
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu, torch.float32, 64) == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend_name("flashinfer", cpu, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend_name("xformers", cpu, torch.float32, 64)
    cache = KVCache(1, 4, 4, 2, 8, torch.float32, "cpu")
    backend = get_attention_backend("auto", cache, num_heads=4, num_kv_heads=2, head_dim=8)
    assert backend.name == "torch" and not backend.supports_graphs


def test_cuda_graphs_option(tiny_llama):
    from actors.engine.llm_engine import Engine

    with pytest.raises(ValueError, match="engine.cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="engine.cuda_graph_max_batch"):
        EngineConfig(cuda_graph_max_batch=0)
    with pytest.raises(ValueError, match="engine.cuda_graphs: needs a CUDA device"):
        Engine(tiny_llama, {"device": "cpu", "cuda_graphs": True, "num_kv_blocks": 16,
                            "max_model_len": 64})
    engine = Engine(tiny_llama, {"device": "cpu", "num_kv_blocks": 16, "max_model_len": 64})
    assert engine.info()["cuda_graphs"] is False
    assert engine.kv_cache.pool.shape[1] == 16  # no scratch page without graphs
