"""The progress bar on a terminal, log lines elsewhere, the per-actor share, manifest totals."""

from __future__ import annotations

import io
import logging
import sys

from jobs.progress import Progress, totals


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_shows_rows_rate_and_eta(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = Progress(total_rows=100, done_rows=20)
    bar.update(30, 600, "actor-0")
    bar.update(10, 100, "actor-1")
    bar.close()
    text = term.getvalue()
    assert "60/100" in text and "tok/s" in text and "<" in text  # done/total, rate, ETA
    assert bar.actor_share() == {"actor-0": 0.75, "actor-1": 0.25}


def test_an_actor_that_ran_nothing_is_listed_with_zero(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = Progress(total_rows=8)
    bar.add_actors(["actor-0", "actor-1"])
    bar.update(8, 40, "actor-1")  # actor-1 took every shard while actor-0 was loading
    assert bar.actor_share() == {"actor-0": 0.0, "actor-1": 1.0}


def test_logs_every_tenth_without_a_terminal(monkeypatch, caplog):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = Progress(total_rows=100)
    with caplog.at_level(logging.INFO, logger="jobs.progress"):
        for _ in range(20):
            bar.update(5, 10, "actor-0")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10 and lines[0].startswith("10/100 rows") and "tok/s" in lines[0]
    assert lines[-1].startswith("100/100 rows")


def test_totals_sum_the_manifest_entries():
    committed = {"0": {"rows": 3, "output_rows": 4, "errors": 1, "output_tokens": 9,
                       "prompt_tokens": 5},
                 "1": {"rows": 2, "output_rows": 2, "errors": 0, "output_tokens": 1,
                       "prompt_tokens": 2}}
    assert totals(committed) == {"rows": 5, "output_rows": 6, "errors": 1, "output_tokens": 10,
                                 "prompt_tokens": 7}


def test_startup_shows_actors_ready_k_of_n_on_the_bar_and_in_the_log(monkeypatch, caplog):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = Progress(total_rows=10)
    bar.add_actors(["actor-0", "actor-1", "actor-2"])
    bar.actor_ready("actor-1")
    assert bar._bar.desc == "raygen (starting actors 1/3)"
    bar.actor_ready("actor-1")  # a replaced actor counts once
    bar.actor_ready("actor-0")
    bar.actor_ready("actor-2")
    assert bar._bar.desc == "raygen"
    bar.close()
    assert "starting actors 1/3" in term.getvalue()

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # no terminal: a line each time
    with caplog.at_level(logging.INFO, logger="jobs.progress"):
        plain = Progress(total_rows=10)
        plain.add_actors(["actor-0", "actor-1"])
        plain.actor_ready("actor-0")
        plain.actor_ready("actor-1")
    assert [r.getMessage() for r in caplog.records if r.name == "jobs.progress"] == [
        "starting actors 0/2", "starting actors 1/2", "actors ready 2/2"]
