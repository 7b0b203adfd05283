"""Two tensor-parallel ranks on one CUDA GPU (gloo over CUDA tensors: NCCL refuses two ranks
on one device) against one rank, in bf16.

Run with ``pytest -m gpu tests/actors/engine/parallel`` on a CUDA machine. Decode runs eagerly
on both ranks (CUDA graphs are off with tensor parallelism: a gloo all-reduce goes through the
host and cannot be captured; docs/tensor_parallel.md).

Tolerance (bf16): the two ranks sum the row-parallel partial products in another order than
one rank's single GEMM, so logits differ by bf16 rounding. Each TP=2 greedy output equals the
TP=1 output up to its first difference, where TP=2's token must be TP=1's runner-up with a
TP=1 logprob gap of at most ``NEAR_TIE`` nats; the sampled-token logprobs of the common prefix
agree within ``LOGPROB_TOL``; at least 12 of the 16 outputs match in full.
"""

from __future__ import annotations

import pytest
import torch

from actors.engine.llm_engine import Engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NEAR_TIE = 0.1
LOGPROB_TOL = 0.1
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
CONFIG = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=256,
              num_kv_blocks=256)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_two_ranks_on_one_gpu_match_one(tiny_model_factory, arch):
    path = tiny_model_factory(arch, **GPU_SHAPE)
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2,
                  detokenize=False)
    requests = [(i, [(31 * i + 7 * j + 3) % 400 + 4 for j in range(8 + 5 * i)], params)
                for i in range(16)]
    one = Engine(path, CONFIG)
    reference = one.generate(requests, token_logprobs=True)
    del one
    torch.cuda.empty_cache()
    two = Engine(path, {**CONFIG, "tensor_parallel_size": 2})
    try:
        assert two.replica.comm.backend == "gloo"
        assert two.info()["cuda_graphs"] is False
        outputs = two.generate(requests, token_logprobs=True)
    finally:
        two.close()
    full = 0
    for ref, out in zip(reference, outputs):
        a, b = ref.output_token_ids, out.output_token_ids
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for p, q in zip(ref.raw_logprobs[:k], out.raw_logprobs[:k]):
            assert abs(p - q) <= LOGPROB_TOL, (ref.id, p, q)
        if k == len(a):
            full += 1
            continue
        top = ref.top_logprobs[k]
        assert top[1]["token_id"] == b[k], (ref.id, k, top, b[k])
        assert top[0]["logprob"] - top[1]["logprob"] <= NEAR_TIE, (ref.id, k, top)
    assert full >= 12, full
