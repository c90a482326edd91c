"""The Ray Serve request router of the engine deployment: prefix-cache affinity balanced
against load (the policy is ``cluster/affinity.py``; this is its adapter to Ray Serve's
``RequestRouter`` extension point).

Each call to an engine replica carries a ``RouteHint`` as its ``route`` keyword (as a plain
tuple: Ray may unpickle the router's module and the caller's as two copies, so a class of
ours would not be recognised): the block keys of the request's prompt and, for rollouts,
the model version it must go to. Load is what
this router has in flight on each replica (exact for this ingress), or what the replica last
reported to Ray's queue-length probes if that is more (other ingress replicas' requests
too); KV use comes from the replica's ``record_routing_stats``.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvgate.cluster.affinity import IMBALANCE, AffinityTable, ReplicaLoad, rank

#: How long a choice counts as load before Ray reports the request routed (seconds). Ray runs
#: up to two routing tasks per replica at once, each choosing before any of them is routed:
#: without counting the choices, a burst saw every replica at its old load and went to one
#: (a CI run sent 7 of 8 concurrent requests to one of two replicas). A choice whose request
#: is never routed (cancelled while queued) stops counting after this.
CHOICE_TTL_S = 5.0


@dataclass(frozen=True)
class RouteHint:
    """What the router needs of a request, before the replica reads its body."""

    keys: tuple[int, ...] = ()
    #: Only replicas serving this model version (None: any).
    version: str | None = None

    def wire(self) -> tuple[tuple[int, ...], str | None]:
        return (self.keys, self.version)


def hint_of(pending: PendingRequest | None) -> RouteHint:
    raw = pending.kwargs.get("route") if pending is not None else None
    if isinstance(raw, (tuple, list)) and len(raw) == 2:
        keys, version = raw
        return RouteHint(tuple(keys), version if isinstance(version, str) else None)
    return RouteHint()


class PrefixAffinityRouter(RequestRouter):
    """``request_router_kwargs``: ``imbalance`` (requests, default ``IMBALANCE``) and
    ``policy``: ``affinity`` (default) or ``least_loaded`` (load alone: the peer that the
    benchmark compares with)."""

    def initialize_state(self, **kwargs: Any) -> None:
        imbalance = kwargs.get("imbalance", IMBALANCE)
        policy = kwargs.get("policy", "affinity")
        if not isinstance(imbalance, int) or imbalance < 0:
            raise ValueError(f"imbalance must be a non-negative int, got {imbalance!r}")
        if policy not in ("affinity", "least_loaded"):
            raise ValueError(f"policy must be 'affinity' or 'least_loaded', got {policy!r}")
        self.imbalance = imbalance
        self.policy = policy
        self.table = AffinityTable()
        self.ongoing: dict[ReplicaID, int] = {}
        self.request_replica: dict[str, ReplicaID] = {}
        #: Requests chosen for but not yet routed: request id -> (first choice, monotonic s).
        self.choosing: dict[str, tuple[ReplicaID, float]] = {}
        self.clock = time.monotonic
        self.turn = 0

    def _chosen(self, now: float) -> dict[ReplicaID, int]:
        """The live choices per replica (expired ones dropped)."""
        self.choosing = {k: v for k, v in self.choosing.items() if now - v[1] < CHOICE_TTL_S}
        counts: dict[ReplicaID, int] = {}
        for rid, _ in self.choosing.values():
            counts[rid] = counts.get(rid, 0) + 1
        return counts

    def _load(self, replica: RunningReplica, chosen: dict[ReplicaID, int]) -> ReplicaLoad:
        rid = replica.replica_id
        mine = self.ongoing.get(rid, 0) + chosen.get(rid, 0)
        probed = self.replica_queue_len_cache.get(rid)
        stats = replica.routing_stats or {}
        kv = stats.get("kv_usage", 0.0)
        return ReplicaLoad(
            rid,
            max(mine, probed or 0),
            float(kv) if isinstance(kv, (int, float)) else 0.0,
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hint = hint_of(pending_request)
        candidates = [
            r
            for r in candidate_replicas
            if hint.version is None or (r.routing_stats or {}).get("version") == hint.version
        ]
        if not candidates:
            return []  # none of that version yet: the router backs off and asks again
        # Replicas equally loaded keep this order in the ranks: it turns with each choice,
        # so that requests finding them equally loaded alternate between them.
        candidates.sort(key=lambda r: str(r.replica_id))
        turn = self.turn % len(candidates)
        self.turn += 1
        candidates = candidates[turn:] + candidates[:turn]
        by_id: dict[Hashable, RunningReplica] = {r.replica_id: r for r in candidates}
        keys = hint.keys if self.policy == "affinity" else ()
        now = self.clock()
        chosen = self._chosen(now)
        loads = [self._load(r, chosen) for r in candidates]
        ranks = rank(keys, loads, self.table, self.imbalance)
        if ranks and pending_request is not None:
            # counted until Ray reports it routed (the first rank is taken when it has room)
            request_id = pending_request.metadata.internal_request_id
            self.choosing[request_id] = (by_id[ranks[0][0]].replica_id, now)
        return [[by_id[rid] for rid in group] for group in ranks]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self.ongoing[replica_id] = self.ongoing.get(replica_id, 0) + 1
        self.choosing.pop(pending_request.metadata.internal_request_id, None)
        self.request_replica[pending_request.metadata.internal_request_id] = replica_id
        keys = hint_of(pending_request).keys
        if keys:
            self.table.record(keys, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self.request_replica.pop(internal_request_id, replica_id)
        if self.ongoing.get(rid, 0) > 0:
            self.ongoing[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)
        self.ongoing.pop(replica_id, None)
        self.choosing = {k: v for k, v in self.choosing.items() if v[0] != replica_id}
