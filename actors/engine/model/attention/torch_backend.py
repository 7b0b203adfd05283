"""Reference paged attention in plain torch: one batched page gather + SDPA per layer.

Runs on any device (CPU in CI). The new tokens are scattered from the packed ``[T]`` order
into a ``[B, max_query_len]`` grid so one SDPA call covers every sequence; no Python loop over
sequences happens inside a layer. An FP8 pool's pages are cast to the query's dtype after the
gather (scale 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from actors.engine.model.attention.base import AttentionBackend
from actors.engine.model.attention.metadata import AttentionMetadata
from actors.engine.model.kv_cache import gather_pages, store_rows


@dataclass(slots=True)
class TorchPlan:
    """Index tensors and masks shared by every layer of one step."""

    metadata: AttentionMetadata
    k_rows: torch.Tensor          # [T] row of each new key in the flattened layer pool
    v_rows: torch.Tensor          # [T] same for values
    grid_index: torch.Tensor      # [T] position of each packed token in the [B*max_q] grid
    query_pos: torch.Tensor       # [B, max_q] position of each grid query (0 where padding)
    key_pos: torch.Tensor         # [max_kv] key positions 0..max_kv-1
    causal_mask: torch.Tensor     # [B, 1, max_q, max_kv] bool, True = attend
    padding_mask: torch.Tensor    # [B, 1, max_q, max_kv] bool: grid padding rows -> key 0
    dense: bool = False           # every sequence has max_q new tokens (e.g. all decodes)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    """Gather-then-SDPA reference backend (correctness oracle for faster backends)."""

    name = "torch"

    def plan(self, metadata: AttentionMetadata) -> TorchPlan:
        device = metadata.slot_mapping.device
        bs = metadata.block_size
        num_seqs, max_q = metadata.num_seqs, metadata.max_query_len
        slots = metadata.slot_mapping
        blocks, offsets = slots // bs, slots % bs
        k_rows = blocks * (2 * bs) + offsets
        v_rows = k_rows + bs

        qsl = metadata.query_start_loc.long()
        query_lens = qsl[1:] - qsl[:-1]                                   # [B]
        seq_ids = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), query_lens, output_size=metadata.num_tokens
        )                                                                 # [T]
        within = torch.arange(metadata.num_tokens, device=device) - qsl[seq_ids]
        grid_index = seq_ids * max_q + within

        context = metadata.seq_lens.long() - query_lens                   # cached before step
        i = torch.arange(max_q, device=device)
        query_pos = context[:, None] + i[None, :]                         # [B, max_q]
        valid_q = i[None, :] < query_lens[:, None]                        # [B, max_q]
        max_kv = metadata.block_tables.shape[1] * bs
        key_pos = torch.arange(max_kv, device=device)
        causal = key_pos[None, None, :] <= query_pos[:, :, None]          # [B, max_q, max_kv]
        # grid padding rows attend to key 0 only, so SDPA never sees an all-masked row
        padding = (~valid_q)[:, :, None] & (key_pos == 0)[None, None, :]
        causal = (causal & valid_q[:, :, None]) | padding
        return TorchPlan(metadata, k_rows, v_rows, grid_index, query_pos, key_pos,
                         causal.unsqueeze(1), padding.unsqueeze(1),
                         dense=metadata.num_tokens == num_seqs * max_q)

    def _mask(self, plan: TorchPlan, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None or sliding_window <= 0:
            return plan.causal_mask
        mask = plan.windowed.get(sliding_window)
        if mask is None:
            inside = plan.key_pos[None, None, :] > plan.query_pos[:, :, None] - sliding_window
            mask = (plan.causal_mask & inside.unsqueeze(1)) | plan.padding_mask
            plan.windowed[sliding_window] = mask
        return mask

    def forward(
        self,
        plan: TorchPlan,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md = plan.metadata
        cache = self.kv_cache
        dk, dv = cache.key_dim, cache.value_dim
        pages = cache.layer(layer_idx)                  # [N, 2, bs, Hkv, D]
        flat = pages.view(-1, self.num_kv_heads, cache.head_dim)
        if dk == dv == cache.head_dim:
            store_rows(flat, plan.k_rows, key)
            store_rows(flat, plan.v_rows, value)
        else:  # MLA: keys and values of different widths in a pool as wide as the widest
            store_rows(flat[:, :, :dk], plan.k_rows, key)
            store_rows(flat[:, :, :dv], plan.v_rows, value)

        num_seqs, max_q, heads = md.num_seqs, md.max_query_len, self.num_heads
        gathered = gather_pages(pages, md.block_tables.long())  # [B, MB, 2, bs, Hkv, D]
        k_all = gathered[:, :, 0, ..., :dk].reshape(num_seqs, -1, self.num_kv_heads, dk)
        v_all = gathered[:, :, 1, ..., :dv].reshape(num_seqs, -1, self.num_kv_heads, dv)

        if plan.dense:  # packed order already is the [B, max_q] grid
            q_grid = query
        else:
            q_grid = query.new_zeros((num_seqs * max_q, heads, dk))
            q_grid[plan.grid_index] = query
        q_grid = q_grid.reshape(num_seqs, max_q, heads, dk).transpose(1, 2)
        k_all = k_all.transpose(1, 2).to(query.dtype)   # [B, Hkv, max_kv, Dk] (FP8: dequantized)
        v_all = v_all.transpose(1, 2).to(query.dtype)
        mask = self._mask(plan, sliding_window)
        if softcap is None and sinks is None:
            out = F.scaled_dot_product_attention(
                q_grid, k_all, v_all, attn_mask=mask, scale=scaling,
                enable_gqa=heads != self.num_kv_heads)  # [B, H, max_q, Dv]
        else:
            out = _explicit_attention(q_grid, k_all, v_all, mask, scaling, softcap, sinks)
        out = out.transpose(1, 2).reshape(num_seqs * max_q, heads, dv)
        return out if plan.dense else out[plan.grid_index]


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scaling: float, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with the scores materialised, in transformers' eager order: scale, soft-cap
    (``cap * tanh(s / cap)``), mask, then a float32 softmax whose denominator also holds each
    head's sink logit. q ``[B, H, Q, Dk]``, k/v ``[B, Hkv, K, D]``, mask ``[B, 1, Q, K]``."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling        # [B, H, Q, K]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=torch.float32).to(q.dtype)[..., :-1]
    return torch.matmul(probs, v)
