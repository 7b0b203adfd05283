"""Startup of a job: how long ``raygen run`` takes before its actors generate.

Builds job_bench's model (Qwen2-0.5B-shaped random weights and a trained tokenizer, or
``tiny``) and a small input of its per-row mix, then runs the job through ``python -m
toolkit.cli run`` (the ``raygen`` entry point, a fresh local Ray each time) ``--repeats``
times and reports, per run, seconds from the command's start: the driver's shard plan
("shards planned"), the local Ray's start and "Ray ready", each actor's "ready" with the
startup report it logs (process age at ready, engine import and build phases), the first
ready less Ray ready (the actors' part, apart from Ray's start), the skew between the actors'
ready times, "job finished" and end to end (the process's exit: Ray's shutdown after the
job). Ray's own start is split by its session's logs (``ray_*``
fields, :func:`ray_timeline`): the GCS, the API server's first line (its imports done), the
raylet's start, its two agents' first lines, the raylet ready, the driver's and the first
worker's core worker.

``--trees A,B`` runs every repeat once with each checkout's code (its directory first on
``PYTHONPATH``, for the driver and the Ray workers alike), alternating, so two versions are
compared on the same stretch of a machine whose speed drifts; the default is this checkout.
The bytecode cache the actors keep (``actors.actor.cache_bytecode``) fills on a checkout's
first run, so compare the runs after it (``--repeats`` >= 2).

    source .carry/activate.sh; export PYTHONPATH=$PWD:$PYTHONPATH
    python3 benchmarks/startup_bench.py --out $OUT --num-actors 2 --gpus-per-actor 0.5 \\
        --repeats 3 --trees $PWD,$PWD/.carry/old
    python benchmarks/startup_bench.py --model-config tiny --device cpu --out /tmp/sb  # CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from job_bare import MODELS, load_e2e, save_text_tokenizer  # noqa: E402
from job_bench import job_config, write_yaml  # noqa: E402
from job_processes import log, run_cli_job  # noqa: E402
from job_rows import write_input  # noqa: E402

READY = re.compile(r"jobs\.dispatch: (actor-\d+) ready \(startup: (.*)\)\s*$")
PHASE = re.compile(r"([a-z_ ]+?) (-?[0-9.]+) s")
LOG_PATH = re.compile(r"^log:\s+(\S+)\s*$")
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")
# Ray's start, from the session's logs: (field, file glob, the line's text or None for the
# file's first line); of several files the earliest line counts. The raylet registers once
# both of its agents are up.
RAY_EVENTS = (
    ("ray_gcs_s", "gcs_server.out", None),
    ("ray_api_server_s", "dashboard.log", None),
    ("ray_raylet_start_s", "raylet.out", None),
    ("ray_dashboard_agent_s", "dashboard_agent.log", None),
    ("ray_runtime_env_agent_s", "runtime_env_agent.log", None),
    ("ray_raylet_ready_s", "raylet.out", "Raylet of id"),
    ("ray_driver_s", "python-core-driver-*.log", None),
    ("ray_first_worker_s", "python-core-worker-*.log", None),
)


def startup_phases(text: str) -> dict[str, float]:
    """``{"process age": 15.0, "engine import": 0.0, ...}`` from a "ready" line's report."""
    return {name.strip(): float(value) for name, value in PHASE.findall(text)}


def timeline(log: list[tuple[float, str]]) -> dict[str, Any]:
    """Seconds from the command's start to each startup event of one run's log."""
    out: dict[str, Any] = {"actors": {}}
    for t, line in log:
        if "shards planned" in line and "planned_s" not in out:
            out["planned_s"] = t
        elif "starting a local Ray" in line and "ray_start_s" not in out:
            out["ray_start_s"] = t
        elif "jobs.cluster: Ray ready in" in line and "ray_ready_s" not in out:
            out["ray_ready_s"] = t
        elif "jobs.runner: job finished" in line and "finished_s" not in out:
            out["finished_s"] = t
        elif (m := READY.search(line)) and m.group(1) not in out["actors"]:
            out["actors"][m.group(1)] = {"ready_s": t, **startup_phases(m.group(2))}
    ready = [a["ready_s"] for a in out["actors"].values()]
    out["first_ready_s"] = min(ready) if ready else None
    out["ready_skew_s"] = max(ready) - min(ready) if ready else None
    # the actors' own start, without Ray's (whose start varies by whole seconds)
    out["ray_to_ready_s"] = (out["first_ready_s"] - out["ray_ready_s"]
                             if ready and "ray_ready_s" in out else None)
    return out


def ray_timeline(logs: Path, started: float) -> dict[str, float]:
    """Seconds from ``started`` (the command's start, ``time.time()``) to each of Ray's
    startup events (``RAY_EVENTS``) found in the session's ``logs`` directory."""
    out: dict[str, float] = {}
    for field, pattern, text in RAY_EVENTS:
        stamps = [t for path in logs.glob(pattern) if (t := _stamp_of(path, text)) is not None]
        if stamps:
            out[field] = min(stamps) - started
    return out


def _stamp_of(path: Path, text: str | None) -> float | None:
    """The local time (``time.time()`` scale) of ``path``'s first line holding ``text`` (any
    line when None) and a timestamp."""
    try:
        with path.open(errors="replace") as f:
            for line in f:
                if text is not None and text not in line:
                    continue
                if m := STAMP.search(line):
                    when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
                    return when.timestamp() + int(m.group(2)) / 1000
    except OSError:
        return None
    return None


def session_logs(lines: list[tuple[float, str]]) -> Path | None:
    """The Ray session's log directory, from the job summary's ``log:`` line."""
    for _t, line in lines:
        if m := LOG_PATH.match(line.strip()):
            return Path(m.group(1)).parent
    return None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", choices=("qwen2-0.5b", "tiny"), default="qwen2-0.5b")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--num-actors", type=int, default=1)
    p.add_argument("--gpus-per-actor", type=float, default=1.0)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trees", default=str(REPO),
                   help="comma-separated checkouts whose code runs the job, alternating")
    p.add_argument("--text", action="store_true",
                   help="the model saved with the Qwen tokenizer, jobs detokenizing (job_bench's "
                        "--text): the tokenizer load of a real vocabulary counted in")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=".", help="directory for startup_bench.json")
    args = p.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",") if t]
    for tree in trees:
        if not (tree / "toolkit" / "cli.py").is_file():
            p.error(f"--trees: {tree} is no raygen checkout (no toolkit/cli.py)")
    spec_name, engine = MODELS[args.model_config]
    rows_per_shard = min(args.rows, engine["max_num_seqs"])
    shards = -(-args.rows // rows_per_shard)
    if shards < args.num_actors:  # the driver starts no more actors than there are shards
        log(f"{args.rows} rows make {shards} shard(s) of {rows_per_shard}: "
               f"{shards} of the {args.num_actors} actors start")
    settings = SimpleNamespace(model_config=args.model_config, prompt_len=128 if
                               args.model_config != "tiny" else 16, output_len=16,
                               max_num_seqs=0, max_batched_tokens=0, device=args.device,
                               gpus_per_actor=args.gpus_per_actor, rows_per_shard=rows_per_shard,
                               text=args.text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="startup_bench-") as tmp:
        work = Path(tmp)
        e2e = load_e2e()
        if args.device == "cpu":
            e2e.DEVICE = "cpu"
        spec = getattr(e2e, spec_name)
        t0 = time.perf_counter()
        model = e2e.build_model(spec, work / "model")
        if args.text:
            save_text_tokenizer(work / "model", spec["vocab_size"])
        del model  # the jobs' actors need the device memory, not this process
        gc.collect()
        import torch  # loaded already by e2e_bench

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log(f"model saved in {time.perf_counter() - t0:.1f} s")
        write_input(work / "input.parquet", args.rows, settings.prompt_len,
                       spec["vocab_size"])
        for r in range(args.repeats):
            for i, tree in enumerate(trees):
                name = f"t{i}_r{r + 1}"
                output = work / f"out-{name}"
                config = job_config(settings, work, output, args.num_actors, True)
                path = write_yaml(config, work / f"{name}.yaml")
                run = run_cli_job(name, path, output, args.timeout, repo=tree,
                                     keep_log=True)
                entry = {"tree": str(tree), "repeat": r + 1, "returncode": run["returncode"],
                         "end_to_end_s": run["end_to_end_s"], **timeline(run["log"])}
                if (logs := session_logs(run["log"])) is not None:
                    entry.update(ray_timeline(logs, run["started_wall"]))
                report["runs"].append(entry)
                (out / "startup_bench.json").write_text(json.dumps(report, indent=1))
    report["summary"] = summarize(report["runs"], trees)
    (out / "startup_bench.json").write_text(json.dumps(report, indent=1))
    print_summary(report)
    return report


def summarize(runs: list[dict], trees: list[Path]) -> dict[str, dict[str, float | None]]:
    """Per tree, the medians over its runs after its first (all runs when it ran once)."""
    summary = {}
    for tree in trees:
        mine = [r for r in runs if r["tree"] == str(tree)]
        later = mine[1:] or mine
        ages = [a.get("process age") for r in later for a in r["actors"].values()]
        summary[str(tree)] = {
            "runs": len(later),
            "planned_s": _median([r.get("planned_s") for r in later]),
            "ray_ready_s": _median([r.get("ray_ready_s") for r in later]),
            "first_ready_s": _median([r["first_ready_s"] for r in later]),
            "ray_to_ready_s": _median([r.get("ray_to_ready_s") for r in later]),
            "ready_skew_s": _median([r["ready_skew_s"] for r in later]),
            "process_age_at_ready_s": _median(ages),
            "finished_s": _median([r.get("finished_s") for r in later]),
            "end_to_end_s": _median([r["end_to_end_s"] for r in later]),
            **{field: _median([r.get(field) for r in later])
               for field, _, _ in RAY_EVENTS},
        }
    return summary


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def print_summary(report: dict) -> None:
    print("\nstartup_bench (seconds from the command's start; medians after each tree's first run)")
    for tree, s in report["summary"].items():
        cells = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in s.items() if v is not None)
        print(f"  {tree}: {cells}")
    for r in report["runs"]:
        actors = "; ".join(f"{a} ready {v['ready_s']:.1f} (age {v.get('process age')})"
                           for a, v in r["actors"].items())
        print(f"  {Path(r['tree']).name} #{r['repeat']}: planned {r.get('planned_s')}, "
              f"{actors}, end to end {r['end_to_end_s']:.1f}, rc {r['returncode']}")


if __name__ == "__main__":
    report = main()
    sys.exit(0 if all(r["returncode"] == 0 for r in report["runs"]) else 1)
