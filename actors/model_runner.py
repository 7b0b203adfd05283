"""Model runner: packs a scheduled step into ``[1, T]`` inputs, runs the transformers model on
our paged KV cache, and applies the LM head only to the rows that need logits.

Host work per step is a handful of numpy operations over the step's sequences; the device
sees one upload of the step's arrays. Decode inputs whose token is still on the device (the
previous step's sample, not yet read by the host) are gathered there from that step's
sampled ids, so a step can be launched before the previous one's output reached the host.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from actors.attention import STEP_KWARG, AttentionBackend, AttentionMetadata, StepContext
from actors.kv_cache import KVCache
from actors.model_loader import LoadedModel
from actors.scheduler import SchedulerOutput
from actors.sequence import PENDING


@dataclass(slots=True)
class StepInputs:
    """Host arrays of one step (built by ``ModelRunner.prepare``)."""

    input_ids: np.ndarray        # [T] int64, PENDING where the token is still on the device
    positions: np.ndarray        # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray         # [B] int32
    block_tables: np.ndarray     # [B, max_blocks] int32
    slot_mapping: np.ndarray     # [T] int64
    pending_index: np.ndarray    # [P] packed index of each PENDING input
    pending_rows: np.ndarray     # [P] its row in the previous step's sampled ids
    last_index: np.ndarray       # [B] packed index of each chunk's last token
    copies: np.ndarray           # [C, 2] (src, dst) pages to copy after the forward
    max_query_len: int
    max_seq_len: int


class ModelRunner:
    """Runs the model for scheduled steps.

    Args:
        loaded: the model and its facts.
        kv_cache: the paged KV pool.
        backend: the attention backend over ``kv_cache``.
    """

    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, backend: AttentionBackend):
        self.loaded = loaded
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = loaded.device
        self.block_size = kv_cache.block_size
        self.vocab_size = loaded.vocab_size

    # ------------------------------------------------------------------ host side
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Packs the scheduled chunks (numpy; no device work)."""
        chunks = sched.chunks
        bs = self.block_size
        starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, len(chunks))
        cu = np.zeros(len(chunks) + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        num_tokens = int(cu[-1])
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                c.seq.token_ids[c.start:c.start + c.num_tokens] for c in chunks),
            np.int64, num_tokens)
        seq_of_token = np.repeat(np.arange(len(chunks)), lens)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], lens)
        seq_lens = starts + lens
        max_blocks = int(-(-seq_lens.max() // bs))
        block_tables = np.zeros((len(chunks), max_blocks), np.int32)
        for i, chunk in enumerate(chunks):
            table = chunk.seq.block_table
            block_tables[i, :len(table)] = table[:max_blocks]
        slot_mapping = (block_tables[seq_of_token, positions // bs].astype(np.int64) * bs
                        + positions % bs)
        pending_index = np.flatnonzero(input_ids == PENDING)
        pending_rows = np.fromiter(
            (chunks[seq_of_token[i]].seq.pending_row for i in pending_index),
            np.int64, len(pending_index))
        assert (pending_rows >= 0).all(), "a pending input has no row to gather from"
        copies = np.asarray(sched.copies, np.int64).reshape(-1, 2)
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=cu.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            pending_index=pending_index,
            pending_rows=pending_rows,
            last_index=cu[1:] - 1,
            copies=copies,
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
        )

    # ------------------------------------------------------------------ device side
    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A device copy of a host array that never makes the host wait for the device
        (pinned staging + non-blocking copy on CUDA; shares memory on CPU)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    @torch.no_grad()
    def execute(self, inputs: StepInputs, prev_token_ids: torch.Tensor | None) -> torch.Tensor:
        """Runs the model; returns the final hidden states ``[T, hidden]``.

        ``prev_token_ids`` is the previous step's sampled ids on the device (needed when some
        inputs are PENDING).
        """
        input_ids = self.to_device(inputs.input_ids)
        if len(inputs.pending_index):
            if prev_token_ids is None:
                raise RuntimeError("pending decode inputs but no previous sampled ids")
            index = self.to_device(inputs.pending_index)
            rows = self.to_device(inputs.pending_rows)
            input_ids = input_ids.clone() if input_ids.device.type == "cpu" else input_ids
            input_ids[index] = prev_token_ids[rows]
        positions = self.to_device(inputs.positions)
        metadata = AttentionMetadata(
            num_seqs=len(inputs.seq_lens),
            num_tokens=len(inputs.input_ids),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            query_start_loc=self.to_device(inputs.query_start_loc),
            seq_lens=self.to_device(inputs.seq_lens),
            block_tables=self.to_device(inputs.block_tables),
            slot_mapping=self.to_device(inputs.slot_mapping),
            positions=positions,
            query_start_loc_host=inputs.query_start_loc,
            seq_lens_host=inputs.seq_lens,
            block_tables_host=inputs.block_tables,
            block_size=self.block_size,
        )
        ctx = StepContext(self.backend, metadata, self.backend.plan(metadata))
        hidden = self.forward(input_ids, positions, ctx)
        if len(inputs.copies):
            copies = self.to_device(inputs.copies)
            self.kv_cache.copy_blocks(copies[:, 0], copies[:, 1])
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """The base model on packed ``[T]`` ids/positions -> hidden ``[T, hidden]``."""
        out = self.loaded.base_model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            attention_mask=None,
            use_cache=False,
            **{STEP_KWARG: ctx},
        )
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on ``[R, hidden]`` rows -> ``[R, vocab]`` logits in the model dtype."""
        logits = self.loaded.lm_head(hidden)[:, :self.vocab_size]
        if self.loaded.logit_scale is not None:
            logits = logits * self.loaded.logit_scale
        cap = self.loaded.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
