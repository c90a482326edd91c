"""Probes: readiness (``/health``), liveness (``/health/live``) and Prometheus metrics
(``/metrics``: per-tenant series for metrics and admin keys only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from kvgate.server.app import ServerState


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvgate
    return state


class Aggregates:
    """A registry's metric families without the per-tenant ones (``kvgate:tenant_*``, and
    the SLO series of a tenant's own targets, ``slo_group="tenant:NAME"``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name.startswith("kvgate:tenant_"):
                continue
            if family.name.startswith("kvgate:slo_"):
                family.samples = [
                    s
                    for s in family.samples
                    if not s.labels.get("slo_group", "").startswith("tenant:")
                ]
            yield family


def install_probe_routes(app: FastAPI) -> None:
    @app.get("/health")
    def health(request: Request) -> Response:
        state = _state(request)
        models = state.models
        if state.drain.draining.is_set():
            body = {"status": "draining", "in_flight": state.drain.active}
            return JSONResponse(body, status_code=503)
        statuses = {slot.name: slot.status for slot in models}
        per_model = {"models": statuses} if len(statuses) > 1 else {}
        if models.all_ready:
            # Steps recovered from inside an engine, and engine processes started again.
            restarts = sum(snap.recoveries for snap in state.snapshots().values()) + sum(
                slot.serving.engine.num_restarts for slot in models if slot.serving is not None
            )
            return JSONResponse({"status": "ok", "engine_restarts": restarts, **per_model})
        loading = all(s in ("ready", "loading") for s in statuses.values())
        restarting = all(s in ("ready", "restarting") for s in statuses.values())
        status = "loading" if loading else "restarting" if restarting else "unhealthy"
        return JSONResponse({"status": status, **per_model}, status_code=503)

    @app.get("/health/live")
    def live(request: Request) -> Response:
        """Liveness: the process serves, and no engine is past recovering (loading and
        draining are alive: only readiness, ``/health``, says 503 for those)."""
        models = _state(request).models
        alive = ("ready", "loading", "restarting")
        dead = [slot.name for slot in models if slot.status not in alive]
        if dead:
            return JSONResponse({"status": "dead", "models": dead}, status_code=503)
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        state = _state(request)
        # Per-tenant series name the tenants and what they do: only for a metrics or admin
        # key (or an open server); anyone else gets the aggregates.
        if state.governance.tenants.may_observe(request.headers.get("authorization")):
            return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(Aggregates(state.registry)), media_type=CONTENT_TYPE_LATEST)
