"""Triton kernels of the engine's model forward on CUDA (tests run them under
``TRITON_INTERPRET=1``): RMSNorm, rotary embedding and the gated-SiLU product, each beside the
torch function it replaces (its oracle). :mod:`actors.engine.model.fused_layers` swaps them into a loaded
transformers model after checking each against the model's own code.

Importing this package imports triton; ``import actors`` does not.
"""
