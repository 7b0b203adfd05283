"""The output directory's ``_manifest.json``: the shard plan, the commits, ``_SUCCESS``.

The manifest is written at job start (the plan, fixed from then on) and rewritten after each
commit, always to a hidden temporary file renamed into place, so a killed driver leaves either
the old or the new manifest, never half of one. A rerun reads it back and skips the committed
shards; a manifest written for another config or another input is refused.
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

MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"
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
    return (name in (MANIFEST, SUCCESS) or (name.startswith("part-") and name.endswith(".parquet"))
            or name.startswith("."))


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
        except OSError as exc:
            raise ValueError(f"output: cannot use {output.spelled!r}: {exc}") from None
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
                manifest.save()
            except OSError as exc:
                raise ValueError(f"output: cannot write to {output.spelled!r}: {exc}") from None
            return manifest
        try:
            data = json.loads(raw)
        except ValueError:
            raise ValueError(f"output: {output.join(MANIFEST)} is not valid JSON; remove the "
                             "directory or use another one") from None
        cls._check_same_job(output, data, identity, plan)
        return cls(output, data)

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
        text = json.dumps(self.data, sort_keys=True, separators=(",", ":"))
        write_atomic(self.output.fs, self.output.join(MANIFEST), text.encode(), before_rename)

    def finish(self) -> None:
        """Marks the job finished (``_SUCCESS``); removes temporaries left by dead actors."""
        self.clean_temporaries()
        self.data["finished"] = time.time()
        self.save(_fault_point("final-manifest"))
        write_atomic(self.output.fs, self.output.join(SUCCESS), b"")

    def clean_temporaries(self) -> list[str]:
        """Removes the hidden temporary files a killed run left behind. Returns their names."""
        fs = self.output.fs
        removed = []
        for info in fs.get_file_info(pafs.FileSelector(self.output.path)):
            name = info.base_name
            if info.type == pafs.FileType.File and name.startswith(".") and name.endswith(".tmp"):
                fs.delete_file(info.path)
                removed.append(name)
        return removed
