"""The acceptance job's input: 500 rows over three files (Parquet + JSONL), mixed prompts and
per-row params (n=2, logprobs=3, prompt_logprobs, stop strings, seeds on some rows)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tests.jobs.helpers import write_jsonl

WORDS = ("the quick brown fox jumps over lazy dog ray actor model token cache sample "
         "parquet arrow column weather sunny rain poem robot").split()
ENGINE = {"max_num_seqs": 48, "max_model_len": 128, "num_kv_blocks": 256}
DEFAULTS = {"max_tokens": 4, "temperature": 0.9}


def row_params(rng: random.Random, i: int) -> dict[str, Any]:
    p: dict[str, Any] = {}
    if i % 5 == 0:
        p["n"] = 2
    if i % 4 == 1:
        p["logprobs"] = 3
    elif i % 4 == 2:
        p["logprobs"] = 0
    if i % 6 == 3:
        p["prompt_logprobs"] = 1
    if i % 7 == 2:
        p["stop"] = ["e", "o"]
    if i % 3 == 0:
        p["seed"] = rng.randrange(2**40)
    if i % 9 == 4:
        p["temperature"] = 0.0
    if i % 11 == 6:
        p["max_tokens"] = 6
    return p


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))


def acceptance_rows(count: int = 500) -> list[dict[str, Any]]:
    """``count`` rows: id, a prompt of one of three kinds, params dict, a passthrough
    ``group`` (the first 500 are the same whatever the count)."""
    rng = random.Random(0)
    rows = []
    for i in range(count):
        kind = ("prompt", "messages", "prompt_token_ids")[i % 3]
        prompt = _text(rng)
        row: dict[str, Any] = {"id": f"r{i:03d}", "group": i % 10, "kind": kind}
        if kind == "messages":
            row["messages"] = [{"role": "user", "content": prompt}]
        elif kind == "prompt_token_ids":
            row["prompt_token_ids"] = [rng.randrange(10, 300) for _ in range(rng.randint(2, 8))]
        else:
            row["prompt"] = prompt
        row["params"] = row_params(rng, i)
        rows.append(row)
    return rows


def table_of(rows: list[dict[str, Any]], params_as: str) -> pa.Table:
    """Rows as an Arrow table; params as a struct column or as JSON strings (a row's own
    ``params_json`` text is used verbatim)."""
    if params_as == "struct":
        params = pa.array([r["params"] for r in rows])
    else:
        params = pa.array([r.get("params_json", json.dumps(r.get("params", {})))
                           for r in rows], pa.string())
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.table({
        "id": pa.array([r["id"] for r in rows], pa.string()),
        "prompt": pa.array([r.get("prompt") for r in rows], pa.string()),
        "messages": pa.array([r.get("messages") for r in rows], pa.list_(message)),
        "prompt_token_ids": pa.array([r.get("prompt_token_ids") for r in rows],
                                     pa.list_(pa.int64())),
        "sampling_params": params,
        "group": pa.array([r.get("group", -1) for r in rows], pa.int64()),
    })


def _json_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSONL records: params as JSON objects, absent keys left out."""
    return [{k: v for k, v in {"id": r["id"], "prompt": r.get("prompt"),
                               "messages": r.get("messages"),
                               "prompt_token_ids": r.get("prompt_token_ids"),
                               "sampling_params": r["params"] or None,
                               "group": r["group"]}.items() if v is not None} for r in rows]


def write_acceptance_input(root: Path, rows: list[dict[str, Any]] | None = None) -> Path:
    """a.parquet (params as a struct column), b.jsonl (params as JSON objects),
    c.parquet (params as JSON strings). Returns the input directory."""
    rows = rows if rows is not None else acceptance_rows()
    root.mkdir(parents=True, exist_ok=True)
    a, b, c = rows[:200], rows[200:350], rows[350:]
    pq.write_table(table_of(a, "struct"), root / "a.parquet", row_group_size=64)
    write_jsonl(root / "b.jsonl", _json_rows(b))
    pq.write_table(table_of(c, "json"), root / "c.parquet")
    return root


def malformed_rows() -> list[dict[str, Any]]:
    """20 rows that must become error rows: (id, prompt, token ids, params JSON, expected text
    in the error)."""
    bad = [
        ('{"temperature": "hot"}', "sampling_params.temperature"),
        ('{"temperature": NaN}', "sampling_params.temperature: must be finite"),
        ('{"top_p": 0}', "sampling_params.top_p"),
        ('{"n": 0}', "sampling_params.n"),
        ('{"max_tokens": -1}', "sampling_params.max_tokens"),
        ('{"tempature": 1}', "unknown field 'tempature'"),
        ('{not json', "sampling_params: not valid JSON"),
        ('[1, 2]', "sampling_params: JSON must be an object"),
        ('{"best_of": 2}', "sampling_params.best_of"),
        ('{"logprobs": -5}', "sampling_params.logprobs"),
        ('{"stop": [""]}', "sampling_params.stop"),
        ('{"seed": "abc"}', "sampling_params.seed"),
        ('{"min_tokens": 10, "max_tokens": 2}', "sampling_params.min_tokens"),
        ('{"logit_bias": {"x": 1}}', "sampling_params.logit_bias"),
        ('{"presence_penalty": 5}', "sampling_params.presence_penalty"),
        ('{"logprobs": 50}', "sampling_params.logprobs"),
        ('{"stop_token_ids": [99999]}', "sampling_params.stop_token_ids"),
    ]
    rows = [{"id": f"bad-{k:02d}", "prompt": "a fine prompt", "params_json": text,
             "expect": expect} for k, (text, expect) in enumerate(bad)]
    rows.append({"id": "bad-17", "prompt": "", "params_json": "{}", "expect": "prompt"})
    rows.append({"id": "bad-18", "prompt": None, "params_json": "{}", "expect": "no prompt"})
    rows.append({"id": "bad-19", "prompt": None, "prompt_token_ids": [5, 100000],
                 "params_json": "{}", "expect": "prompt: token ids must be in"})
    return rows


RELIABILITY_ROWS = 2000
RELIABILITY_ENGINE = {"max_num_seqs": 128, "max_model_len": 128, "num_kv_blocks": 512}


def write_reliability_input(root: Path) -> Path:
    """The 2,000-row input of the fault tests: a.parquet (1,200 rows, params as a struct
    column, row groups of 100) and b.jsonl (800 rows). Returns the input directory."""
    rows = acceptance_rows(RELIABILITY_ROWS)
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(table_of(rows[:1200], "struct"), root / "a.parquet", row_group_size=100)
    write_jsonl(root / "b.jsonl", _json_rows(rows[1200:]))
    return root
