"""The Triton backend of the sampling pipeline: builds the kernels' tables and launches them.

All-greedy steps of unprocessed logits without top logprobs are one launch of the candidate
path's statistics kernel; greedy and top-k rows take the candidate path
(:mod:`sampler.kernels.candidate_stats`, then :mod:`~sampler.kernels.candidate_finish`); the
fused kernel (:mod:`sampler.kernels.fused`) takes the others and the rows the path leaves;
other all-greedy steps run the greedy split (pass 1 over vocab chunks, then the fused kernel).
Same contract as :func:`sampler.pipeline.run_pipeline`. Batches that ask for what the kernels
do not compute (processed logprobs modes, whole-vocab logprobs, more top-k logprobs than the
candidate list, fp64 noise) run on the torch path; the choice is made on the host from the step
plan, without a device sync. A step with grammar masks and no logprobs writes -inf over its
masked tokens first (one pass over the constrained rows) and then runs as an unmasked step;
one with logprobs (whose raw values must be the model's) runs with ``HAS_GRAMMAR``: it skips the
candidate path and the one-launch greedy step, and the fused kernel and the greedy split's
pass 1 apply the masks on the tiles they read.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import triton

from sampler.kernels.candidate_finish import _cand_finish_kernel
from sampler.kernels.candidate_stats import PART_WIDTH, _cand_stats_kernel
from sampler.kernels.kernel_config import (FIRST_BIN_WIDTH, MAX_CAP, MAX_PASSES, NUM_BINS,
                                           REC_WIDTH, LaunchConfig, launch_config, placeholder)
from sampler.kernels.fused import _fused_sampler_kernel
from sampler.kernels.rank import _chunk_rank_kernel
from sampler.kernels.record import record_kwargs, record_sampled_triton
from sampler.kernels.row_stats import _stats_kernel
from sampler.kernels.tables import kernel_tables
from sampler.kernels.token_bitmask_kernel import apply_token_bitmask_triton
from sampler.pipeline import PROCESSED_LOGITS, PROCESSED_LOGPROBS, run_pipeline
from sampler.sampler_output import SamplerOutput
from sampler.step_plan import StepPlan

logger = logging.getLogger(__name__)


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
            (a vocab slice of a padded tensor is fine). Modified only by a step with grammar
            masks and no logprobs, with ``inplace``: its masked tokens become -inf.
        idx_mapping: ``[rows]`` int64 on the logits' device, the slot of each row.
        state: the flushed :class:`~sampler.state.SamplerState`.
        plan: the host-side predicates of this batch.
        inplace: whether the logits may be written: then a step with grammar masks and no
            logprobs (whose raw values nothing reads) writes -inf over its masked tokens in
            one pass first, and its kernels read no mask.
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
        :class:`~sampler.sampler_output.SamplerOutput` on the device.
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
    if plan.do_grammar and inplace and not plan.any_logprobs:
        mask = state.token_bitmask
        apply_token_bitmask_triton(logits, mask.bits, mask.rows)
        plan = replace(plan, do_grammar=False)
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
    # the step's kernels record the sampled ids in the state themselves
    record = dict(record_kwargs(state, dev), RECORD=True) if record_rows is not None else None
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
                 ANY_LP=plan.any_logprobs, ANY_RANDOM=plan.any_random)
    tables = (t.pbits, t.pmask, t.counts, t.bias_ids, t.bias_vals, t.nbias, t.stop_ids, t.nstop,
              t.bans, t.nban, t.allowed, t.gbits, t.grow, t.gw)
    head = (logits, logits.stride(0), vocab, t.W, idx_mapping, state.fparams,
            state.fparams.stride(0), state.iparams, state.iparams.stride(0), state.positions)
    nchunk = 1
    part = placeholder(dev, torch.float32)  # read only with SPLIT / HAS_DONE, set below
    part_i = done = placeholder(dev, torch.int32)
    split = False  # pass 1 ran as _stats_kernel: the fused kernel combines its chunks
    block, warps = cfg.block, cfg.num_warps  # the fused kernel's launch
    has_done = False
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
    elif cfg.greedy_split and not plan.any_random and k == 0:
        split = True  # the greedy split: small programs for both kernels
        block, warps = cfg.chunk_block, cfg.chunk_warps
        chunk = max(block, cfg.chunk // block * block)
        nchunk = triton.cdiv(vocab, chunk)
        part = torch.empty(rows, nchunk, 8, dtype=torch.float32, device=dev)
        part_i = torch.empty(rows, nchunk, dtype=torch.int32, device=dev)
        _stats_kernel[(rows, nchunk)](*head, *tables, part, part_i, nchunk, chunk, **flags,
                                      BLOCK=block, VEC=cfg.vec, PREFETCH=cfg.prefetch,
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
        MAX_PASSES=MAX_PASSES, W0=FIRST_BIN_WIDTH, SPLIT=split,
        NCP2=triton.next_power_of_2(nchunk), FAST=cfg.fast and thresholds is None,
        HAS_DONE=has_done, PREFETCH=cfg.prefetch, **(record or {}),
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
    return (cfg.greedy_one and cfg.cand
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
    may be eligible for it, the step is not all-greedy without top logprobs (the greedy
    split's kernels are faster there), and it carries no grammar masks (the candidate
    kernels do not read them: the fused kernel applies them on its tiles)."""
    greedy_split = cfg.greedy_split and not plan.any_random and plan.max_num_logprobs == 0
    return (cfg.cand and not greedy_split and not plan.do_grammar
            and plan.min_select_k <= cfg.cand_kmax)


def _run_candidates(cfg: LaunchConfig, plan: StepPlan, k: int, kout: int, rows: int, vocab: int,
                    dev, state, logits, idx_mapping, bans, tok, lp, rank, topk_ids, topk_vals,
                    thr, record: dict | None) -> tuple[torch.Tensor, bool]:
    """The candidate path's two kernels (:mod:`sampler.kernels.candidate_stats`, then
    :mod:`~sampler.kernels.candidate_finish`); returns the per-row ``done`` flags
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
