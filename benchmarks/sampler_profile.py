"""Device time of one sampler step, and per kernel, for diagnostic workloads (CUDA only).

Each argument is ``CASE:BATCH[:BACKEND[:p]]``: a workload of ``CASES`` (the `full` workload of
``sampler_bench.py`` and variants of it with parts left out, plus single features), the batch
size, the sampler_bench backend name (default ``triton``; ``triton@...`` variants too), and
``p`` to add a ``torch.profiler`` table of the step's kernels (device microseconds per step,
mean over 5 steps). A case named ``CASE+dense`` or ``CASE+sparse`` also gives every row a
grammar mask (structured outputs): 90% of the tokens allowed (a JSON string's body), or 16
tokens a row (between a schema's fields); ``CASE+ninf`` has no masks but 10% of the logits
at -inf, at random. Vocab 151,936, bf16 logits ``randn * 3``. Records go to
``$OUT/prof.json`` (or ``/tmp``):

    python benchmarks/sampler_profile.py full:256:triton:p full_nopen:256 gsl:256:triton:p
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.sampler_bench import _gpu_time_ms, _triton_variant, _workload  # noqa: E402
from sampler import AsyncOutput, Sampler, SamplingParams, derive_seed  # noqa: E402
from sampler.grammar_mask import StepBitmask  # noqa: E402
from sampler.ops.token_bitmask import pack_token_bitmask  # noqa: E402

V = 151936
# sampler_bench's `full` workload: its params (the fields it sets) and its bad words
_FULL = _workload("full", 0, V, random.Random(0))
_DEFAULTS = SamplingParams().to_dict()
FULL = {k: v for k, v in _FULL["params"].to_dict().items() if k != "seed" and v != _DEFAULTS[k]}
BAD_WORDS = _FULL["bad_words"]
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")
LISTS = ("min_tokens", "stop_token_ids", "logit_bias")


def _drop(params: dict, *keys: str) -> dict:
    return {k: v for k, v in params.items() if k not in keys}


# name -> (SamplingParams fields, bad words on, a 256-token prompt (penalties) on)
CASES: dict[str, tuple[dict, bool, bool]] = {
    "greedy": (dict(temperature=0.0), False, False),
    "gsl": (dict(temperature=0.0, logprobs=0), False, False),
    "full": (FULL, True, True),
    "full_nopen": (_drop(FULL, *PENALTIES), True, True),
    "full_nolist": (_drop(FULL, *LISTS), False, True),
    "full_noproc": (_drop(FULL, *PENALTIES, *LISTS), False, False),
    "full_nolp": (_drop(FULL, "logprobs"), True, True),
    "tk_lp": (dict(temperature=0.8, top_k=50, logprobs=20), False, False),
    "tk": (dict(temperature=0.8, top_k=50), False, False),
    "lp20": (dict(temperature=0.0, logprobs=20), False, False),
    "top_p": (dict(temperature=1.0, top_p=0.9), False, False),
    "e2e": (dict(temperature=0.8, top_p=0.95), False, False),
    "temp": (dict(temperature=0.8), False, False),
}


def grammar_masks(kind: str, batch: int, dev: torch.device) -> StepBitmask:
    """Every row's packed mask: ``dense`` 90% of the tokens allowed, ``sparse`` 16 a row."""
    g = torch.Generator().manual_seed(1)
    if kind == "dense":
        allowed = torch.rand(batch, V, generator=g) < 0.9
    elif kind == "sparse":
        allowed = torch.zeros(batch, V, dtype=torch.bool)
        allowed.scatter_(1, torch.randint(0, V, (batch, 16), generator=g), True)
    else:
        raise ValueError(f"mask kind {kind!r}: dense or sparse")
    return StepBitmask.build(pack_token_bitmask(allowed).to(dev), np.arange(batch), batch, dev)


def run(case: str, batch: int, variant: str, prof: bool) -> dict:
    _triton_variant(variant)
    case, _, kind = case.partition("+")
    params, bad, prompt = CASES[case]
    dev = torch.device("cuda")
    mask = grammar_masks(kind, batch, dev) if kind and kind != "ninf" else None
    sampler = Sampler(batch, V, device=dev, eos_token_ids=[0], max_logprobs=20,
                      backend="triton")
    rng = random.Random(batch)
    for slot in range(batch):
        sampler.add_request(
            slot, SamplingParams(**params),
            [rng.randrange(V) for _ in range(256)] if prompt else [1, 2, 3],
            seed=derive_seed(0, slot),
            bad_words_token_ids=BAD_WORDS if bad else ())
    slots = torch.arange(batch)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(batch, V, generator=g) * 3
    if kind == "ninf":  # no mask: 10% of the logits are -inf already
        src[torch.rand(batch, V, generator=g) < 0.1] = float("-inf")
    src = src.to(dev, torch.bfloat16)

    def step():  # (a masked step writes -inf over src's masked tokens: the same each time)
        return sampler.sample(src, slots, token_bitmask=mask)

    for _ in range(3):
        AsyncOutput(step()).get()
    t0 = time.perf_counter()
    for _ in range(5):
        AsyncOutput(step()).get()
    host = (time.perf_counter() - t0) / 5 * 1e3
    gpu = statistics.median(_gpu_time_ms(step, 10, dev, ahead_ms=max(1.0, 3 * host)))
    rec = {"case": case + ("+" + kind if kind else ""), "batch": batch, "variant": variant,
           "gpu_us": gpu * 1e3, "host_ms": host}
    if prof:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        kernels = {}
        for e in p.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                kernels[e.key[:60]] = round(t / 5, 1)
        rec["kernels_us"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:10])
    print(json.dumps(rec), flush=True)
    return rec


def main(argv: list[str]) -> int:
    out = Path(os.environ.get("OUT", "/tmp"))
    recs = []
    for spec in argv:
        parts = spec.split(":")
        case, batch = parts[0], int(parts[1])
        variant = parts[2] if len(parts) > 2 else "triton"
        try:
            recs.append(run(case, batch, variant, len(parts) > 3))
        except Exception as exc:  # report and go on with the next case
            print(json.dumps({"case": case, "batch": batch, "variant": variant,
                              "error": repr(exc)[:300]}), flush=True)
    (out / "prof.json").write_text(json.dumps(recs, indent=1))
    for r in recs:
        print(f"{r['case']:<12}{r['batch']:>6} {r['variant']:<24}{r['gpu_us']:>9.1f} us  "
              f"host {r['host_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
