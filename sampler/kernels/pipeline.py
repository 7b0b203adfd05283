"""The Triton backend of the sampling pipeline: builds the kernels' tables and launches them
(the candidate path, :mod:`sampler.kernels.candidates`, for the greedy and top-k rows it
takes; the fused kernel, :mod:`sampler.kernels.fused`, for the others and the rows the path
leaves; all-greedy steps of unprocessed logits without top logprobs as one launch of the
candidate path's statistics kernel; the chunked pipeline or the greedy split where
configured).

Same contract as :func:`sampler.pipeline.run_pipeline`. Batches that ask for something the
fused kernel does not compute (processed logprobs modes, whole-vocab logprobs, more top-k
logprobs than its candidate list, fp64 noise) run on the torch path instead; the choice is
made on the host from the step plan, without a device sync.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton

from sampler.kernels.chunked import (DRAW_ACTIVE, REC_WIDTH, _chunk_bounds_kernel,
                                     _chunk_draw_combine_kernel, _chunk_draw_kernel,
                                     _chunk_finish_kernel, _chunk_gather_kernel,
                                     _chunk_rank_kernel)
from sampler.kernels.candidates import PART_WIDTH, _cand_finish_kernel, _cand_stats_kernel
from sampler.kernels.fused import _fused_sampler_kernel, _stats_kernel
from sampler.kernels.record import record_kwargs, record_sampled_triton
from sampler.ops.bad_words import PAD_ANY
from sampler.output import SamplerOutput
from sampler.pipeline import PROCESSED_LOGITS, PROCESSED_LOGPROBS, run_pipeline
from sampler.plan import StepPlan

logger = logging.getLogger(__name__)

MAX_CAP = 1024  # longest candidate list (top-k / top-p boundary, top-k logprobs)
NUM_BINS = 16
MAX_PASSES = 48  # bound on refinement passes; typical rows need 2-6
FIRST_BIN_WIDTH = 0.5


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Tile size and warps of the fused kernel (per vocab size; tunable by the benchmark)."""

    block: int = 4096
    num_warps: int = 16
    cap: int = 256
    vec: int = 8
    hist: bool = True  # bin counts through tl.histogram (else per-lane sums)
    skip: bool = True  # the full sampling pass skips tiles with nothing kept
    split: int = 0  # > 0: pass 1 runs as a separate kernel over vocab chunks of this size
    fast: bool = True  # top-k alone / top-p alone: draw over the min-p survivors, then verify
    # the chunked pipeline (sampler.kernels.chunked) first, the fused kernel only for the rows
    # it leaves unsettled: vocab chunks of `chunk` tokens, tiles of `chunk_block`, `lanes`
    # lane maxima kept per chunk for the top-k bounds
    chunked: bool = False
    chunk: int = 16384
    chunk_block: int = 1024
    chunk_warps: int = 4
    lanes: int = 64
    draw_rounds: int = 6  # chunked draw-then-verify: verification rounds after the first draw
    # all-greedy steps without top-k logprobs: pass 1 over vocab chunks of `chunk` tokens
    # (tiles of `chunk_block`, `chunk_warps` warps), then the fused kernel at that size only
    # combines them (token, logprob, rank); off: the fused kernel alone
    greedy_split: bool = True
    # all-greedy steps of unprocessed logits without top-k logprobs: one launch (the candidate
    # path's statistics kernel, whose last program of a row finishes it); before the greedy
    # split and the candidate path
    greedy_one: bool = True
    # > 1: the row-pass loops of the fused kernel (statistics, draws, verification) are
    # software-pipelined this deep (tile loads run ahead into shared memory)
    stages: int = 1
    # the row-pass loops request the logits of the tile this many iterations ahead (0, 1, 2)
    # before processing the current one
    prefetch: int = 1
    # the candidate path (sampler.kernels.candidates) for greedy rows and rows with top-k (and
    # top logprobs) up to `cand_kmax`, the fused kernel only for the other rows and the rows
    # it leaves: vocab chunks of `cand_chunk` tokens read in tiles of `cand_block` by
    # `cand_warps` warps (`cand_vec` tokens a thread and tile row), candidate lists of
    # `cand_cap` entries (a power of two), touched lists of `cand_tcap`
    cand: bool = True
    cand_chunk: int = 32768
    cand_block: int = 1024
    cand_warps: int = 4
    cand_vec: int = 8
    cand_cap: int = 1024
    cand_tcap: int = 4096
    cand_kmax: int = 64
    cand_finish_warps: int = 4
    # statistics kernel: selected cells a chunk (more: the row falls back), touch words
    # expanded at a time
    cand_cellcap: int = 256
    cand_gw: int = 32


_config_override: LaunchConfig | None = None


def set_launch_config(config: LaunchConfig | None) -> None:
    """Forces a launch config (benchmarks sweep it); None restores the default choice."""
    global _config_override
    _config_override = config


def launch_config(vocab: int) -> LaunchConfig:
    if _config_override is not None:
        return _config_override
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter runs every op in Python
        return LaunchConfig(block=min(4096, max(64, triton.next_power_of_2(vocab))),
                            num_warps=4, cap=64, cand_chunk=1024, cand_block=256, cand_vec=4,
                            cand_cap=512, cand_tcap=256)
    return LaunchConfig()


@dataclass(slots=True)
class KernelTables:
    """Device tables of one step, with 1-element dummies for steps that do not run."""

    W: int
    pbits: torch.Tensor
    pmask: torch.Tensor
    counts: torch.Tensor
    bias_ids: torch.Tensor
    bias_vals: torch.Tensor
    nbias: int
    stop_ids: torch.Tensor
    nstop: int
    bans: torch.Tensor
    nban: int
    allowed: torch.Tensor
    gbits: torch.Tensor  # the step's grammar masks [num_masked, gw] int32
    grow: torch.Tensor  # [rows] int32, each row's mask (-1: none)
    gw: int


def compute_bad_word_bans(idx_mapping: torch.Tensor, state) -> torch.Tensor:
    """``[rows, max_words]`` int64: the last token of each bad word whose prefix matches the
    row's recent output tokens, else -1 (same rule as :func:`sampler.ops.apply_bad_words`)."""
    words = state.word_tokens[idx_mapping]  # [rows, W, L]
    lens = state.word_lens[idx_mapping]
    max_len = words.shape[-1]
    last = words[..., -1]
    if max_len > 1:
        recent = state.recent_tokens
        window = recent[idx_mapping][:, None, recent.shape[1] - (max_len - 1):]
        prefix = words[..., :-1]
        matched = ((prefix == window) | (prefix == PAD_ANY)).all(dim=-1)
    else:
        matched = torch.ones_like(last, dtype=torch.bool)
    matched &= lens > 0
    return torch.where(matched, last, -1).contiguous()


_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 1-element zero tensor standing for a table that the launched specialisation never
    reads or writes (made once per device and dtype: no fill kernel per step)."""
    key = (device, dtype)
    tensor = _PLACEHOLDERS.get(key)
    if tensor is None:
        tensor = _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return tensor


def kernel_tables(state, plan: StepPlan, idx_mapping: torch.Tensor,
                  bans: torch.Tensor | None = None) -> KernelTables:
    """Collects the state's tables for a launch (no copies of the large tables)."""
    dev = idx_mapping.device
    i64 = placeholder(dev, torch.int64)
    if plan.do_penalties:
        pbits, counts = state.penalty_bits, state.output_counts
        pmask = state.prompt_mask.view(torch.uint8)
    else:
        pbits = placeholder(dev, torch.int32)
        counts = pbits
        pmask = placeholder(dev, torch.uint8)
    if plan.do_bad_words and bans is None:
        bans = compute_bad_word_bans(idx_mapping, state)
    if not plan.do_bad_words:
        bans = i64
    allowed = state.allowed_mask.view(torch.uint8) if plan.do_allowed else pmask
    if plan.do_grammar:
        mask = state.token_bitmask
        gbits, grow, gw = mask.bits, mask.row_map, mask.bits.shape[1]
    else:
        gbits = grow = placeholder(dev, torch.int32)
        gw = 1
    return KernelTables(
        W=(state.vocab_size + 31) // 32, pbits=pbits, pmask=pmask, counts=counts,
        bias_ids=state.bias_ids, bias_vals=state.bias_values, nbias=state.bias_ids.shape[1],
        stop_ids=state.stop_ids, nstop=state.stop_ids.shape[1],
        bans=bans, nban=bans.shape[1] if plan.do_bad_words else 0, allowed=allowed,
        gbits=gbits, grow=grow, gw=gw,
    )


def supports(plan: StepPlan, precision: str) -> bool:
    """Whether the fused kernel computes everything this step asks for."""
    return (
        precision == "fp32"
        and PROCESSED_LOGPROBS not in plan.modes
        and PROCESSED_LOGITS not in plan.modes
        and plan.max_num_logprobs <= min(MAX_CAP, launch_config(1).cap)
    )


_fallback_logged = False


def run_pipeline_triton(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    state,
    plan: StepPlan,
    *,
    inplace: bool,
    precision: str = "fp32",
    thresholds: torch.Tensor | None = None,
    scratch: dict | None = None,
    record_rows: tuple | None = None,
) -> SamplerOutput:
    """Samples one token per row with the Triton kernels (module docstring).

    Args:
        logits: ``[rows, vocab]`` float32/bf16/fp16; the vocab dimension must have stride 1
            (a vocab slice of a padded tensor is fine). Never modified.
        idx_mapping: ``[rows]`` int64 on the logits' device, the slot of each row.
        state: the flushed :class:`~sampler.state.SamplerState`.
        plan: the host-side predicates of this batch.
        inplace: accepted for the torch path's contract (the kernel never writes logits).
        precision: Gumbel noise precision; "fp64" runs the torch path.
        thresholds: optional ``[rows]`` float32 output: each random row's kept-set threshold
            (keep t iff processed logit / T >= threshold), for tests; asking for it turns the
            draw-then-verify path off (that path never computes the threshold).
        record_rows: ``(rows_host,)`` (the batch's host slots, or None) to record the step's
            sampled ids in the state as :meth:`~sampler.state.SamplerState.record_sampled`
            does, in the step's last kernel where it can (the stateful Sampler's case).
        scratch: optional dict that receives the kernel's candidate lists and counters, and
            ``cand_done``, the candidate path's per-row flags (1 / 2: settled there, 0: left
            to the fused kernel), when that path ran (debugging aid, tests).

    Returns:
        :class:`~sampler.output.SamplerOutput` on the device.
    """
    global _fallback_logged
    if not supports(plan, precision):
        if not _fallback_logged:
            _fallback_logged = True
            logger.info("sampler: a step needs processed/whole-vocab logprobs or fp64 noise; "
                        "such steps run on the torch path")
        out = run_pipeline(logits, idx_mapping, state, plan, inplace=inplace,
                           precision=precision)
        if record_rows is not None:
            record_sampled_triton(state, idx_mapping, out.token_ids, record_rows[0])
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    dev = logits.device
    k = plan.max_num_logprobs
    kout = max(k, 1)
    tok = torch.empty(rows, dtype=torch.int64, device=dev)
    lp = torch.empty(rows, dtype=torch.float32, device=dev)
    rank = torch.empty(rows, dtype=torch.int64, device=dev)
    topk_ids = torch.empty(rows, kout, dtype=torch.int64, device=dev)
    topk_vals = torch.empty(rows, kout, dtype=torch.float32, device=dev)
    cfg = launch_config(vocab)
    thr = thresholds if thresholds is not None else torch.empty(rows, dtype=torch.float32,
                                                                 device=dev)
    if rows == 0:
        return SamplerOutput(token_ids=tok)
    chunked = cfg.chunked
    # the step's kernels record the sampled ids in the state themselves (not the chunked
    # pipeline: its rank kernel runs after the fused kernel's)
    record = (dict(record_kwargs(state, dev), RECORD=True)
              if record_rows is not None and not chunked else None)
    if greedy_one(cfg, plan):
        _run_greedy_one(cfg, plan, rows, vocab, dev, state, logits, idx_mapping, tok, lp, rank,
                        thr, record)
        return _finish(plan, k, tok, lp, rank, topk_ids, topk_vals, state, idx_mapping,
                       record_rows, record is not None)
    on_cand = use_candidates(cfg, plan)
    bans = None  # on the candidate path the finish kernel writes the bad-word bans
    if on_cand and plan.do_bad_words:
        bans = torch.empty(rows, state.word_tokens.shape[1], dtype=torch.int64, device=dev)
    t = kernel_tables(state, plan, idx_mapping, bans)
    flags = dict(HAS_PEN=plan.do_penalties, HAS_BIAS=plan.do_logit_bias,
                 HAS_STOP=plan.do_min_tokens, HAS_BAN=plan.do_bad_words,
                 HAS_ALLOWED=plan.do_allowed, HAS_GRAMMAR=plan.do_grammar,
                 ANY_LP=plan.any_logprobs,
                 ANY_RANDOM=plan.any_random)
    tables = (t.pbits, t.pmask, t.counts, t.bias_ids, t.bias_vals, t.nbias, t.stop_ids, t.nstop,
              t.bans, t.nban, t.allowed, t.gbits, t.grow, t.gw)
    head = (logits, logits.stride(0), vocab, t.W, idx_mapping, state.fparams,
            state.fparams.stride(0), state.iparams, state.iparams.stride(0), state.positions)
    nchunk = 1
    part = placeholder(dev, torch.float32)  # read only with SPLIT / HAS_DONE, set below
    part_i = done = placeholder(dev, torch.int32)
    split = False  # pass 1 ran as _stats_kernel: the fused kernel combines its chunks
    block, warps = cfg.block, cfg.num_warps  # the fused kernel's launch
    has_done = chunked
    if on_cand:
        done, left = _run_candidates(
            cfg, plan, k, kout, rows, vocab, dev, state, logits, idx_mapping, bans, tok, lp,
            rank, topk_ids, topk_vals, thr, record)
        if scratch is not None:
            scratch["cand_done"] = done
        if not left:  # every row settles on the candidate path
            return _finish(plan, k, tok, lp, rank, topk_ids, topk_vals, state, idx_mapping,
                           record_rows, True)
        has_done = True
    elif chunked:
        nchunk, ran = _run_chunked(cfg, head, tables, flags, plan, k, kout, rows, vocab, dev,
                                   state, logits, idx_mapping, tok, lp, rank, topk_ids,
                                   topk_vals, thr, draw=cfg.fast and thresholds is None)
        part, part_i, done = ran.part, ran.part_i, ran.flags
        if not plan.any_random and k == 0:  # greedy rows without top-k lists always settle
            return _finish(plan, k, tok, lp, rank, topk_ids, topk_vals, state, idx_mapping,
                           record_rows, False)
    elif cfg.split > 0 or (cfg.greedy_split and not plan.any_random and k == 0):
        split = True
        size = cfg.split
        if size <= 0:  # the greedy split: small programs for both kernels
            block, warps, size = cfg.chunk_block, cfg.chunk_warps, cfg.chunk
        chunk = max(block, size // block * block)
        nchunk = triton.cdiv(vocab, chunk)
        part = torch.empty(rows, nchunk, 8, dtype=torch.float32, device=dev)
        part_i = torch.empty(rows, nchunk, dtype=torch.int32, device=dev)
        _stats_kernel[(rows, nchunk)](*head, *tables, part, part_i, nchunk, chunk, part, 1,
                                      **flags, BLOCK=block, VEC=cfg.vec, LANES=False,
                                      STAGES=cfg.stages, PREFETCH=cfg.prefetch,
                                      num_warps=warps, enable_fp_fusion=False)
    cand = torch.empty(rows, 2 * cfg.cap, dtype=torch.int64, device=dev)
    # candidate-list counters: only the selection and top-k logprob passes use them
    counters = (torch.zeros(rows, 2, dtype=torch.int32, device=dev)
                if plan.do_top_k or plan.do_top_p or k > 0 else placeholder(dev, torch.int32))
    _fused_sampler_kernel[(rows,)](
        logits, logits.stride(0), vocab, t.W,
        idx_mapping, state.fparams, state.fparams.stride(0), state.iparams,
        state.iparams.stride(0), state.positions,
        *tables, cand, counters, part, part_i, nchunk, tok, lp, rank, topk_ids, topk_vals,
        kout, thr, done, **flags,
        ANY_SEL=plan.do_top_k or plan.do_top_p, ANY_MASS=plan.do_top_p, ANY_RK=k > 0,
        HIST=cfg.hist, SKIP=cfg.skip, BLOCK=block, VEC=cfg.vec, NP=NUM_BINS, CAP=cfg.cap,
        MAX_PASSES=MAX_PASSES, W0=FIRST_BIN_WIDTH, SPLIT=chunked or split,
        NCP2=triton.next_power_of_2(nchunk), FAST=cfg.fast and thresholds is None,
        HAS_DONE=has_done, STAGES=cfg.stages, PREFETCH=cfg.prefetch, **(record or {}),
        num_warps=warps,
        # no fused multiply-adds: bin edges computed per element and per row round alike
        # (as under the interpreter), so a token on an edge never falls between two bins
        enable_fp_fusion=False,
    )
    if scratch is not None:
        scratch.update(cand=cand, counters=counters, cap=cfg.cap)
    return _finish(plan, k, tok, lp, rank, topk_ids, topk_vals, state, idx_mapping,
                   record_rows, record is not None)


def _finish(plan: StepPlan, k: int, tok, lp, rank, topk_ids, topk_vals, state, idx_mapping,
            record_rows, recorded: bool) -> SamplerOutput:
    """The step's output; with ``record_rows`` the sampled ids recorded in the state (by
    the record kernel unless a kernel of the step did it)."""
    if record_rows is not None:
        record_sampled_triton(state, idx_mapping, tok, record_rows[0], launched=recorded)
    return _output(plan, k, tok, lp, rank, topk_ids, topk_vals)


def cand_geometry(cfg: LaunchConfig, vocab: int) -> tuple[int, int, int, int]:
    """(chunk, chunks a row, tiles a cell, touch words a chunk as a power of two) of the
    candidate statistics kernel: chunks are whole tiles; a cell is a lane's tokens in a
    power-of-two number of tiles, at most ``cand_vec`` cells a lane and chunk."""
    chunk = max(cfg.cand_block, cfg.cand_chunk // cfg.cand_block * cfg.cand_block)
    cg = triton.next_power_of_2(triton.cdiv(chunk // cfg.cand_block, cfg.cand_vec))
    return chunk, triton.cdiv(vocab, chunk), cg, triton.next_power_of_2(chunk // 32)


def greedy_one(cfg: LaunchConfig, plan: StepPlan) -> bool:
    """Whether a step is one launch (:func:`_run_greedy_one`, a kernel of the candidate path,
    so not with that path off): every row greedy, nothing changes the logits, no top-k
    logprobs."""
    return (cfg.greedy_one and cfg.cand and not cfg.chunked and cfg.split <= 0
            and not plan.any_random and not plan.mutates and plan.max_num_logprobs == 0)


def _run_greedy_one(cfg: LaunchConfig, plan: StepPlan, rows: int, vocab: int, dev, state,
                    logits, idx_mapping, tok, lp, rank, thr, record: dict | None) -> None:
    """The candidate statistics kernel alone, each row finished by its last chunk program
    (``FINISH``; with ``record``, the record keyword arguments, it also advances the
    slots)."""
    chunk, nchunk, _cg, _cw = cand_geometry(cfg, vocab)
    i32, f32 = placeholder(dev, torch.int32), placeholder(dev, torch.float32)
    part = torch.empty(rows, nchunk, PART_WIDTH.value, dtype=torch.float32, device=dev)
    part_i = torch.empty(rows, nchunk, dtype=torch.int32, device=dev)
    _cand_stats_kernel[(rows, nchunk)](
        logits, logits.stride(0), vocab, (vocab + 31) // 32, idx_mapping, state.fparams,
        state.fparams.stride(0), state.iparams, state.iparams.stride(0), i32, part, part_i,
        nchunk, chunk, cfg.cand_kmax, f32, i32, i32, f32, i32, 1, 1, i32,
        arrive_ptr=state.arrivals, positions_ptr=state.positions, tok_ptr=tok, lp_ptr=lp,
        rank_ptr=rank, thr_ptr=thr, FINISH=True, NCP2=triton.next_power_of_2(nchunk),
        **(record or {}), HAS_TOUCH=False, ANY_LP=plan.any_logprobs, ANY_LIST=False,
        BLOCK=cfg.cand_block, VEC=cfg.cand_vec, PREFETCH=cfg.prefetch, CG=1,
        CELLCAP=cfg.cand_cellcap, CW=1, GW=cfg.cand_gw, num_warps=cfg.cand_warps,
        enable_fp_fusion=False)


def use_candidates(cfg: LaunchConfig, plan: StepPlan) -> bool:
    """Whether a step runs the candidate path (unless :func:`greedy_one` takes it): some row
    may be eligible for it, and the step is not all-greedy without top logprobs (the greedy
    split's kernels are faster there)."""
    greedy_split = cfg.greedy_split and not plan.any_random and plan.max_num_logprobs == 0
    return (cfg.cand and not cfg.chunked and not greedy_split and not plan.do_grammar
            and plan.min_select_k <= cfg.cand_kmax)


def _run_candidates(cfg: LaunchConfig, plan: StepPlan, k: int, kout: int, rows: int, vocab: int,
                    dev, state, logits, idx_mapping, bans, tok, lp, rank, topk_ids, topk_vals,
                    thr, record: dict | None) -> tuple[torch.Tensor, bool]:
    """The kernels of :mod:`sampler.kernels.candidates`; returns the per-row ``done`` flags
    and whether some row may be left to the fused kernel (ineligible, or a list that can
    overflow or fall short). ``record``: the record keyword arguments
    (:func:`sampler.kernels.record.record_kwargs` with ``RECORD``: the finish kernel then
    records the rows it settles), or None. ``bans``:
    ``[rows, words]`` int64 that the finish kernel fills with the bad-word bans (None
    without bad words)."""
    chunk, nchunk, cg, cw = cand_geometry(cfg, vocab)
    any_list = plan.any_random or k > 0
    has_touch = (plan.do_penalties or plan.do_logit_bias or plan.do_min_tokens
                 or plan.do_bad_words)
    i64, i32, f32 = (placeholder(dev, d) for d in (torch.int64, torch.int32, torch.float32))
    part = torch.empty(rows, nchunk, PART_WIDTH.value, dtype=torch.float32, device=dev)
    part_i = torch.empty(rows, nchunk, dtype=torch.int32, device=dev)
    counters = torch.zeros(rows, 2, dtype=torch.int32, device=dev)
    cap = cfg.cand_cap
    # candidate and touched lists: raw values and ids (and the touched candidates' processed
    # values)
    lval, lid, proc = (f32, i32, f32)
    if any_list:
        lval, lid, proc = (torch.empty(rows, cap, dtype=d, device=dev)
                           for d in (torch.float32, torch.int32, torch.float32))
    tval, tid = ((torch.empty(rows, cfg.cand_tcap, dtype=d, device=dev) for d in
                  (torch.float32, torch.int32)) if has_touch else (f32, i32))
    tbits = state.touch_bits if has_touch else i32
    params = (idx_mapping, state.fparams, state.fparams.stride(0), state.iparams,
              state.iparams.stride(0))
    # the scratch holds a chunk's selected cells, then its nonzero touch words
    scratch = (torch.empty(rows, nchunk, cfg.cand_cellcap + cw, dtype=torch.int32, device=dev)
               if any_list or has_touch else i32)
    _cand_stats_kernel[(rows, nchunk)](
        logits, logits.stride(0), vocab, (vocab + 31) // 32, *params, tbits, part, part_i,
        nchunk, chunk, cfg.cand_kmax, lval, lid, counters, tval, tid, cap, cfg.cand_tcap,
        scratch, HAS_TOUCH=has_touch, ANY_LP=plan.any_logprobs, ANY_LIST=any_list,
        BLOCK=cfg.cand_block, VEC=cfg.cand_vec, PREFETCH=cfg.prefetch, CG=cg,
        CELLCAP=cfg.cand_cellcap, CW=cw, GW=cfg.cand_gw,
        num_warps=cfg.cand_warps, enable_fp_fusion=False)
    nw = wl = rw = 1
    words = wlens = recent = i64
    if plan.do_bad_words:
        words, wlens, recent = state.word_tokens, state.word_lens, state.recent_tokens
        nw, wl, rw = words.shape[1], words.shape[2], recent.shape[1]
    if plan.do_penalties:
        pbits, counts, pmask = (state.penalty_bits, state.output_counts,
                                state.prompt_mask.view(torch.uint8))
    else:
        pbits, counts, pmask = i32, i32, placeholder(dev, torch.uint8)
    done = torch.empty(rows, dtype=torch.int32, device=dev)
    vtok = torch.empty(rows, dtype=torch.float32, device=dev)
    rec = torch.empty(rows, REC_WIDTH.value, dtype=torch.float32, device=dev)
    every_row = plan.max_select_k <= cfg.cand_kmax and not plan.do_allowed
    left = not every_row or any_list or has_touch
    # with `record` the finish kernel records the rows it settles (the fused kernel, after
    # it, the others: each reads and advances only its own rows' slots)
    small = min(cap, max(128, triton.next_power_of_2(kout)))  # the finish kernel's sorts
    _cand_finish_kernel[(rows,)](
        logits, logits.stride(0), vocab, (vocab + 31) // 32, *params, state.positions,
        pbits, pmask, counts, state.bias_ids, state.bias_values, state.bias_ids.shape[1],
        state.stop_ids, state.stop_ids.shape[1], words, wlens, nw, wl, recent, rw,
        i64 if bans is None else bans, part, part_i, nchunk, cfg.cand_kmax, lval, lid, proc,
        counters, tval, tid, cfg.cand_tcap, tok, lp, rank, topk_ids, topk_vals, kout, thr, done,
        vtok, rec, **(record or {}),
        HAS_PEN=plan.do_penalties, HAS_BIAS=plan.do_logit_bias, HAS_STOP=plan.do_min_tokens,
        HAS_BAN=plan.do_bad_words, HAS_TOUCH=has_touch, ANY_LP=plan.any_logprobs,
        ANY_LIST=any_list, CAP=cap, SMALL=small, MID=max(small, min(512, cap)),
        NCP2=triton.next_power_of_2(nchunk),
        NWP2=triton.next_power_of_2(nw), WLP2=triton.next_power_of_2(wl),
        TB=min(256, cfg.cand_tcap), num_warps=cfg.cand_finish_warps, enable_fp_fusion=False)
    # a greedy row of unprocessed logits samples the raw maximum: rank 1, no count
    if plan.any_logprobs and (plan.any_random or plan.mutates):
        _chunk_rank_kernel[(rows, nchunk)](logits, logits.stride(0), vocab, *params, rec, done,
                                           vtok, rank, chunk, BLOCK=cfg.cand_block,
                                           num_warps=cfg.cand_warps, enable_fp_fusion=False)
    return done, left


def _output(plan: StepPlan, k: int, tok, lp, rank, topk_ids, topk_vals) -> SamplerOutput:
    if not plan.any_logprobs:
        return SamplerOutput(token_ids=tok)
    return SamplerOutput(tok, lp, rank, topk_ids if k else None, topk_vals if k else None)


@dataclass(slots=True)
class _Chunked:
    part: torch.Tensor
    part_i: torch.Tensor
    flags: torch.Tensor


def _run_chunked(cfg: LaunchConfig, head, tables, flags, plan: StepPlan, k: int, kout: int,
                 rows: int, vocab: int, dev, state, logits, idx_mapping, tok, lp, rank,
                 topk_ids, topk_vals, thr, *, draw: bool) -> tuple[int, _Chunked]:
    """Steps 1-5 of :mod:`sampler.kernels.chunked`; returns the chunk count and the chunk
    partials (the fused kernel's pass 1 for the rows left to it) with the per-row flags.
    ``draw``: run the draw-then-verify rounds for random rows without top-k (else they are
    left to the fused kernel)."""
    chunk = max(cfg.chunk_block, cfg.chunk // cfg.chunk_block * cfg.chunk_block)
    nchunk = triton.cdiv(vocab, chunk)
    km = min(cfg.lanes, cfg.chunk_block // cfg.vec)
    part = torch.empty(rows, nchunk, 8, dtype=torch.float32, device=dev)
    part_i = torch.empty(rows, nchunk, dtype=torch.int32, device=dev)
    lanes = torch.empty(rows, nchunk, 2, km, dtype=torch.float32, device=dev)
    rec = torch.empty(rows, REC_WIDTH.value, dtype=torch.float32, device=dev)
    best = torch.empty(rows, dtype=torch.int32, device=dev)
    cand = torch.empty(rows, 2 * cfg.cap, dtype=torch.int64, device=dev)
    counters = torch.zeros(rows, 2, dtype=torch.int32, device=dev)
    done = torch.empty(rows, dtype=torch.int32, device=dev)
    vtok = torch.empty(rows, dtype=torch.float32, device=dev)
    small = dict(num_warps=cfg.chunk_warps, enable_fp_fusion=False)
    # lane maxima only feed the top-k bounds (random rows' top-k, top-k logprobs)
    _stats_kernel[(rows, nchunk)](*head, *tables, part, part_i, nchunk, chunk, lanes, km,
                                  **flags, BLOCK=cfg.chunk_block, VEC=cfg.vec,
                                  LANES=plan.any_random or k > 0, **small)
    params = (idx_mapping, state.fparams, state.fparams.stride(0), state.iparams,
              state.iparams.stride(0))
    _chunk_bounds_kernel[(rows,)](part, part_i, lanes, nchunk, km, rec, best, *params, vocab,
                                  NCP2=triton.next_power_of_2(nchunk),
                                  NL=triton.next_power_of_2(nchunk * km), **small)
    any_rk = k > 0
    masks = {f: flags[f] for f in ("HAS_PEN", "HAS_BIAS", "HAS_STOP", "HAS_BAN", "HAS_ALLOWED",
                                   "HAS_GRAMMAR")}
    if plan.any_random or any_rk:
        _chunk_gather_kernel[(rows, nchunk)](
            *head, *tables, rec, cand, counters, chunk, **masks, ANY_RANDOM=plan.any_random,
            ANY_RK=any_rk, BLOCK=cfg.chunk_block, VEC=cfg.vec, CAP=cfg.cap, **small)
    draw = draw and plan.any_random and not plan.all_top_k
    draw_f = draw_i = rec  # not read without draws
    if draw:
        draw_f = torch.empty(rows, 2, dtype=torch.float32, device=dev)  # (value of x, mass Z)
        draw_i = torch.full((rows, 2), DRAW_ACTIVE.value, dtype=torch.int32,
                            device=dev)  # (x, state)
        dpart = torch.empty(rows, nchunk, 4, dtype=torch.float32, device=dev)
        dpart_i = torch.empty(rows, nchunk, dtype=torch.int32, device=dev)
        ncp2 = triton.next_power_of_2(nchunk)
        for r in range(cfg.draw_rounds + 1):
            first, last = r == 0, r == cfg.draw_rounds
            _chunk_draw_kernel[(rows, nchunk)](
                *head, *tables, rec, draw_f, draw_i, dpart, dpart_i, nchunk, chunk, **masks,
                FIRST=first, BLOCK=cfg.chunk_block, VEC=cfg.vec, **small)
            _chunk_draw_combine_kernel[(rows,)](
                *params, vocab, draw_f, draw_i, dpart, dpart_i, nchunk, FIRST=first,
                LAST=last, NCP2=ncp2, **small)
    _chunk_finish_kernel[(rows,)](
        logits, logits.stride(0), vocab, *params, state.positions, rec, best, cand, counters,
        draw_f, draw_i, tok, lp, rank, topk_ids, topk_vals, kout, thr, done, vtok,
        ANY_LP=plan.any_logprobs, ANY_RANDOM=plan.any_random, ANY_RK=any_rk, CAP=cfg.cap,
        DRAW=draw, **small)
    # a greedy row of unprocessed logits samples the raw maximum: rank 1, no count
    if plan.any_logprobs and (plan.any_random or plan.mutates):
        _chunk_rank_kernel[(rows, nchunk)](logits, logits.stride(0), vocab, *params, rec, done,
                                           vtok, rank, chunk, BLOCK=cfg.chunk_block, **small)
    return nchunk, _Chunked(part, part_i, done)
