"""Assembles an engine's parts from an ``EngineConfig``: model, KV pool, attention backend,
model runner, block manager, scheduler, sampler, input and output processors."""

from __future__ import annotations

import importlib.util
import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from actors.engine.block_manager import BlockManager
from actors.engine.engine_config import EngineConfig
from actors.engine.model.attention import StepContext, get_attention_backend, resolve_backend_name
from actors.engine.model.attention.base import LayerSpec
from actors.engine.model.attention.probe import (
    UnsupportedAttentionError,
    one_token_metadata,
    probe_layers,
)
from actors.engine.model.attention.torch_backend import TorchAttentionBackend
from actors.engine.model.kv_cache import KVCache, bytes_per_block, compute_num_blocks
from actors.engine.model.loader import LoadedModel, PhaseTimer, UnsupportedModelError, load_model
from actors.engine.model.model_runner import ModelRunner
from actors.engine.output_processor import OutputProcessor
from actors.engine.request_builder import InputProcessor
from actors.engine.scheduler import Scheduler
from sampler import Sampler

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 4096
# device memory kept out of the KV budget for kernel workspaces and CUDA-graph pools
_CUDA_WORKSPACE_RESERVE = 1 << 30


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
    # seconds of each build phase: the loading phases of LoadedModel.phases
    # (transformers_import, model_config, cuda_init, model_weights, tokenizer),
    # fused_projections, fused_layers,
    # fused_moe (MoE models),
    # kv_cache (profiling step memory and allocating the pool), attention (probe + backend),
    # cuda_graphs (capture), rest
    startup: dict[str, float] = field(default_factory=dict)
    # tensor parallel: {state-dict name: ShardSlice} of this rank's sharded tensors
    shard_slices: dict | None = None


def build_engine_parts(model: str, config: EngineConfig, comm=None) -> EngineParts:
    """Loads ``model`` and builds everything an engine needs. ``comm``: rank 0's
    ``actors.engine.parallel.comm.TPComm`` when the model is split over several ranks (the
    other ranks build their part in ``actors.engine.parallel.worker``)."""
    phases = PhaseTimer()
    slices = None
    if comm is None:
        loaded = load_model(model, config)
    else:
        from actors.engine.parallel.sharding import load_shard

        loaded, slices = load_shard(model, config, comm)
    phases.add(loaded.phases)
    max_model_len = config.max_model_len or loaded.max_position_embeddings \
        or _DEFAULT_MAX_MODEL_LEN
    bs = config.block_size
    device = loaded.device
    backend_name = resolve_backend_name(config.attention_backend, device, loaded.dtype,
                                        loaded.head_dim, value_dim=loaded.value_dim,
                                        layer_specs=loaded.layer_specs)
    use_graphs = resolve_cuda_graphs(config, device, backend_name)
    projections = None
    if resolve_fused_projections(config, device):
        from actors.engine.model.fused_projections import install_fused_projections

        projections = install_fused_projections(loaded.model)
        phases.mark("fused_projections")
    fused = None
    if resolve_fused_layers(config, device):
        from actors.engine.model.fused_layers import install_fused_layers

        fused = install_fused_layers(loaded.model)
        phases.mark("fused_layers")
    moe = None
    moe_backend = resolve_fused_moe(config, device)
    if moe_backend is not None:
        from actors.engine.model.moe import install_fused_moe

        moe = install_fused_moe(loaded.model, moe_backend)
        if moe.experts or moe.routers or moe.kept:  # an MoE model
            phases.mark("fused_moe")
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        reserved = 0
        if device.type == "cuda" and config.kv_cache_memory is None:
            with comm.local() if comm is not None else nullcontext():
                reserved = profile_step_memory(loaded, config, fused)
            reserved += _CUDA_WORKSPACE_RESERVE
        num_blocks = compute_num_blocks(
            per_block=bytes_per_block(loaded.num_layers, bs, loaded.num_kv_heads,
                                      pool_head_dim(loaded), loaded.kv_dtype or loaded.dtype),
            device=device, block_size=bs, max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs, kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization, reserved=reserved)
        if comm is not None and comm.ranks_per_device > 1:  # the GPU's ranks share it
            num_blocks //= comm.ranks_per_device
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"engine: {num_blocks} KV blocks of {bs} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len}; lower max_model_len or raise num_kv_blocks")
    if comm is not None:  # the other ranks size their pools (their KV heads) alike
        from actors.engine.parallel.comm import OP_SIZES

        comm.send_header(OP_SIZES, num_blocks, max_model_len)
    kv_cache = make_kv_cache(loaded, num_blocks, bs, device,
                             num_scratch_blocks=1 if use_graphs else 0)
    phases.mark("kv_cache")
    reference = TorchAttentionBackend(kv_cache, loaded.num_heads, loaded.num_kv_heads,
                                      loaded.head_dim)
    runner_cls = ModelRunner
    if comm is not None:
        from actors.engine.parallel.step import TPModelRunner as runner_cls
    runner = runner_cls(loaded, kv_cache, reference, max_num_seqs=config.max_num_seqs,
                        max_model_len=max_model_len, fused=fused)
    runner.moe = moe
    runner.projections = projections
    if comm is not None:
        runner.comm = comm
    with comm.local() if comm is not None else nullcontext():
        layer_specs = probe_attention_layers(runner)
    if backend_name != "torch":
        runner.set_backend(get_attention_backend(
            backend_name, kv_cache, num_heads=loaded.num_heads,
            num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim,
            layer_specs=layer_specs, max_model_len=max_model_len))
    phases.mark("attention")
    if use_graphs:
        runner.graphs = capture_graphs(runner, config, kv_cache, max_model_len)
        phases.mark("cuda_graphs")
    scheduler = Scheduler(
        BlockManager(num_blocks, bs, config.enable_prefix_caching),
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len, batch_invariant=config.batch_invariant)
    sampler = Sampler(config.max_num_seqs, loaded.vocab_size, device=device,
                      eos_token_ids=[t for t in loaded.eos_token_ids if t < loaded.vocab_size],
                      max_logprobs=config.max_logprobs, backend=config.sampler_backend)
    inputs = InputProcessor(
        loaded.tokenizer, vocab_size=loaded.vocab_size, eos_token_ids=loaded.eos_token_ids,
        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        max_logprobs=config.max_logprobs, num_kv_blocks=num_blocks, block_size=bs,
        base_seed=config.seed)
    outputs = OutputProcessor(loaded.tokenizer, max_model_len=max_model_len,
                              vocab_size=loaded.vocab_size)
    phases.mark("rest")
    return EngineParts(loaded, max_model_len, kv_cache, runner, scheduler, sampler, inputs,
                       outputs, phases.seconds, slices)


def pool_head_dim(loaded: LoadedModel) -> int:
    """Width of the KV pool's rows: the wider of the model's key and value widths."""
    return max(loaded.head_dim, loaded.value_dim or loaded.head_dim)


def make_kv_cache(loaded: LoadedModel, num_blocks: int, block_size: int,
                  device: torch.device, num_scratch_blocks: int = 0) -> KVCache:
    """The KV pool shaped from the probed attention (kv heads, key and value widths), in
    ``loaded.kv_dtype`` (``kv_cache_dtype``)."""
    return KVCache(loaded.num_layers, num_blocks, block_size, loaded.num_kv_heads,
                   pool_head_dim(loaded), loaded.kv_dtype or loaded.dtype, device,
                   num_scratch_blocks=num_scratch_blocks, key_dim=loaded.head_dim,
                   value_dim=loaded.value_dim or loaded.head_dim, compute_dtype=loaded.dtype)


def _cuda_feature(name: str, wanted: bool | None, device: torch.device,
                  missing: str | None) -> bool:
    """Whether an on-by-default CUDA feature runs: never when turned off; off another device
    (an error when asked for explicitly); off with a warning when ``missing`` says why it
    cannot run here."""
    if wanted is False:
        return False
    if device.type != "cuda":
        if wanted:
            raise ValueError(f"engine.{name}: needs a CUDA device")
        return False
    if missing is not None:
        logger.warning("%s off: %s", name, missing)
        return False
    return True


def resolve_fused_layers(config: EngineConfig, device: torch.device) -> bool:
    """Whether the fused Triton layers go into the model (CUDA with Triton installed)."""
    missing = None if importlib.util.find_spec("triton") else "triton is not installed"
    return _cuda_feature("fused_layers", config.fused_layers, device, missing)


def resolve_fused_projections(config: EngineConfig, device: torch.device) -> bool:
    """Whether q/k/v and gate/up run as fused GEMMs: on CUDA unless turned off, on another
    device when asked for (plain torch: nothing is missing anywhere)."""
    if config.fused_projections is None:
        return device.type == "cuda"
    return config.fused_projections


def resolve_fused_moe(config: EngineConfig, device: torch.device) -> str | None:
    """The fused MoE backend: "triton" on CUDA with Triton installed (unless turned off),
    "torch" (the kernels' references) on another device when asked for, else None."""
    if config.fused_moe is False:
        return None
    if device.type != "cuda":
        return "torch" if config.fused_moe else None
    if importlib.util.find_spec("triton") is None:
        if config.fused_moe:
            raise ValueError("engine.fused_moe: needs triton on CUDA")
        logger.warning("fused_moe off: triton is not installed")
        return None
    return "triton"


def capture_graphs(runner: ModelRunner, config: EngineConfig, kv_cache: KVCache,
                   max_model_len: int):
    """The decode graphs of ``runner`` (every rank of a replica captures the same buckets)."""
    from actors.engine.model.cuda_graphs import DecodeGraphs, default_buckets

    max_batch = min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs)
    graphs = DecodeGraphs(runner, default_buckets(max_batch), kv_cache.scratch_page)
    graphs.capture(max_pages=max_batch * -(-max_model_len // config.block_size))
    return graphs


def resolve_cuda_graphs(config: EngineConfig, device: torch.device, backend_name: str) -> bool:
    """Whether decode steps run as CUDA graphs (they need CUDA and the FlashInfer backend;
    with tensor parallelism every rank decides alike and captures its own)."""
    missing = None if backend_name == "flashinfer" else (
        f"they need the flashinfer attention backend (attention backend is {backend_name})")
    return _cuda_feature("cuda_graphs", config.cuda_graphs, device, missing)


@torch.no_grad()
def profile_step_memory(loaded: LoadedModel, config: EngineConfig, fused=None) -> int:
    """Peak device bytes one step needs beyond the weights (CUDA): a warm-up forward of
    ``max_num_batched_tokens`` tokens (torch attention over a one-page pool, an upper bound for
    the paged kernels), the LM head on ``max_num_seqs`` rows and a float32 copy of those
    logits, plus ``max_num_seqs * vocab * 12`` bytes for the sampler's sort (values and ids)."""
    device = loaded.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    cache = make_kv_cache(loaded, 1, config.block_size, device)
    backend = TorchAttentionBackend(cache, loaded.num_heads, loaded.num_kv_heads,
                                    loaded.head_dim)
    runner = ModelRunner(loaded, cache, backend, fused=fused)
    tokens = config.max_num_batched_tokens
    metadata = one_token_metadata(tokens, device, config.block_size)
    ids = torch.zeros(tokens, dtype=torch.int64, device=device)
    hidden = runner.forward(ids, ids, StepContext(backend, metadata, backend.plan(metadata)))
    rows = min(config.max_num_seqs, tokens)
    logits = runner.compute_logits(hidden[:rows]).float()
    peak = torch.cuda.max_memory_allocated(device) - base
    del cache, backend, runner, hidden, logits
    torch.cuda.empty_cache()
    sampler = config.max_num_seqs * loaded.vocab_size * 12
    logger.info("warm-up forward of %d tokens: peak %.1f MiB beyond the weights (+%.1f MiB "
                "sampler estimate)", tokens, peak / 2**20, sampler / 2**20)
    return peak + sampler


def probe_attention_layers(runner: ModelRunner) -> dict[int, LayerSpec]:
    """Runs one token through the runner's model and checks that every layer's attention went
    through our function exactly once, with nothing the backends would ignore; refuses the
    model otherwise. Returns each layer's ``LayerSpec``."""
    try:
        return probe_layers(runner.forward, runner.loaded.num_layers,
                            runner.loaded.architecture, runner.device)
    except UnsupportedAttentionError as exc:
        raise UnsupportedModelError(str(exc)) from None
