"""Helpers shared by the engine tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """``[len, vocab]`` fp32 logits of one sequence from the HF model's own forward."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0,
                   low: int = 5) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids >= ``low``: no special tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab_size, n).tolist() for n in lengths]


def make_engine(model: str, **options: Any):
    from actors.engine.llm_engine import Engine

    defaults = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 256,
                "max_model_len": 256}
    return Engine(model, {**defaults, **options})


def by_id(outputs) -> dict:
    """{(id, sample_index): output}."""
    return {(o.id, o.sample_index): o for o in outputs}
