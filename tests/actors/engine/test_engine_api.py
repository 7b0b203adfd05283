"""Engine API: abort, thread-safe add_request, generate() alongside other requests, the async
step structure (one step in flight), and GenerationActor."""

from __future__ import annotations

import gc
import threading

import pytest

from actors.actor import GenerationActor
from actors.engine.generation_output import SCHEMA_FIELDS, GenerationOutput
from sampler import SamplingParams
from tests.actors.helpers import make_engine

LONG = SamplingParams(temperature=1.0, max_tokens=200, seed=1, ignore_eos=True, logprobs=1)


def drain(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_abort_running_and_waiting_requests(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    engine.add_request("run", [5, 6, 7], LONG)
    engine.add_request("fan", [8, 9], LONG.replace(n=2))  # waits: needs 2 free slots
    for _ in range(6):
        assert engine.step() == []
    engine.abort_request("run")
    engine.abort_request("fan")
    engine.abort_request("unknown")
    outs = engine.step()
    assert [(o.id, o.sample_index, o.finish_reason) for o in outs] == [
        ("run", 0, "abort"), ("fan", 0, "abort"), ("fan", 1, "abort")]
    run = outs[0]
    assert 3 <= run.num_output_tokens <= 6  # what was known when the abort arrived
    assert len(run.logprobs) == len(run.sampled_ranks) == run.num_output_tokens
    assert isinstance(run.output_text, str)
    assert drain(engine) == []
    bm = engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(engine.scheduler.free_slots) == [0, 1]


def test_abort_a_running_request_of_several_samples_frees_them_all(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=4)
    engine.add_request("fan", [8, 9], LONG.replace(n=3))
    engine.add_request("other", [5, 6], SamplingParams(max_tokens=8, seed=1, ignore_eos=True))
    for _ in range(4):
        assert engine.step() == []
    engine.abort_request("fan")
    outs = engine.step()
    assert [(o.id, o.sample_index, o.finish_reason) for o in outs] == [
        ("fan", 0, "abort"), ("fan", 1, "abort"), ("fan", 2, "abort")]
    assert all(2 <= o.num_output_tokens <= 4 for o in outs)
    rest = drain(engine)
    assert [(o.id, o.finish_reason, o.num_output_tokens) for o in rest] == [("other", "length", 8)]
    bm = engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2, 3]
    assert engine.sampler.state.active.sum() == 0


def test_one_step_in_flight(tiny_llama):
    """Step N's tokens are read while step N+1 runs: the first token comes back from the
    second step() call, and the last output needs a final step with nothing to launch."""
    engine = make_engine(tiny_llama)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, seed=0, ignore_eos=True))
    calls = [engine.step() for _ in range(4)]
    assert [len(c) for c in calls] == [0, 0, 0, 1]
    assert calls[3][0].num_output_tokens == 3
    assert engine.stats.num_steps == 4 and not engine.has_unfinished_requests()
    counters = engine.counters  # 3 launches (prefill + 2 decodes); the 4th call only reads
    assert counters.steps == 3
    assert 0 <= counters.device_wait_s <= counters.busy_s
    # thread CPU time outside the waits: positive (the steps ran a model) and within the
    # wall time outside the waits (the clocks tick at different grains: 1 ms of slack)
    assert 0 < counters.cpu_s <= counters.busy_s - counters.device_wait_s + 1e-3


def test_server_reports_where_a_call_spent_its_time(tiny_llama):
    from actors.serving import EngineServer

    engine = make_engine(tiny_llama)
    server = EngineServer(engine)
    params = SamplingParams(max_tokens=5, seed=0, ignore_eos=True)
    first, second = {}, {}
    outs = server.run([("a", [5, 6, 7], params), ("b", [8, 9], params)], exclusive=True,
                      stats=first)
    assert sorted(o.id for o in outs) == ["a", "b"] and all(o.num_output_tokens == 5
                                                           for o in outs)
    assert first["steps"] == 5  # both prompts in one prefill step, then 4 decode steps
    assert 0 <= first["device_wait_s"] <= first["busy_s"] <= first["run_s"]
    assert 0 < first["cpu_s"] <= first["busy_s"] + 1e-3
    assert first["queued_s"] >= 0
    server.run([("c", [5, 6], params.replace(max_tokens=2))], exclusive=True, stats=second)
    assert second["steps"] == 2  # the call's own steps only


def test_engine_loop_profile_is_written_when_asked(tiny_llama, tmp_path, monkeypatch):
    """RAYGEN_PROFILE_DIR: the engine loop's thread runs under cProfile and its statistics are
    written when a call's requests are done; without it, nothing is written."""
    import pstats

    from actors.serving import EngineServer

    params = SamplingParams(max_tokens=3, seed=0, ignore_eos=True)
    monkeypatch.setenv("RAYGEN_PROFILE_DIR", str(tmp_path / "prof"))
    server = EngineServer(make_engine(tiny_llama))
    server.run([("a", [5, 6, 7], params)], exclusive=True)
    files = list((tmp_path / "prof").glob("engine-loop-*.pstats"))
    assert len(files) == 1
    stats = pstats.Stats(str(files[0])).stats  # {(file, line, function): (cc, nc, tt, ct, ...)}
    steps = [v for (f, _, fn), v in stats.items() if fn == "step" and f.endswith("engine.py")]
    assert steps and steps[0][1] >= 3  # at least one call per token (the loop thread's)
    monkeypatch.delenv("RAYGEN_PROFILE_DIR")
    EngineServer(make_engine(tiny_llama)).run([("b", [5, 6], params)], exclusive=True)
    assert list((tmp_path / "prof").iterdir()) == files


def test_token_sampled_after_a_stop_is_dropped(tiny_llama):
    """A stop is only seen a step late, so the next step already sampled for the request:
    that token is dropped."""
    engine = make_engine(tiny_llama)
    eos = engine.tokenizer.eos_token_id
    rows = []
    original = engine.sampler.sample

    def sample(logits, slots, **kwargs):
        rows.append(len(slots))
        return original(logits, slots, **kwargs)

    engine.sampler.sample = sample
    out = engine.generate([("a", [5, 6, 7], SamplingParams(
        max_tokens=50, min_tokens=2, logit_bias={eos: 100.0}, seed=0))])[0]
    assert out.output_token_ids[-1] == eos and out.num_output_tokens == 3
    assert sum(rows) == 4  # one more token was sampled than the output holds


def test_add_request_from_other_threads_while_stepping(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=4)
    params = SamplingParams(temperature=0.7, max_tokens=5, seed=2, ignore_eos=True)
    expected = {o.id: o.output_token_ids for o in engine.generate(
        [(i, [5 + i, 6, 7], params) for i in range(12)])}

    started = threading.Event()

    def producer(offset):
        started.wait()
        for i in range(offset, 12, 3):
            engine.add_request(i, [5 + i, 6, 7], params)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    got: dict = {}
    started.set()
    while len(got) < 12:
        for out in engine.step():
            got[out.id] = out.output_token_ids
    for t in threads:
        t.join()
    assert got == expected


def test_requests_built_on_another_thread_run_as_queued_ones(tiny_llama):
    """build_requests on a second thread while the engine steps, then add_requests: the same
    outputs, errors and duplicate handling as requests queued raw."""
    params = SamplingParams(temperature=0.7, max_tokens=5, seed=2, ignore_eos=True)
    batch = [(i, [5 + i, 6, 7], params) for i in range(6)] + [
        ("bad_ids", [5, 9999], params), ("bad_params", [5, 6], {"temperature": -1}),
        (["unhashable"], [5, 6], params), (0, [8, 9], params)]  # 0 twice: already running
    plain = make_engine(tiny_llama, max_num_seqs=4)
    plain.add_requests(batch)
    expected = sorted((repr(o.id), o.sample_index, o.finish_reason, o.error,
                       o.output_token_ids) for o in drain(plain))

    engine = make_engine(tiny_llama, max_num_seqs=4)
    engine.add_requests([("other", [7, 7, 7], LONG.replace(max_tokens=12))])
    engine.step()
    built = []
    builder = threading.Thread(target=lambda: built.append(engine.build_requests(batch)))
    builder.start()
    outs = []
    while builder.is_alive():
        outs += engine.step()
    builder.join()
    assert len(built[0]) == len(batch)
    engine.add_requests(built[0])
    outs += drain(engine)
    got = sorted((repr(o.id), o.sample_index, o.finish_reason, o.error, o.output_token_ids)
                 for o in outs if o.id != "other")
    assert got == expected
    errors = {rid: err for rid, _, reason, err, _ in got if reason == "error"}
    assert set(errors) == {"'bad_ids'", "'bad_params'", "['unhashable']", "0"}
    assert "already running" in errors["0"] and "not hashable" in errors["['unhashable']"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_large_batch_is_built_as_the_scheduler_can_admit_it(tiny_llama, prefix_caching):
    """Requests handed in at once are built and added a step's worth at a time (not all
    before the first launch), in order: every one finishes with the tokens it has alone, a
    bad one deep in the queue comes back as its error, and generate() waits for all."""
    params = SamplingParams(max_tokens=3, seed=0, ignore_eos=True)
    batch = [(i, [5 + i % 50, 6, 7, 8], params.replace(seed=i)) for i in range(300)]
    batch.insert(250, ("bad", [5, 99999], params))
    options = dict(max_num_seqs=8, max_num_batched_tokens=64,
                   enable_prefix_caching=prefix_caching)
    engine = make_engine(tiny_llama, **options)
    engine.add_requests(batch)
    engine.step()
    # before the first launch one chunk of requests was built; after it, none more (the
    # waiting queue already fills the next step)
    assert 0 < len(engine.book.requests) <= 64 and engine.intake.pending()
    outs = drain(engine)
    assert sorted(map(repr, (o.id for o in outs))) == sorted(repr(rid) for rid, _, _ in batch)
    bad = [o for o in outs if o.id == "bad"]
    assert bad[0].finish_reason == "error" and "99999" in bad[0].error
    alone = make_engine(tiny_llama, **options).generate(batch[:5] + batch[-5:])
    tokens = {o.id: o.output_token_ids for o in outs}
    assert all(tokens[o.id] == o.output_token_ids for o in alone)

    engine = make_engine(tiny_llama, **options)
    got = engine.generate(batch)
    assert [o.id for o in got] == [rid for rid, _, _ in batch]
    assert not engine.has_unfinished_requests()


def test_generate_returns_while_other_threads_keep_queueing(tiny_llama):
    """generate() ends once its own requests have answered, not when the queue is empty: a
    producer that queues a request at every step does not hold it up."""
    engine = make_engine(tiny_llama, max_num_seqs=4)
    params = SamplingParams(max_tokens=2, seed=0, ignore_eos=True)
    step, calls = engine.step, []

    def step_and_queue():
        calls.append(1)
        if len(calls) > 200:
            raise AssertionError("generate() kept stepping for other requests")
        outputs = step()
        engine.add_request(f"late{len(calls)}", [5, 6], params)  # queued when step returns
        return outputs

    engine.step = step_and_queue
    mine = engine.generate([("mine", [7, 8], params), ("bad", [7, 99999], params)])
    assert [(o.id, o.finish_reason) for o in mine] == [("mine", "length"), ("bad", "error")]
    assert len(calls) < 20


def test_generate_keeps_other_requests_outputs_for_step(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("other", [5, 6], SamplingParams(max_tokens=2, seed=0, ignore_eos=True))
    mine = engine.generate([("mine", [7, 8], SamplingParams(max_tokens=8, seed=0,
                                                            ignore_eos=True))])
    assert [o.id for o in mine] == ["mine"]
    assert [o.id for o in drain(engine)] == ["other"]
    with pytest.raises(ValueError, match="unique"):
        engine.generate([("x", [5], None), ("x", [6], None)])


def test_generation_actor(tiny_llama, monkeypatch):
    import actors.shard

    warmed = []
    real_warm_up_io = actors.shard.warm_up_io
    monkeypatch.setattr(actors.shard, "warm_up_io",
                        lambda: warmed.append(1) or real_warm_up_io() + 1000.0)
    gc.unfreeze()
    try:
        actor = GenerationActor(tiny_llama, {"max_num_seqs": 4, "num_kv_blocks": 64,
                                             "max_model_len": 128})
        assert gc.get_freeze_count() > 0  # the startup objects are out of the collector's way
    finally:
        gc.unfreeze()
    info = actor.info()
    assert info["architecture"].startswith("LlamaForCausalLM") and info["max_num_seqs"] == 4
    startup = actor.startup_report()
    assert {"process_age", "process_cpu", "engine_import", "engine_build", "warm_up", "io_warm_up",
            "build_transformers_import", "build_model_config",
            "build_model_weights", "build_tokenizer", "build_kv_cache", "build_attention",
            "build_rest"} == set(startup)  # CPU: no device context, fused layers or graphs
    assert sum(v for k, v in startup.items() if k.startswith("build_")) <= \
        startup["engine_build"]
    assert startup["engine_build"] > 0 and startup["warm_up"] == 0.0  # no warm-up on CPU
    # the shard I/O path is warmed once, before the actor is ready, and its time reported
    assert warmed == [1] and startup["io_warm_up"] >= 1000.0
    assert startup["process_age"] > startup["engine_build"]
    assert 0 < startup["process_cpu"]  # this test process's CPU seconds so far
    params = [SamplingParams(max_tokens=3, n=2, seed=1), {"max_tokens": 2, "seed": 5},
              None]
    outs = actor.generate(["Hello", [5, 6, 7], [{"role": "user", "content": "hi"}]], params)
    assert [(o.id, o.sample_index) for o in outs] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    assert all(isinstance(o, GenerationOutput) and o.error is None for o in outs)
    row = outs[2].to_dict()
    assert tuple(row) == SCHEMA_FIELDS and row["num_output_tokens"] == 2
    assert row["seed"] == 5 and row["num_prompt_tokens"] == 3
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        actor.generate(["a", "b", "c"], params[:2])


@pytest.mark.ray
def test_generation_actor_under_ray(tiny_llama):
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()  # another test module's session Ray is used as it is
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=0)(GenerationActor).remote(
            tiny_llama, {"max_num_seqs": 2, "num_kv_blocks": 32, "max_model_len": 64})
        outs = ray.get(remote.generate.remote([[5, 6, 7]], {"max_tokens": 4, "seed": 3}))
        local = make_engine(tiny_llama).generate([(0, [5, 6, 7], {"max_tokens": 4,
                                                                  "seed": 3})])
        assert outs[0].output_token_ids == local[0].output_token_ids
        assert ray.get(remote.info.remote())["max_num_seqs"] == 2
        ray.kill(remote)
    finally:
        if started:
            ray.shutdown()


def test_warm_up_leaves_nothing_behind(tiny_llama):
    """warm_up runs its full batch to completion: no outputs surface later, the prefix cache
    is empty again, and a request afterwards gives what it gives on a fresh engine."""
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6, seed=4, logprobs=2)
    fresh = make_engine(tiny_llama).generate([("a", [5, 6, 7, 8], params)])
    engine = make_engine(tiny_llama)
    assert engine.warm_up() > 0
    # a full batch of 16-token prompts went through
    assert engine.scheduler.stats.num_prompt_tokens_computed == 16 * engine.config.max_num_seqs
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert not engine.scheduler.bm._cached
    again = engine.generate([("a", [5, 6, 7, 8], params)])
    assert [(o.output_token_ids, o.logprobs) for o in again] == \
        [(o.output_token_ids, o.logprobs) for o in fresh]
