"""Smoke test of benchmarks/structured_bench.py on a tiny model (CPU in CI; the H200 run is
the benchmark itself)."""

from __future__ import annotations

import json

from tests.benchmarks.helpers import load_benchmark


def test_tiny_workload_writes_every_figure(tmp_path):
    from actors.engine import structured_sequence

    bench = load_benchmark("structured_bench")
    before = structured_sequence.ROWS_PER_TEMPLATE
    result = bench.main(["--workload", "tiny", "--out", str(tmp_path), "--tmp", str(tmp_path),
                         "--reps", "2", "--compile-samples", "4", "--pairs", "2",
                         "--max-batched-tokens", "128", "--trace", "--rows-per-template", "2",
                         "--max-templates", "3"])
    assert structured_sequence.ROWS_PER_TEMPLATE == before  # set for the run only
    saved = json.loads((tmp_path / "structured_bench.json").read_text())
    assert saved == json.loads(json.dumps(result))
    n = result["num_prompts"]
    plain = result["unconstrained"]
    assert plain["output_tokens"] == n * result["output_len"]
    for key in ("one_schema", "distinct_schemas"):
        run = result[key]
        assert run["finish_reasons"]["error"] == 0
        assert sum(run["finish_reasons"].values()) == n and run["output_tok_s"] > 0
    assert result["one_schema_ratio"] > 0 and result["compile_s_per_schema"] > 0
    # the ratio is of the medians of alternating timed pairs, each pair the same tokens
    one = result["one_schema"]
    pairs = one["pairs_out_tok_s"]
    assert len(pairs) == 2 and one["lengths_as_warm_up"]
    assert one["output_tok_s"] == min(g for g, _ in pairs)  # of two, the slower
    assert result["one_schema_unconstrained"]["output_tok_s"] == min(u for _, u in pairs)
    assert result["one_schema_ratio"] == one["output_tok_s"] / min(u for _, u in pairs)
    assert result["one_schema_unconstrained"]["output_tokens"] == one["output_tokens"]
    # --trace: the ahead fill's phases of each constrained run, a call each step it ran
    trace = result["one_schema"]["trace"]
    for phase in ("ids_wait", "accept", "fill", "ahead", "step_mask"):
        assert trace[phase]["calls"] > 0 and trace[phase]["median_ms"] > 0, phase
    assert trace["ahead"]["calls"] == trace["ids_wait"]["calls"]
    # the chain's timeline, from the end of each advance: the ahead fill's thread starts,
    # has the ids, accepts them and ends in that order; step_mask is left after it is entered
    at = {k[3:]: v["median_ms"] for k, v in trace.items() if k.startswith("at_")}
    assert trace["at_start"]["calls"] == trace["ahead"]["calls"]
    assert 0 <= at["start"] <= at["ids"] <= at["accept"] <= at["ahead"]
    assert at["step_mask"] <= at["step_mask_end"] and at["sample"] <= at["sample_end"]
    assert "trace" not in plain
    assert [s["rows"] for s in result["sampler_steps"]] == [4, 8]
    assert all(s["sampler_masked_ms"] > 0 and s["mask_fill_ms"] > 0
               for s in result["sampler_steps"])


def test_no_length_limits_a_pinned_stepping_thread_and_the_fill_threads(tmp_path):
    import os

    bench = load_benchmark("structured_bench")
    before = os.sched_getaffinity(0)
    cpu = min(before)
    result = bench.main(["--workload", "tiny", "--out", str(tmp_path), "--tmp", str(tmp_path),
                         "--reps", "1", "--compile-samples", "2", "--pairs", "1",
                         "--max-batched-tokens", "128", "--no-length-limits",
                         "--step-cpu", str(cpu), "--fill-threads", "3"])
    assert "one_schema" in result and result["one_schema_ratio"] > 0
    assert result["fill_threads"] == 3
    assert not any(key.startswith("one_schema_length_limits") for key in result)
    # the stepping thread ran the constrained runs on that CPU; its mask is given back
    assert result["step_cpus"]["cpus"] == [cpu]
    assert set(result["step_cpus"]["probe_ms"]) == before
    assert os.sched_getaffinity(0) == before


def test_a_saved_tokenizer_lists_its_added_tokens_and_loads_without_its_json_parsed(
        tmp_path, monkeypatch):
    """The benchmarks' tokenizer directories hold the added tokens in
    ``tokenizer_config.json``, as released checkpoints do: the tokenizer loads the same, and
    its ``tokenizer.json`` is not parsed in Python."""
    import builtins

    from transformers import AutoTokenizer

    from toolkit.tiny_model import train_tokenizer

    vocab = load_benchmark("bench_vocab")
    tok = train_tokenizer(512)
    vocab.save_tokenizer(tok, tmp_path)
    listed = json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {int(i): t["content"] for i, t in listed.items()} == \
        {i: t.content for i, t in tok.added_tokens_decoder.items()}
    opened: list[str] = []
    real_open = builtins.open

    def spy_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    monkeypatch.undo()
    assert not any(name.endswith("tokenizer.json") for name in opened)
    text = "hello <|endoftext|> world"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.all_special_ids == tok.all_special_ids and len(loaded) == len(tok)
