"""CUDA graphs for pure-decode steps, one per batch-size bucket.

Each bucket ``b`` captures the whole base-model forward (``begin_forward`` + every layer) over
static device buffers: ``input_ids[:b]``, ``positions[:b]``, ``slot_mapping[:b]`` and the
attention backend's static page tables. A step of ``B <= b`` sequences uploads its arrays into
those buffers, pads rows ``B..b-1`` (token 0 at position 0, KV written to a scratch page that
no sequence owns, one-token attention over that page), re-plans the backend's bucket wrappers
and replays; the LM head and the sampler run outside the graph on ``hidden[:B]``. Prefill and
mixed steps, and decode batches above the largest bucket, run eagerly. With tensor
parallelism every rank captures the same buckets: over NCCL the all-reduces are inside the
graph; over gloo (ranks sharing a GPU) the graph is captured in pieces between them and the
replay runs each sum between two pieces. Rank 0 announces each replay to the other ranks.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from actors.engine.model.attention import AttentionMetadata, StepContext
from actors.engine.model.attention.csr import build_csr

logger = logging.getLogger(__name__)


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ..., 64, then every 32 up to 256, every 64 up to 512, every 128 beyond,
    and ``max_batch`` itself."""
    sizes = {b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch}
    for step, stop in ((32, 256), (64, 512), (128, max_batch)):
        start = max(sizes) if sizes else 0
        sizes.update(range(start + step, min(stop, max_batch) + 1, step))
    sizes.add(max_batch)
    return sorted(sizes)


class DecodeGraphs:
    """Captured decode graphs of one model runner.

    Args:
        runner: the model runner (its backend must support graphs).
        buckets: batch sizes to capture.
        scratch_page: a KV page outside the block manager's range (padding rows write it).
    """

    def __init__(self, runner, buckets: list[int], scratch_page: int):
        self.runner = runner
        self.backend = runner.backend
        self.buckets = sorted(buckets)
        self.max_batch = self.buckets[-1]
        self.scratch_page = scratch_page
        device = runner.device
        m = self.max_batch
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((m,), scratch_page * runner.block_size,
                                       dtype=torch.int64, device=device)
        # per bucket: [(graph piece, tensor all-reduced after it or None)]
        self._graphs: dict[int, list] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._plans: dict[int, object] = {}
        self._fallbacks = 0
        self.num_replays = 0
        self.max_pages = 0  # set by capture (a re-capture after wake-up reuses it)

    # ------------------------------------------------------------------ capture
    @torch.no_grad()
    def capture(self, max_pages: int) -> None:
        """Captures every bucket, largest first, into one shared memory pool."""
        runner, backend = self.runner, self.backend
        comm = getattr(runner, "comm", None)  # tensor parallel: this rank's collectives
        self.max_pages = max_pages
        backend.prepare_graphs(self.max_batch, max_pages)
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.buckets):
            plan = backend.graph_plan(b, self.slot_mapping[:b], self.scratch_page)
            ctx = StepContext(backend, self._dummy_metadata(b), plan)
            ids, pos = self.input_ids[:b], self.positions[:b]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), _alone(comm):  # warm-up outside the capture
                runner.forward(ids, pos, ctx)
            torch.cuda.current_stream().wait_stream(stream)
            pieces, out = _capture(lambda: runner.forward(ids, pos, ctx), pool, comm)
            self._graphs[b], self._outputs[b], self._plans[b] = pieces, out, plan
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batch %d..%d) in %.1f s", len(self.buckets),
                    self.buckets[0], self.max_batch, time.perf_counter() - t0)

    def _dummy_metadata(self, b: int) -> AttentionMetadata:
        device = self.runner.device
        one = np.ones(b, np.int32)
        return AttentionMetadata(
            num_seqs=b, num_tokens=b, max_query_len=1, max_seq_len=1,
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(b, dtype=torch.int32, device=device),
            block_tables=torch.full((b, 1), self.scratch_page, dtype=torch.int32,
                                    device=device),
            slot_mapping=self.slot_mapping[:b], positions=self.positions[:b],
            query_start_loc_host=np.arange(b + 1, dtype=np.int32), seq_lens_host=one,
            block_tables_host=np.full((b, 1), self.scratch_page, np.int32),
            block_size=self.runner.block_size)

    # ------------------------------------------------------------------ replay
    def accepts(self, inputs) -> bool:
        """Whether a step runs as a graph (one token per sequence, batch within a bucket)."""
        return inputs.max_query_len == 1 and len(inputs.seq_lens) <= self.max_batch

    def bucket_for(self, batch: int) -> int:
        return self.buckets[int(np.searchsorted(self.buckets, batch))]

    def run(self, runner, inputs, prev_token_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Uploads the step into the static buffers, re-plans, replays; returns
        ``hidden[:B]`` (None if the backend's plan left the captured layout: run eagerly)."""
        n = len(inputs.seq_lens)
        b = self.bucket_for(n)
        up = runner.staging.upload
        pad = b - n
        if pad:
            scratch = self.scratch_page * runner.block_size
            ids = np.concatenate([inputs.input_ids, np.zeros(pad, np.int64)])
            pos = np.concatenate([inputs.positions, np.zeros(pad, np.int64)])
            slots = np.concatenate([inputs.slot_mapping, np.full(pad, scratch, np.int64)])
        else:
            ids, pos, slots = inputs.input_ids, inputs.positions, inputs.slot_mapping
        csr = build_csr(inputs.seq_lens, inputs.block_tables, runner.block_size, pad_to=b,
                        scratch_page=self.scratch_page)
        if not self.backend.update_graph_plan(self._plans[b], csr):
            self._fallbacks += 1
            if self._fallbacks == 1:
                logger.warning("decode graph of batch %d: plan layout changed; running "
                               "eagerly", b)
            return None
        up(ids, self.input_ids[:b])
        up(pos, self.positions[:b])
        up(slots, self.slot_mapping[:b])
        index = rows = None
        if len(inputs.pending_index):
            index = up(inputs.pending_index)
            rows = up(inputs.pending_rows)
        runner._upload_sampling(inputs)
        runner.staging.end_uploads()
        if index is not None:
            self.input_ids.index_copy_(0, index, prev_token_ids.index_select(0, rows))
        runner.announce_replay(self.input_ids[:n], inputs)
        comm = getattr(runner, "comm", None)
        for graph, reduce in self._graphs[b]:
            graph.replay()
            if reduce is not None:  # a gloo all-reduce between two pieces
                comm.all_reduce(reduce)
        self.num_replays += 1
        return self._outputs[b][:n]


def _alone(comm):
    """A forward of this rank alone (no collective, no message): the capture's warm-up."""
    return comm.local() if comm is not None else contextlib.nullcontext()


def _capture(forward, pool, comm) -> tuple[list, torch.Tensor]:
    """``forward`` captured as ``[(graph, tensor to all-reduce after it or None)]`` and its
    output: one graph, with the all-reduces of NCCL inside; over gloo (host collectives) a
    piece per stretch between two all-reduces, the sums run by the replay."""
    if comm is None or comm.graph_all_reduce:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), \
                (comm.capture() if comm is not None else contextlib.nullcontext()):
            out = forward()
        return [(graph, None)], out
    pieces: list = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool)

        def split(tensor: torch.Tensor) -> None:
            nonlocal graph
            graph.capture_end()
            pieces.append((graph, tensor))
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool)

        with comm.capture(split):
            out = forward()
        graph.capture_end()
        pieces.append((graph, None))
    torch.cuda.current_stream().wait_stream(side)
    return pieces, out
