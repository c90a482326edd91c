"""The engine: requests, KV block pool, scheduler, runner, sampler, detokenizer, engine loop."""
