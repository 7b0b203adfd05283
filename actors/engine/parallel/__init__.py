"""Tensor parallelism inside one replica: rank 0 is the engine (scheduler, sampler, outputs),
ranks 1..tp-1 hold their shard of the model and run the forward of every step rank 0
broadcasts (``docs/tensor_parallel.md``)."""
