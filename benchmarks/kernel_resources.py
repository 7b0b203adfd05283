"""Registers and spills of the sampler's Triton kernels, compiled ahead of time for a GPU
architecture (no GPU needed: Triton's own ptxas and cuobjdump do the work).

    python benchmarks/kernel_resources.py                  # sm_90, the launch configs in use
    python benchmarks/kernel_resources.py --arch 80 --chunk-block 2048 --chunk-warps 8

Prints one line per kernel specialisation: registers per thread and the stack (spill) bytes
per thread that ``cuobjdump --dump-resource-usage`` reports. A kernel that needs more
registers than its warps get spills to local memory, which every pass then pays for.
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POINTERS = {
    "logits_ptr": "*bf16", "idx_ptr": "*i64", "fparams_ptr": "*fp32", "iparams_ptr": "*i64",
    "positions_ptr": "*i64", "pbits_ptr": "*i32", "pmask_ptr": "*u8", "counts_ptr": "*i32",
    "bias_ids_ptr": "*i64", "bias_vals_ptr": "*fp32", "stop_ids_ptr": "*i64", "ban_ptr": "*i64",
    "allowed_ptr": "*u8", "cand_ptr": "*i64", "tok_ptr": "*i64", "lp_ptr": "*fp32",
    "rank_ptr": "*i64", "topk_id_ptr": "*i64", "topk_val_ptr": "*fp32", "thr_ptr": "*fp32",
    "counter_ptr": "*i32", "part_ptr": "*fp32", "part_i_ptr": "*i32",
    "rec_ptr": "*fp32", "done_ptr": "*i32", "vtok_ptr": "*fp32",
    "tbits_ptr": "*i32", "lval_ptr": "*fp32", "lid_ptr": "*i32", "tval_ptr": "*fp32",
    "tid_ptr": "*i32", "proc_ptr": "*fp32", "scratch_ptr": "*i32",
    "arrive_ptr": "*i32", "gbits_ptr": "*i32", "grow_ptr": "*i32",
    "words_ptr": "*i64", "wlens_ptr": "*i64", "recent_ptr": "*i64", "r_counts_ptr": "*i32",
    "r_pbits_ptr": "*i32", "r_tbits_ptr": "*i32", "r_recent_ptr": "*i64",
}
ALIGNED_INTS = {"stride_row", "V", "CHUNK", "CAP", "TCAP", "KMAX"}
MASKS = dict(HAS_PEN=True, HAS_BIAS=True, HAS_STOP=True, HAS_BAN=True, HAS_ALLOWED=True)
NO_MASKS = {k: False for k in MASKS}
LIST_MASKS = {k: v for k, v in MASKS.items() if k != "HAS_ALLOWED"}  # kernels of listed ids


def resources(kernel, constants: dict, num_warps: int, arch: int) -> str:
    """``REG:n STACK:m`` of one specialisation."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = inspect.signature(kernel.fn).parameters
    # constexpr parameters left out take their defaults, as at a launch
    constants = {**{n: p.default for n, p in names.items()
                    if p.default is not inspect.Parameter.empty and n not in constants
                    and "constexpr" in str(p.annotation)},
                 **constants}
    signature = {n: POINTERS.get(n, "i32") for n in names if n not in constants}
    signature.update({k: "constexpr" for k in constants})
    # what the launcher specialises on at run time: 16-byte aligned pointers, and row strides,
    # the vocab size, chunk sizes and list capacities divisible by 16 (151,936 and 128,256
    # are; 32,000 is too)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n in signature and (signature[n].startswith("*") or (
                   n in ALIGNED_INTS and signature[n] != "constexpr"))}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "enable_fp_fusion": False})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "cuobjdump"
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return f"REG:{found[1]} STACK:{found[2]}" if found else text.strip()


def specialisations(args) -> list[tuple[str, object, dict, int]]:
    from sampler.kernels import rank, record
    from sampler.kernels.candidate_finish import _cand_finish_kernel
    from sampler.kernels.candidate_stats import _cand_stats_kernel
    from sampler.kernels.kernel_config import FIRST_BIN_WIDTH, MAX_PASSES, NUM_BINS, LaunchConfig
    from sampler.kernels.fused import _fused_sampler_kernel
    from sampler.kernels.launcher import cand_geometry
    from sampler.kernels.row_stats import _stats_kernel

    cfg = LaunchConfig()
    fused = dict(MASKS, ANY_LP=True, ANY_RANDOM=True, ANY_SEL=True, ANY_MASS=True, ANY_RK=True,
                 HIST=cfg.hist, SKIP=cfg.skip, BLOCK=cfg.block, VEC=cfg.vec, NP=NUM_BINS,
                 CAP=cfg.cap, MAX_PASSES=MAX_PASSES, W0=FIRST_BIN_WIDTH, SPLIT=False, NCP2=1,
                 FAST=cfg.fast, HAS_DONE=False)
    greedy = dict(NO_MASKS, ANY_RANDOM=False, ANY_SEL=False, ANY_MASS=False, ANY_RK=False)
    top_p = dict(fused, **NO_MASKS, ANY_LP=False, ANY_RK=False)  # e2e's and structured's mix
    block, warps = args.chunk_block, args.chunk_warps
    _chunk, _n, cg, cw = cand_geometry(cfg, 151936)
    cand = dict(BLOCK=cfg.cand_block, VEC=cfg.cand_vec, PREFETCH=cfg.prefetch, CG=cg,
                CELLCAP=cfg.cand_cellcap, CW=cw, GW=cfg.cand_gw)
    return [
        ("fused, full workload", _fused_sampler_kernel, fused, cfg.num_warps),
        ("fused, T + top-p", _fused_sampler_kernel, top_p, cfg.num_warps),
        ("fused, T + top-p, grammar masks", _fused_sampler_kernel,
         {**top_p, "HAS_GRAMMAR": True}, cfg.num_warps),
        ("fused, greedy + top-k logprobs", _fused_sampler_kernel,
         {**fused, **greedy, "ANY_RK": True}, cfg.num_warps),
        ("fused, greedy", _fused_sampler_kernel, {**fused, **greedy, "ANY_LP": False},
         cfg.num_warps),
        ("greedy split stats", _stats_kernel,
         dict(NO_MASKS, ANY_LP=True, ANY_RANDOM=False, BLOCK=block, VEC=cfg.vec), warps),
        ("rank", rank._chunk_rank_kernel, dict(BLOCK=cfg.cand_block), cfg.cand_warps),
        ("candidate stats, full", _cand_stats_kernel,
         dict(cand, HAS_TOUCH=True, ANY_LP=True, ANY_LIST=True), cfg.cand_warps),
        ("candidate stats, greedy + logprob", _cand_stats_kernel,
         dict(cand, HAS_TOUCH=False, ANY_LP=True, ANY_LIST=False), cfg.cand_warps),
        ("candidate stats, greedy step", _cand_stats_kernel,
         dict(cand, HAS_TOUCH=False, ANY_LP=True, ANY_LIST=False, FINISH=True, NCP2=8,
              RECORD=True), cfg.cand_warps),
        ("candidate finish, full", _cand_finish_kernel,
         dict(LIST_MASKS, HAS_TOUCH=True, ANY_LP=True, ANY_LIST=True, CAP=cfg.cand_cap,
              NCP2=16, NWP2=4, WLP2=4, TB=256, SMALL=128, MID=512), cfg.cand_finish_warps),
        ("candidate finish, greedy + logprob", _cand_finish_kernel,
         dict({k: False for k in LIST_MASKS}, HAS_TOUCH=False, ANY_LP=True, ANY_LIST=False,
              CAP=cfg.cand_cap, NCP2=16, NWP2=1, WLP2=1, TB=256, SMALL=128, MID=512,
              RECORD=True, R_RECENT=True,
              R_RWP2=4), cfg.cand_finish_warps),
        ("record", record._record_kernel,
         dict(R_COUNTS=True, R_TOUCH=True, R_RECENT=True, R_RWP2=4), 1),
    ]


def main(argv: list[str] | None = None) -> list[tuple[str, str]]:
    from sampler.kernels.kernel_config import LaunchConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    p.add_argument("--chunk-block", type=int, default=LaunchConfig().chunk_block)
    p.add_argument("--chunk-warps", type=int, default=LaunchConfig().chunk_warps)
    p.add_argument("--only", default="", help="names containing this text")
    args = p.parse_args(argv)
    rows = []
    for name, kernel, constants, warps in specialisations(args):
        if args.only and args.only not in name:
            continue
        usage = resources(kernel, constants, warps, args.arch)
        rows.append((name, usage))
        print(f"{name:34} {warps:2} warps  {usage}", flush=True)
    return rows


if __name__ == "__main__":
    main()
