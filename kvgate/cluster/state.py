"""The deployment's one shared state: a Ray actor holding every tenant's rate buckets (so a
tenant's requests- and tokens-per-minute hold for all replicas together, not per replica)
and each replica's latest ``/metrics`` text (which the ingress serves, labelled by
replica).

A replica reaches it through ``SharedBuckets``, a drop-in for ``RateBuckets``. When the
actor cannot be reached within ``timeout`` seconds, a replica either serves without the
shared rates (``fail="open"``, the default: its own in-process buckets take over, so each
replica then allows a tenant its full rate) or refuses rate-limited tenants with 503
(``fail="closed"``) until the actor answers again; it asks again at most every
``retry_s`` seconds, so an unreachable actor costs one timeout per ``retry_s``, not one
per request. Tenants without rate limits never call it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from kvgate.errors import Overloaded
from kvgate.governance.admission import RateBuckets, Shortfall

log = logging.getLogger("kvgate.cluster")

STATE_ACTOR = "kvgate-cluster-state"
NAMESPACE = "kvgate"


class ClusterState:
    """The actor's class (see ``state_actor``). Time is the actor's own wall clock: one
    clock for every replica's charges."""

    def __init__(self) -> None:
        self.buckets = RateBuckets()
        self.metrics: dict[str, tuple[float, tuple[str, str]]] = {}
        self.pids: dict[str, int] = {}

    def take(
        self, tenant: str, limits: tuple[int | None, int | None], amounts: tuple[int, int]
    ) -> tuple[Shortfall | None, dict[str, str]]:
        return self.buckets.take(tenant, limits, amounts, time.time())

    def give(self, tenant: str, amounts: tuple[int, int]) -> None:
        self.buckets.give(tenant, amounts, time.time())

    def push_metrics(self, replica: str, texts: tuple[str, str], pid: int = 0) -> None:
        """``texts``: the replica's whole exposition, and the one without per-tenant series;
        ``pid``: its process (for operators, and the tests that kill one)."""
        self.metrics[replica] = (time.time(), texts)
        self.pids[replica] = pid

    def drop_metrics(self, replica: str) -> None:
        self.metrics.pop(replica, None)
        self.pids.pop(replica, None)

    def replica_pids(self, max_age_s: float) -> dict[str, int]:
        """The processes of the replicas that pushed within ``max_age_s``."""
        now = time.time()
        return {
            n: self.pids.get(n, 0) for n, (t, _) in self.metrics.items() if now - t <= max_age_s
        }

    def replica_metrics(self, max_age_s: float) -> dict[str, tuple[str, str]]:
        """Each replica's latest metrics texts, of replicas that pushed within ``max_age_s``."""
        now = time.time()
        for name in [n for n, (t, _) in self.metrics.items() if now - t > max_age_s]:
            del self.metrics[name]
        return {name: text for name, (_, text) in self.metrics.items()}


def state_actor() -> Any:
    """The deployment's state actor, created by whichever caller comes first (named, in the
    ``kvgate`` namespace, living as long as the Ray cluster)."""
    actor_class = ray.remote(num_cpus=0, max_restarts=-1)(ClusterState)
    return actor_class.options(
        name=STATE_ACTOR, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class SharedBuckets(RateBuckets):
    """``RateBuckets`` kept by the state actor; its own (inherited) buckets serve while the
    actor is unreachable and ``fail`` is ``open``."""

    def __init__(
        self, actor: Any, *, fail: str = "open", timeout: float = 0.5, retry_s: float = 5.0
    ) -> None:
        super().__init__()
        if fail not in ("open", "closed"):
            raise ValueError(f"fail must be 'open' or 'closed', got {fail!r}")
        self.actor = actor
        self.fail = fail
        self.timeout = timeout
        self.retry_s = retry_s
        self._down_until = 0.0
        self._headers: dict[str, dict[str, str]] = {}

    def _call(self, method: str, *args: Any) -> Any:
        """The actor's answer, or raises ``_Unreachable``."""
        if time.monotonic() < self._down_until:
            raise _Unreachable()
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout)
        except Exception as exc:  # timeout, actor dead or restarting: the same to a caller
            self._down_until = time.monotonic() + self.retry_s
            log.warning(
                "shared rate state unreachable (%s: %s); failing %s for %.0f s",
                type(exc).__name__, exc, self.fail, self.retry_s,
            )  # fmt: skip
            raise _Unreachable() from None

    def _unavailable(self) -> Overloaded:
        return Overloaded(
            "the deployment's shared rate limits cannot be checked right now; retry later",
            retry_after=int(self.retry_s),
        )

    def take(
        self,
        tenant: str,
        limits: tuple[int | None, int | None],
        amounts: tuple[int, int],
        now: float,
    ) -> tuple[Shortfall | None, dict[str, str]]:
        try:
            result: tuple[Shortfall | None, dict[str, str]] = self._call(
                "take", tenant, limits, amounts
            )
        except _Unreachable:
            if self.fail == "closed":
                raise self._unavailable() from None
            result = super().take(tenant, limits, amounts, now)
        self._headers[tenant] = result[1]
        return result

    def give(self, tenant: str, amounts: tuple[int, int], now: float) -> None:
        if time.monotonic() < self._down_until:
            super().give(tenant, amounts, now)
            return
        self.actor.give.remote(tenant, amounts)  # nothing to wait for

    def headers(self, tenant: str) -> dict[str, str]:
        """As of this replica's last charge for the tenant (no call to the actor)."""
        return self._headers.get(tenant, {})


class _Unreachable(Exception):
    pass
