"""Issue 4 acceptance, on the local Ray with the real engine and a tiny model.

One 500-row job over three files (Parquet + JSONL) is run once per module; the other tests
compare against it: a second run, a resumed run after killing its driver, malformed rows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobs.manifest import FAULTS_ENV, MANIFEST, SUCCESS, read_manifest
from jobs.runner import run_job
from sampler import derive_seed
from sampler.seeding import sample_seed
from tests.jobs.acceptance_data import (DEFAULTS, ENGINE, acceptance_rows, malformed_rows,
                                        table_of, write_acceptance_input)
from tests.jobs.helpers import assert_identical, part_stats, read_output, temporaries

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOP = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
MESSAGE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
EXPECTED_SCHEMA = pa.schema([
    ("id", pa.string()), ("sample_index", pa.int32()), ("output_text", pa.string()),
    ("output_token_ids", pa.list_(pa.int32())), ("finish_reason", pa.string()),
    ("stop_reason", pa.string()), ("stop_token_id", pa.int32()),
    ("logprobs", pa.list_(pa.float32())),
    ("top_logprobs", pa.list_(pa.list_(TOP))), ("sampled_ranks", pa.list_(pa.int32())),
    ("prompt_logprobs", pa.list_(pa.float32())), ("prompt_token_ids", pa.list_(pa.int32())),
    ("prompt_top_logprobs", pa.list_(pa.list_(TOP))), ("num_prompt_tokens", pa.int32()),
    ("num_output_tokens", pa.int32()), ("seed", pa.int64()), ("error", pa.string()),
    ("prompt", pa.string()), ("messages", MESSAGE), ("group", pa.int64()),
])
JOB_SEED = 1234


def _config(model, input_dir, output, **kw):
    return {"model": model, "input": str(input_dir), "output": str(output), "num_actors": 2,
            "num_gpus_per_actor": 0, "rows_per_shard": 40, "seed": JOB_SEED,
            "sampling_params": DEFAULTS, "engine": ENGINE, **kw}


@pytest.fixture(scope="module")
def job_a(ray_local, tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("acceptance")
    input_dir = write_acceptance_input(root / "in")
    config = _config(tiny_llama, input_dir, root / "out-a")
    result = run_job(config, progress=False)
    return {"root": root, "config": config, "result": result,
            "table": read_output(root / "out-a"), "rows": acceptance_rows()}


def test_rows_types_and_logprobs(job_a):
    table, rows, result = job_a["table"], job_a["rows"], job_a["result"]
    params = {r["id"]: r["params"] for r in rows}
    n = {rid: p.get("n", 1) for rid, p in params.items()}
    assert table.num_rows == sum(n.values()) == result.rows
    assert result.input_rows == 500 and result.errors == 0 and result.shards == 5 + 4 + 4
    assert table.schema.equals(EXPECTED_SCHEMA), table.schema
    assert Counter(table.column("id").to_pylist()) == Counter(n)
    out = table.to_pylist()
    assert [r["sample_index"] for r in out] == [j for rid in sorted(n) for j in range(n[rid])]
    assert {r["id"]: r["group"] for r in out} == {r["id"]: r["group"] for r in rows}
    stopped = 0
    for r in out:
        p = params[r["id"]]
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
        assert r["num_output_tokens"] == len(r["output_token_ids"]) >= 1
        assert r["num_output_tokens"] <= p.get("max_tokens", DEFAULTS["max_tokens"])
        row_seed = p.get("seed", derive_seed(JOB_SEED, r["id"]))
        assert r["seed"] == sample_seed(row_seed, r["sample_index"])  # each sample its own
        if "logprobs" in p:
            assert len(r["logprobs"]) == len(r["sampled_ranks"]) == r["num_output_tokens"]
            assert all(v <= 0 for v in r["logprobs"])
            top = r["top_logprobs"]
            if p["logprobs"] == 3:
                assert len(top) == r["num_output_tokens"] and all(len(t) == 3 for t in top)
            else:
                assert top is None
        else:
            assert r["logprobs"] is None and r["sampled_ranks"] is None
        if "prompt_logprobs" in p:
            plp = r["prompt_logprobs"]
            assert len(plp) == r["num_prompt_tokens"] and plp[0] is None
            assert all(v is not None and v <= 0 for v in plp[1:])
        else:
            assert r["prompt_logprobs"] is None
        if r["finish_reason"] == "stop" and "stop" in p and r["stop_reason"] in p["stop"]:
            stopped += 1
            assert r["stop_reason"] not in r["output_text"]
    assert stopped > 0  # the stop strings did stop some rows


def test_output_loads_everywhere(job_a):
    from tests.jobs.test_output_columns import assert_every_reader_reads

    assert_every_reader_reads(job_a["root"] / "out-a", job_a["table"],
                              job_a["root"] / "hf-cache")


@pytest.fixture(scope="module")
def job_b(job_a):
    """The same job again, into another directory, on one actor instead of two (so every
    shard runs on another engine, after other shards than in job_a)."""
    out_b = job_a["root"] / "out-b"
    run_job(_config(job_a["config"]["model"], job_a["root"] / "in", out_b, num_actors=1),
            progress=False)
    return read_output(out_b)


def test_second_run_is_bit_identical(job_a, job_b):
    # deterministic (the default): seeded and unseeded rows alike, floats to the last bit
    assert job_b.schema.equals(job_a["table"].schema)
    for name in job_b.column_names:
        assert job_b.column(name).equals(job_a["table"].column(name)), name
    parts_a = sorted((job_a["root"] / "out-a").glob("part-*.parquet"))
    parts_b = sorted((job_a["root"] / "out-b").glob("part-*.parquet"))
    assert [p.name for p in parts_a] == [p.name for p in parts_b] and len(parts_a) == 13
    for a, b in zip(parts_a, parts_b):
        assert a.read_bytes() == b.read_bytes(), a.name


def _float_values(value) -> list[float]:
    """The floats of a logprobs cell (a list, a list of top-k structs, or None), flattened."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [value["logprob"]]
    if isinstance(value, list):
        return [v for item in value for v in _float_values(item)]
    return [value]


def test_shards_that_share_the_engine_match_up_to_rounding(job_a, tmp_path):
    """deterministic: false with 40-row shards and an engine of 48 sequences: an actor holds
    three shards at once and their rows share steps (which rows, timing decides). Everything
    but the floats is job_a's; the floats move by rounding only. A sampled token may differ
    where the top two candidates tie within that rounding (``JobConfig.deterministic``): at
    most 1% of the rows."""
    out = tmp_path / "out-shared"
    result = run_job(_config(job_a["config"]["model"], job_a["root"] / "in", out,
                             deterministic=False), progress=False)
    table, clean = read_output(out), job_a["table"]
    assert result.errors == 0 and table.num_rows == clean.num_rows
    assert table.schema.equals(clean.schema)
    for name in ("id", "sample_index", "seed", "num_prompt_tokens", "group", "error"):
        assert table.column(name).equals(clean.column(name)), name
    rows, clean_rows = table.to_pylist(), clean.to_pylist()
    token_columns = ("output_text", "output_token_ids", "finish_reason", "stop_reason",
                     "sampled_ranks", "num_output_tokens")
    same = [i for i, (r, c) in enumerate(zip(rows, clean_rows))
            if all(r[k] == c[k] for k in token_columns)]
    assert len(same) >= 0.99 * len(rows), len(rows) - len(same)
    compared = 0
    for i in same:
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            got, want = _float_values(rows[i][name]), _float_values(clean_rows[i][name])
            assert len(got) == len(want), (i, name)
            assert all(g == w or (g is not None and abs(g - w) <= 1e-4)
                       for g, w in zip(got, want)), (i, name, got, want)
            compared += len(got)
    assert compared > 1000  # the mix asks for logprobs, top logprobs and prompt logprobs


def test_resume_after_killing_the_driver(job_a, ray_local):
    root = job_a["root"]
    out_c = root / "out-c"
    config = _config(job_a["config"]["model"], root / "in", out_c,
                     ray_address=ray_local.get_runtime_context().gcs_address)
    (root / "job-c.yaml").write_text(yaml.safe_dump(config))
    # commits paced at one per 0.5 s (RAYGEN_TEST_FAULTS=slow-commits): the shards of this
    # small job can otherwise all commit between two polls, and the kill would come too late
    driver = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "run", str(root / "job-c.yaml"),
                               "--no-progress"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env={**os.environ, FAULTS_ENV: "slow-commits"})
    try:
        committed: dict = {}
        deadline = time.monotonic() + 240
        while len(committed) < 3:
            assert driver.poll() is None, "the driver finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.2)
            if (out_c / MANIFEST).exists():
                committed = read_manifest(out_c)["committed"]
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    committed = read_manifest(out_c)["committed"]
    assert 3 <= len(committed) < 13 and not (out_c / SUCCESS).exists()
    before = part_stats(out_c)
    result = run_job({**config, "ray_address": None}, progress=False)
    after = part_stats(out_c)
    assert result.shards_skipped == len(committed)
    for entry in committed.values():  # not recomputed: same inode, same mtime
        assert after[entry["part"]] == before[entry["part"]]
    assert len(after) == 13 and not temporaries(out_c)
    assert_identical(read_output(out_c), job_a["table"])


def test_malformed_rows_become_error_rows(job_a):
    root = job_a["root"]
    good = job_a["rows"][:200]
    bad = malformed_rows()
    mixed = []
    for i, row in enumerate(good):
        mixed.append(row)
        if i % 10 == 4:
            mixed.append(bad[len(mixed) // 11])
    assert len(mixed) == 220
    (root / "in-bad").mkdir()
    pq.write_table(table_of(mixed, "json"), root / "in-bad" / "mixed.parquet")
    # deterministic (the default), and shards of 44 rows: shard k holds job_a's shard k (the
    # 40 good rows of a.parquet, in order) plus 4 malformed rows that never reach the engine,
    # so the good rows run in the same batches as in job_a and must equal it to the last bit
    config = _config(job_a["config"]["model"], root / "in-bad", root / "out-bad",
                     rows_per_shard=44)
    result = run_job(config, progress=False)
    table = read_output(root / "out-bad")
    errors = table.filter(pa.compute.equal(table.column("finish_reason"), "error"))
    assert result.errors == errors.num_rows == 20 and result.shards == 5
    assert sorted(errors.column("id").to_pylist()) == sorted(b["id"] for b in bad)
    shard_of = {r["id"]: i // 44 for i, r in enumerate(mixed)}
    for row in errors.to_pylist():
        expect = next(b["expect"] for b in bad if b["id"] == row["id"])
        assert row["error"].startswith(f"row id {row['id']!r} (shard {shard_of[row['id']]}): ")
        assert expect in row["error"], row["error"]
    good_ids = pa.array([r["id"] for r in good])
    ok = table.filter(pa.compute.is_in(table.column("id"), value_set=good_ids))
    clean = job_a["table"].filter(pa.compute.is_in(job_a["table"].column("id"),
                                                   value_set=good_ids))
    assert_identical(ok, clean)
