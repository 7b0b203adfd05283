"""The ``raygen`` command: ``run``, ``submit``, ``status`` and ``demo``.

    raygen run job.yaml
    raygen submit job.yaml --address http://127.0.0.1:8265 [--wait]
    raygen status JOB_ID --address http://127.0.0.1:8265 [--logs]
    raygen demo [--output demo-out]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

EXIT_ERROR = 1


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("jobs", "actors", "toolkit"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)


def _cmd_run(args: argparse.Namespace) -> int:
    from jobs.runner import run_job

    result = run_job(args.config, progress=not args.no_progress)
    print(result.summary())
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from toolkit.submit import job_status, submit_job

    job_id = submit_job(args.config, args.address, token=args.token, job_id=args.job_id)
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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raygen", description="Ray-distributed batch "
                                     "generation for LLMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job (YAML config) on Ray, locally by default")
    run.add_argument("config", help="job YAML file")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run)

    for name, helptext in (("submit", "submit a job to a Ray cluster (Ray Jobs API)"),
                           ("status", "status of a submitted job")):
        cmd = sub.add_parser(name, help=helptext)
        if name == "submit":
            cmd.add_argument("config", help="job YAML file")
            cmd.add_argument("--job-id", help="submission id of your choice")
            cmd.add_argument("--wait", action="store_true", help="wait and print the logs")
            cmd.set_defaults(func=_cmd_submit)
        else:
            cmd.add_argument("job_id")
            cmd.add_argument("--logs", action="store_true", help="print the job's logs")
            cmd.set_defaults(func=_cmd_status)
        cmd.add_argument("--address", help="Ray dashboard URL (default: RAY_API_SERVER_ADDRESS,"
                         " RAY_ADDRESS or http://127.0.0.1:8265)")
        cmd.add_argument("--token", help="the cluster's auth token (default: RAY_AUTH_TOKEN, "
                         "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)")

    demo = sub.add_parser("demo", help="run a small job with a bundled tiny model")
    demo.add_argument("--output", default="demo-out", help="output directory (replaced)")
    demo.add_argument("--num-actors", type=int, default=None, help="actors (default 2)")
    demo.add_argument("--show", type=int, default=8, help="rows to print")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``raygen`` console script."""
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"raygen: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("raygen: interrupted (committed shards are kept; rerun to resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
