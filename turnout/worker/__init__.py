"""One rank of the engine (``Worker``: device, model shard, KV shard) and the flat per-step message the
driver rank sends the others (``step_codec``)."""
