"""raygen's public API: the only names users import.

Heavy modules (ray, transformers, torch kernels) load on first use of the name that needs
them, so ``import toolkit`` stays fast.
"""
