"""The grammar library's raw rates for ``structured_host_bench.py``: llguidance's parallel
mask fill and the accept before it, at the states a run left its rows in, over the run's own
matchers and over the same states replayed into other matcher layouts.
"""

from __future__ import annotations

import statistics
import time

import torch


def raw_fill(structured, live: list, threads: int, args) -> dict:
    """The library's parallel fill alone (``fill_next_token_bitmask_par`` on ``threads``
    threads) and the accept of a decode step's token before it (``consume_token_par``;
    ``serial_accept_ms``: one ``consume_token`` a row on the calling thread) at the live
    rows' states, in four matcher layouts: the run's own matchers, and
    the same states replayed into independent matchers, into copies of one matcher and into
    templates of ``--rows-per-template`` rows. ``first_ms``: the first fill of a replayed
    layout (cold caches of fresh templates); ``after_token_ms``: the median fill right after
    every matcher took its last token again (rollback, consume), as in a decode step."""
    import llguidance
    import llguidance.torch

    live = [s for s in live if s.grammar.num_accepted]
    compiled = live[0].request.grammar.result()
    lt = structured.compiler.ll_tokenizer()
    history = [s.token_ids[s.num_prompt:s.num_prompt + s.grammar.num_accepted] for s in live]

    def replayed(make) -> list:
        matchers = [make(i) for i in range(len(live))]
        for m, tokens in zip(matchers, history):
            assert m.consume_tokens(tokens)
        return matchers

    def fresh(_):
        return llguidance.LLMatcher(lt, compiled.grammar, log_level=0)

    per = args.rows_per_template
    templates = [fresh(0) for _ in range((len(live) + per - 1) // per)]
    layouts = {"engine": [s.grammar.matcher for s in live],
               "independent": replayed(fresh),
               "one_template": replayed(lambda i: compiled.template.deep_copy()),
               f"templates_of_{per}": replayed(lambda i: templates[i // per].deep_copy())}
    executor = llguidance.LLExecutor(threads)
    buf = torch.full((len(live), structured.words), -1, dtype=torch.int32)  # pages touched
    last = [tokens[-1] for tokens in history]
    out = {}
    for name, matchers in layouts.items():
        pairs = [(m, j) for j, m in enumerate(matchers)]
        spans, accepts, serial = [], [], []
        for rep in range(1 + args.reps):
            if rep:  # the last token again: in parallel, as a decode step's accept
                for m in matchers:
                    assert m.rollback(1)
                t0 = time.perf_counter()
                assert all(executor.consume_token_par(list(zip(matchers, last))))
                accepts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask_par(executor, pairs, buf)
            spans.append(time.perf_counter() - t0)
        for m in matchers:  # and one matcher at a time, on this thread
            assert m.rollback(1)
        t0 = time.perf_counter()
        assert all([m.consume_token(t) for m, t in zip(matchers, last)])
        serial.append(time.perf_counter() - t0)
        out[name] = {"first_ms": spans[0] * 1e3,
                     "after_token_ms": statistics.median(spans[1:]) * 1e3,
                     "accept_ms": statistics.median(accepts) * 1e3 if accepts else None,
                     "serial_accept_ms": serial[0] * 1e3}
    return out
