"""Compiles the Triton kernel specialisations that the GPU kept-set test needs, in parallel
processes sharing Triton's on-disk cache, so that the test itself runs in seconds:

    python -m tests.sampler.prewarm_gpu_kernels          # 4 processes
    python -m pytest -m gpu tests/sampler/test_gpu_sampler.py

Each process runs the Triton pipeline on its share of the test's random batches (nothing is
checked here: the test checks).
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def run_share(start: int, stop: int) -> None:
    import torch

    from sampler.kernels.launcher import run_pipeline_triton
    from sampler.step_plan import make_plan
    from tests.sampler.test_gpu_sampler import DEV, kept_set_batches

    for _, sampler, slots, logits in kept_set_batches(start, stop):
        state = sampler.state
        state.flush()
        idx = torch.as_tensor(slots, dtype=torch.int64, device=DEV)
        thresholds = torch.empty(len(slots), device=DEV)
        run_pipeline_triton(logits, idx, state, make_plan(state, slots), inplace=False,
                            thresholds=thresholds)
    torch.cuda.synchronize()


def main() -> None:
    from tests.sampler.test_gpu_sampler import KEPT_SET_BATCHES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--share", type=int, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.share:
        run_share(*args.share)
        return
    step = -(-KEPT_SET_BATCHES // args.processes)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sampler.prewarm_gpu_kernels",
                               "--share", str(lo), str(min(lo + step, KEPT_SET_BATCHES))])
             for lo in range(0, KEPT_SET_BATCHES, step)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
