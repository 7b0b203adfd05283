"""The description of one job shard that the driver hands to an actor.

Kept apart from :mod:`actors.shard` (which imports the engine's modules, torch among them) so
that unpickling a task imports only this module and pyarrow: an actor is created with its
first task as an argument, and Ray unpickles the arguments before the constructor runs, that
is before ``actors.actor.cache_bytecode`` lets the process read and write its bytecode cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs


@dataclass(slots=True)
class ShardTask:
    """Everything an actor needs to process one shard (plain and picklable)."""

    shard_id: int
    attempt: int
    input_fs: pafs.FileSystem
    input_path: str
    input_format: str  # "parquet" | "ipc" | "json"
    row_start: int
    row_stop: int
    columns: dict[str, str]  # role (id, prompt, messages, token_ids, params) -> column name
    default_params: dict[str, Any]
    seed: int
    output_fs: pafs.FileSystem
    output_dir: str
    schema: pa.Schema
    id_offset: int | None = None  # global index of the file's first row, when ids are generated
    deterministic: bool = True  # run alone on an idle engine: rows depend on the shard only
    max_num_seqs: int | None = None  # the engine's: a row asking for more samples fails
    write_sampling_params: bool = False  # the schema's sampling_params column is generated

    @property
    def part_name(self) -> str:
        return f"part-{self.shard_id:05d}.parquet"

    @property
    def temp_name(self) -> str:
        return f".part-{self.shard_id:05d}-{self.attempt}.parquet.tmp"


class EngineFailure(RuntimeError):
    """The engine raised during a step; its state is unknown, so the actor must be replaced."""


class PartWriteError(OSError):
    """The part file could not be written or renamed (the output storage failed)."""


@dataclass(slots=True)
class ShardResult:
    """What an actor reports for a written shard (the rows stay in the part file)."""

    shard_id: int
    attempt: int
    part: str
    rows: int
    output_rows: int
    errors: int
    output_tokens: int
    prompt_tokens: int
    seconds: float
    error_messages: list[str] = field(default_factory=list)  # the first few, for logs
    phases: dict[str, float] = field(default_factory=dict)  # seconds: prepare, generate, write
    engine: dict[str, float] = field(default_factory=dict)  # EngineServer.run's stats

    def timing(self) -> str:
        """Where the shard's time went on the actor, for the driver's log: ``prepare 0.08 s,
        generate 3.67 s (queued 1.80 s; 130 steps of 250 sequences in 1.85 s: 14.2 ms a step,
        host 6.1 (on a CPU 5.2), waiting for the device 8.1), write 0.44 s``: the steps' mean
        batch (how full the engine was), host time the stepping thread's wall time outside
        device waits, "on a CPU" the part of it the thread was running."""
        parts = []
        for name, seconds in self.phases.items():
            text = f"{name} {seconds:.2f} s"
            if name == "generate" and self.engine.get("steps"):
                e = self.engine
                per = 1e3 / e["steps"]
                cpu = f" (on a CPU {e['cpu_s'] * per:.1f})" if "cpu_s" in e else ""
                batch = f" of {e['seqs'] / e['steps']:.0f} sequences" if "seqs" in e else ""
                text += (f" (queued {e['queued_s']:.2f} s; {e['steps']} steps{batch} in "
                         f"{e['run_s']:.2f} s: {e['run_s'] * per:.1f} ms a step, host "
                         f"{(e['busy_s'] - e['device_wait_s']) * per:.1f}{cpu}, waiting for "
                         f"the device {e['device_wait_s'] * per:.1f})")
            parts.append(text)
        return ", ".join(parts)
