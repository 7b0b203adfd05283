"""Triton kernels of the sampler (the GPU backend; tests run them under TRITON_INTERPRET=1).

Each op module holds ``@triton.jit`` tile functions (used by the fused kernel), a standalone
kernel and a launcher with the signature of the torch op it mirrors, so every op is tested
against its torch oracle. :mod:`sampler.kernels.fused` composes them into one kernel per step:
one program per row, a few passes over the row's logits (bf16/fp16/fp32 in, fp32 math), no
``[rows, vocab]`` float32 tensor.

Importing this package imports triton; ``import sampler`` does not.
"""
