"""The Ray worker side: the generation actor, its shard loop and row code (this package), the
inference engine it drives (:mod:`actors.engine`), and the contract it shares with the job
driver (:mod:`actors.contract`: shard task and result, output schema, shard I/O)."""
