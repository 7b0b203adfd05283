"""Generation actors: engine (scheduler, paged KV cache, model runner) and the Ray actor."""
