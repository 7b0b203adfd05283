"""Host cost of an engine step: scheduling, input preparation and output processing, timed
per decode step at a large batch on a tiny model (the device work is negligible there, the
host work is what it is for any model size).

    python benchmarks/host_step_bench.py                       # batch 1024, both param mixes
    python benchmarks/host_step_bench.py --batch 256 --mix job
    python benchmarks/host_step_bench.py --mix top_p --waves   # + admissions, rows ending

Mixes: ``top_p`` (e2e_bench's: T 0.8, top-p 0.95, a seed per request), ``job``
(job_bench's per-row mix: greedy, top-p, top-k, min-p, seeds, logprobs 0/5/20) and
``structured`` (``top_p`` with every row under a regex of 200 lower-case letters or spaces,
so no row ends before its last token; ``--mix all`` runs it too). Prints the
median milliseconds per decode step of ``Scheduler.schedule``, ``ModelRunner.prepare`` and
``Engine._process`` (reading back a step's tokens and logprobs into the sequences); with the
structured mix also ``StructuredOutputs.step_mask`` (the step's masks: which rows take the
ahead fill's, the wait for them, none here, where the sampler takes longer than the fill) and
``StructuredOutputs.advance`` (the next fill's rows and plan).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def _job_row_params():
    spec = importlib.util.spec_from_file_location("job_rows", REPO / "benchmarks" / "job_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.row_params


def _time_calls(owner, name: str, record) -> None:
    """Wraps ``owner.name``: each call's seconds and arguments go to ``record``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            record(time.perf_counter() - t0, args)
    setattr(owner, name, wrapper)


def run(mix: str, batch: int, output_len: int, model: str) -> dict[str, float]:
    import torch

    from actors.engine.llm_engine import Engine
    from sampler import SamplingParams

    torch.set_num_threads(1)
    row_params = _job_row_params()
    engine = Engine(model, {"device": "cpu", "max_num_seqs": batch, "max_model_len": 64,
                            "max_num_batched_tokens": 32768, "num_kv_blocks": 4 * batch + 8,
                            "enable_prefix_caching": False})
    for i in range(batch):
        extra = row_params(i) if mix == "job" else {"temperature": 0.8, "top_p": 0.95, "seed": i}
        if mix == "structured":
            extra["structured_outputs"] = {"regex": "[a-z ]{200}"}
        engine.add_request(i, [(7 * i + j) % 400 + 10 for j in range(16)],
                           SamplingParams(max_tokens=output_len, ignore_eos=True,
                                          detokenize=False, **extra))
    timed = [(engine.scheduler, "schedule", "schedule"),
             (engine.executor.runner, "prepare", "prepare"), (engine, "_process", "process")]
    if mix == "structured":  # the stepping thread's own work for the masks
        timed += [(engine.structured, "step_mask", "step_mask"),
                  (engine.structured, "advance", "advance")]
    times: dict[str, list[float]] = {key: [] for _, _, key in timed}
    for owner, name, key in timed:
        _time_calls(owner, name, lambda seconds, args, key=key: times[key].append(seconds))
    errors = []
    while engine.has_unfinished_requests():
        errors += [out.error for out in engine.step() if out.error is not None]
    if errors:  # e.g. a constraint that did not compile: its rows measured nothing
        raise RuntimeError(f"{len(errors)} rows failed: {errors[0]}")
    # decode steps only: drop the prefill steps at the start and the draining ones at the end
    return {k: 1e3 * statistics.median(v[4:-2]) for k, v in times.items()}


def run_waves(batch: int, output_len: int, model: str) -> dict[str, float]:
    """The host work at a batch's two ends (e2e_bench's mix): 128-token prompts admitted 256
    to a 32,768-token step, and rows ending over four steps (``max_tokens`` ``output_len - i %
    4``). Medians of ``Engine._admit_to_sampler`` a step that admits and of ``Engine._process``
    a step where rows end, each also per sequence; and the host time from the batch handed in
    (``add_request`` a row) to the first step's launch (``first_launch_ms``)."""
    import torch
    from e2e_bench import frozen_heap

    from actors.engine.llm_engine import Engine
    from sampler import SamplingParams

    torch.set_num_threads(1)
    prompt_len = 128
    engine = Engine(model, {"device": "cpu", "max_num_seqs": batch,
                            "max_model_len": prompt_len + output_len,
                            "max_num_batched_tokens": 32768,
                            "num_kv_blocks": batch * ((prompt_len + output_len) // 16 + 2),
                            "enable_prefix_caching": False})
    # one-time costs (first calls, lazy imports) paid before the timed batch
    engine.generate([(f"warm{i}", [(5 * i + j) % 400 + 10 for j in range(prompt_len)],
                      SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False,
                                     temperature=0.8, top_p=0.95, seed=i)) for i in range(4)])
    step_s: dict[str, float] = {}

    def admitted(seconds: float, args: tuple) -> None:  # a step's sequences, or one of them
        step_s["_admit_to_sampler"] = step_s.get("_admit_to_sampler", 0.0) + seconds
        step_s["admitted"] = step_s.get("admitted", 0) + (
            len(args[0]) if isinstance(args[0], list) else 1)

    _time_calls(engine, "_admit_to_sampler", admitted)
    _time_calls(engine, "_process", lambda seconds, args: step_s.update(_process=seconds))
    launches: list[float] = []
    _time_calls(engine.executor, "launch_model", lambda seconds, args: launches.append(
        time.perf_counter() - seconds))
    admit, finish = [], []
    with frozen_heap():  # as e2e_bench's timed runs: no full collection inside the steps
        for i in range(batch):
            engine.add_request(i, [(7 * i + j) % 400 + 10 for j in range(prompt_len)],
                               SamplingParams(max_tokens=output_len - i % 4, ignore_eos=True,
                                              detokenize=False, temperature=0.8, top_p=0.95,
                                              seed=i))
        handed_in = time.perf_counter()
        while engine.has_unfinished_requests():
            step_s.clear()
            ended = len(engine.step())
            admitted = step_s.get("admitted", 0)
            if admitted:
                admit.append((step_s.get("_admit_to_sampler", 0.0), admitted))
            if ended:
                finish.append((step_s.get("_process", 0.0), ended))
    out = {"first_launch_ms": 1e3 * (launches[0] - handed_in)}
    for key, rows in (("admit", admit), ("finish", finish)):
        out[f"{key}_ms"] = 1e3 * statistics.median(t for t, _ in rows)
        out[f"{key}_us_per_seq"] = 1e6 * statistics.median(t / n for t, n in rows)
        out[f"{key}_steps"] = len(rows)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--mix", choices=("top_p", "job", "structured", "both", "all"),
                   default="both", help="both: top_p and job; all: the three")
    p.add_argument("--waves", action="store_true",
                   help="also the admissions of a prefill of 128-token prompts and the rows "
                        "ending over the last four steps (run_waves)")
    args = p.parse_args(argv)
    from toolkit.tiny_model import build_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "m", "qwen2", hidden_size=32,
                                     intermediate_size=64, num_attention_heads=2,
                                     num_key_value_heads=1))
        mixes = {"both": ("top_p", "job"), "all": ("top_p", "job", "structured")}
        for mix in mixes.get(args.mix, (args.mix,)):
            results[mix] = run(mix, args.batch, args.output_len, model)
            print(f"{mix:6} batch {args.batch}: " + ", ".join(
                f"{k} {v:.2f} ms" for k, v in results[mix].items()) + " per decode step",
                flush=True)
        if args.waves:
            w = results["waves"] = run_waves(args.batch, args.output_len, model)
            print(f"waves  batch {args.batch}: admission {w['admit_ms']:.2f} ms a prefill "
                  f"step ({w['admit_us_per_seq']:.1f} us a sequence), output processing "
                  f"{w['finish_ms']:.2f} ms a step where rows end ({w['finish_us_per_seq']:.1f} "
                  f"us a row), first launch {w['first_launch_ms']:.1f} ms after the batch was "
                  f"handed in", flush=True)
    return results


if __name__ == "__main__":
    main()
