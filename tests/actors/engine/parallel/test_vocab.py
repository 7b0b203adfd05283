"""The vocab-parallel embedding and LM head, checked in one process (no process group): each
rank keeps ceil(V / tp) rows, the ranks' summed lookups equal the full embedding bit for bit,
their logits side by side equal the full logits, and classes that cannot be split are
refused."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from actors.engine.engine_config import EngineConfig
from actors.engine.model.lm_head import ModelHead
from actors.engine.model.loader import UnsupportedModelError, load_model
from actors.engine.parallel.vocab import shard_vocab, vocab_rows


def _fake_comm(rank: int, world_size: int) -> SimpleNamespace:
    # the lookup's all-reduce leaves each rank's part, the all-gather each rank's logits
    return SimpleNamespace(rank=rank, world_size=world_size, enabled=True,
                           all_reduce=lambda t: t, all_gather=lambda t: [t])


@pytest.mark.parametrize("vocab", [5, 512, 515])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_rows_cover_the_vocabulary_once_with_padding_at_the_end(vocab, tp):
    parts = [vocab_rows(vocab, r, tp) for r in range(tp)]
    per = -(-vocab // tp)
    assert all(p.per_rank == per for p in parts)
    assert [i for p in parts for i in range(p.start, p.stop)] == list(range(vocab))
    full = torch.arange(vocab, dtype=torch.float32)[:, None] + 1  # no zero row
    taken = torch.cat([p.take(full) for p in parts])
    assert taken.shape == (tp * per, 1)
    assert torch.equal(taken[:vocab], full) and not taken[vocab:].any()


def _split(loaded, tp: int, swap=None):
    """Each rank's copy of ``loaded`` after ``shard_vocab`` (``swap(model)`` first)."""
    ranks = []
    for rank in range(tp):
        mine = copy.copy(loaded)
        mine.model = copy.deepcopy(loaded.model)
        if swap is not None:
            swap(mine.model)
        mine.head = ModelHead(mine.model)
        ranks.append((mine, shard_vocab(mine, _fake_comm(rank, tp))))
    return ranks


@pytest.mark.parametrize("arch,vocab", [("llama", 512), ("qwen3", 515), ("llama", 515)])
def test_shards_recombine_to_the_full_embedding_and_logits(tiny_model_factory, arch, vocab):
    path = tiny_model_factory(arch, vocab_size=vocab)
    loaded = load_model(path, EngineConfig(device="cpu", dtype="float32"))
    model = loaded.model
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (arch == "qwen3")
    ids = torch.tensor([[0, 1, 257, 258, vocab - 2, vocab - 1]])
    hidden = torch.randn(4, model.config.hidden_size)
    full_embed, full_logits = model.model.embed_tokens(ids), loaded.head(hidden)
    ranks = _split(loaded, 2)
    per = -(-vocab // 2)
    for mine, slices in ranks:
        embed, head = mine.model.model.embed_tokens, mine.model.lm_head
        assert embed.weight.shape == head.weight.shape == (per, model.config.hidden_size)
        assert (head.weight is embed.weight) == tied
        names = {"model.embed_tokens.weight", "lm_head.weight"}
        assert names <= set(slices)
        for name in names:
            full_shape, take = slices[name]
            assert full_shape == (vocab, model.config.hidden_size)
            assert torch.equal(take(model.state_dict()[name]), embed.weight if "embed" in name
                               else head.weight)
    lookups = [mine.model.model.embed_tokens(ids) for mine, _ in ranks]
    assert torch.equal(lookups[0] + lookups[1], full_embed)
    logits = torch.cat([mine.head(hidden) for mine, _ in ranks], dim=-1)[:, :vocab]
    torch.testing.assert_close(logits, full_logits, rtol=1e-5, atol=1e-5)


def test_a_scaled_embedding_subclass_keeps_its_scale(tiny_llama):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    loaded = load_model(tiny_llama, EngineConfig(device="cpu", dtype="float32"))

    def swap(model):
        old = model.model.embed_tokens
        new = Gemma3TextScaledWordEmbedding(old.num_embeddings, old.embedding_dim,
                                            old.padding_idx, embed_scale=8.0)
        new.weight = old.weight
        model.model.embed_tokens = new

    reference = copy.deepcopy(loaded.model)
    swap(reference)
    ids = torch.tensor([[0, 3, 255, 256, 511]])
    full = reference.model.embed_tokens(ids)
    assert torch.equal(full, loaded.model.model.embed_tokens(ids) * 8.0)
    ranks = _split(loaded, 2, swap)
    parts = [mine.model.model.embed_tokens(ids) for mine, _ in ranks]
    assert torch.equal(parts[0] + parts[1], full)


class _SizeScaledEmbedding(torch.nn.Embedding):
    """A lookup that depends on the table's size: it cannot be split over the vocabulary."""

    def forward(self, input_ids):
        return super().forward(input_ids) * self.weight.shape[0]


def test_an_embedding_that_needs_the_whole_table_is_refused(tiny_llama):
    loaded = load_model(tiny_llama, EngineConfig(device="cpu", dtype="float32"))
    old = loaded.model.model.embed_tokens
    new = _SizeScaledEmbedding(old.num_embeddings, old.embedding_dim)
    new.weight = old.weight
    loaded.model.model.embed_tokens = new
    with pytest.raises(ValueError, match="LlamaForCausalLM.*_SizeScaledEmbedding.*cannot be "
                                         "split"):
        shard_vocab(loaded, _fake_comm(0, 2))


def test_a_head_path_that_projects_twice_is_refused(tiny_llama):
    loaded = load_model(tiny_llama, EngineConfig(device="cpu", dtype="float32"))
    lm_head = loaded.model.lm_head
    loaded.head = SimpleNamespace(through_model=lambda h: lm_head(h) + lm_head(h))
    with pytest.raises(UnsupportedModelError, match="calls the LM head 2 times"):
        shard_vocab(loaded, _fake_comm(0, 2))
