"""The shard plan: each input file cut into row ranges of ``rows_per_shard`` rows.

The plan depends only on the sorted file list, the row counts and ``rows_per_shard``, so a
rerun computes the same one; it is stored in the manifest at job start and checked on resume.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from actors.contract.task import ShardTask
from jobs.cluster import MAX_SHARDS_IN_FLIGHT
from jobs.config import JobConfig
from jobs.manifest import encode_schema
from jobs.sources import InputSpec
from jobs.storage import Location


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows ``[row_start, row_stop)`` of input file ``file_index``."""

    shard_id: int
    file_index: int
    row_start: int
    row_stop: int

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start


def plan_shards(spec: InputSpec, rows_per_shard: int) -> list[Shard]:
    """Cuts every file into consecutive ranges of at most ``rows_per_shard`` rows."""
    shards: list[Shard] = []
    for index, f in enumerate(spec.files):
        for start in range(0, f.rows, rows_per_shard):
            shards.append(Shard(len(shards), index, start, min(start + rows_per_shard, f.rows)))
    return shards


def plan_document(spec: InputSpec, shards: list[Shard], rows_per_shard: int) -> dict[str, Any]:
    """The JSON form of the plan, as stored in (and compared against) the manifest."""
    doc = {
        "files": [{"path": f.path, "format": f.format, "rows": f.rows, "size": f.size}
                  for f in spec.files],
        "rows_per_shard": rows_per_shard,
        "shards": [[s.file_index, s.row_start, s.row_stop] for s in shards],
        "columns": spec.columns,
        "generated_ids": spec.generated_ids,
        "schema": encode_schema(spec.schema),
    }
    return json.loads(json.dumps(doc))


def make_task(shard: Shard, attempt: int, spec: InputSpec, config: JobConfig,
              output: Location) -> ShardTask:
    """The task an actor runs for ``shard`` (attempt numbers start at 1)."""
    f = spec.files[shard.file_index]
    return ShardTask(
        shard_id=shard.shard_id,
        attempt=attempt,
        input_fs=f.location.fs,
        input_path=f.path,
        input_format=f.format,
        row_start=shard.row_start,
        row_stop=shard.row_stop,
        columns=dict(spec.columns),
        default_params=dict(config.sampling_params),
        seed=config.seed,
        output_fs=output.fs,
        output_dir=output.path,
        schema=spec.schema,
        id_offset=f.row_offset if spec.generated_ids else None,
        deterministic=config.deterministic,
        max_num_seqs=_max_num_seqs(config),
        write_sampling_params=config.write_sampling_params,
    )


def fill_rows(config: JobConfig) -> int:
    """Input rows an actor may hold in shards that share its engine (``deterministic:
    false``): the rows its engine runs at once (``max_num_seqs`` sequences over the job's
    default ``n``) and a shard to spare, so that the engine stays full while a finished
    shard's next one is on its way. 0 for a deterministic job (its shards run one at a time)."""
    return 0 if config.deterministic else _engine_rows(config) + config.rows_per_shard


def underfilled_engine(config: JobConfig, total_rows: int) -> str | None:
    """A note for a job whose shards are too small to fill an engine, else None: a
    deterministic job's shards run alone (the engine runs at most a shard's rows at once);
    shards that share the engine fill it up to ``MAX_SHARDS_IN_FLIGHT`` of them."""
    n = _default_n(config)
    seqs = _max_num_seqs(config)
    rows = config.rows_per_shard
    enough = _engine_rows(config)
    alone = config.deterministic
    held = rows if alone else rows * MAX_SHARDS_IN_FLIGHT  # the most rows an engine gets
    if held >= enough or total_rows <= held:
        return None
    if alone:
        why = "each shard runs alone on its actor's engine (deterministic: true)"
        fix = (f"a rows_per_shard of {enough} or more fills it, and deterministic: false lets "
               "shards share it")
    else:
        why = f"an actor holds at most {MAX_SHARDS_IN_FLIGHT} shards"
        fix = f"a rows_per_shard of {-(-enough // MAX_SHARDS_IN_FLIGHT)} or more fills it"
    return (f"{why}, so with rows_per_shard={rows} at most {held} rows x n={n} of the "
            f"engine's max_num_seqs={seqs} sequences run at once; {fix}")


def _engine_rows(config: JobConfig) -> int:
    """Input rows that fill an engine: its ``max_num_seqs`` sequences over the job's default
    ``n`` (rows asking for more samples fill it sooner)."""
    return -(-_max_num_seqs(config) // _default_n(config))


def _default_n(config: JobConfig) -> int:
    """The samples a row asks for unless its own params say otherwise."""
    return int(config.sampling_params.get("n") or 1)


def _max_num_seqs(config: JobConfig) -> int:
    """The engine's ``max_num_seqs`` (the largest ``n`` a row may ask for)."""
    from actors.engine.engine_config import EngineConfig

    default = next(f.default for f in dataclasses.fields(EngineConfig)
                   if f.name == "max_num_seqs")
    return int(config.engine.get("max_num_seqs", default))
