"""One engine replica of the Ray Serve deployment: a whole kvgate server (the app that
``kvgate serve`` runs, with its engine, KV pool, tenants, usage ledger, metrics) in a Ray
actor, fed the ingress's requests through ``bridge.run_asgi`` instead of a socket. Nothing of
the server is rewritten for the cluster: a request through the ingress meets the same
routes, limits, admission, streaming and errors.

What the cluster adds here: the tenants' rate buckets are the deployment's (``state.py``),
the replica reports its load and KV use to the router (``record_routing_stats``) and its
health to Ray (``check_health``), and pushes its metrics for the ingress's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest
from ray import serve

from kvgate.cluster.bridge import Forwarded, Head, run_asgi
from kvgate.cluster.controller import PROBE_HEADER
from kvgate.cluster.metrics import merge
from kvgate.cluster.state import SharedBuckets, state_actor

log = logging.getLogger("kvgate.cluster")


@dataclass(frozen=True)
class Fault:
    """Faults injected on purpose, to see a rollout roll back: ``ClusterSpec.fault`` (tests
    and ``bench/cluster.py`` set it through the rollout controller), not a served flag."""

    errors: float = 0.0  # fraction of API requests answered 500
    latency_s: float = 0.0  # added before each request

    @classmethod
    def parse(cls, spec: str | None) -> Fault:
        from kvgate.errors import InvalidConfig

        if not spec:
            return cls()
        values: dict[str, float] = {}
        for item in spec.split(","):
            name, _, value = item.partition("=")
            if name.strip() not in ("errors", "latency"):
                raise InvalidConfig(f"fault: unknown {name!r} (errors=F, latency=S)", param="fault")
            try:
                values[name.strip()] = float(value)
            except ValueError:
                raise InvalidConfig(f"fault: {item!r} needs a number", param="fault") from None
        return cls(values.get("errors", 0.0), values.get("latency", 0.0))


#: Seconds between pushes of this replica's metrics to the shared state; the ingress's
#: /metrics is at most this old (plus a scrape), and forgets a replica silent for 4 pushes.
METRICS_PUSH_S = 2.0


class EngineReplica:
    """``argv``: ``kvgate serve``'s arguments for this replica's server (its port and host
    unused); ``rates_unreachable``: ``open`` or ``closed`` (see ``state.py``); ``fault``:
    see :class:`Fault`."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, argv: Sequence[str], rates_unreachable: str = "open", fault: str = ""
    ) -> None:
        from kvgate.launch.server import build_server, setup_logging
        from kvgate.launch.settings import serve_settings
        from kvgate.server.app import ServerState

        launch = serve_settings(list(argv))
        self.fault = Fault.parse(fault)
        setup_logging(launch.config)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.actor = state_actor()
        buckets = SharedBuckets(self.actor, fail=rates_unreachable)
        self.app = build_server(launch, rate_buckets=buckets)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        self.state: ServerState = self.app.state.kvgate
        await asyncio.to_thread(self.state.ready.wait)
        if self.state.load_error is not None:
            raise RuntimeError(f"the model failed to load: {self.state.load_error}")
        self._pusher = asyncio.ensure_future(self._push_metrics())
        log.info("replica %s ready", self.name)

    async def handle(
        self, req: Forwarded, route: tuple[tuple[int, ...], str | None] = ((), None)
    ) -> AsyncIterator[Head | bytes]:
        """One forwarded HTTP request (``route`` is the router's: see ``router.py``)."""
        if self.fault.latency_s:
            await asyncio.sleep(self.fault.latency_s)
        probe = any(k == PROBE_HEADER for k, _ in req.headers)
        if self.fault.errors and not probe and random.random() < self.fault.errors:
            body = b'{"error": {"message": "injected fault", "type": "server_error", '
            body += b'"param": null, "code": "injected_fault"}}'
            yield Head(500, ((b"content-type", b"application/json"),))
            yield body
            return
        async for part in run_asgi(self.app, req):
            yield part

    def record_routing_stats(self) -> dict[str, Any]:
        """Load and KV use for the router (Ray asks every ``request_routing_stats_period_s``)."""
        snaps = self.state.snapshots().values()
        blocks = sum(s.kv_blocks for s in snaps)
        used = sum(s.kv_used for s in snaps)
        return {
            "running": sum(s.running for s in snaps),
            "waiting": sum(s.waiting for s in snaps),
            "kv_usage": used / blocks if blocks else 0.0,
            "version": self.state.serving.model_version if self.state.serving else None,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The custom metrics of ``autoscale.kv_aware_policy``."""
        return {"kv_usage": float(self.record_routing_stats()["kv_usage"])}

    async def check_health(self) -> None:
        """Ray restarts the replica when this raises: an engine the supervisor gave up on."""
        for slot in self.state.models:
            if slot.status not in ("ready", "loading"):
                raise RuntimeError(f"model {slot.name!r} is {slot.status}")

    async def cluster_metrics(self, authorization: str | None) -> bytes:
        """Every live replica's metrics, labelled ``replica``; per-tenant series only for a
        caller this server would show them to (as its own ``/metrics``)."""
        full = self.state.governance.tenants.may_observe(authorization)
        texts = await self.actor.replica_metrics.remote(4 * METRICS_PUSH_S)
        texts[self.name] = self._texts()  # this replica's, fresh
        return merge({name: pair[0 if full else 1] for name, pair in texts.items()})

    def _texts(self) -> tuple[str, str]:
        from kvgate.server.probes import Aggregates

        registry = self.state.registry
        return (
            generate_latest(registry).decode(),
            generate_latest(Aggregates(registry)).decode(),
        )

    async def _push_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the actor restarting: next time
                await self.actor.push_metrics.remote(self.name, self._texts(), os.getpid())
            await asyncio.sleep(METRICS_PUSH_S)

    async def __del__(self) -> None:
        """Also after a constructor that raised: only what it got to is undone."""
        pusher = getattr(self, "_pusher", None)
        if pusher is not None:
            pusher.cancel()
            with contextlib.suppress(Exception):
                await self.actor.drop_metrics.remote(self.name)
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            with contextlib.suppress(Exception):
                await lifespan.__aexit__(None, None, None)
