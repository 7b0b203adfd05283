"""What a user reads from a job's output: the directory loads in every common reader, the
prompt is carried along, vLLM's finish/stop semantics, per-sample seeds, prompt logprob ids."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from jobs.manifest import MANIFEST, SUCCESS
from jobs.runner import run_job
from tests.jobs.helpers import read_output, write_parquet

pytestmark = [pytest.mark.ray]


def assert_every_reader_reads(out: Path, expected: pa.Table, cache: Path) -> None:
    """HF datasets, polars, pandas, pyarrow.dataset, DuckDB and Ray Data, each given the output
    directory as a user passes it, read every row (and no marker)."""
    import datasets
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as pads
    import ray

    want = Counter(expected.column("id").to_pylist())
    hf = datasets.load_dataset("parquet", data_dir=str(out), split="train",
                               cache_dir=str(cache))
    got = {
        "datasets": Counter(hf["id"]),
        "polars": Counter(pl.read_parquet(out)["id"].to_list()),
        "pandas": Counter(pd.read_parquet(out)["id"].tolist()),
        "pyarrow.dataset": Counter(pads.dataset(out, format="parquet").to_table()
                                   .column("id").to_pylist()),
        "duckdb": Counter(r[0] for r in duckdb.sql(
            f"select id from read_parquet('{out}/*.parquet')").fetchall()),
        "ray.data": Counter(r["id"] for r in ray.data.read_parquet(str(out)).take_all()),
    }
    for reader, ids in got.items():
        assert ids == want, reader
    assert hf.features["seed"].dtype == "int64"


@pytest.fixture(scope="module")
def tokens(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    word = tok.encode("robot", add_special_tokens=False)[0]
    return {"eos": tok.eos_token_id, "word": word, "text": tok.decode([word]).strip()}


ROWS_PER_SHARD = 4


def _alive_generation_actors() -> set[str]:
    from ray._private.state import actors

    return {a["ActorID"] for a in actors(actor_state_name="ALIVE").values()
            if "GenerationActor" in a.get("ActorClassName", "")}


def test_the_jobs_actors_are_gone_when_it_returns(job):
    # killed and waited for: none is left for a Ray shutdown to stop with SIGTERM (a normal
    # interpreter exit, where Triton's nanobind bindings print a leak report)
    before, after = job["alive"]
    assert after <= before


@pytest.fixture(scope="module")
def job(ray_local, tiny_llama, tokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("columns")
    eos, word, text = tokens["eos"], tokens["word"], tokens["text"]
    greedy = {"temperature": 0.0, "max_tokens": 6}
    rows = [
        {"id": "text", "prompt": "the quick fox", "params": {"prompt_logprobs": 2}},
        {"id": "chat", "messages": [{"role": "user", "content": "hello there"}]},
        {"id": "ids", "prompt_token_ids": [5, 17, 42, 99]},
        {"id": "eos", "prompt": "a b", "params": {**greedy, "logit_bias": {str(eos): 100}}},
        {"id": "stop-id", "prompt": "a b", "params": {
            **greedy, "logit_bias": {str(word): 100}, "stop_token_ids": [word]}},
        {"id": "stop-str", "prompt": "a b", "params": {
            **greedy, "logit_bias": {str(word): 100}, "stop": [text]}},
        {"id": "n3", "prompt": "sunny rain", "params": {"n": 3, "seed": 5, "temperature": 1.0}},
        {"id": "bad", "prompt": "fine", "params": {"top_p": 7}},
    ]
    write_parquet(root / "in.parquet", [
        {"id": r["id"], "prompt": r.get("prompt"), "messages": r.get("messages"),
         "prompt_token_ids": r.get("prompt_token_ids"),
         "sampling_params": json.dumps(r.get("params", {}))} for r in rows])
    config = {"model": tiny_llama, "input": str(root / "in.parquet"), "output": str(root / "out"),
              "num_actors": 1, "num_gpus_per_actor": 0, "rows_per_shard": ROWS_PER_SHARD,
              "sampling_params": {"max_tokens": 5, "temperature": 0.8},
              "engine": {"max_num_seqs": 8, "max_model_len": 128},
              "write_sampling_params": True}
    alive_before = _alive_generation_actors()
    result = run_job(config, progress=False)
    alive_after = _alive_generation_actors()
    table = read_output(root / "out")
    return {"root": root, "out": root / "out", "result": result, "table": table,
            "alive": (alive_before, alive_after),
            "rows": {r["id"]: r for r in table.to_pylist()}, "config": config,
            "samples": [r for r in table.to_pylist() if r["id"] == "n3"]}


def test_output_directory_loads_in_every_reader(job):
    out = job["out"]
    assert (out / SUCCESS).is_file() and (out / MANIFEST).is_file()
    assert sorted(p.name for p in out.iterdir()) == [
        ".raygen", "part-00000.parquet", "part-00001.parquet"]
    assert_every_reader_reads(out, job["table"], job["root"] / "hf-cache")


def test_the_prompt_is_carried_to_the_output(job):
    rows = job["rows"]
    assert rows["text"]["prompt"] == "the quick fox" and rows["text"]["messages"] is None
    assert rows["chat"]["messages"] == [{"role": "user", "content": "hello there"}]
    assert rows["ids"]["prompt_token_ids"] == [5, 17, 42, 99]
    assert rows["bad"]["prompt"] == "fine" and rows["bad"]["finish_reason"] == "error"
    assert "sampling_params.top_p" in rows["bad"]["error"]


def test_prompt_logprobs_come_with_their_token_ids_and_top_k(job):
    row = job["rows"]["text"]
    ids, values, tops = row["prompt_token_ids"], row["prompt_logprobs"], row["prompt_top_logprobs"]
    assert len(ids) == len(values) == len(tops) == row["num_prompt_tokens"] > 2
    assert values[0] is None and tops[0] is None
    for token, value, top in zip(ids[1:], values[1:], tops[1:]):
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] >= value - 1e-5
        for entry in top:  # the prompt's own token, where among the top-k, has its value
            if entry["token_id"] == token:
                assert entry["logprob"] == pytest.approx(value, abs=1e-5)
    assert job["rows"]["chat"]["prompt_top_logprobs"] is None


def test_finish_and_stop_reasons_as_vllm(job, tokens):
    rows = job["rows"]
    eos = rows["eos"]
    assert (eos["finish_reason"], eos["stop_reason"], eos["stop_token_id"]) == ("stop", None, None)
    assert eos["output_token_ids"] == [tokens["eos"]]
    stop_id = rows["stop-id"]
    assert (stop_id["finish_reason"], stop_id["stop_reason"]) == ("stop", None)
    assert stop_id["stop_token_id"] == tokens["word"]
    stop_str = rows["stop-str"]
    assert (stop_str["finish_reason"], stop_str["stop_token_id"]) == ("stop", None)
    assert stop_str["stop_reason"] == tokens["text"]
    assert rows["chat"]["finish_reason"] in ("length", "stop")


def test_each_sample_has_its_own_seed_and_params_that_reproduce_it(job, tiny_llama):
    from actors.engine.llm_engine import Engine
    from sampler import SamplingParams

    samples = job["samples"]
    assert [s["sample_index"] for s in samples] == [0, 1, 2]
    assert samples[0]["seed"] == 5 and len({s["seed"] for s in samples}) == 3
    engine = Engine(tiny_llama, {**job["config"]["engine"], "device": "cpu"})
    for s in samples:
        params = json.loads(s["sampling_params"])
        assert params["n"] == 1 and params["seed"] == s["seed"]
        [alone] = engine.generate([("x", "sunny rain", SamplingParams.from_dict(params))])
        assert alone.output_token_ids == s["output_token_ids"]
    assert job["rows"]["bad"]["sampling_params"] is None
