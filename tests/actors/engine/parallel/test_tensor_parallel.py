"""Tensor parallelism on CPU (gloo): two ranks against one, on tiny llama, qwen3 (tied
embeddings) and qwen2 (with fused projections) in fp32; vocabularies that two ranks do not
divide, and head paths that scale or cap the logits after the vocab-parallel LM head (granite,
gemma2)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from actors.engine.engine_config import EngineConfig
from actors.engine.llm_engine import Engine

CONFIG = dict(device="cpu", dtype="float32", max_num_seqs=6, max_num_batched_tokens=24,
              max_model_len=96, num_kv_blocks=48, block_size=4)


def _requests(vocab: int) -> list[tuple]:
    prompt = [(7 * j + 3) % vocab for j in range(30)]  # longer than a step: chunked
    common = dict(max_tokens=10, ignore_eos=True, detokenize=False)
    return [
        ("greedy", prompt, dict(temperature=0.0, logprobs=2, **common)),
        ("shared-prefix", prompt[:20] + [11, 12], dict(temperature=0.0, **common)),
        ("seeded", [5, 9, 13], dict(temperature=1.0, top_p=0.9, seed=7, **common)),
        ("forked", [21, 22, 23, 24, 25], dict(temperature=0.8, n=2, seed=3, **common)),
        ("scored", prompt[:12], dict(temperature=0.0, prompt_logprobs=1, **common)),
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2-fused"])
def engines(request, tiny_model_factory):
    """One rank against two; "-fused": the two ranks fuse their q/k/v and gate/up slices
    (``fused_projections``) and are compared with the one rank's plain layers."""
    arch, _, fused = request.param.partition("-")
    path = tiny_model_factory(arch)
    one = Engine(path, CONFIG)
    two = Engine(path, {**CONFIG, "tensor_parallel_size": 2, "fused_projections": bool(fused)})
    if fused:
        assert two.info()["fused_projections"]["qkv"] == two.loaded.num_layers
    yield path, one, two
    pids = two.replica.pids
    two.close()
    assert not any(_alive(p) for p in pids)


def _compare(a, b) -> None:
    assert [(o.id, o.sample_index) for o in a] == [(o.id, o.sample_index) for o in b]
    for x, y in zip(a, b):
        assert x.output_token_ids == y.output_token_ids, x.id
        assert x.finish_reason == y.finish_reason
        for p, q in zip(x.raw_logprobs, y.raw_logprobs):
            assert abs(p - q) <= 1e-5, x.id
        for p, q in zip(x.logprobs or [], y.logprobs or []):
            assert abs(p - q) <= 1e-5, x.id
        for p, q in zip(x.prompt_logprobs or [], y.prompt_logprobs or []):
            assert (p is None and q is None) or abs(p - q) <= 1e-5, x.id


def _vocab_weights(loaded) -> tuple[torch.Tensor, torch.Tensor]:
    model = loaded.model
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def test_two_ranks_match_one(engines):
    _, one, two = engines
    (embed, head), (full_embed, full_head) = _vocab_weights(two.loaded), _vocab_weights(
        one.loaded)
    assert embed.shape[0] == head.shape[0] == full_embed.shape[0] // 2  # rank 0's rows
    assert (head is embed) == (full_head is full_embed)  # tied (qwen3) stay one tensor
    requests = _requests(one.loaded.vocab_size)
    a = one.generate(requests, token_logprobs=True)
    b = two.generate(requests, token_logprobs=True)
    assert all(o.finish_reason == "length" for o in a)
    _compare(a, b)
    assert two.info()["tensor_parallel_size"] == 2
    # a second round reuses the prefix cache of rank 0's blocks on both ranks' pages
    _compare(one.generate(requests, token_logprobs=True),
             two.generate(requests, token_logprobs=True))


def test_update_weights_full_tensors(engines):
    from transformers import AutoModelForCausalLM

    path, one, two = engines
    assert two.weights.spec() == one.weights.spec()  # full HF shapes on rank 0
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    scaled = {k: v * 1.05 for k, v in full.items()}
    requests = _requests(one.loaded.vocab_size)[:3]
    before = one.generate(requests, token_logprobs=True)
    one.update_weights(scaled)
    two.update_weights(scaled)
    after = one.generate(requests, token_logprobs=True)
    assert [o.raw_logprobs for o in after] != [o.raw_logprobs for o in before]
    _compare(after, two.generate(requests, token_logprobs=True))
    with pytest.raises(ValueError, match="shape"):
        name = next(k for k in full if k.endswith("q_proj.weight"))
        two.update_weights({name: full[name][:2]})
    one.update_weights(full)
    two.update_weights(iter(full.items()))  # an iterator of pairs too
    _compare(before, two.generate(requests, token_logprobs=True))


def _update_vocab_weights(path: str, one, two, scale: float) -> None:
    """The same new embedding and LM head (tied names: the same values) into both engines."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    names = ("model.embed_tokens.weight", "lm_head.weight")
    update = {n: full[n] * scale for n in names if n in full}
    one.update_weights(update)
    two.update_weights(update)


def test_update_embedding_and_lm_head(engines):
    path, one, two = engines
    requests = _requests(one.loaded.vocab_size)[:3]
    before = two.generate(requests, token_logprobs=True)
    _update_vocab_weights(path, one, two, 1.3)
    after = two.generate(requests, token_logprobs=True)
    assert [o.raw_logprobs for o in after] != [o.raw_logprobs for o in before]
    _compare(one.generate(requests, token_logprobs=True), after)
    _update_vocab_weights(path, one, two, 1.0)
    _compare(before, two.generate(requests, token_logprobs=True))


def test_sleep_and_wake_on_every_rank(engines):
    path, one, two = engines
    requests = _requests(one.loaded.vocab_size)[:3]
    reference = one.generate(requests, token_logprobs=True)
    assert two.sleep(1)["kv_cache"] > 0
    two.wake_up()
    _compare(reference, two.generate(requests, token_logprobs=True))
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    freed = two.sleep(2)
    assert freed["weights"] > 0
    two.wake_up(["weights"])
    two.update_weights(full)
    two.wake_up(["kv_cache"])
    _compare(reference, two.generate(requests, token_logprobs=True))


def test_size_checked():
    with pytest.raises(ValueError, match="engine.tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_heads_must_divide(tiny_llama):
    with pytest.raises(ValueError, match="engine.tensor_parallel_size: must divide the "
                                         "model's 4 attention heads, got 3"):
        Engine(tiny_llama, {**CONFIG, "tensor_parallel_size": 3})


def test_dropped_engine_ends_its_ranks_and_a_dead_rank_is_reported(tiny_llama):
    engine = Engine(tiny_llama, {**CONFIG, "tensor_parallel_size": 2})
    (pid,) = engine.replica.pids
    assert _alive(pid)
    proc = engine.replica.ranks.procs[0]
    del engine
    gc.collect()
    assert proc.poll() is not None and not _alive(pid)

    engine = Engine(tiny_llama, {**CONFIG, "tensor_parallel_size": 2})
    proc = engine.replica.ranks.procs[0]
    proc.kill()
    proc.wait()
    engine.add_request("x", [1, 2, 3], dict(max_tokens=2))
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
        engine.step()
    engine.close()


@pytest.mark.slow
def test_kv_heads_replicated_over_four_ranks(tiny_llama):
    """4 ranks, 4 heads, 2 KV heads: each rank keeps one query head and a copy of its KV
    head."""
    one = Engine(tiny_llama, CONFIG)
    four = Engine(tiny_llama, {**CONFIG, "tensor_parallel_size": 4})
    assert (four.loaded.num_heads, four.loaded.num_kv_heads) == (1, 1)
    assert four.kv_cache.pool.shape[-2] == 1  # the pool holds this rank's KV head only
    requests = _requests(one.loaded.vocab_size)
    _compare(one.generate(requests, token_logprobs=True),
             four.generate(requests, token_logprobs=True))
    pids = four.replica.pids
    four.close()
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (4 experts, top 2; layer 1 a dense MLP) with fused 3-D experts."""
    import transformers

    from toolkit.tiny_model import train_tokenizer

    path = tmp_path_factory.mktemp("tiny-moe")
    tokenizer = train_tokenizer(512)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        decoder_sparse_step=1, mlp_only_layers=[1])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_moe_experts_sharded(tiny_moe):
    from transformers import AutoModelForCausalLM

    one = Engine(tiny_moe, CONFIG)
    two = Engine(tiny_moe, {**CONFIG, "tensor_parallel_size": 2})
    experts = two.loaded.model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 32, 64)  # [experts, 2 * 32 / 2, hidden]
    assert tuple(experts.down_proj.shape) == (4, 64, 16)
    requests = _requests(one.loaded.vocab_size)
    _compare(one.generate(requests, token_logprobs=True),
             two.generate(requests, token_logprobs=True))
    full = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).state_dict()
    scaled = {k: v * 0.9 for k, v in full.items()}
    one.update_weights(scaled)
    two.update_weights(scaled)
    _compare(one.generate(requests, token_logprobs=True),
             two.generate(requests, token_logprobs=True))
    two.close()


class _Experts(torch.nn.Module):
    def __init__(self, gate_up_shape, down_shape):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(gate_up_shape))
        self.down_proj = torch.nn.Parameter(torch.zeros(down_shape))
        self.act_fn = torch.nn.SiLU()


def test_experts_left_out_of_the_plan_are_added_or_refused():
    from actors.engine.model.loader import UnsupportedModelError
    from actors.engine.parallel.sharding import _experts_plan, compile_plan

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].experts = _Experts((4, 32, 16), (4, 16, 16))  # [E, 2I, H], [E, H, I]
    covered = compile_plan({"layers.*.experts": "moe_tp_experts"})
    assert _experts_plan(model, covered, "model.", "toy") == {}
    assert _experts_plan(model, [], "model.", "toy") == {
        "layers.0.experts": "moe_tp_experts", "layers.0.experts.gate_up_proj": "packed_colwise",
        "layers.0.experts.down_proj": "rowwise"}
    model.layers[0].experts = _Experts((4, 16, 32), (4, 16, 16))  # [E, H, 2I]: transposed
    with pytest.raises(UnsupportedModelError, match="layers.0.experts.*cannot be sharded"):
        _experts_plan(model, [], "model.", "toy")


def test_worker_rank_exits_when_rank_0_is_killed(tiny_llama):
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys\n"
        "from actors.engine.llm_engine import Engine\n"
        f"e = Engine({tiny_llama!r}, {{**{CONFIG!r}, 'tensor_parallel_size': 2}})\n"
        "print(e.replica.pids[0], flush=True)\n"
        "sys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = int(rank0.stdout.readline())
        assert _alive(worker)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait()
        deadline = time.monotonic() + 15
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker)
    finally:
        rank0.kill()
        rank0.wait()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from toolkit.tiny_model import train_tokenizer

    path = tmp_path_factory.mktemp("tp-tokenizer")
    train_tokenizer(512).save_pretrained(path)
    return str(path)


# vocabularies of 515 rows: rank 0 keeps 258, rank 1 257 and a zero row of padding
ODD_VOCAB = {
    "qwen3": None,  # tied embeddings (tiny_model's qwen3)
    "granite": dict(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5,
                    attention_multiplier=0.2),  # the head path divides by logits_scaling
    "gemma2": dict(final_logit_softcapping=3.0, attn_logit_softcapping=2.0,
                   query_pre_attn_scalar=16),   # tied, a scaled embedding, capped logits
}


@pytest.mark.parametrize("arch", sorted(ODD_VOCAB))
def test_odd_vocabulary_and_head_path_scalings(arch, tiny_model_factory, tokenizer_dir,
                                               tmp_path):
    if ODD_VOCAB[arch] is None:
        path, extra = tiny_model_factory(arch, vocab_size=515), {}
    else:
        from tests.actors.engine.model.model_sweep import build

        path, extra = str(tmp_path), {"tokenizer": tokenizer_dir}
        build(arch, tmp_path, vocab_size=515, **ODD_VOCAB[arch])
    config = {**CONFIG, **extra, "prompt_logprobs_chunk": 5}  # several head calls a step
    one = Engine(path, config)
    two = Engine(path, {**config, "tensor_parallel_size": 2})
    try:
        assert one.loaded.vocab_size == 515
        embed, head = _vocab_weights(two.loaded)
        assert embed.shape[0] == head.shape[0] == 258
        if arch != "qwen3":  # more than the LM head alone
            assert two.loaded.head.direct is None
        requests = _requests(512)
        _compare(one.generate(requests, token_logprobs=True),
                 two.generate(requests, token_logprobs=True))
        _update_vocab_weights(path, one, two, 0.8)
        _compare(one.generate(requests, token_logprobs=True),
                 two.generate(requests, token_logprobs=True))
    finally:
        two.close()
        one.close()
