"""EngineConfig: the knobs of one engine (one model on one device).

A slotted dataclass that checks and derives what it can in ``__post_init__``; the values that
depend on the model (``max_model_len`` when None, the KV block count) are resolved by the engine
once the model config is known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping

DType = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
_SAMPLER_BACKENDS = ("auto", "torch", "triton", "flashinfer")
Quantization = Literal["fp8"]
_QUANTIZATIONS = (None, "fp8")
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _fail(name: str, rule: str, value: Any) -> ValueError:
    return ValueError(f"engine.{name}: {rule}, got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    """Settings of one engine.

    Args:
        dtype: model dtype (and the KV pool's with ``kv_cache_dtype`` "auto"); "auto" is
            bfloat16 on CUDA and float32 on CPU.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:<i>".
        max_model_len: longest sequence (prompt + output); None takes the model's
            ``max_position_embeddings``.
        max_num_seqs: most sequences (samples) running at once; also the sampler's slot count
            and the largest ``n`` a request may ask for.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        block_size: tokens per KV page.
        num_kv_blocks: KV pages; None sizes the pool from ``kv_cache_memory`` (bytes) or, on
            CUDA, from ``gpu_memory_utilization`` of the device memory.
        kv_cache_memory: bytes for the KV pool when ``num_kv_blocks`` is None (CPU default 1 GiB).
        gpu_memory_utilization: share of the device memory the process may use on CUDA.
        enable_prefix_caching: reuse full KV blocks by chained block hash.
        attention_backend: "auto" (FlashInfer on CUDA when it is installed, else torch),
            "torch" (reference, any device) or "flashinfer".
        cuda_graphs: capture pure-decode steps in CUDA graphs, one per batch-size bucket;
            None means True on CUDA (with the FlashInfer backend) and False elsewhere.
        cuda_graph_max_batch: the largest captured decode batch; None takes ``max_num_seqs``.
            Larger decode batches, and prefill or mixed steps, run eagerly.
        fused_layers: swap one-kernel Triton RMSNorm, rotary embedding and gated SiLU into
            the model (``actors.engine.model.fused_layers``, each checked against the model's own code
            first); None means True on CUDA when Triton is installed, False elsewhere.
        fused_projections: run each attention's q/k/v projections, and each MLP's gate/up,
            as one GEMM over weights concatenated in place
            (``actors.engine.model.fused_projections``; the HF names stay views of the fused
            storage for ``update_weights``); None means True on CUDA, False elsewhere; True
            on CPU fuses them too.
        fused_moe: route MoE tokens and run their experts in the fused kernels
            (``actors.engine.model.moe``, each module checked against the model's own code
            first); None means True on CUDA when Triton is installed, False elsewhere. True
            on CPU runs the kernels' torch references (same results as the model's modules).
        sampler_backend: passed to the sampler ("auto", "torch", "triton", "flashinfer").
        max_logprobs: the largest ``logprobs`` / ``prompt_logprobs`` a request may ask for.
        trust_remote_code: allow model code from the checkpoint.
        seed: base seed from which unseeded requests' seeds derive.
        prompt_logprobs_chunk: rows per LM-head chunk when scoring prompts.
        revision, tokenizer: optional hub revision and tokenizer path/id.
        batch_invariant: schedule so that a sequence's attention and sampling never depend
            on its batch-mates: each step is either one sequence's prefill chunk or a
            pure-decode batch (never mixed), so every token of a sequence runs the same
            attention kernel with the same tiling whatever else runs (FlashInfer: split-KV
            is off; its tensor-core decode tile is fixed for one-token queries). The sampler
            is per-row already. What stays batch-dependent: the GEMMs of the linear layers
            and the LM head (their tiling follows the step's token count, padded to the
            CUDA-graph bucket), and on CPU the torch reference attention (it pads to the
            longest sequence of the step). Costs prefill throughput (one prompt per step).
        tensor_parallel_size: ranks the model is split over (``actors.engine.parallel``);
            1 runs the whole model in this process. Its divisibility by the model's heads
            and MLP width is checked when the model config is read.
        quantization: None (the checkpoint's dtype) or "fp8": the decoder projections run in
            e4m3 with per-channel weight scales and per-token activation scales
            (``actors.engine.model.quantization``; docs/fp8.md). A bf16/fp16 checkpoint is
            quantized at load, an FP8 one (``quant_method`` fp8 or compressed-tensors) loads
            as it is; embeddings, norms and the LM head stay bf16. Needs a CUDA GPU of compute
            capability >= 8.9 (Hopper for speed) and bfloat16; refused elsewhere before the
            model loads. ``update_weights`` takes bf16 tensors and re-quantizes them.
        kv_cache_dtype: "auto" (the KV pool in the model's dtype) or "fp8" (alias
            "fp8_e4m3", stored as "fp8"): the pool is ``float8_e4m3fn``, half the bytes per
            block (twice the blocks from the same memory); new K/V rows are clamped to +-448
            and cast with a scale of 1.0, and attention reads them back in the model's dtype
            (docs/fp8.md). Independent of ``quantization``. Needs, on CUDA, compute capability
            >= 8.9 (checked when the engine starts); on CPU the torch backend runs it.
        cpu_threads: torch intra-op threads of the engine's process, set on each thread that
            runs the engine (``actors.engine.cpu_threads``); None means, on CPU, the process's
            share: a Ray actor's ``num_cpus``, else the CPUs it may use, per
            tensor-parallel rank, at most ``OMP_NUM_THREADS``; on CUDA, torch's own.
    """

    dtype: DType = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    cuda_graphs: bool | None = None
    cuda_graph_max_batch: int | None = None
    fused_layers: bool | None = None
    fused_projections: bool | None = None
    fused_moe: bool | None = None
    sampler_backend: str = "auto"
    max_logprobs: int = 20
    trust_remote_code: bool = False
    seed: int = 0
    prompt_logprobs_chunk: int = 1024
    revision: str | None = None
    tokenizer: str | None = None
    batch_invariant: bool = False
    tensor_parallel_size: int = 1
    quantization: Quantization | None = None
    kv_cache_dtype: KVCacheDType = "auto"
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise _fail("dtype", f"must be one of {', '.join(_DTYPES)}", self.dtype)
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise _fail("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:<index>'", self.device)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "prompt_logprobs_chunk", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(name, "must be an integer >= 1", value)
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory",
                     "cuda_graph_max_batch", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise _fail(name, "must be None or an integer >= 1", value)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise _fail("num_kv_blocks", "must be >= 2", self.num_kv_blocks)
        if not 0 < float(self.gpu_memory_utilization) <= 1:
            raise _fail("gpu_memory_utilization", "must be in (0, 1]",
                        self.gpu_memory_utilization)
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise _fail("attention_backend", f"must be one of {', '.join(_ATTENTION_BACKENDS)}",
                        self.attention_backend)
        if self.sampler_backend not in _SAMPLER_BACKENDS:
            raise _fail("sampler_backend", f"must be one of {', '.join(_SAMPLER_BACKENDS)}",
                        self.sampler_backend)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < 0:
            raise _fail("max_logprobs", "must be an integer >= 0", self.max_logprobs)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise _fail("seed", "must be an integer >= 0", self.seed)
        for name in ("enable_prefix_caching", "trust_remote_code", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "must be true or false", getattr(self, name))
        for name in ("cuda_graphs", "fused_layers", "fused_projections", "fused_moe"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise _fail(name, "must be true, false or None", getattr(self, name))
        if self.quantization not in _QUANTIZATIONS:
            raise _fail("quantization", "must be None or 'fp8'", self.quantization)
        if self.quantization == "fp8" and self.dtype not in ("auto", "bfloat16"):
            raise _fail("dtype", "must be bfloat16 (or auto) with quantization 'fp8'",
                        self.dtype)
        if not isinstance(self.kv_cache_dtype, str) \
                or self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise _fail("kv_cache_dtype", "must be 'auto', 'fp8' or 'fp8_e4m3'",
                        self.kv_cache_dtype)
        if self.kv_cache_dtype == "fp8_e4m3":
            self.kv_cache_dtype = "fp8"
        if self.device == "auto":
            self.device = _default_device()
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> EngineConfig:
        """Builds a config from a mapping; unknown keys raise ``ValueError`` naming them."""
        data = dict(data or {})
        unknown = sorted(set(data) - FIELD_NAMES)
        if unknown:
            raise ValueError(
                f"engine: unknown option(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(sorted(FIELD_NAMES))})"
            )
        return cls(**data)

    @classmethod
    def check(cls, data: Mapping[str, Any] | None) -> None:
        """Validates a mapping as :meth:`from_dict` does (``ValueError`` naming the option)
        without resolving ``device: auto``: a job driver or a rollout pool checks the options
        it ships to the actors, where the device is resolved; resolving it here would import
        torch and probe CUDA in a process that runs no engine."""
        data = dict(data or {})
        if data.get("device", "auto") == "auto":
            data["device"] = "cpu"  # "auto" is valid wherever the engine runs
        cls.from_dict(data)

    @classmethod
    def coerce(cls, value: EngineConfig | Mapping[str, Any] | None) -> EngineConfig:
        """Accepts an EngineConfig, a mapping of its fields, or None (all defaults)."""
        if isinstance(value, EngineConfig):
            return value
        if value is None or isinstance(value, Mapping):
            return cls.from_dict(value)
        raise TypeError(f"engine_config: expected EngineConfig, dict or None, got {value!r:.100}")

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> EngineConfig:
        """A checked copy with some fields changed."""
        return EngineConfig.from_dict({**self.to_dict(), **changes})


FIELD_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def check_tensor_parallel(tp: int, num_heads: int, num_kv_heads: int) -> None:
    """Raises ``ValueError`` naming ``engine.tensor_parallel_size`` when ``tp`` ranks cannot
    split the heads: it must divide the attention heads, and divide the KV heads or be a
    multiple of them (KV heads are then replicated). Widths are checked while sharding."""
    if num_heads % tp:
        raise _fail("tensor_parallel_size", f"must divide the model's {num_heads} attention "
                    "heads", tp)
    if num_kv_heads % tp and tp % num_kv_heads:
        raise _fail("tensor_parallel_size", f"must divide the model's {num_kv_heads} KV "
                    "heads, or be a multiple of them (KV heads are then replicated)", tp)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
