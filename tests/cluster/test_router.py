"""PrefixAffinityRouter's own bookkeeping, without a cluster: Ray runs several routing tasks
at once, each choosing before any is reported routed."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

from kvgate.cluster import router as router_mod
from kvgate.cluster.router import PrefixAffinityRouter


class _NoProbes:
    """Ray's queue-length cache with nothing in it (no probe answered yet)."""

    def get(self, replica_id: object) -> None:
        return None


def _router() -> Any:  # its ReplicaID-keyed state, with plain names
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # no Ray router behind it
    r.initialize_state()
    r._replica_queue_len_cache = _NoProbes()  # type: ignore[assignment]
    return r


def _replica(name: str) -> Any:
    return SimpleNamespace(replica_id=name, routing_stats={})


def _pending(i: int) -> Any:
    return SimpleNamespace(kwargs={}, metadata=SimpleNamespace(internal_request_id=f"r{i}"))


def _first_choices(router: Any, replicas: list[Any], n: int) -> list[str]:
    async def choose(i: int) -> str:
        ranks = await router.choose_replicas(replicas, _pending(i))
        return str(ranks[0][0].replica_id)

    async def burst() -> list[str]:  # every choice made before any request is routed
        return [await choose(i) for i in range(n)]

    return asyncio.run(burst())


def test_a_burst_chosen_before_any_is_routed_spreads_over_the_replicas() -> None:
    router, replicas = _router(), [_replica("a"), _replica("b")]
    assert Counter(_first_choices(router, replicas, 8)) == {"a": 4, "b": 4}


def test_choices_count_as_load_until_routed() -> None:
    router, replicas = _router(), [_replica("a"), _replica("b")]
    router.ongoing["a"] = 2  # a already holds two routed requests
    first = _first_choices(router, replicas, 4)
    assert first[:2] == ["b", "b"]  # b until the choices even the loads
    assert Counter(first) == {"a": 1, "b": 3}
    for i, rid in enumerate(first):  # Ray reports them routed: choices become ongoing
        router.on_request_routed(_pending(i), rid, None)
    assert router.choosing == {} and router.ongoing == {"a": 3, "b": 3}


def test_a_choice_never_routed_stops_counting() -> None:
    router, replicas = _router(), [_replica("a"), _replica("b")]
    clock = [100.0]
    router.clock = lambda: clock[0]
    router.ongoing["a"] = 1
    assert _first_choices(router, replicas, 1) == ["b"]  # then cancelled while queued
    assert router._chosen(clock[0]) == {"b": 1}
    clock[0] += router_mod.CHOICE_TTL_S
    assert router._chosen(clock[0]) == {} and router.choosing == {}
