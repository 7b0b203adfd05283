"""XGrammar vs llguidance on the strictness cases of structured outputs, plus compile and
mask-fill times (the figures of docs/structured_outputs.md; CPU only, needs both libraries).

    python benchmarks/grammar_library_probe.py --out /tmp/probe

Each case feeds a byte string through the library's matcher (token ids from llguidance's
tokenizer, the same for both) and records whether it is accepted as a whole output, next to
what the strict definition wants (RFC 8259 JSON, code-point lengths, Python ``re``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB = 151936
SHORT = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}},
         "required": ["s"], "additionalProperties": False}
ANY = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
       "additionalProperties": False}
JSON_CASES = [  # (name, schema or None for the library's any-object JSON, text, wanted)
    ("control char with maxLength", SHORT, b'{"s":"a\x01b"}', False),
    ("control char", ANY, b'{"s":"a\x01b"}', False),
    ("raw newline", ANY, b'{"s":"a\nb"}', False),
    ("encoded surrogate", ANY, b'{"s":"a\xed\xa0\x80"}', False),
    ("maxLength counts code points", SHORT, '{"s":"ééééé"}'.encode(), True),
    ("valid", SHORT, b'{"s":"abc"}', True),
    ("top-level array as any object", None, b'[1,2]', False),
    ("an object as any object", None, b'{"a":[1]}', True),
]
CHARS = ["5", "\u0663", "a", "\u00e9", "_", " ", "\t", "\x0b", "\x1c", "\x85", "\xa0",
         "\u2028", "\n", "\r", "\u00b2", "\u0300"]
CLASSES = [r"\d", r"[0-9]", r"\w", r"\s", r".", r"\D", r"\S", r"\W"]


def schema_of(i: int) -> dict:
    from structured_bench import person_schema

    return person_schema(i)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch as lgt
    import torch
    import xgrammar as xgr

    from bench_vocab import qwen_tokenizer

    tok = qwen_tokenizer()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    xc = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB),
                             max_threads=args.threads)
    compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def ll_ok(grammar: str, text: bytes) -> bool:
        m = llg.LLMatcher(lt, grammar, log_level=0)
        return bool(m.consume_tokens(lt.tokenize_bytes(text)) and m.is_accepting())

    def xg_ok(compiled, text: bytes) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return all(m.accept_token(t) for t in lt.tokenize_bytes(text)) and m.is_completed()

    cases = {}
    for name, schema, text, want in JSON_CASES:
        if schema is None:
            g, x = (llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact),
                    xc.compile_builtin_json_grammar())
        else:
            g = llg.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
            x = xc.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                       separators=(",", ":"), strict_mode=True)
        cases[name] = {"want": want, "llguidance": ll_ok(g, text), "xgrammar": xg_ok(x, text)}
    for pattern in CLASSES:
        g, x = llg.LLMatcher.grammar_from_regex(pattern), xc.compile_regex(pattern)
        wrong = {"llguidance": [], "xgrammar": []}
        for c in CHARS:
            want = re.fullmatch(pattern, c) is not None
            for lib, ok in (("llguidance", ll_ok(g, c.encode())),
                            ("xgrammar", xg_ok(x, c.encode()))):
                if ok != want:
                    wrong[lib].append(f"{'accepts' if ok else 'refuses'} U+{ord(c):04X}")
        cases[f"regex {pattern}"] = wrong

    t0 = time.perf_counter()
    for i in range(20):
        llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(schema_of(i), defaults=compact),
                      log_level=0).compute_bitmask()
    ll_compile = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for i in range(20):
        xc.compile_json_schema(json.dumps(schema_of(100 + i)), any_whitespace=False,
                               separators=(",", ":"), strict_mode=True)
    xg_compile = (time.perf_counter() - t0) / 20

    n, words = args.rows, (VOCAB + 31) // 32
    grammar = llg.LLMatcher.grammar_from_json_schema(schema_of(0), defaults=compact)
    compiled = xc.compile_json_schema(json.dumps(schema_of(0)), any_whitespace=False,
                                      separators=(",", ":"), strict_mode=True)
    executor = llg.LLExecutor(args.threads)
    batch = xgr.BatchGrammarMatcher(max_threads=args.threads)
    fill = {}
    for where, prefix in (("inside a string", b'{"name_0":"ab'),
                          ("after a number", b'{"name_0":"ab","age_0":1')):
        lms = [llg.LLMatcher(lt, grammar, log_level=0) for _ in range(n)]
        xms = [xgr.GrammarMatcher(compiled) for _ in range(n)]
        for m in lms:
            m.consume_tokens(lt.tokenize_bytes(prefix))
        for m in xms:
            for t in lt.tokenize_bytes(prefix):
                m.accept_token(t)
        lbits = torch.zeros((n, words), dtype=torch.int32)
        xbits = xgr.allocate_token_bitmask(n, VOCAB)
        timings = {}
        for lib, fn in (("llguidance", lambda: lgt.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(lms)], lbits)),
                        ("xgrammar", lambda: batch.batch_fill_next_token_bitmask(xms, xbits))):
            fn()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            timings[lib] = (time.perf_counter() - t0) / 5 * 1e3
        fill[where] = timings
    result = {"versions": {"llguidance": llg.__version__, "xgrammar": xgr.__version__},
              "cases": cases, "compile_ms": {"llguidance": ll_compile * 1e3,
                                             "xgrammar": xg_compile * 1e3},
              "fill_ms": {"rows": n, "threads": args.threads, **fill}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_library_probe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
