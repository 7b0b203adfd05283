"""What the job driver and the worker share: the shard task and its result (``task``), the
output schema (``schema``), the JSONL reader (``jsonl``) and a shard's input rows and part file
(``shard_io``). Light: pyarrow and the sampler's parameters only."""
