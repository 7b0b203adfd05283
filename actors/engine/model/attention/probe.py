"""The load-time attention probe: one token through the model records how each layer calls
attention (window, scale, soft-cap, sinks, heads, key/value widths), so the KV pool and the
backends are sized from what the attention modules really produce, and a model whose layers
bypass the registered function, or pass it arguments the backends would ignore, is refused."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from actors.engine.model.attention.base import AttentionBackend, LayerSpec, StepContext
from actors.engine.model.attention.metadata import AttentionMetadata


class UnsupportedAttentionError(ValueError):
    """A model's attention cannot run on the paged backends (the message says why)."""


def one_token_metadata(num_seqs: int, device: torch.device, block_size: int
                       ) -> AttentionMetadata:
    """``num_seqs`` sequences of one token at position 0, all on page 0, slot 0."""
    return AttentionMetadata(
        num_seqs=num_seqs, num_tokens=num_seqs, max_query_len=1, max_seq_len=1,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=device),
        block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=device),
        positions=torch.zeros(num_seqs, dtype=torch.int64, device=device),
        query_start_loc_host=np.arange(num_seqs + 1, dtype=np.int32),
        seq_lens_host=np.ones(num_seqs, np.int32),
        block_tables_host=np.zeros((num_seqs, 1), np.int32), block_size=block_size)


class ProbeBackend(AttentionBackend):
    """Attention of sequences of one token, without a pool: each query's only key is its own,
    so the output is its value (per head group); sinks and soft-caps do not change shapes."""

    name = "probe"

    def __init__(self) -> None:
        super().__init__(None, 0, 0, 0)

    def plan(self, metadata: AttentionMetadata) -> None:
        return None

    def forward(self, plan, layer_idx, query, key, value, *, scaling, sliding_window=None,
                softcap=None, sinks=None) -> torch.Tensor:
        group = query.shape[1] // value.shape[1]
        return value.repeat_interleave(group, dim=1).to(query.dtype)


@torch.no_grad()
def probe_layers(forward: Callable[[torch.Tensor, torch.Tensor, StepContext], object],
                 num_layers: int, name: str, device: torch.device) -> dict[int, LayerSpec]:
    """Runs ``forward(ids [1], positions [1], ctx)`` once; returns ``{layer: LayerSpec}``.

    Raises:
        UnsupportedAttentionError: some layer did not call the attention function exactly
            once, passed an argument the backends would ignore, or the layers disagree on the
            KV heads / widths (one pool holds every layer).
    """
    backend = ProbeBackend()
    metadata = one_token_metadata(1, device, 1)
    ctx = StepContext(backend, metadata, None, layers_called=[], layer_specs={},
                      unknown_kwargs=set())
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    forward(ids, ids, ctx)
    expected = list(range(num_layers))
    if sorted(ctx.layers_called) != expected:
        raise UnsupportedAttentionError(
            f"{name}: its attention layers do not all go through transformers' "
            f"attention-function registry (layers seen: {ctx.layers_called}, expected "
            f"{expected}); it cannot run on the paged KV cache")
    if ctx.unknown_kwargs:
        raise UnsupportedAttentionError(
            f"{name}: its attention passes {sorted(ctx.unknown_kwargs)}, which the paged "
            "backends do not apply")
    specs = ctx.layer_specs
    shapes = {(s.num_kv_heads, s.key_dim, s.value_dim) for s in specs.values()}
    if len(shapes) > 1:
        raise UnsupportedAttentionError(
            f"{name}: layers differ in (kv heads, key width, value width): {sorted(shapes)}; "
            "one KV pool holds every layer")
    if len({s.num_heads for s in specs.values()}) > 1:
        raise UnsupportedAttentionError(f"{name}: layers differ in their number of heads")
    return specs
