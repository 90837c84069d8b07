"""Per-rank model execution: the model runner, models, attention backends, sampler, KV transfer, and the
engine's config and step contract (scheduler_output) they share with the engine above."""
