"""The model of a benchmark job and the bare engine over the job's rows, in a child process:
the same rows (the job's own reader, so identical params and derived seeds) and engine
options as the job's actors, after the warm-up an actor runs, timed over the whole batch.

    python benchmarks/job_bare.py --config job.yaml --bare-result r.json \
        --bare-tokens t.parquet --model-config tiny --device cpu        # what job_bench runs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from job_processes import T0, child_env, log  # noqa: E402
from job_rows import ROW_PARAMS  # noqa: E402

# model config name: (e2e_bench spec name, engine options). The KV pool is sized exactly
# (every sequence at full length), so the bare engine and each actor get the same one.
MODELS = {
    "qwen2-0.5b": ("QWEN2_05B", {"max_num_seqs": 1024, "max_num_batched_tokens": 32768}),
    "tiny": ("TINY", {"max_num_seqs": 32, "max_num_batched_tokens": 2048}),
}


def save_text_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """``--text``: a model whose vocabulary the saved 512-token tokenizer cannot spell gets
    the Qwen tokenizer (``bench_vocab.save_qwen_tokenizer``) in its place."""
    if vocab_size <= 512:
        return
    from bench_vocab import save_qwen_tokenizer  # (the benchmarks directory is on the path)

    save_qwen_tokenizer(model_dir)


def load_e2e():
    spec = importlib.util.spec_from_file_location("e2e_bench", REPO / "benchmarks" / "e2e_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bare_stage(args) -> None:
    """Child process: build the model, then run the bare engine over the job's rows."""
    import gc

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from actors.engine.llm_engine import Engine
    from actors.engine.profiling import LoopProfile
    from actors.contract.shard_io import read_rows, row_ids
    from actors.rows import prepare_requests
    from jobs.config import JobConfig
    from jobs.sources import discover
    from jobs.plan import Shard, make_task
    from jobs.runner import engine_options
    from jobs.storage import resolve

    e2e = load_e2e()
    if args.device == "cpu":
        e2e.DEVICE = "cpu"
    config = JobConfig.from_yaml(args.config)
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if not (Path(config.model) / "config.json").exists():  # a repeat reuses the model
        model_spec = getattr(e2e, MODELS[args.model_config][0])
        e2e.build_model(model_spec, Path(config.model))
        if args.text:
            save_text_tokenizer(Path(config.model), model_spec["vocab_size"])
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        log(f"bare: model saved in {time.perf_counter() - t0:.1f} s")
    build_s = time.perf_counter() - t0

    spec = discover(config)
    task = make_task(Shard(0, 0, 0, spec.total_rows), 1, spec, config, resolve(config.output))
    table = read_rows(task)
    ids, values, id_errors = row_ids(task, table)
    requests, failed = prepare_requests(task, table, values, id_errors)
    assert not failed, list(failed.values())[:3]
    t0 = time.perf_counter()
    engine = Engine(config.model, engine_options(config))
    load_s = time.perf_counter() - t0
    if cuda:  # what an actor does before its first shard
        engine.warm_up()
        torch.cuda.synchronize()
    else:
        engine.generate([(f"w{i}", prompt[:16], params.replace(max_tokens=8))
                         for i, (_, prompt, params) in enumerate(requests[:len(ROW_PARAMS)])])
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in engine.startup.items())
    log(f"bare: engine loaded in {load_s:.1f} s ({phases}), warmed up; generating "
        f"{len(requests)} rows")
    profile = LoopProfile("bare")  # RAYGEN_PROFILE_DIR: as the actors' engine loop
    with e2e.frozen_heap():  # as the actors after startup
        t0 = time.perf_counter()
        before = engine.counters.snapshot()
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        outputs = []
        profile.start()
        while engine.has_unfinished_requests():
            outputs.extend(engine.step())
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        spent = engine.counters.since(before)
    profile.dump()
    from actors.engine import profiling

    if profiling.trace is not None:  # RAYGEN_TRACE_DIR: the bare run's steps, as the actors'
        profiling.span("batch", time.time() - elapsed, len(requests))
        profiling.trace.dump()
    tokens = sum(o.num_output_tokens for o in outputs)
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    outputs.sort(key=lambda o: index[o.id])
    pq.write_table(pa.table({
        "id": pa.array([values[index[o.id]] for o in outputs], pa.string()),
        "output_token_ids": pa.array([list(o.output_token_ids) for o in outputs],
                                     pa.list_(pa.int32()))}), args.bare_tokens)
    info = engine.info()
    result = {"build_model_s": build_s, "load_s": load_s, "load_phases_s": engine.startup,
              "elapsed_s": elapsed, "steps": spent.steps, "busy_s": spent.busy_s,
              "device_wait_s": spent.device_wait_s, "cpu_s": spent.cpu_s,
              "rows": len(outputs), "output_tokens": tokens, "output_tok_s": tokens / elapsed,
              "attention_backend": info.get("attention_backend"),
              "cuda_graphs": info.get("cuda_graphs"), "sampler_backend": engine.sampler.backend,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    Path(args.bare_result).write_text(json.dumps(result, indent=1))
    per_step = 1e3 / max(spent.steps, 1)
    log(f"bare: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:,.0f} output tok/s "
        f"({spent.steps} steps: {spent.busy_s * per_step:.1f} ms a step, host "
        f"{(spent.busy_s - spent.device_wait_s) * per_step:.1f} (on a CPU "
        f"{spent.cpu_s * per_step:.1f}), waiting for the device "
        f"{spent.device_wait_s * per_step:.1f})")


def run_bare(args, work: Path, config_path: Path, repeat: int = 0) -> dict:
    """One bare-engine child process (a repeat reuses the saved model)."""
    result, tokens = work / f"bare{repeat}.json", work / f"bare_tokens{repeat}.parquet"
    cmd = [sys.executable, str(Path(__file__).resolve()),
           "--config", str(config_path), "--bare-result", str(result),
           "--bare-tokens", str(tokens), "--model-config", args.model_config,
           "--device", args.device] + (["--text"] if args.text else [])
    # the thread count a num_cpus=1 Ray actor gets (Ray sets OMP_NUM_THREADS=1 in it); more
    # threads than free cores make a CPU engine ~10x slower on a busy 2-core box
    env = {**child_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "JOB_BENCH_T0": repr(T0)}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, timeout=args.timeout)
    return {**json.loads(result.read_text()), "tokens_file": str(tokens)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the job's YAML")
    p.add_argument("--bare-result", required=True, help="where the run's figures go (JSON)")
    p.add_argument("--bare-tokens", required=True, help="where its output ids go (Parquet)")
    p.add_argument("--model-config", choices=sorted(MODELS), default="qwen2-0.5b")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--text", action="store_true", help="the Qwen tokenizer with the model")
    bare_stage(p.parse_args(argv))


if __name__ == "__main__":
    main()
