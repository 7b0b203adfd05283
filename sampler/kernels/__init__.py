"""Triton kernels of the sampler (the GPU backend; tests run them under TRITON_INTERPRET=1).

:mod:`sampler.kernels.launcher` runs a step on them; :mod:`sampler.kernels.kernel_config` holds the
launch configuration. How they work: docs/sampler_kernels.md. Importing this package imports
triton; ``import sampler`` does not.
"""
