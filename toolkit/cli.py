"""The ``raygen`` command: ``run``, ``run-batch``, ``submit``, ``status``, ``list``, ``stop``,
``demo``.

    raygen run job.yaml [--set sampling_params.max_tokens=64 --set num_actors=4] [--output D]
    raygen run-batch -i in.jsonl -o out.jsonl --model M      # OpenAI Batch files
    raygen submit job.yaml --address http://127.0.0.1:8265 [--wait]
    raygen status JOB_ID | raygen list | raygen stop JOB_ID   (--address, --token)
    raygen demo [--output demo-out]

A run prints its progress and summary; details go to a log file (its path is printed) and,
with ``-v`` / ``--log-level``, to the terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from typing import Any

EXIT_ERROR = 1
_LEVELS = ("debug", "info", "warning", "error")


def _level(args: argparse.Namespace) -> int:
    if args.log_level:
        return getattr(logging, args.log_level.upper())
    return logging.INFO if args.verbose else logging.WARNING


def _config_data(args: argparse.Namespace) -> dict[str, Any]:
    """The job config of ``run`` / ``submit``: the YAML file with the command line's
    overrides (``--set``, ``--model``, ``--input``, ``--output``) applied."""
    from jobs.config import apply_overrides, read_yaml

    sets = list(args.set or [])
    for key in ("model", "input", "output"):
        value = getattr(args, key, None)
        if value is not None:
            sets.append(f"{key}={_yaml_string(value)}")
    return apply_overrides(read_yaml(args.config), sets)


def _yaml_string(value: str) -> str:
    import json

    return json.dumps(value)  # a JSON string is YAML: kept a string whatever it spells


def _cmd_run(args: argparse.Namespace) -> int:
    from jobs.runner import run_job

    result = run_job(_config_data(args), progress=not args.no_progress)
    print(result.summary())
    _print_log_path(args)
    return 0


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from toolkit.batch import run_batch

    overrides = list(args.set or [])
    result = run_batch(args.input, args.output, args.model, num_actors=args.num_actors,
                       num_gpus_per_actor=args.num_gpus_per_actor, overrides=overrides,
                       progress=not args.no_progress)
    print(result.summary())
    _print_log_path(args)
    return 0


def _print_log_path(args: argparse.Namespace) -> None:
    log = getattr(args, "log_handler", None)
    if log is not None:
        print(f"log:     {log.path}")


def _auth(exc: Exception) -> None:
    from toolkit.submit import AuthTokenError

    if isinstance(exc, AuthTokenError):
        exc.option = "--token"


def _cmd_submit(args: argparse.Namespace) -> int:
    from toolkit.submit import job_status, submit_job

    job_id = submit_job(_config_data(args), args.address, token=args.token, job_id=args.job_id)
    print(job_id)
    if not args.wait:
        return 0
    while True:
        status = job_status(job_id, args.address, token=args.token)
        if status.finished:
            break
        time.sleep(2)
    print(status.logs, end="" if status.logs.endswith("\n") else "\n")
    print(f"{job_id}: {status.status}" + (f" ({status.message})" if status.message else ""))
    return 0 if status.status == "SUCCEEDED" else EXIT_ERROR


def _cmd_status(args: argparse.Namespace) -> int:
    from toolkit.submit import job_status

    status = job_status(args.job_id, args.address, token=args.token)
    print(f"{status.job_id}: {status.status}" + (f" ({status.message})" if status.message
                                                 else ""))
    if args.logs:
        print(status.logs, end="")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from toolkit.submit import list_jobs

    jobs = list_jobs(args.address, token=args.token, all_jobs=args.all)
    for job in jobs:
        started = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time))
                   if job.start_time else "-")
        print(f"{job.job_id}  {job.status:<9}  {started}  {job.output or '-'}")
    if not jobs:
        print("no raygen jobs" + ("" if args.all else " (--all lists every Ray job)"))
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    from toolkit.submit import stop_job

    stopped = stop_job(args.job_id, args.address, token=args.token)
    print(f"{args.job_id}: " + ("stopping (committed shards are kept; submit the same config "
                                "again to resume)" if stopped else "already finished"))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    from toolkit.demo import run_demo

    result = run_demo(args.output, num_actors=args.num_actors)
    print(result.summary())
    table = pq.read_table(args.output).sort_by([("id", "ascending"),
                                                ("sample_index", "ascending")])
    print(f"\nfirst rows of {args.output} (a tiny random model: the text is noise):")
    for row in table.slice(0, args.show).to_pylist():
        text = (row["output_text"] or "").replace("\n", " ")
        print(f"  {row['id']}[{row['sample_index']}] {row['topic']:<8} {row['finish_reason']:<6}"
              f" {row['num_output_tokens']:>2} tok  {text[:60]!r}")
    _print_log_path(args)
    return 0


def config_keys_help() -> str:
    """The config keys with their defaults, for ``raygen run --help``."""
    from jobs.config import JobConfig

    lines = ["config keys (YAML, or --set KEY=VALUE; every key: jobs/config.py JobConfig):"]
    for f in dataclasses.fields(JobConfig):
        if f.default is not dataclasses.MISSING:
            default = f"default {f.default!r}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"default {f.default_factory()!r}"
        else:
            default = "required"
        lines.append(f"  {f.name:<22} {default}")
    lines.append("  sampling_params.<field>: vLLM SamplingParams fields (max_tokens, temperature,"
                 " top_p, n, seed, stop, logprobs, ...)")
    lines.append("  engine.<field>: actors/engine/engine_config.py EngineConfig fields (dtype, max_model_len,"
                 " max_num_seqs, ...)")
    return "\n".join(lines)


def _add_config_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("config", help="job YAML file")
    cmd.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override a config key (dotted for nested keys, the value read as "
                          "YAML), e.g. --set sampling_params.max_tokens=64; repeatable")
    for key in ("model", "input", "output"):
        cmd.add_argument(f"--{key}", help=f"override the config's {key}")


def _add_cluster_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--address", help="Ray dashboard URL (default: RAY_API_SERVER_ADDRESS, "
                     "RAY_ADDRESS or http://127.0.0.1:8265)")
    cmd.add_argument("--token", help="the cluster's auth token (default: RAY_AUTH_TOKEN, "
                     "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)")


def build_parser() -> argparse.ArgumentParser:
    from toolkit import __version__

    parser = argparse.ArgumentParser(prog="raygen", description="Ray-distributed batch "
                                     "generation for LLMs.")
    parser.add_argument("--version", action="version", version=f"raygen {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the run's details (INFO) on the terminal")
    parser.add_argument("--log-level", choices=_LEVELS, help="the terminal's log level "
                        "(default warning; the log file gets info and above)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job (YAML config) on Ray, locally by default",
                         epilog=config_keys_help(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_options(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run)

    batch = sub.add_parser("run-batch", help="run an OpenAI Batch file (JSONL of /v1/chat/"
                           "completions or /v1/completions requests)")
    batch.add_argument("-i", "--input", required=True, help="the batch input JSONL file")
    batch.add_argument("-o", "--output", required=True, help="the output JSONL file")
    batch.add_argument("--model", required=True, help="local model directory or hub id")
    batch.add_argument("--num-actors", type=int, default=1, help="actors (default 1)")
    batch.add_argument("--num-gpus-per-actor", type=float, default=None,
                       help="GPUs per actor (default 1 when CUDA is visible, else 0)")
    batch.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="a job config key for the batch's job (e.g. rows_per_shard=500, "
                            "engine.max_model_len=4096, sampling_params.max_tokens=256 as a "
                            "default); repeatable")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    batch.set_defaults(func=_cmd_run_batch)

    submit = sub.add_parser("submit", help="submit a job to a Ray cluster (Ray Jobs API)")
    _add_config_options(submit)
    submit.add_argument("--job-id", help="submission id of your choice")
    submit.add_argument("--wait", action="store_true", help="wait and print the logs")
    _add_cluster_options(submit)
    submit.set_defaults(func=_cmd_submit)

    status = sub.add_parser("status", help="status of a submitted job")
    status.add_argument("job_id")
    status.add_argument("--logs", action="store_true", help="print the job's logs")
    _add_cluster_options(status)
    status.set_defaults(func=_cmd_status)

    listing = sub.add_parser("list", help="the submitted raygen jobs of a cluster")
    listing.add_argument("--all", action="store_true", help="every Ray job, not only raygen's")
    _add_cluster_options(listing)
    listing.set_defaults(func=_cmd_list)

    stop = sub.add_parser("stop", help="stop a submitted job (its committed shards stay)")
    stop.add_argument("job_id")
    _add_cluster_options(stop)
    stop.set_defaults(func=_cmd_stop)

    demo = sub.add_parser("demo", help="run a small job with a bundled tiny model")
    demo.add_argument("--output", default="demo-out", help="output directory (replaced)")
    demo.add_argument("--num-actors", type=int, default=None, help="actors (default 2)")
    demo.add_argument("--show", type=int, default=8, help="rows to print")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``raygen`` console script."""
    from toolkit import logs

    args = build_parser().parse_args(argv)
    runs = args.command in ("run", "run-batch", "demo")
    with logs.configured(_level(args), log_file=runs) as args.log_handler:
        had_ray = _ray_connected()
        try:
            code = args.func(args)
        except (ValueError, OSError, RuntimeError) as exc:
            _auth(exc)
            print(f"raygen: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print("raygen: interrupted (committed shards are kept; rerun to resume)",
                  file=sys.stderr)
            return 130
        if runs and code == 0 and not had_ray and _ray_connected():
            # the session this run opened ends now (a local Ray it started stops; a cluster is
            # only left), as at the exit less the 0.5 s Ray's exit hook waits for late worker
            # lines (a failed run keeps that wait: its workers' last lines may tell why)
            from jobs.cluster import disconnect

            disconnect()
        return code


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


if __name__ == "__main__":
    sys.exit(main())
