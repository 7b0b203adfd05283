"""The inference engine: requests in, generation outputs out. Scheduling, the paged block
manager, sequences, request building, output processing, weights and sleep live here; the
model's execution on the device (runner, loader, KV cache, CUDA graphs, fused layers,
attention backends) in :mod:`actors.engine.model`. Nothing here imports the worker side.

Importing this package imports nothing heavy: the driver reads :mod:`actors.engine.engine_config`.
"""
