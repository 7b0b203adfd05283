"""Shared test helpers: one local Ray per session, input files, reading the output back, what
is still alive (actors, processes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

_STARTED: list[bool] = []


def local_ray_session():
    """Starts (once) a local Ray on 127.0.0.1 with 2 CPUs; shuts it down at session end."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        _STARTED.append(True)
    yield ray
    if _STARTED:
        _STARTED.clear()
        ray.shutdown()


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def read_output(path: str | os.PathLike) -> pa.Table:
    """Every part file of an output directory, sorted by (id, sample_index)."""
    table = pq.read_table(str(path))
    return table.sort_by([("id", "ascending"), ("sample_index", "ascending")])


def part_stats(path: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """part file name -> (inode, mtime_ns), to prove files were not rewritten."""
    out = {}
    for p in sorted(Path(path).glob("part-*.parquet")):
        st = p.stat()
        out[p.name] = (st.st_ino, st.st_mtime_ns)
    return out


def _same(x: Any, y: Any, atol: float) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= atol
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b, atol) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k], atol) for k in x)
    return x == y


def assert_same_rows(a: pa.Table, b: pa.Table, atol: float = 1e-4) -> None:
    """Equal schemas and rows; every non-float value identical, float values (logprobs)
    within ``atol``: what stays fixed when batch composition changes between runs."""
    assert a.schema.equals(b.schema), (a.schema, b.schema)
    assert a.num_rows == b.num_rows
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        bad = [i for i in range(len(x)) if not _same(x[i], y[i], atol)]
        assert not bad, f"column {name!r} differs in {len(bad)} rows, e.g. {x[bad[0]]!r} vs " \
                        f"{y[bad[0]]!r}"


def assert_identical(a: pa.Table, b: pa.Table) -> None:
    """Equal schemas and every value identical, floats to the last bit (deterministic jobs)."""
    assert a.schema.equals(b.schema), (a.schema, b.schema)
    assert a.num_rows == b.num_rows, (a.num_rows, b.num_rows)
    for name in a.column_names:
        x, y = a.column(name), b.column(name)
        if not x.equals(y):
            xs, ys = x.to_pylist(), y.to_pylist()
            bad = [i for i in range(len(xs)) if xs[i] != ys[i]]
            where = f"e.g. row {bad[0]}: {xs[bad[0]]!r} vs {ys[bad[0]]!r}" if bad else ""
            raise AssertionError(f"column {name!r} differs in {len(bad)} rows, {where}")


def _hex_address(text: str) -> str:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        addr = ".".join(str(b) for b in raw[::-1])
    else:  # IPv6: four little-endian 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        full = b"".join(words)
        addr = ":".join(full[i:i + 2].hex() for i in range(0, 16, 2))
        if full[:12] == b"\0" * 10 + b"\xff\xff":
            addr = "::ffff:" + ".".join(str(b) for b in full[12:])
        elif full == b"\0" * 16:
            addr = "::"
    return f"{addr}:{int(port, 16)}"


def listening_addresses(pids: set[int]) -> dict[str, int]:
    """TCP listening address -> pid, for sockets held by ``pids`` (like ``ss -ltnp``)."""
    listening: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening[fields[9]] = _hex_address(fields[1])
    out: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                out[listening[link[8:-1]]] = pid
    return out


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1") or \
        host.startswith("::ffff:127.")


def temporaries(out: str | os.PathLike) -> list[str]:
    """The hidden files beside the parts and among the markers (``.raygen/``): temporaries
    a run left behind."""
    out = Path(out)
    folders = [out, out / ".raygen"]
    return sorted(p.name for folder in folders if folder.is_dir() for p in folder.iterdir()
                  if p.name.startswith(".") and p.is_file())


def alive_actor_classes() -> list[str]:
    """Class names of the live actors: from ``ray.util.state`` where its API server runs,
    else (no dashboard, as in these tests) from the GCS actor table it reads."""
    import ray
    from ray.util.state.exception import ServerUnavailable

    try:
        from ray.util.state import list_actors

        return [a.class_name for a in list_actors(
            address=ray.get_runtime_context().gcs_address,
            filters=[("state", "=", "ALIVE")])]
    except (ServerUnavailable, ConnectionError):
        return [a["ActorClassName"] for a in ray._private.state.actors().values()
                if a["State"] == "ALIVE"]


def processes_gone(pids: list[int], wait_s: float = 10.0) -> bool:
    """Whether every process of ``pids`` has ended within ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False
