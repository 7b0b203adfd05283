"""Vocab-parallel input embedding and LM head of a tensor-parallel replica.

Rank r keeps rows ``[r * P, (r + 1) * P)`` of a ``V``-row vocabulary, ``P = ceil(V / tp)``;
rows past ``V`` (the last ranks' share when ``tp`` does not divide ``V``) are zeros, never
looked up, and cut off after the gather, so the logits stay ``V`` wide.

- Input embedding (an ``nn.Embedding``, or a subclass such as a scaled word embedding): the
  module's own forward runs on this rank's rows with its ids shifted into them (ids of other
  ranks look up row 0), the rows of those ids are zeroed, and the ranks' outputs are summed
  (all-reduce). Every id is held by exactly one rank, so the sum is the full lookup bit for
  bit; a check on the full weights at load time verifies this for the module's class.
- LM head (an ``nn.Linear``): each rank projects onto its rows; a forward hook all-gathers the
  ranks' logits in rank order and cuts them to ``V``, so the CausalLM's own head path
  (``actors.engine.model.lm_head``: granite's scaling, soft-capping, ...) runs on the full
  logits exactly as with one rank.
- Tied embeddings share one parameter: it is sliced once and both modules read the slice.

The other ranks never choose logit rows: every LM-head call on rank 0 is announced with the
hidden rows it projects (``actors.engine.parallel.step``), and they join its all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from actors.engine.model.model_support import UnsupportedModelError


@dataclass(slots=True, frozen=True)
class VocabRows:
    """The vocabulary rows ``[start, stop)`` of one rank, padded to ``per_rank`` rows."""

    start: int
    stop: int
    per_rank: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full ``[V, ...]`` tensor, zero-padded to ``per_rank``."""
        part = full[self.start:self.stop]
        missing = self.per_rank - part.shape[0]
        if missing:
            part = torch.cat([part, part.new_zeros((missing, *full.shape[1:]))])
        return part.contiguous()


def vocab_rows(vocab: int, rank: int, tp: int) -> VocabRows:
    """Rank ``rank``'s share of ``vocab`` rows over ``tp`` ranks."""
    per = -(-vocab // tp)
    start = min(rank * per, vocab)
    return VocabRows(start, min(start + per, vocab), per)


def _partial_lookup(forward: Callable, rows: VocabRows, ids: torch.Tensor) -> torch.Tensor:
    """``forward`` (the module's own) on this rank's rows; zeros for ids of other ranks."""
    local = ids - rows.start
    outside = (local < 0) | (local >= rows.stop - rows.start)
    out = forward(local.masked_fill(outside, 0))
    return out.masked_fill(outside.unsqueeze(-1), 0)


class _GatherLogits:
    """Forward hook of the LM head: the ranks' logits side by side, cut to ``vocab``."""

    def __init__(self, comm: Any, vocab: int):
        self.comm = comm
        self.vocab = vocab
        self.calls = 0
        self.gather = True  # False while the head path is probed on this rank alone

    def __call__(self, _module, _inputs, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if not self.gather:
            return out
        if self.comm.enabled:
            parts = self.comm.all_gather(out)
        else:  # a forward of this rank alone (the memory profile): the gathered shape
            parts = [out] * self.comm.world_size
        return torch.cat(parts, dim=-1)[..., :self.vocab]


@torch.no_grad()
def _check_embedding_split(module: torch.nn.Embedding, tp: int, architecture: str) -> None:
    """Refuses an embedding class whose lookup, split this way, differs from the full one."""
    weight = module.weight
    vocab = weight.shape[0]
    ids = sorted({0, vocab - 1} | {i for r in range(tp) for i in (
        vocab_rows(vocab, r, tp).start, vocab_rows(vocab, r, tp).stop - 1) if 0 <= i < vocab})
    ids = torch.tensor([ids], dtype=torch.long, device=weight.device)
    full = module(ids)
    parts, padding_idx, data = [], module.padding_idx, weight.data
    try:
        module.padding_idx = None
        for rank in range(tp):
            rows = vocab_rows(vocab, rank, tp)
            weight.data = rows.take(data)
            parts.append(_partial_lookup(module.forward, rows, ids))
    finally:
        weight.data, module.padding_idx = data, padding_idx
    if full.shape != parts[0].shape or not torch.equal(sum(parts), full):
        raise UnsupportedModelError(
            f"{architecture}: its input embedding ({type(module).__name__}) does not look up "
            "rows independently of the vocabulary size; it cannot be split over "
            "tensor-parallel ranks")


def _param_names(model: torch.nn.Module, param: torch.Tensor) -> list[str]:
    """Every state-dict name of ``param`` (a tied weight has two)."""
    return [name for name, t in model.state_dict(keep_vars=True).items() if t is param]


def shard_vocab(loaded: Any, comm: Any
                ) -> dict[str, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]:
    """Splits ``loaded.model``'s input embedding and LM head over the vocabulary, in place.
    Returns ``{state-dict name: (full shape, slicer)}`` of the tensors it split."""
    tp, rank, arch = comm.world_size, comm.rank, loaded.architecture
    model = loaded.model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, torch.nn.Embedding) or embed.max_norm is not None:
        raise UnsupportedModelError(
            f"{arch}: its input embedding ({type(embed).__name__}) is not an nn.Embedding "
            "without max_norm; it cannot be split over tensor-parallel ranks")
    if not isinstance(head, torch.nn.Linear):
        raise UnsupportedModelError(
            f"{arch}: its LM head ({type(head).__name__}) is not an nn.Linear; it cannot be "
            "split over tensor-parallel ranks")
    _check_embedding_split(embed, tp, arch)
    tied = head.weight is embed.weight
    slices = {}
    for param in [embed.weight] + ([] if tied else [head.weight]) + (
            [head.bias] if head.bias is not None else []):
        rows = vocab_rows(param.shape[0], rank, tp)
        for name in _param_names(model, param):
            slices[name] = (tuple(param.shape), rows.take)
        param.data = rows.take(param.data)

    embed_rows = vocab_rows(embed.num_embeddings, rank, tp)
    embed.num_embeddings, embed.padding_idx = embed_rows.per_rank, None
    lookup = embed.forward  # the class's own forward, bound to the module

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(_partial_lookup(lookup, embed_rows, input_ids))

    embed.forward = forward
    vocab = head.out_features
    head.out_features = vocab_rows(vocab, rank, tp).per_rank
    gather = _GatherLogits(comm, vocab)
    head.register_forward_hook(gather)
    _check_one_head_call(loaded, gather, head.weight)
    return slices


@torch.no_grad()
def _check_one_head_call(loaded: Any, gather: _GatherLogits, weight: torch.Tensor) -> None:
    """The head path must call the LM head exactly once (each call is one all-gather that
    the other ranks join)."""
    head = loaded.head
    before = gather.calls
    gather.gather = False
    try:
        head.through_model(weight.new_zeros(1, weight.shape[1]))
    finally:
        gather.gather = True
    calls = gather.calls - before
    if calls != 1:
        raise UnsupportedModelError(
            f"{loaded.architecture}: its head path calls the LM head {calls} times per "
            "forward; a vocab-parallel LM head needs exactly one call")
