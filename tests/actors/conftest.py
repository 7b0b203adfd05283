"""Fixtures for the engine tests: tiny models, engines and HF references."""

from __future__ import annotations

import pytest
import torch

# Tiny models run fastest single-threaded, and the CI machine is shared: no thread spinning.
torch.set_num_threads(1)

SLIDING = {"qwen2": 8, "mistral": 8}


@pytest.fixture(scope="session")
def arch_model(tiny_model_factory):
    """``arch_model(arch)``: the tiny model of ``arch`` (qwen2/mistral with a window of 8)."""

    def make(arch: str) -> str:
        kwargs = {"sliding_window": SLIDING[arch]} if arch in SLIDING else {}
        return tiny_model_factory(arch, **kwargs)

    return make


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(path)``: the HF model itself (eager attention, fp32), cached."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def load(path: str) -> torch.nn.Module:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", dtype=torch.float32).eval()
        return cache[path]

    return load


@pytest.fixture(scope="session")
def llama_engine(tiny_llama):
    """A shared engine on the tiny llama (tests must leave it idle)."""
    from actors.engine.llm_engine import Engine

    return Engine(tiny_llama, {"max_num_seqs": 8, "max_num_batched_tokens": 64,
                               "num_kv_blocks": 256, "max_model_len": 256})

