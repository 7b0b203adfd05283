"""The output directory's manifest (the shard plan, the commits) and its end marker.

Both live in the hidden ``.raygen/`` folder of the output directory, so that every reader
given the directory reads the part files only (docs/reliability.md, "Where the markers
live"): ``.raygen/manifest.parquet`` is a Parquet file of no rows, with the output schema and
the manifest as JSON in its key-value metadata (a reader that walks hidden folders, polars,
finds a valid empty part), ``.raygen/SUCCESS`` an empty file. The manifest is written at job
start (the plan, fixed from then on) and rewritten after each commit, always to a hidden
temporary file renamed into place, so a killed driver leaves either the old or the new
manifest, never half of one. A rerun reads it back and skips the committed shards; a manifest
written for another config or another input is refused.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.fs as pafs

from jobs.storage import Location, read_bytes, write_atomic

logger = logging.getLogger(__name__)

STATE_DIR = ".raygen"
MANIFEST = f"{STATE_DIR}/manifest.parquet"
SUCCESS = f"{STATE_DIR}/SUCCESS"
LEGACY_MANIFEST, LEGACY_SUCCESS = "_manifest.json", "_SUCCESS"  # raygen <= 0.1's root markers
_METADATA_KEY = b"raygen.manifest"
VERSION = 1
# Fault injection for the reliability tests (docs/reliability.md), off unless this variable
# is set: "kill-driver@first-commit" / "kill-driver@final-manifest" make the driver SIGKILL
# itself once the manifest recording the job's first commit / marking it finished is written
# to its temporary file, before the rename; "slow-commits" makes it wait SLOW_COMMIT_S after
# recording each commit (so a test's own SIGKILL lands mid-job however fast the shards run).
FAULTS_ENV = "RAYGEN_TEST_FAULTS"
SLOW_COMMIT_S = 0.5


def _fault_point(name: str) -> Callable[[], None] | None:
    """The kill for ``name`` when the tests asked for it, else None (nothing runs)."""
    if f"kill-driver@{name}" not in os.environ.get(FAULTS_ENV, "").split(","):
        return None

    def kill() -> None:
        logger.warning("%s: killing the driver at %s", FAULTS_ENV, name)
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


def encode_schema(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode_schema(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def _is_ours(name: str) -> bool:
    return (name in (LEGACY_MANIFEST, LEGACY_SUCCESS) or name.startswith(".")
            or (name.startswith("part-") and name.endswith(".parquet")))


def manifest_bytes(data: dict[str, Any]) -> bytes:
    """The manifest file's content: an empty table of the plan's output schema (when the plan
    has one) with ``data`` as JSON under the ``raygen.manifest`` metadata key."""
    import pyarrow.parquet as pq

    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    encoded = data.get("plan", {}).get("schema")
    schema = decode_schema(encoded) if encoded else pa.schema([])
    schema = schema.with_metadata({**(schema.metadata or {}), _METADATA_KEY: text.encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    return sink.getvalue().to_pybytes()


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """The manifest held by a manifest file's bytes; ``ValueError`` when it holds none."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_schema(pa.BufferReader(raw)).metadata or {}
        return json.loads(metadata[_METADATA_KEY])
    except (pa.ArrowException, KeyError, ValueError, OSError):
        raise ValueError("not a raygen manifest") from None


def read_manifest(output: str | os.PathLike) -> dict[str, Any]:
    """The manifest of an output directory (a path or URI) as a dict: ``config``, ``plan``,
    ``committed`` (shard id -> part, counts), ``finished`` once done.

    Example:
        >>> read_manifest("out/run-1")["committed"]["0"]["part"]  # doctest: +SKIP
        'part-00000.parquet'
    """
    from jobs.storage import resolve

    loc = resolve(os.fspath(output))
    raw = read_bytes(loc.fs, loc.join(MANIFEST))
    if raw is None:
        raise ValueError(f"output: {loc.spelled!r} holds no raygen manifest ({MANIFEST})")
    return parse_manifest(raw)


class Manifest:
    """The manifest of one output directory (see the module docstring)."""

    def __init__(self, output: Location, data: dict[str, Any]) -> None:
        self.output = output
        self.data = data

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, output: Location, identity: dict[str, Any], plan: dict[str, Any]) -> Manifest:
        """Creates the manifest, or reads the existing one and checks it belongs to this job.

        Raises:
            ValueError: the directory cannot be written, holds foreign files, or holds a
                manifest of a different config or input.
        """
        fs, path = output.fs, output.path
        try:
            fs.create_dir(path, recursive=True)
            raw = read_bytes(fs, output.join(MANIFEST))
            legacy = read_bytes(fs, output.join(LEGACY_MANIFEST)) if raw is None else None
        except OSError as exc:
            raise ValueError(f"output: cannot use {output.spelled!r}: {exc}") from None
        if legacy is not None:
            return cls._migrate(output, legacy, identity, plan)
        if raw is None:
            foreign = [i.base_name for i in fs.get_file_info(pafs.FileSelector(path))
                       if not _is_ours(i.base_name)]
            if foreign:
                raise ValueError(f"output: {output.spelled!r} is not empty and holds no raygen "
                                 f"manifest (found {', '.join(sorted(foreign)[:3])}); use an "
                                 "empty or new directory")
            data = {"version": VERSION, "config": identity, "plan": plan, "committed": {},
                    "created": time.time()}
            manifest = cls(output, data)
            try:
                fs.create_dir(output.join(STATE_DIR), recursive=True)
                manifest.save()
            except OSError as exc:
                raise ValueError(f"output: cannot write to {output.spelled!r}: {exc}") from None
            return manifest
        try:
            data = parse_manifest(raw)
        except ValueError:
            raise ValueError(f"output: {output.join(MANIFEST)} is not a raygen manifest; remove "
                             "the directory or use another one") from None
        cls._check_same_job(output, data, identity, plan)
        return cls(output, data)

    @classmethod
    def _migrate(cls, output: Location, raw: bytes, identity: dict[str, Any],
                 plan: dict[str, Any]) -> Manifest:
        """An output of raygen <= 0.1 (``_manifest.json`` and ``_SUCCESS`` beside the parts):
        its manifest moves into ``.raygen/`` (once checked to be this job's)."""
        try:
            data = json.loads(raw)
        except ValueError:
            raise ValueError(f"output: {output.join(LEGACY_MANIFEST)} is not valid JSON; remove "
                             "the directory or use another one") from None
        cls._check_same_job(output, data, identity, plan)
        manifest = cls(output, data)
        fs = output.fs
        fs.create_dir(output.join(STATE_DIR), recursive=True)
        manifest.save()
        if fs.get_file_info(output.join(LEGACY_SUCCESS)).type == pafs.FileType.File:
            write_atomic(fs, output.join(SUCCESS), b"")
            fs.delete_file(output.join(LEGACY_SUCCESS))
        fs.delete_file(output.join(LEGACY_MANIFEST))
        logger.info("moved the manifest of %s into %s/", output.spelled, STATE_DIR)
        return manifest

    @staticmethod
    def _check_same_job(output: Location, data: dict, identity: dict, plan: dict) -> None:
        old = data.get("config", {})
        changed = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
        if data.get("version") != VERSION or changed:
            raise ValueError(
                f"output: {output.spelled!r} holds the manifest of a job with a different "
                f"configuration (differs in: {', '.join(changed) or 'manifest version'}); "
                "use another output directory, or remove this one to start over")
        old_plan = data.get("plan", {})
        if old_plan.get("files") != plan["files"]:
            raise ValueError(
                f"output: {output.spelled!r} holds a job over different input files or rows "
                "than the input has now; use another output directory, or remove this one")
        if old_plan != plan:
            raise ValueError(f"output: {output.spelled!r} holds a job with a different shard "
                             "plan; use another output directory, or remove this one")

    # ------------------------------------------------------------------ state
    @property
    def committed(self) -> dict[str, dict[str, Any]]:
        return self.data["committed"]

    def is_committed(self, shard_id: int) -> bool:
        return str(shard_id) in self.committed

    @property
    def finished(self) -> bool:
        info = self.output.fs.get_file_info(self.output.join(SUCCESS))
        return info.type == pafs.FileType.File

    def record(self, shard_id: int, entry: dict[str, Any]) -> None:
        """Records a committed shard and rewrites the manifest atomically."""
        first = not self.committed
        self.committed[str(shard_id)] = entry
        self.save(_fault_point("first-commit") if first else None)
        if "slow-commits" in os.environ.get(FAULTS_ENV, "").split(","):
            time.sleep(SLOW_COMMIT_S)

    def save(self, before_rename: Callable[[], None] | None = None) -> None:
        """Writes the manifest to a temporary file and renames it into place."""
        self.data["updated"] = time.time()
        write_atomic(self.output.fs, self.output.join(MANIFEST), manifest_bytes(self.data),
                     before_rename)

    def finish(self) -> None:
        """Marks the job finished (``SUCCESS``); removes temporaries left by dead actors."""
        self.clean_temporaries()
        self.data["finished"] = time.time()
        self.save(_fault_point("final-manifest"))
        write_atomic(self.output.fs, self.output.join(SUCCESS), b"")

    def clean_temporaries(self) -> list[str]:
        """Removes the hidden temporary files a killed run left behind. Returns their names."""
        fs = self.output.fs
        removed = []
        for folder in (self.output.path, self.output.join(STATE_DIR)):
            for info in fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True)):
                name = info.base_name
                if (info.type == pafs.FileType.File and name.startswith(".")
                        and name.endswith(".tmp")):
                    fs.delete_file(info.path)
                    removed.append(name)
        return removed
