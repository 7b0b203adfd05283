"""examples/grpo_rollout.py: two rounds on a 2-actor CPU pool (local Ray). Round 2's trainer
vs rollout logprob parity holds only if the pool really runs the updated weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_rollout.py"
pytestmark = pytest.mark.ray


def test_two_rounds_on_a_two_actor_pool(ray_local, tiny_llama, capsys):
    spec = importlib.util.spec_from_file_location("grpo_rollout", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--model", tiny_llama, "--num-actors", "2", "--rounds", "2"])
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["rows"] == len(example.PROMPTS) * 4 for r in rounds)
    # the trainer's forward reproduces the rollout's temperature_logprobs, also after the
    # update (with stale weights in the pool round 2 would be off by whole nats)
    assert all(r["max_logprob_diff"] < 1e-4 for r in rounds), rounds
    assert all(0.0 <= r["mean_reward"] <= 1.0 for r in rounds)
    assert "round 2:" in capsys.readouterr().out
