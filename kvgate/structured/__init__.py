"""Constrained decoding: grammars from response formats and tools, compiled by llguidance,
applied as token masks in the sampler."""
