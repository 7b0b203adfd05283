"""Driver side of a job: config, shard plan, actor pool, commit protocol, resume."""
