"""The processes of a job a benchmark runs through ``raygen run``: the child's environment,
the command streamed and timed from its log (actors ready, shards committed, one actor
SIGKILLed on request), each actor's busy window, and the actors' worker processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
T0 = float(os.environ.get("JOB_BENCH_T0", time.time()))  # the bare child logs on our clock


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", flush=True)


def child_env(repo: Path = REPO) -> dict[str, str]:
    """The environment of a ``raygen run`` child: ``repo``'s modules first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo)] + [p for p in env.get("PYTHONPATH", "")
                                                      .split(os.pathsep) if p])
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def process_tree(root_pid: int) -> set[int]:
    """``root_pid`` and all its descendants (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def actor_pids(root: int) -> list[tuple[int, str]]:
    """(pid, process title) of the GenerationActor workers below the job's process."""
    out = []
    for pid in sorted(process_tree(root) - {root}):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if title.startswith("ray::GenerationActor"):
            out.append((pid, title))
    return out


def committed_shards(output: Path) -> dict:
    """The manifest's committed shards of ``output`` (empty while there is none)."""
    from jobs.manifest import read_manifest

    try:
        return read_manifest(output).get("committed", {})
    except (OSError, ValueError):
        return {}


def run_cli_job(name: str, config_path: Path, output: Path, timeout: float,
                kill: bool = False, repo: Path = REPO, keep_log: bool = False) -> dict:
    """Runs ``raygen run config`` (as ``python -m toolkit.cli``, with ``repo``'s code),
    streaming its log with timestamps; ``kill``: SIGKILL one actor process once the first
    shard is committed; ``keep_log``: return every line as ``(seconds, line)`` in ``log``."""
    log(f"{name}: raygen run {config_path.name}")
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "-v", "run", str(config_path)],
                            cwd=repo, env=child_env(repo), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    events: dict[str, float] = {}
    actor_events: list[tuple[float, str, str, int]] = []  # (time, actor, "ready"|"shard", id)
    lines: list[str] = []
    stamped: list[tuple[float, str]] = []
    affinity: dict[int, str | None] = {}  # actor pid: its CPUs
    batches: dict[int, int] = {}  # shard id: its steps' mean batch (sequences a step)

    def read() -> None:
        for line in proc.stdout:
            now = time.time()
            line = ANSI.sub("", line)
            lines.append(line.rstrip("\n"))
            if keep_log:
                stamped.append((now - started, lines[-1]))
            print(f"    {name} +{now - started:6.1f}s | {line.rstrip()}", flush=True)
            if m := re.search(r"jobs\.dispatch: (actor-\d+) ready", line):
                actor_events.append((now, m.group(1), "ready", -1))
                for pid, _ in actor_pids(proc.pid):
                    affinity.setdefault(pid, cpus_allowed(pid))
            elif m := re.search(r"jobs\.runner: shard (\d+) by (actor-\d+):", line):
                actor_events.append((now, m.group(2), "shard", int(m.group(1))))
                if b := re.search(r" steps of (\d+) sequences in ", line):
                    batches[int(m.group(1))] = int(b.group(1))
            elif "jobs.runner: job finished" in line:
                events["finished"] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed: dict[str, Any] = {}
    if kill:
        while proc.poll() is None and not committed_shards(output):
            time.sleep(0.05)
        actors = actor_pids(proc.pid)
        busy = [a for a in actors if "process_shard" in a[1]] or actors
        if proc.poll() is None and busy:
            pid, title = busy[0]
            os.kill(pid, signal.SIGKILL)
            killed = {"pid": pid, "title": title, "at_s": time.time() - started,
                      "committed_before": len(committed_shards(output))}
            log(f"{name}: killed actor process {pid} ({title}) after "
                f"{killed['committed_before']} committed shard(s)")
        else:
            log(f"{name}: no actor process to kill (job already over?)")
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    reader.join(timeout=10)
    ended = time.time()
    finished = events.get("finished", ended)
    ready = [t for t, _, kind, _ in actor_events if kind == "ready"]
    first_ready = min(ready) if ready else started
    return {"returncode": rc, "end_to_end_s": ended - started, "started_wall": started,
            "start_to_first_ready_s": first_ready - started,
            "start_to_all_ready_s": (max(ready) if ready else started) - started,
            "generation_s": finished - first_ready, "actors_started": len(ready),
            "ready_skew_s": (max(ready) - min(ready)) if ready else 0.0,
            "actor_events": [(t - started, a, kind, i) for t, a, kind, i in actor_events],
            "killed": killed, "actor_cpus": {str(k): v for k, v in affinity.items()},
            "shard_batches": {str(k): v for k, v in sorted(batches.items())},
            "log_tail": lines[-12:], **({"log": stamped} if keep_log else {})}


def actor_windows(events: list[tuple[float, str, str, int]], shard_tokens) -> dict[str, dict]:
    """Per actor: its shards, their output tokens (``shard_tokens(shard id)``) and its busy
    window, from its last "ready" to its last shard committed (a restarted actor counts from
    its new start). What each actor generated while it was up, free of the other's start."""
    out: dict[str, dict] = {}
    for t, actor, kind, shard in sorted(events):
        entry = out.setdefault(actor, {"ready_s": t, "shards": [], "output_tokens": 0})
        if kind == "ready":
            entry.update(ready_s=t, shards=[], output_tokens=0)
        else:
            entry["shards"].append(shard)
            entry["output_tokens"] += shard_tokens(shard)
            entry["last_commit_s"] = t
    for entry in out.values():
        if entry["shards"]:
            entry["window_s"] = entry["last_commit_s"] - entry["ready_s"]
            entry["output_tok_s"] = entry["output_tokens"] / max(entry["window_s"], 1e-9)
    return out


def cpus_allowed(pid: int) -> str | None:
    """A process's ``Cpus_allowed_list`` (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
