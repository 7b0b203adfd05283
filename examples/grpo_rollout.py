"""GRPO-style rollouts with ``toolkit.RolloutPool``: generate groups, score them, take a policy
step in the trainer, push the new weights, generate again.

    python examples/grpo_rollout.py                       # a tiny random model, 2 CPU actors
    python examples/grpo_rollout.py --model Qwen/Qwen2.5-0.5B-Instruct --num-gpus-per-actor 1

The trainer recomputes the log-probability of every sampled token with its own forward and
compares it with the rollout's ``temperature_logprobs`` column: they agree to float rounding
(the pool ran the same weights), so the PPO/GRPO ratio starts at 1. The reward is a toy one
(the share of output tokens with an even id); swap in your own.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1 2 3", "Ray schedules",
           "The weather today is", "Questions? Answers!", "def main():", "Parquet files"]


def toy_reward(token_ids: list[int]) -> float:
    """Share of even token ids in the output (a stand-in for a real verifier)."""
    return sum(t % 2 == 0 for t in token_ids) / max(len(token_ids), 1)


def group_advantages(ids: list, rewards: list[float]) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, over the group's std."""
    groups: dict = {}
    for i, r in zip(ids, rewards):
        groups.setdefault(i, []).append(r)
    stats = {}
    for i, rs in groups.items():
        t = torch.tensor(rs)
        stats[i] = (t.mean().item(), t.std(unbiased=False).item())
    return [(r - stats[i][0]) / (stats[i][1] + 1e-6) for i, r in zip(ids, rewards)]


def trainer_logprobs(model, prompt_ids: list[int], output_ids: list[int], temperature: float
                     ) -> torch.Tensor:
    """log_softmax(logits / T) of the sampled tokens from the trainer's own forward."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(
        1, torch.tensor(output_ids)[:, None])[:, 0]


def train_step(model, optimizer, rows, prompt_ids, advantages, temperature) -> float:
    """One GRPO step (on-policy, so no clipping is active); returns the largest difference
    between the trainer's log-probs and the rollout's temperature_logprobs."""
    optimizer.zero_grad()
    worst, losses = 0.0, []
    for row, adv in zip(rows, advantages):
        if not row["output_token_ids"]:
            continue
        new = trainer_logprobs(model, prompt_ids[row["id"]], row["output_token_ids"],
                               temperature)
        old = torch.tensor(row["temperature_logprobs"])
        worst = max(worst, (new.detach() - old).abs().max().item())
        ratio = torch.exp(new - old)
        losses.append(-(ratio * adv).mean())
    torch.stack(losses).mean().backward()
    optimizer.step()
    return worst


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or hub id (default: a tiny one)")
    parser.add_argument("--num-actors", type=int, default=2)
    parser.add_argument("--num-gpus-per-actor", type=float, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit import RolloutPool, SamplingParams

    model_path = args.model
    if model_path is None:
        from toolkit.tiny_model import build_tiny_model

        model_path = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama", "llama"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    engine = {"max_num_seqs": 32, "max_model_len": 256}
    if args.num_gpus_per_actor == 0:
        engine["dtype"] = "float32"
    summary = {"rounds": []}
    with RolloutPool(model_path, num_actors=args.num_actors, engine=engine,
                     num_gpus_per_actor=args.num_gpus_per_actor) as pool:
        for round_index in range(args.rounds):
            t0 = time.perf_counter()
            params = SamplingParams(n=args.group_size, temperature=args.temperature,
                                    max_tokens=args.max_tokens, seed=1000 + round_index)
            table = pool.generate(prompt_ids, params)  # ids are the prompts' positions
            rows = table.to_pylist()
            rewards = [toy_reward(r["output_token_ids"]) for r in rows]
            advantages = group_advantages([r["id"] for r in rows], rewards)
            gen_s = time.perf_counter() - t0
            pool.sleep(level=1)  # the trainer gets the KV memory meanwhile
            parity = train_step(policy, optimizer, rows, prompt_ids, advantages,
                                args.temperature)
            pool.wake_up()
            t1 = time.perf_counter()
            pool.update_weights(policy.state_dict())  # in place, nothing read from disk
            update_s = time.perf_counter() - t1
            entry = {"round": round_index + 1, "rows": len(rows),
                     "mean_reward": sum(rewards) / len(rewards),
                     "max_logprob_diff": parity, "generate_s": gen_s, "update_s": update_s}
            summary["rounds"].append(entry)
            print(f"round {entry['round']}: {entry['rows']} samples, mean reward "
                  f"{entry['mean_reward']:.3f}, trainer vs rollout logprob max diff "
                  f"{parity:.2e}, generate {gen_s:.2f} s, weight update {update_s:.3f} s")
    return summary


if __name__ == "__main__":
    main()
