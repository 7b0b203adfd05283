"""One step across the ranks: rank 0 packs the forward's inputs into one int64 tensor and
broadcasts it (after a header of its sizes); the other ranks unpack it into the same
``(input_ids, positions, AttentionMetadata)`` and run the same forward on their shard.

Packed layout (``[N]`` int64): input ids ``[T]`` (pending decode inputs already filled in from
the previous step's sampled ids on rank 0's device), positions ``[T]``, slot mapping ``[T]``,
query start offsets ``[B+1]``, sequence lengths ``[B]``, block tables ``[B * max_blocks]``,
page copies ``[C * 2]``. The header is ``[OP_STEP, T, B, max_blocks, max_query_len,
max_seq_len, C]``.

LM-head calls: the input embedding and the LM head are split over the vocabulary
(``actors.engine.parallel.vocab``), so every LM-head call is one all-gather of all ranks. Each
of rank 0's ``compute_logits`` calls (the sample rows of a step, each prompt-logprob chunk, any
later caller) first broadcasts ``[OP_LOGITS, R, hidden, dtype]`` and its ``[R, hidden]`` rows;
the other ranks project the same rows onto their vocabulary slice and join the gather. Rank 0
alone chooses the rows, so the ranks' calls match in number and order by construction (the
rows are few: the hidden states of sampled and scored positions).
"""

from __future__ import annotations

import numpy as np
import torch

from actors.engine.model.attention import AttentionMetadata, StepContext
from actors.engine.model.model_runner import ModelRunner, StepInputs
from actors.engine.parallel.comm import OP_LOGITS, OP_STEP, TPComm

_NO_COPIES = np.zeros((0, 2), np.int64)
_EMPTY = np.zeros(0, np.int64)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def send_step(comm: TPComm, input_ids: torch.Tensor, positions, slot_mapping,
              query_start_loc, seq_lens, block_tables, max_query_len: int, max_seq_len: int,
              copies: np.ndarray) -> None:
    """Rank 0: broadcasts one step's forward inputs (tensors or host arrays)."""
    parts = [input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
             np.ascontiguousarray(copies.reshape(-1))]
    parts = [torch.as_tensor(p) if isinstance(p, np.ndarray) else p for p in parts]
    num_blocks = parts[5].shape[1]
    packed = torch.cat([p.reshape(-1).to(comm.device, torch.int64) for p in parts])
    comm.send_header(OP_STEP, parts[0].shape[0], parts[4].shape[0], num_blocks,
                     max_query_len, max_seq_len, len(copies))
    comm.broadcast(packed)


def send_graph_step(comm: TPComm, input_ids: torch.Tensor, inputs: StepInputs) -> None:
    """Rank 0: a decode step that replays its graph (``input_ids``: the step's ids on the
    device, pending ones filled in)."""
    send_step(comm, input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
              inputs.seq_lens, inputs.block_tables, inputs.max_query_len, inputs.max_seq_len,
              inputs.copies)


def recv_step(comm: TPComm, header: list[int], device: torch.device, block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                         list[np.ndarray]]:
    """Ranks > 0: the step announced by ``header``: ids, positions, metadata, copies, and the
    packed parts on the host (ids, positions, slots, ...: one copy back for all of them)."""
    _, T, B, num_blocks, max_query_len, max_seq_len, num_copies, _ = header
    sizes = [T, T, T, B + 1, B, B * num_blocks, 2 * num_copies]
    received = comm.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=comm.device))
    host = np.split(received.cpu().numpy(), np.cumsum(sizes)[:-1])
    packed = received.to(device)
    ids, positions, slots, qsl, seq_lens, tables, copies = torch.split(packed, sizes)
    qsl, seq_lens = qsl.to(torch.int32), seq_lens.to(torch.int32)
    tables = tables.to(torch.int32).reshape(B, num_blocks)
    metadata = AttentionMetadata(
        num_seqs=B, num_tokens=T, max_query_len=max_query_len, max_seq_len=max_seq_len,
        query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables, slot_mapping=slots,
        positions=positions, query_start_loc_host=host[3].astype(np.int32),
        seq_lens_host=host[4].astype(np.int32),
        block_tables_host=host[5].astype(np.int32).reshape(B, num_blocks),
        block_size=block_size)
    return ids, positions, metadata, copies.reshape(-1, 2), host


def send_logit_rows(comm: TPComm, hidden: torch.Tensor) -> None:
    """Rank 0: announces an LM-head call on ``hidden`` ``[R, hidden]`` (contiguous)."""
    comm.send_header(OP_LOGITS, hidden.shape[0], hidden.shape[1], _DTYPES.index(hidden.dtype))
    comm.broadcast(hidden)


def run_worker_logits(runner: ModelRunner, comm: TPComm, header: list[int]) -> None:
    """Ranks > 0: the announced rows through this rank's LM-head slice and its all-gather."""
    _, rows, width, dtype = header[:4]
    hidden = comm.broadcast(torch.empty(rows, width, dtype=_DTYPES[dtype], device=comm.device))
    runner.loaded.model.get_output_embeddings()(hidden.to(runner.device))


class TPModelRunner(ModelRunner):
    """Rank 0's runner: every forward of a step and every LM-head call is announced to the
    other ranks first (those run while ``comm.enabled`` is False, the load-time probes, stay
    local)."""

    comm: TPComm

    def execute(self, inputs: StepInputs, prev_token_ids: torch.Tensor | None
                ) -> torch.Tensor:
        self._copies = inputs.copies
        try:
            return super().execute(inputs, prev_token_ids)
        finally:
            self._copies = _NO_COPIES

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        if self.comm.enabled and not self.comm.capturing:
            m = ctx.metadata
            send_step(self.comm, input_ids, positions, m.slot_mapping, m.query_start_loc,
                      m.seq_lens, m.block_tables, m.max_query_len, m.max_seq_len,
                      getattr(self, "_copies", _NO_COPIES))
        return super().forward(input_ids, positions, ctx)

    def announce_replay(self, input_ids: torch.Tensor, inputs: StepInputs) -> None:
        """Called by the decode graphs before a replay: the other ranks replay theirs."""
        send_graph_step(self.comm, input_ids, inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.comm.enabled:
            hidden = hidden.contiguous()
            send_logit_rows(self.comm, hidden)
        return super().compute_logits(hidden)


def run_worker_step(runner: ModelRunner, comm: TPComm, header: list[int]) -> None:
    """Ranks > 0: runs the announced step's forward on this shard (a decode step in this
    rank's CUDA graph when it has one for the batch), then its page copies."""
    ids, positions, metadata, copies, host = recv_step(comm, header, runner.device,
                                                       runner.block_size)
    runner.staging.begin_uploads()
    graphs = runner.graphs
    if graphs is not None and metadata.max_query_len == 1 \
            and metadata.num_seqs <= graphs.max_batch:
        inputs = StepInputs(
            input_ids=host[0], positions=host[1],
            query_start_loc=metadata.query_start_loc_host, seq_lens=metadata.seq_lens_host,
            block_tables=metadata.block_tables_host,
            slot_mapping=host[2], pending_index=_EMPTY,
            pending_rows=_EMPTY, last_index=_EMPTY, copies=_NO_COPIES,
            max_query_len=1, max_seq_len=metadata.max_seq_len)
        if graphs.run(runner, inputs, None) is not None:
            _copy_pages(runner, copies)
            return
        runner.staging.begin_uploads()
    backend = runner.backend
    ctx = StepContext(backend, metadata, backend.plan(metadata))
    runner.staging.end_uploads()
    runner.forward(ids, positions, ctx)
    _copy_pages(runner, copies)


def _copy_pages(runner: ModelRunner, copies: torch.Tensor) -> None:
    if len(copies):
        runner.kv_cache.copy_blocks(copies[:, 0], copies[:, 1])
