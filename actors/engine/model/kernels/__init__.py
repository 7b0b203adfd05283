"""Triton kernels of the engine's model forward on CUDA (tests run them under
``TRITON_INTERPRET=1``): RMSNorm, rotary embedding and the gated-SiLU product, each beside the
torch function it replaces (its oracle). :mod:`actors.engine.model.fused_layers` swaps them
into a loaded transformers model after checking each against the model's own code. The MoE
kernels (``moe_routing``, ``moe_align``, ``moe_gemm``) go in through
:mod:`actors.engine.model.moe`; ``decode_attention`` through the FlashInfer attention backend;
``kv_store`` (a step's K/V rows into the pool) through
``actors.engine.model.kv_cache.store_kv``.

Importing this package imports triton; ``import actors`` does not.
"""

import os


def interpreted() -> bool:
    """Whether Triton runs on the CPU interpreter (whose ``tl.dot`` is wrong on bf16/fp16
    operands: the kernels that multiply matrices upcast them there)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
