"""The processes of a job a benchmark runs through ``raygen run``: the child's environment,
and the generation actors' worker processes below it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
