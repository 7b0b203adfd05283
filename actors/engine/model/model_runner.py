"""Model runner: packs a scheduled step into ``[1, T]`` inputs, runs the transformers model on
our paged KV cache, and applies the LM head only to the rows that need logits.

Host work per step is a handful of numpy operations over the step's sequences (block tables
come from a per-slot mirror updated incrementally); the device sees the step's arrays through
one persistent pinned staging arena, uploaded before any kernel of the step. Decode inputs
whose token is still on the device (the previous step's sample, not yet read by the host) are
gathered there from that step's sampled ids, so a step can be launched before the previous
one's output reached the host. Pure-decode steps replay a CUDA graph when graphs are enabled.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actors.engine.model.attention import (
    STEP_KWARG,
    AttentionBackend,
    AttentionMetadata,
    StepContext,
)
from actors.engine.model.block_table import BlockTableMirror
from actors.engine.model.decode_rows import DecodeRows
from actors.engine.model.kv_cache import KVCache
from actors.engine.model.loader import LoadedModel
from actors.engine.model.staging import Staging
from actors.engine.scheduler_output import SchedulerOutput
from actors.engine.sequence import PENDING, Sequence

_EMPTY = np.zeros(0, np.int64)


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
    sample_rows: np.ndarray = field(default_factory=lambda: _EMPTY)  # [U] rows that sample
    sample_inverse: np.ndarray | None = None    # [S] row of each sample among them (forks)
    sample_slots: np.ndarray = field(default_factory=lambda: _EMPTY)  # [S] sampler slots


class ModelRunner:
    """Runs the model for scheduled steps.

    Args:
        loaded: the model and its facts.
        kv_cache: the paged KV pool.
        backend: the attention backend over ``kv_cache``.
        max_num_seqs, max_model_len: size the block-table mirror (it grows if needed).
    """

    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, backend: AttentionBackend,
                 *, max_num_seqs: int = 8, max_model_len: int = 256, fused=None):
        self.loaded = loaded
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = loaded.device
        self.block_size = kv_cache.block_size
        self.vocab_size = loaded.vocab_size
        self.staging = Staging(self.device)
        self.set_backend(backend)
        self.tables = BlockTableMirror(max_num_seqs, -(-max_model_len // self.block_size))
        self.rows = DecodeRows()  # the last prepared step's sample rows
        self.graphs = None  # actors.engine.model.cuda_graphs.DecodeGraphs once captured
        self.fused = fused  # actors.engine.model.fused_layers.FusedLayers installed in the model, or None
        self.moe = None  # actors.engine.model.moe.FusedMoE installed in the model, or None
        # actors.engine.model.fused_projections.FusedProjections of the model, or None
        self.projections = None
        self.sample_rows: torch.Tensor | None = None     # device copies of the step's
        self.sample_inverse: torch.Tensor | None = None  # sample_rows / sample_inverse
        self.sample_slots: torch.Tensor | None = None    # / sample_slots

    def set_backend(self, backend: AttentionBackend) -> None:
        """Switches the attention backend (the engine probes with the torch reference)."""
        self.backend = backend
        if hasattr(backend, "upload"):
            backend.upload = self.staging.upload

    def describe(self) -> dict[str, Any]:
        """How the model runs: attention backend, CUDA graphs, and each fused path's own
        description (None where it is not installed)."""
        def described(part: Any) -> dict[str, Any] | None:
            return None if part is None else part.describe()

        return {"attention_backend": self.backend.name, "cuda_graphs": self.graphs is not None,
                "fused_layers": described(self.fused),
                "fused_projections": described(self.projections),
                "fused_moe": described(self.moe)}

    # ------------------------------------------------------------------ host side
    def prepare(self, sched: SchedulerOutput, inflight: list[Sequence] | None = None
                ) -> StepInputs:
        """Packs the scheduled chunks (numpy; no device work). ``inflight``: the sample rows
        of the step still in flight (``InflightStep.sample_seqs``), if any: a step that
        decodes exactly them reuses their row arrays (:class:`DecodeRows`)."""
        seqs = sched.seqs
        n = len(seqs)
        bs = self.block_size
        num_tokens = sched.num_tokens
        rows = self.rows
        if rows.continues(seqs, num_tokens, inflight):
            # steady decoding: row i is the in-flight step's sample row i, one token each
            starts, slots = rows.lens, rows.slots
            input_ids = np.full(n, PENDING, np.int64)
            lens = np.ones(n, np.int64)
            cu = np.arange(n + 1, dtype=np.int64)
            seq_of_token = cu[:-1]
            positions = starts
            pending_index = pending_rows = seq_of_token
        else:
            starts = np.array(sched.starts, np.int64)
            if num_tokens == n:  # one token per chunk (decodes)
                input_ids = np.array([s.token_ids[b] for s, b in zip(seqs, sched.starts)],
                                     np.int64)
                lens = np.ones(n, np.int64)
                cu = np.arange(n + 1, dtype=np.int64)
                seq_of_token = cu[:-1]
                positions = starts
            else:
                lens = np.array(sched.num_new, np.int64)
                cu = np.zeros(n + 1, np.int64)
                np.cumsum(lens, out=cu[1:])
                input_ids = np.fromiter(
                    itertools.chain.from_iterable(
                        s.token_ids[b:b + m]
                        for s, b, m in zip(seqs, sched.starts, sched.num_new)),
                    np.int64, num_tokens)
                seq_of_token = np.repeat(np.arange(n), lens)
                positions = (np.arange(num_tokens, dtype=np.int64)
                             + np.repeat(starts - cu[:-1], lens))
            slots = np.array([s.slot for s in seqs], np.int64)
            pending_index = np.flatnonzero(input_ids == PENDING)
            if len(pending_index):  # only a chunk's last token can be pending
                rows_of = np.array([s.pending_row for s in seqs], np.int64)
                pending_rows = rows_of[seq_of_token[pending_index]]
                assert (pending_rows >= 0).all(), "a pending input has no row to gather from"
            else:
                pending_rows = _EMPTY
        seq_lens = starts + lens
        # only sequences admitted, forked or given pages since their last step can have a
        # new slot or table (the scheduler lists them); every other row is up to date
        changed = sched.table_seqs
        self.tables.update([s.slot for s in changed], [s.block_table for s in changed])
        max_blocks = int(-(-seq_lens.max() // bs))
        block_tables = self.tables.gather(slots, max_blocks)
        slot_mapping = (block_tables[seq_of_token, positions // bs].astype(np.int64) * bs
                        + positions % bs)
        last_index = cu[1:] - 1
        sample_rows, sample_inverse, sample_slots = _EMPTY, None, _EMPTY
        sample_seqs = sched.sample_seqs
        if sample_seqs:
            if sample_seqs == seqs:  # every chunk samples, in order (decodes): rows as listed
                sample_rows, sample_slots, sample_lens = last_index, slots, seq_lens
            else:
                sample_slots = np.array([s.slot for s in sample_seqs], np.int64)
                chunk_rows = np.asarray(sched.sample_chunks, np.int64)
                if (chunk_rows[1:] > chunk_rows[:-1]).all():  # no fork: rows as listed
                    sample_rows = last_index[chunk_rows]
                else:  # forked samples share their parent's row
                    unique, inverse = np.unique(chunk_rows, return_inverse=True)
                    sample_rows = last_index[unique]
                    sample_inverse = inverse.reshape(-1).astype(np.int64)
                sample_lens = seq_lens[chunk_rows]
            rows.record(sample_seqs, sample_slots, sample_lens)
        else:
            rows.record(None, _EMPTY, _EMPTY)
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=cu.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            pending_index=pending_index,
            pending_rows=pending_rows,
            last_index=last_index,
            copies=np.asarray(sched.copies, np.int64).reshape(-1, 2),
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
            sample_rows=sample_rows,
            sample_inverse=sample_inverse,
            sample_slots=sample_slots,
        )

    # ------------------------------------------------------------------ device side
    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A device copy of a host array that never makes the host wait for the device
        (fresh pinned staging + non-blocking copy on CUDA; shares memory on CPU). For uploads
        after the step's staging phase (the staging arena is reused by the next step)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def announce_replay(self, input_ids: torch.Tensor, inputs: StepInputs) -> None:
        """Called before a decode graph replays (tensor parallelism: rank 0 tells the other
        ranks); nothing to do on one rank."""

    def _upload_sampling(self, inputs: StepInputs) -> None:
        up = self.staging.upload
        self.sample_rows = up(inputs.sample_rows)
        self.sample_inverse = (None if inputs.sample_inverse is None
                               else up(inputs.sample_inverse))
        self.sample_slots = up(inputs.sample_slots)

    @torch.no_grad()
    def execute(self, inputs: StepInputs, prev_token_ids: torch.Tensor | None) -> torch.Tensor:
        """Runs the model; returns the final hidden states ``[T, hidden]``.

        ``prev_token_ids`` is the previous step's sampled ids on the device (needed when some
        inputs are PENDING). Also leaves the device copies of ``inputs.sample_rows`` /
        ``sample_inverse`` / ``sample_slots`` in ``self.sample_rows`` / ``self.sample_inverse``
        / ``self.sample_slots``.
        """
        if len(inputs.pending_index) and prev_token_ids is None:
            raise RuntimeError("pending decode inputs but no previous sampled ids")
        staging = self.staging
        staging.begin_uploads()
        hidden = None
        if self.graphs is not None and self.graphs.accepts(inputs):
            hidden = self.graphs.run(self, inputs, prev_token_ids)
        if hidden is None:
            hidden = self._execute_eager(inputs, prev_token_ids)
        if len(inputs.copies):
            copies = self.to_device(inputs.copies)
            self.kv_cache.copy_blocks(copies[:, 0], copies[:, 1])
        return hidden

    def _execute_eager(self, inputs: StepInputs, prev_token_ids: torch.Tensor | None
                       ) -> torch.Tensor:
        up = self.staging.upload
        input_ids = up(inputs.input_ids)
        if len(inputs.pending_index):
            index = up(inputs.pending_index)
            rows = up(inputs.pending_rows)
            input_ids = input_ids.clone() if input_ids.device.type == "cpu" else input_ids
            input_ids[index] = prev_token_ids[rows]
        positions = up(inputs.positions)
        metadata = AttentionMetadata(
            num_seqs=len(inputs.seq_lens),
            num_tokens=len(inputs.input_ids),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            query_start_loc=up(inputs.query_start_loc),
            seq_lens=up(inputs.seq_lens),
            block_tables=up(inputs.block_tables),
            slot_mapping=up(inputs.slot_mapping),
            positions=positions,
            query_start_loc_host=inputs.query_start_loc,
            seq_lens_host=inputs.seq_lens,
            block_tables_host=inputs.block_tables,
            block_size=self.block_size,
        )
        self._upload_sampling(inputs)
        ctx = StepContext(self.backend, metadata, self.backend.plan(metadata))
        self.staging.end_uploads()
        return self.forward(input_ids, positions, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        """The base model on packed ``[T]`` ids/positions -> hidden ``[T, hidden]``."""
        ctx.backend.begin_forward(ctx.plan)
        with self.fused.active() if self.fused is not None else nullcontext():
            out = self.loaded.base_model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                attention_mask=None,
                use_cache=False,
                **{STEP_KWARG: ctx},
            )
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own head path (LM head and every model-specific scaling after it, see
        ``actors.engine.model.lm_head``) on ``[R, hidden]`` rows -> ``[R, vocab]`` logits."""
        return self.loaded.head(hidden)[:, :self.vocab_size]
