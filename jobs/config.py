"""JobConfig: what a job reads, how it samples, where it writes, and on how many actors.

A config is a dataclass, or a dict, or a YAML file (read with ``yaml.safe_load``) with the same
keys. Unknown keys and wrong types raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Union

from sampler.params import SamplingParams

_SEED_MAX = 2**63 - 1
# Fields whose change would change the output rows: a manifest written under other values of
# these is refused. The rest (actors, GPUs, attempts, address, deterministic) only change how
# the job runs (deterministic: whether floats reproduce to the bit or up to rounding);
# the input is compared through its resolved file list (the shard plan), not its spelling.
OUTPUT_FIELDS = (
    "model", "id_column", "prompt_column", "messages_column", "token_ids_column",
    "params_column", "sampling_params", "rows_per_shard", "seed", "engine", "trust_remote_code",
    "write_sampling_params", "input_format",
)
INPUT_FORMATS = ("auto", "openai_batch")


def _fail(name: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"config.{name}: {rule}, got {value!r}")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, "must be an integer", value)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _fail(name, f"must be {bound}", value)
    return value


@dataclass(slots=True)
class JobConfig:
    """A batch generation job (see docs/design.md, "JobConfig").

    Args:
        model: local model directory or hub id (anything ``transformers`` loads).
        input: a file, a directory, a glob or a URI (``s3://…``, ``file://…``, any fsspec
            protocol), or a list of them. Parquet, Arrow/Feather and JSONL.
        output: the output directory (local path or URI); it holds ``part-*.parquet`` and the
            hidden ``.raygen/`` folder (``manifest.parquet``, once finished ``SUCCESS``).
        id_column, prompt_column, messages_column, token_ids_column, params_column: input
            column names. A row needs one of the three prompt columns.
        sampling_params: job defaults (vLLM field names); a row's own params override them
            field by field.
        num_actors: size of the actor pool (replicas). num_gpus_per_actor: GPUs per rank
            (``engine.tensor_parallel_size`` ranks per replica); 0 runs on CPU.
        rows_per_shard: input rows per shard (the unit of work, commit and retry).
        seed: job seed; unseeded rows use a seed derived from (seed, row id).
        max_shard_attempts: attempts per shard before its rows are written as error rows.
        ray_address: None = the cluster in ``RAY_ADDRESS`` or an already connected one, else a
            new local Ray on 127.0.0.1; ``"local"`` = always that local Ray.
        engine: ``actors.engine.llm_engine.EngineConfig`` fields (dtype, max_model_len, max_num_seqs, …).
        trust_remote_code: passed to transformers; off unless set.
        input_format: ``auto`` (each file's format from its name) or ``openai_batch``: every
            input file is an OpenAI Batch JSONL file (``actors.contract.openai_batch``), its lines the
            rows (``raygen run-batch`` runs such a job and writes the OpenAI output file).
        write_sampling_params: also write a ``sampling_params`` column: per output row, the
            params (JSON text) that reproduce it alone (the row's effective params, with
            ``n: 1`` and the sample's own seed).
        deterministic: True (default): each actor runs one shard at a time on its engine,
            all of the shard's requests admitted together on a fresh prefix cache, so a
            shard's rows depend only on its rows and the model (and the hardware and library
            versions): a rerun or a retried shard reproduces every bit, logprobs included.
            False: the next shard's requests join the engine while the previous shard
            drains (fuller engine at shard boundaries, better throughput); which requests
            share a step then depends on timing, so token ids, text and seeds still
            reproduce but float values (logprobs) only up to float rounding, and rarely a
            sampled token whose top two logits tie within that rounding.

    Example:
        >>> cfg = JobConfig(model="m", input="in.parquet", output="out", num_gpus_per_actor=0)
        >>> JobConfig.from_dict({"model": "m", "input": "x", "output": "o"}).num_actors
        1
    """

    model: str
    input: Union[str, list[str]]
    output: str
    id_column: str = "id"
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    token_ids_column: str = "prompt_token_ids"
    params_column: str = "sampling_params"
    sampling_params: dict[str, Any] = field(default_factory=dict)
    num_actors: int = 1
    num_gpus_per_actor: float = 1
    rows_per_shard: int = 1000
    seed: int = 0
    max_shard_attempts: int = 3
    ray_address: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    deterministic: bool = True
    write_sampling_params: bool = False
    input_format: str = "auto"

    def __post_init__(self) -> None:
        for name in ("model", "output"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                setattr(self, name, value)
            if not isinstance(value, str) or not value.strip():
                raise _fail(name, "must be a non-empty string", value)
        self.input = _check_input(self.input)
        names = []
        for name in ("id_column", "prompt_column", "messages_column", "token_ids_column",
                     "params_column"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise _fail(name, "must be a non-empty column name", value)
            if value in names:
                raise _fail(name, "must differ from the other column names", value)
            names.append(value)
        if not isinstance(self.sampling_params, Mapping):
            raise _fail("sampling_params", "must be a mapping of field -> value",
                        self.sampling_params)
        self.sampling_params = dict(self.sampling_params)
        SamplingParams.from_dict(self.sampling_params)  # ValueError names the field
        self.num_actors = _check_int("num_actors", self.num_actors, 1)
        gpus = self.num_gpus_per_actor
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not gpus >= 0:
            raise _fail("num_gpus_per_actor", "must be a number >= 0", gpus)
        self.rows_per_shard = _check_int("rows_per_shard", self.rows_per_shard, 1)
        self.seed = _check_int("seed", self.seed, 0, _SEED_MAX)
        self.max_shard_attempts = _check_int("max_shard_attempts", self.max_shard_attempts, 1)
        if self.ray_address is not None and not isinstance(self.ray_address, str):
            raise _fail("ray_address", "must be a string or null", self.ray_address)
        if not isinstance(self.engine, Mapping):
            raise _fail("engine", "must be a mapping of EngineConfig field -> value", self.engine)
        self.engine = dict(self.engine)
        if self.input_format not in INPUT_FORMATS:
            raise _fail("input_format", f"must be one of {', '.join(INPUT_FORMATS)}",
                        self.input_format)
        for name in ("trust_remote_code", "deterministic", "write_sampling_params"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "must be true or false", getattr(self, name))

    @property
    def inputs(self) -> list[str]:
        """The input paths/URIs/globs as a list."""
        return [self.input] if isinstance(self.input, str) else list(self.input)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobConfig:
        """Builds a config from a mapping; unknown keys raise ``ValueError`` naming them."""
        if not isinstance(data, Mapping):
            raise ValueError(f"config: expected a mapping of key -> value, got {data!r:.200}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"config: unknown key {key!r}{hint}; known keys: "
                                 f"{', '.join(known)}")
        for key in ("model", "input", "output"):
            if key not in data:
                raise ValueError(f"config.{key}: required key is missing")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> JobConfig:
        """Reads a YAML file (``yaml.safe_load``) holding the config keys at top level."""
        return cls.from_dict(read_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field (the YAML/JSON form)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["input"] = list(self.input) if isinstance(self.input, list) else self.input
        out["sampling_params"] = dict(self.sampling_params)
        out["engine"] = dict(self.engine)
        return out

    def output_identity(self) -> dict[str, Any]:
        """The fields that decide the output rows, JSON-normalised (stored in the manifest)."""
        data = {name: getattr(self, name) for name in OUTPUT_FIELDS}
        data["sampling_params"] = SamplingParams.from_dict(self.sampling_params).to_dict()
        return json.loads(json.dumps(data, sort_keys=True, default=str))

    def fingerprint(self) -> str:
        """A short hash of :meth:`output_identity`."""
        text = json.dumps(self.output_identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_input(value: Any) -> str | list[str]:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        if not value.strip():
            raise _fail("input", "must be a non-empty path, glob or URI", value)
        return value
    if isinstance(value, (list, tuple)) and value:
        items = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
        for item in items:
            if not isinstance(item, str) or not item.strip():
                raise _fail("input", "every entry must be a non-empty path, glob or URI", item)
        return items
    raise _fail("input", "must be a path, glob or URI, or a non-empty list of them", value)


ConfigLike = Union[JobConfig, Mapping[str, Any], str, os.PathLike]


def apply_overrides(data: Mapping[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``data`` with each ``key=value`` of ``overrides`` set: a dotted key reaches into a
    mapping (``sampling_params.max_tokens=64``), the value is read as YAML (``4`` an int,
    ``true`` a bool, ``[a, b]`` a list, ``null``). The result is checked as a config file is.

    Example:
        >>> apply_overrides({"num_actors": 1}, ["num_actors=4", "engine.dtype=float32"])
        {'num_actors': 4, 'engine': {'dtype': 'float32'}}
    """
    import yaml

    out = json.loads(json.dumps(dict(data), default=str))  # a deep copy of plain values
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"config: --set {item!r}: expected key=value (a dotted key for a "
                             "nested one, e.g. sampling_params.max_tokens=64)")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"config: --set {item!r}: the value is not valid YAML "
                             f"({str(exc).splitlines()[0]})") from None
        *parents, leaf = key.split(".")
        target = out
        for depth, part in enumerate(parents):
            child = target.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parents[:depth + 1])
                raise ValueError(f"config.{where}: --set {key}: {where} is not a mapping "
                                 f"(it is {child!r})")
            target = child
        target[leaf] = value
    return out


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping a YAML config file holds (``ValueError`` naming the file otherwise)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"config: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"config: {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"config: {str(path)!r} must hold a mapping of keys, got {data!r:.200}")
    return dict(data)


def load_config(config: ConfigLike) -> JobConfig:
    """Accepts a JobConfig, a dict, or the path of a YAML file."""
    if isinstance(config, JobConfig):
        return config
    if isinstance(config, Mapping):
        return JobConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return JobConfig.from_yaml(config)
    raise TypeError(f"config: expected a JobConfig, a dict or a YAML path, got {type(config)!r}")
