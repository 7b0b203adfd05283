"""Assembles an engine's parts from an ``EngineConfig``: model, KV pool, attention backend,
model runner, block manager, scheduler, sampler, input and output processors."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from actors.attention import AttentionMetadata, StepContext, get_attention_backend
from actors.block_manager import BlockManager
from actors.config import EngineConfig
from actors.inputs import InputProcessor
from actors.kv_cache import KVCache, bytes_per_block, compute_num_blocks
from actors.model_loader import LoadedModel, UnsupportedModelError, load_model
from actors.model_runner import ModelRunner
from actors.output_processor import OutputProcessor
from actors.scheduler import Scheduler
from sampler import Sampler

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(slots=True)
class EngineParts:
    loaded: LoadedModel
    max_model_len: int
    kv_cache: KVCache
    runner: ModelRunner
    scheduler: Scheduler
    sampler: Sampler
    inputs: InputProcessor
    outputs: OutputProcessor


def build_engine_parts(model: str, config: EngineConfig) -> EngineParts:
    """Loads ``model`` and builds everything an engine needs."""
    loaded = load_model(model, config)
    max_model_len = config.max_model_len or loaded.max_position_embeddings \
        or _DEFAULT_MAX_MODEL_LEN
    bs = config.block_size
    num_blocks = config.num_kv_blocks or compute_num_blocks(
        per_block=bytes_per_block(loaded.num_layers, bs, loaded.num_kv_heads, loaded.head_dim,
                                  loaded.dtype),
        device=loaded.device, block_size=bs, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs, kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization)
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"engine: {num_blocks} KV blocks of {bs} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len}; lower max_model_len or raise num_kv_blocks")
    kv_cache = KVCache(loaded.num_layers, num_blocks, bs, loaded.num_kv_heads,
                       loaded.head_dim, loaded.dtype, loaded.device)
    backend = get_attention_backend(config.attention_backend, kv_cache,
                                    num_heads=loaded.num_heads,
                                    num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim)
    runner = ModelRunner(loaded, kv_cache, backend)
    probe_attention_layers(runner)
    scheduler = Scheduler(
        BlockManager(num_blocks, bs, config.enable_prefix_caching),
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len)
    sampler = Sampler(config.max_num_seqs, loaded.vocab_size, device=loaded.device,
                      eos_token_ids=[t for t in loaded.eos_token_ids if t < loaded.vocab_size],
                      max_logprobs=config.max_logprobs, backend=config.sampler_backend)
    inputs = InputProcessor(
        loaded.tokenizer, vocab_size=loaded.vocab_size, eos_token_ids=loaded.eos_token_ids,
        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_logprobs=config.max_logprobs, num_kv_blocks=num_blocks, block_size=bs,
        base_seed=config.seed)
    outputs = OutputProcessor(loaded.tokenizer, max_model_len=max_model_len,
                              vocab_size=loaded.vocab_size)
    return EngineParts(loaded, max_model_len, kv_cache, runner, scheduler, sampler, inputs,
                       outputs)


@torch.no_grad()
def probe_attention_layers(runner: ModelRunner) -> None:
    """Runs one token through the model and checks that every layer's attention went through
    our function exactly once; refuses the model otherwise (hybrid or custom attention)."""
    device = runner.device
    zero = np.zeros(1, np.int64)
    metadata = AttentionMetadata(
        num_seqs=1, num_tokens=1, max_query_len=1, max_seq_len=1,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([1], dtype=torch.int32, device=device),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        positions=torch.zeros(1, dtype=torch.int64, device=device),
        query_start_loc_host=np.array([0, 1], np.int32), seq_lens_host=np.array([1], np.int32),
        block_tables_host=np.zeros((1, 1), np.int32), block_size=runner.block_size)
    ctx = StepContext(runner.backend, metadata, runner.backend.plan(metadata), layers_called=[])
    ids = torch.from_numpy(zero).to(device)
    runner.forward(ids, ids, ctx)
    expected = list(range(runner.loaded.num_layers))
    if sorted(ctx.layers_called) != expected:
        raise UnsupportedModelError(
            f"{runner.loaded.architecture}: its attention layers do not all go through "
            f"transformers' attention-function registry (layers seen: {ctx.layers_called}, "
            f"expected {expected}); it cannot run on the paged KV cache")
    runner.kv_cache.pool.zero_()
