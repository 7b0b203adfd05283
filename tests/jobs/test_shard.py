"""One shard in-process (no Ray), with the fake engine: rows, requests, errors, the part file."""

from __future__ import annotations

import dataclasses
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.contract.schema import output_schema
from actors.serving import EngineServer
from actors.shard import (ShardResult, process_shard, read_rows, warm_up_io,
                          write_failed_shard)
from jobs.config import JobConfig
from jobs.sources import discover
from jobs.plan import make_task, plan_shards
from jobs.storage import resolve
from sampler import derive_seed
from tests.jobs.fakes import FakeEngine
from tests.jobs.helpers import write_jsonl, write_parquet


def _tasks(tmp_path, rows_per_shard=4, **kw):
    cfg = JobConfig.from_dict({"model": "m", "input": str(tmp_path / "in"),
                               "output": str(tmp_path / "out"), "rows_per_shard": rows_per_shard,
                               "seed": 7, **kw})
    spec = discover(cfg)
    out = resolve(cfg.output)
    out.fs.create_dir(out.path)
    return [make_task(s, 1, spec, cfg, out) for s in plan_shards(spec, rows_per_shard)]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_read_rows_crosses_row_groups_and_blocks(tmp_path, fmt):
    rows = [{"id": i, "prompt": f"p{i}"} for i in range(23)]
    if fmt == "parquet":
        write_parquet(tmp_path / "in" / "a.parquet", rows, row_group_size=5)
    else:
        write_jsonl(tmp_path / "in" / "a.jsonl", rows)
    tasks = _tasks(tmp_path, rows_per_shard=7)
    got = [read_rows(t).column("id").to_pylist() for t in tasks]
    assert got == [list(range(0, 7)), list(range(7, 14)), list(range(14, 21)), [21, 22]]


def test_rows_become_requests_and_errors_name_row_and_shard(tmp_path):
    rows = [
        {"id": "a", "prompt": "one two", "sampling_params": {"n": 2, "seed": 5, "logprobs": 2}},
        {"id": "b", "prompt": "three", "sampling_params": {"temperature": None}},
        {"id": "c", "prompt": "x", "sampling_params": {"top_p": 5.0}},
        {"id": "d", "prompt": None, "sampling_params": None},
        {"id": "e", "prompt": "", "sampling_params": None},
        {"id": "f", "prompt": "ok", "sampling_params": {"prompt_logprobs": 0}},
    ]
    write_jsonl(tmp_path / "in" / "a.jsonl", rows)
    [task] = _tasks(tmp_path, rows_per_shard=10, sampling_params={"max_tokens": 3})
    result = process_shard(task, EngineServer(FakeEngine()).run)
    part = pq.read_table(tmp_path / "out" / task.part_name)
    assert part.schema.equals(output_schema(pa.string(), pa.schema([("prompt", pa.string())])))
    assert part.column("id").to_pylist() == ["a", "a", "b", "c", "d", "e", "f"]
    assert part.column("sample_index").to_pylist() == [0, 1, 0, 0, 0, 0, 0]
    errors = dict(zip(part.column("id").to_pylist(), part.column("error").to_pylist()))
    assert errors["c"] == "row id 'c' (shard 0): sampling_params.top_p: must be in (0, 1], got 5.0"
    assert errors["d"].startswith("row id 'd' (shard 0): no prompt")
    assert errors["e"] == "row id 'e' (shard 0): prompt is empty"
    assert errors["a"] is None and errors["f"] is None
    seeds = dict(zip(part.column("id").to_pylist(), part.column("seed").to_pylist()))
    assert seeds["a"] == 5 and seeds["b"] == derive_seed(7, "b") and seeds["c"] is None
    assert part.column("finish_reason").to_pylist()[3:6] == ["error"] * 3
    assert part.column("num_output_tokens").to_pylist()[:3] == [3, 3, 3]
    assert [len(x) for x in part.column("logprobs").to_pylist()[:2]] == [3, 3]
    assert result.errors == 3 and result.output_rows == 7 and result.rows == 6
    assert not list((tmp_path / "out").glob(".*"))


def test_generated_ids_and_passthrough(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [{"prompt": f"p {i}", "tag": i}
                                                  for i in range(3)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"prompt_token_ids": [1, 2, 3], "note": "x"}])
    tasks = _tasks(tmp_path, rows_per_shard=2)
    server = EngineServer(FakeEngine())
    for t in tasks:
        process_shard(t, server.run)
    table = pq.read_table(tmp_path / "out")
    assert table.column("id").to_pylist() == ["0", "1", "2", "3"]
    assert table.column("tag").to_pylist() == [0, 1, 2, None]
    assert table.column("note").to_pylist() == [None, None, None, "x"]
    assert table.column("num_prompt_tokens").to_pylist() == [2, 2, 2, 3]


def test_failed_shard_writes_every_row_as_error(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "prompt": "p"} for i in range(5)])
    task = _tasks(tmp_path, rows_per_shard=3)[1]
    result = write_failed_shard(task, "shard failed after 3 attempts, last: boom")
    part = pq.read_table(tmp_path / "out" / task.part_name)
    assert part.column("id").to_pylist() == [3, 4] and result.errors == 2
    assert part.column("error").to_pylist()[0] == (
        "row id 3 (shard 1): shard failed after 3 attempts, last: boom")


def test_params_column_as_json_string(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [
        {"id": 1, "prompt": "a b", "sampling_params": json.dumps({"n": 3, "max_tokens": 2})},
        {"id": 2, "prompt": "c", "sampling_params": "{not json"}])
    [task] = _tasks(tmp_path)
    process_shard(task, EngineServer(FakeEngine()).run)
    part = pq.read_table(tmp_path / "out" / task.part_name)
    assert part.column("id").to_pylist() == [1, 1, 1, 2]
    assert "row id 2 (shard 0): sampling_params: not valid JSON" in part.column("error")[3].as_py()


def test_logit_bias_from_struct_and_map_columns(tmp_path):
    struct = pa.array([{"logit_bias": {"5": 1.0, "7": None}, "seed": 1},
                       {"logit_bias": {"5": None, "7": -2.0}, "seed": 2}])
    mapped = pa.array([[(5, 1.0)], [(7, -2.0)]], pa.map_(pa.int64(), pa.float64()))
    mapped = pa.StructArray.from_arrays([mapped, pa.array([1, 2])], ["logit_bias", "seed"])
    for name, params in (("struct", struct), ("map", mapped)):
        root = tmp_path / name
        (root / "in").mkdir(parents=True)
        pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"], "sampling_params": params}),
                       root / "in" / "a.parquet")
        [task] = _tasks(root)
        seen = []

        def run(requests):
            seen.extend(p.logit_bias for _, _, p in requests)
            return EngineServer(FakeEngine()).run(requests)

        process_shard(task, run)
        assert seen == [{5: 1.0}, {7: -2.0}], name


def test_null_id_is_an_error_row_named_by_position(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": "x", "prompt": "p q"},
                                              {"id": None, "prompt": "p q"}])
    [task] = _tasks(tmp_path)
    process_shard(task, EngineServer(FakeEngine()).run)
    errors = pq.read_table(tmp_path / "out" / task.part_name).column("error").to_pylist()
    assert errors[0] is None
    assert errors[1] == (f"row 1 of {tmp_path / 'in' / 'a.jsonl'} (shard 0): id: the 'id' "
                         "column is null")


def test_jsonl_rows_whose_params_disagree_on_types_fail_one_by_one(tmp_path):
    rows = [{"id": "a", "prompt": "x y", "sampling_params": {"stop": "e", "max_tokens": 2}},
            {"id": "b", "prompt": "x", "sampling_params": {"stop": ["e", "o"]}},
            {"id": "c", "prompt": "x", "sampling_params": {"temperature": "hot"}},
            {"id": "d", "prompt": "x", "sampling_params": "{\"seed\": 3}"},
            {"id": "e", "prompt": "x", "sampling_params": {"tempature": None, "n": 2}}]
    write_jsonl(tmp_path / "in" / "a.jsonl", rows)  # pyarrow cannot type this as one table
    [task] = _tasks(tmp_path, rows_per_shard=10)
    assert task.input_format == "jsonl-text-params"
    process_shard(task, EngineServer(FakeEngine()).run)
    part = pq.read_table(tmp_path / "out" / task.part_name)
    assert part.column("id").to_pylist() == ["a", "b", "c", "d", "e", "e"]
    errors = part.column("error").to_pylist()
    assert errors[2] == ("row id 'c' (shard 0): sampling_params.temperature: must be a "
                         "number, got 'hot'")
    assert [e for i, e in enumerate(errors) if i != 2] == [None] * 5
    assert part.column("seed").to_pylist()[3] == 3
    assert part.column("num_output_tokens").to_pylist()[:2] == [2, 16]


def test_shard_timing_line():
    result = ShardResult(shard_id=3, attempt=1, part="part-00003.parquet", rows=8,
                         output_rows=8, errors=0, output_tokens=64, prompt_tokens=32,
                         seconds=4.2, phases={"prepare": 0.08, "generate": 3.67, "write": 0.44},
                         engine={"queued_s": 1.8, "run_s": 1.85, "steps": 130, "busy_s": 1.84,
                                 "device_wait_s": 1.05})
    assert result.timing() == ("prepare 0.08 s, generate 3.67 s (queued 1.80 s; 130 steps in "
                               "1.85 s: 14.2 ms a step, host 6.1, waiting for the device 8.1), "
                               "write 0.44 s")
    result.engine["cpu_s"] = 0.676  # the stepping thread's CPU time, when reported
    assert "14.2 ms a step, host 6.1 (on a CPU 5.2), waiting for the device 8.1)" in \
        result.timing()
    result.engine["seqs"] = 130 * 250  # the sequences of those steps: their mean batch
    assert "130 steps of 250 sequences in 1.85 s: 14.2 ms a step" in result.timing()
    result.engine = {}  # an engine without counters: the phases alone
    assert result.timing() == "prepare 0.08 s, generate 3.67 s, write 0.44 s"


def test_warm_up_io_round_trips_a_part_like_table_in_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seconds = warm_up_io()
    assert isinstance(seconds, float) and seconds >= 0.0
    assert list(tmp_path.iterdir()) == []  # nothing written to disk


@pytest.mark.parametrize("params", [
    {"allowed_token_ids": [], "stop": "e", "seed": -2},   # a bad seed and a bad list
    {"seed": 2 ** 70, "top_p": 5.0},                      # a bad seed and a bad float
    {"top_k": -7, "seed": "x"},
])
def test_a_row_with_a_bad_seed_and_another_bad_field_names_one_field_in_every_form(
        tmp_path, params):
    """A per-row seed is validated apart from the row's other params (those are validated
    once per distinct value); a row with a bad seed and another bad field must still name
    the field that validating the whole row names, whatever form its params come in."""
    errors = {}
    for form in ("object", "text"):
        root = tmp_path / form
        cell = params if form == "object" else json.dumps(params)
        write_jsonl(root / "in" / "a.jsonl", [{"id": "r", "prompt": "p", "sampling_params": cell}])
        [task] = _tasks(root, rows_per_shard=10, sampling_params={"max_tokens": 2})
        process_shard(task, EngineServer(FakeEngine()).run)
        [error] = pq.read_table(root / "out" / task.part_name).column("error").to_pylist()
        assert error and error.startswith("row id 'r' (shard 0): sampling_params."), error
        errors[form] = error
    assert errors["object"] == errors["text"]


class _BuildingEngine(FakeEngine):
    """A FakeEngine with ``build_requests``: records the thread that built each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.built_on: list[str] = []

    def build_requests(self, requests):
        import threading

        self.built_on.append(threading.current_thread().name)
        return [("built", rid, prompt, params) for rid, prompt, params in requests]

    def add_requests(self, requests, *, fresh_prefix_cache=False):
        super().add_requests([item[1:] for item in requests],
                             fresh_prefix_cache=fresh_prefix_cache)


def test_a_prefetched_shard_writes_the_same_part_and_is_built_on_the_prefetch_thread(tmp_path):
    from actors.shard import ShardPrefetch

    rows = [{"id": f"r{i}", "prompt": f"p {i}", "sampling_params": {"max_tokens": 1 + i % 3}}
            for i in range(9)] + [{"id": "bad", "prompt": "x", "sampling_params": {"top_p": 5}}]
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    [task] = _tasks(tmp_path, rows_per_shard=16)
    plain = process_shard(task, EngineServer(_BuildingEngine()).run)
    expected = pq.read_table(tmp_path / "out" / task.part_name)

    engine = _BuildingEngine()
    prefetch = ShardPrefetch(task)
    other = dataclasses.replace(task, attempt=2)
    assert prefetch.take(other) is None  # attempt 2 of the shard is not what was read
    prefetch.engine_ready(engine)
    prepared = prefetch.take(task)
    assert prepared is not None and prepared.built is not None
    assert engine.built_on == ["shard-prefetch"]
    assert prefetch.take(task) is None  # handed out once
    result = process_shard(task, EngineServer(engine).run, prepared)
    assert engine.built_on == ["shard-prefetch"]  # not built again by the run
    assert pq.read_table(tmp_path / "out" / task.part_name).equals(expected)
    assert set(result.phases) == {"prefetch", "prepare", "generate", "write"}
    assert set(plain.phases) == {"prepare", "generate", "write"}
    assert result.errors == plain.errors == 1


def test_a_prefetch_that_fails_leaves_the_shard_to_meet_the_error_itself(tmp_path):
    from actors.shard import ShardPrefetch

    write_parquet(tmp_path / "in" / "a.parquet", [{"id": 1, "prompt": "p"}])
    [task] = _tasks(tmp_path, rows_per_shard=4)
    (tmp_path / "in" / "a.parquet").unlink()  # gone after planning
    prefetch = ShardPrefetch(task)
    prefetch.cancel()  # no engine: the thread ends after reading
    assert prefetch.take(task) is None and isinstance(prefetch.error, OSError)
    with pytest.raises(OSError):
        process_shard(task, EngineServer(FakeEngine()).run)


def test_an_actor_given_its_first_shard_reads_and_builds_it_while_the_model_loads(
        tmp_path, tiny_llama, monkeypatch):
    import threading

    from actors.actor import GenerationActor
    from actors.engine.llm_engine import Engine

    built_on = []
    real_build = Engine.build_requests

    def spy(self, requests, **kw):
        built_on.append(threading.current_thread().name)
        return real_build(self, requests, **kw)

    monkeypatch.setattr(Engine, "build_requests", spy)
    rows = [{"id": i, "prompt_token_ids": [3 + i, 4, 5], "sampling_params":
             {"max_tokens": 2 + i % 3, "seed": i, "temperature": 0.7, "logprobs": i % 2}}
            for i in range(6)]
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    [task] = _tasks(tmp_path, rows_per_shard=8)
    engine_config = {"max_num_seqs": 4, "num_kv_blocks": 64, "max_model_len": 64}
    plain = GenerationActor(tiny_llama, engine_config).process_shard(task)
    expected = pq.read_table(tmp_path / "out" / task.part_name)
    assert built_on == ["MainThread"] and "prefetch" not in plain.phases

    built_on.clear()
    actor = GenerationActor(tiny_llama, engine_config, first_shard=task)
    result = actor.process_shard(task)
    assert built_on == ["shard-prefetch"]  # built ahead, once
    assert set(result.phases) == {"prefetch", "prepare", "generate", "write"}
    assert pq.read_table(tmp_path / "out" / task.part_name).equals(expected)
    again = actor.process_shard(task)  # a second call of that shard reads it itself
    assert "prefetch" not in again.phases and built_on == ["shard-prefetch", "MainThread"]


def test_a_trace_records_every_step_the_shard_phases_and_collections(tmp_path, tiny_llama,
                                                                      monkeypatch):
    import gc

    from actors.engine import profiling
    from actors.actor import GenerationActor

    rows = [{"id": i, "prompt_token_ids": [3 + i, 4, 5, 6][: 2 + i % 3],
             "sampling_params": {"max_tokens": 2 + i % 4, "seed": i, "logprobs": 1}}
            for i in range(5)]
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    [task] = _tasks(tmp_path, rows_per_shard=8)
    actor = GenerationActor(tiny_llama, {"max_num_seqs": 4, "num_kv_blocks": 64,
                                         "max_model_len": 64})
    trace = profiling.Trace(str(tmp_path / "trace"))
    monkeypatch.setattr(profiling, "trace", trace)
    try:
        result = actor.process_shard(task)
        gc.collect()
    finally:
        trace.close()
    trace.dump()
    data = json.loads((tmp_path / "trace" / f"trace-{os.getpid()}.json").read_text())
    part = pq.read_table(tmp_path / "out" / task.part_name)
    # every token the engine computed: prompts, then each output token but the last
    computed = (sum(part.column("num_prompt_tokens").to_pylist())
                + sum(part.column("num_output_tokens").to_pylist()) - part.num_rows)
    assert sum(step[4] for step in data["steps"]) == computed
    assert len([s for s in data["steps"] if s[4]]) == result.engine["steps"]
    assert all(end > 0 and host >= wait >= 0 for end, host, wait, _, _ in data["steps"])
    kinds = [e[0] for e in data["events"] if e[0] != "gc"]
    assert kinds == ["prepare", "build", "batch", "write"]
    assert [e[4] for e in data["events"] if e[0] == "gc" and e[1] == "MainThread"][-1] == 2
    assert gc.callbacks.count(trace._on_gc) == 0


def test_a_chat_message_without_content_is_a_row_error(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", [
        {"id": "ok", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "none", "messages": [{"role": "user"}]},
        {"id": "null", "messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": None}]},
    ])
    [task] = _tasks(tmp_path, rows_per_shard=10, sampling_params={"max_tokens": 2})
    result = process_shard(task, EngineServer(FakeEngine()).run)
    part = pq.read_table(tmp_path / "out" / task.part_name)
    errors = dict(zip(part.column("id").to_pylist(), part.column("error").to_pylist()))
    assert errors == {
        "ok": None,
        "none": "row id 'none' (shard 0): messages: message 0 of the 'messages' column has no "
                "content",
        "null": "row id 'null' (shard 0): messages: message 1 of the 'messages' column has no "
                "content"}
    assert result.errors == 2
