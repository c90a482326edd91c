"""Ray Serve autoscaling on queue depth and KV use.

Ray Serve's own rule scales on requests in flight per replica (``target_ongoing_requests``):
that is the queue. On an LLM engine a second signal matters: a pool whose KV cache is
nearly full preempts and recomputes, so a replica can be slow with few requests, each with
a long context. ``desired_replicas`` takes the larger of the two answers: enough replicas
for the requests at the target, and one more than now while the replicas' mean KV use is
over ``KV_HIGH`` (never fewer than now while it is over ``KV_HOLD``: scaling down would
push their long contexts onto fewer pools). Ray applies its delays and bounds around it.

Each replica reports ``kv_usage`` through ``EngineReplica.record_autoscaling_stats``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: Mean KV use (fraction of each pool) past which a replica is added.
KV_HIGH = 0.85
#: Mean KV use past which no replica is removed.
KV_HOLD = 0.6


def desired_replicas(
    current: int, requests: float, kv_usage: Sequence[float], target_requests: float
) -> int:
    """Replicas wanted for ``requests`` in flight in all, and each replica's KV use."""
    by_queue = math.ceil(requests / target_requests) if target_requests > 0 else current
    mean_kv = sum(kv_usage) / len(kv_usage) if kv_usage else 0.0
    if mean_kv > KV_HIGH:
        return max(by_queue, current + 1)
    if mean_kv > KV_HOLD:
        return max(by_queue, current)
    return max(by_queue, 1)


def kv_aware_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve's ``policy_function``: ``ctx`` is its ``AutoscalingContext``."""
    metrics = ctx.aggregated_metrics or {}
    kv = list((metrics.get("kv_usage") or {}).values())
    target = float(getattr(ctx.config, "target_ongoing_requests", 1.0) or 1.0)
    n = desired_replicas(ctx.current_num_replicas, float(ctx.total_num_requests), kv, target)
    n = min(max(n, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
    return n, ctx.policy_state
