"""Host cost of an engine step: scheduling, input preparation and output processing, timed
per decode step at a large batch on a tiny model (the device work is negligible there, the
host work is what it is for any model size).

    python benchmarks/host_step_bench.py                       # batch 1024, both param mixes
    python benchmarks/host_step_bench.py --batch 256 --mix job

Mixes: ``top_p`` (e2e_bench's: T 0.8, top-p 0.95, a seed per request), ``job``
(job_bench's per-row mix: greedy, top-p, top-k, min-p, seeds, logprobs 0/5/20) and
``structured`` (``top_p`` with every row under a regex of 200 lower-case letters or spaces,
so no row ends before its last token; ``--mix all`` runs it too). Prints the
median milliseconds per decode step of ``Scheduler.schedule``, ``ModelRunner.prepare`` and
``Engine._process`` (reading back a step's tokens and logprobs into the sequences).
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


def _job_row_params():
    spec = importlib.util.spec_from_file_location("job_bench", REPO / "benchmarks" / "job_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.row_params


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
    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "process": []}

    def timed(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times[key].append(time.perf_counter() - t0)
        setattr(owner, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.executor.runner, "prepare", "prepare")
    timed(engine, "_process", "process")
    errors = []
    while engine.has_unfinished_requests():
        errors += [out.error for out in engine.step() if out.error is not None]
    if errors:  # e.g. a constraint that did not compile: its rows measured nothing
        raise RuntimeError(f"{len(errors)} rows failed: {errors[0]}")
    # decode steps only: drop the prefill steps at the start and the draining ones at the end
    return {k: 1e3 * statistics.median(v[4:-2]) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--mix", choices=("top_p", "job", "structured", "both", "all"),
                   default="both", help="both: top_p and job; all: the three")
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
    return results


if __name__ == "__main__":
    main()
