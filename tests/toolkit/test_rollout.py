"""RolloutPool on a local Ray (2 CPU actors): logprob columns against an fp32 HF forward,
weight updates from a state dict / ObjectRef / iterator, sleep and wake, all without the
model directory (it is moved away once the actors have started)."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pytest
import torch

from actors.contract.schema import OUTPUT_COLUMNS
from tests.actors.helpers import hf_logits, random_prompts
from tests.actors.engine.test_weights import hf_greedy, other_model
from toolkit.rollout import split_by_samples

pytestmark = pytest.mark.ray
ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 256, "max_model_len": 256,
          "max_num_batched_tokens": 64}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def pool_setup(ray_local, tiny_llama, tmp_path_factory):
    """A 2-actor pool on a private copy of the tiny llama, whose directory is then moved
    away: any later read of the model from disk would fail."""
    from toolkit import RolloutPool

    root = tmp_path_factory.mktemp("rollout")
    model_dir = root / "model"
    shutil.copytree(tiny_llama, model_dir)
    pool = RolloutPool(str(model_dir), num_actors=2, num_gpus_per_actor=0, engine=ENGINE)
    model_dir.rename(root / "moved")
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def pool(pool_setup):
    return pool_setup


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def check_row(model, prompt, row, temperature):
    tokens = row["output_token_ids"]
    logits = hf_logits(model, prompt + tokens)[len(prompt) - 1:-1]
    index = torch.tensor(tokens)[:, None]
    raw = torch.log_softmax(logits, -1).gather(1, index)[:, 0]
    temp = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, index)[:, 0]
    torch.testing.assert_close(torch.tensor(row["raw_logprobs"]), raw, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(row["temperature_logprobs"]), temp, rtol=0,
                               atol=1e-5)


def test_generate_returns_the_job_columns_and_exact_logprob_columns(pool, hf_model):
    prompts = random_prompts([6, 11, 4, 9, 15], 500, seed=41)
    params = [{"n": 3, "temperature": 0.8, "top_k": 30, "seed": i, "max_tokens": 7}
              for i in range(len(prompts))]
    params[1] = {"temperature": 0.0, "max_tokens": 5}
    table = pool.generate(prompts, params, ids=[f"p{i}" for i in range(len(prompts))])
    assert isinstance(table, pa.Table)
    assert table.column_names == list(OUTPUT_COLUMNS) + ["raw_logprobs",
                                                         "temperature_logprobs"]
    assert table.schema.field("raw_logprobs").type == pa.list_(pa.float32())
    rows = table.to_pylist()
    want_order = [(f"p{i}", j) for i, p in enumerate(params) for j in range(p.get("n", 1))]
    assert [(r["id"], r["sample_index"]) for r in rows] == want_order
    for row in rows:
        i = int(row["id"][1:])
        assert row["error"] is None and row["num_output_tokens"] == len(row["raw_logprobs"])
        check_row(hf_model, prompts[i], row, params[i]["temperature"])
    samples = [r["output_token_ids"] for r in rows if r["id"] == "p0"]
    assert len({tuple(s) for s in samples}) > 1  # n samples differ


def test_processed_column_is_the_rows_processed_logprobs(pool):
    prompts = random_prompts([8, 5], 500, seed=42)
    params = {"temperature": 0.7, "top_k": 5, "seed": 3, "max_tokens": 6}
    table = pool.generate(prompts, params, logprob_columns=("processed", "temperature"))
    assert table.column_names[-2:] == ["temperature_logprobs", "processed_logprobs"]
    for row in table.to_pylist():
        assert row["processed_logprobs"] == row["logprobs"]
        # renormalised over the top 5: at least the full-vocab probability, at most 0
        for p, t in zip(row["processed_logprobs"], row["temperature_logprobs"]):
            assert t - 1e-6 <= p <= 1e-6
    with pytest.raises(ValueError, match=r"params\[0\].*processed_logprobs"):
        pool.generate(prompts, {"logprobs": 0, "logprobs_mode": "raw_logprobs"},
                      logprob_columns=["processed"])
    with pytest.raises(ValueError, match="unknown column 'rawest'"):
        pool.generate(prompts, params, logprob_columns=["rawest"])
    with pytest.raises(ValueError, match=r"params\[1\]: sampling_params.top_p"):
        pool.generate(prompts, [params, {"top_p": 2.0}])
    assert pool.generate([], params).num_rows == 0


def test_weight_updates_switch_models_without_the_model_directory(pool, tiny_llama):
    import ray

    prompts = random_prompts([5, 12, 7], 500, seed=43)
    first = other_model(tiny_llama, seed=0)  # not the checkpoint's weights
    second = other_model(tiny_llama, seed=1)

    def greedy():
        rows = pool.generate(prompts, GREEDY).to_pylist()
        return [r["output_token_ids"] for r in rows]

    stats = pool.update_weights(first.state_dict(), chunk_bytes=100_000)  # several chunks
    assert stats["num_tensors"] == len(first.state_dict())
    want_first = [hf_greedy(first, p, 8) for p in prompts]
    assert greedy() == want_first
    pool.update_weights(ray.put(second.state_dict()))  # an ObjectRef, resolved in the actors
    want_second = [hf_greedy(second, p, 8) for p in prompts]
    assert want_second != want_first and greedy() == want_second
    pool.update_weights(iter(first.state_dict().items()), chunk_bytes=200_000)  # an iterator
    assert greedy() == want_first
    bad = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"q_proj.weight'\]: shape \(3, 3\)"):
        pool.update_weights(bad)
    with pytest.raises(ValueError, match="not in the model's state dict"):
        pool.update_weights({"lm_head.bias": torch.zeros(3)})
    assert greedy() == want_first  # nothing was sent


def test_sleep_and_wake_between_rounds(pool, tiny_llama):
    prompts = random_prompts([9, 4], 500, seed=44)
    second = other_model(tiny_llama, seed=2)
    pool.update_weights(second.state_dict())
    before = pool.generate(prompts, GREEDY).column("output_token_ids").to_pylist()
    freed = pool.sleep(1)
    assert freed["kv_cache"] > 0 and freed["weights"] == 0
    with pytest.raises(Exception, match="asleep"):
        pool.generate(prompts, GREEDY)
    pool.wake_up()
    assert pool.generate(prompts, GREEDY).column("output_token_ids").to_pylist() == before
    freed = pool.sleep(level=2)
    assert freed["weights"] == 2 * sum(t.numel() * 4 for t in second.parameters())
    pool.wake_up()
    pool.update_weights(second.state_dict())  # level 2: the weights come from the trainer
    assert pool.generate(prompts, GREEDY).column("output_token_ids").to_pylist() == before
    pool.reset_prefix_cache()
    assert all(info["sleep_level"] == 0 for info in pool.info())


def test_split_by_samples_is_contiguous_and_balanced():
    assert split_by_samples([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert split_by_samples([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 9)]
    assert split_by_samples([2], 3) == [(0, 0), (0, 1), (1, 1)]
    bounds = split_by_samples([3] * 10, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


def test_structured_outputs_in_rollouts(pool):
    prompts = random_prompts([6, 4, 7], 500, seed=8)
    params = [{"temperature": 1.0, "seed": i, "max_tokens": 20,
               "structured_outputs": {"choice": ["up", "down"]}} for i in range(3)]
    params[2] = {**params[2], "structured_outputs": {"regex": "[0-9]{3}"}}
    table = pool.generate(prompts, params, logprob_columns=("temperature",))
    rows = table.to_pylist()
    assert [r["finish_reason"] for r in rows] == ["stop"] * 3
    assert rows[0]["output_text"] in ("up", "down") and rows[1]["output_text"] in ("up", "down")
    assert len(rows[2]["output_text"]) == 3 and rows[2]["output_text"].isdigit()
    assert all(len(r["temperature_logprobs"]) == r["num_output_tokens"] for r in rows)
