"""The Ray Serve application: N engine replicas (``replica.py``) behind one ingress
(``ingress.py``), the engine deployment routed by ``router.PrefixAffinityRouter``.

Two ways to run it:

- ``kvgate serve --replicas N [serve options]``: starts a local Ray, deploys, serves on
  ``--host``/``--port`` until interrupted;
- ``serve run kvgate.cluster:app replicas=2 args="--model smollm2 --tenants t.toml"`` (or
  a Serve config file with the same ``args``), on a Ray cluster of your own.

Every replica runs ``kvgate serve``'s server with the same arguments; ``--shutdown-timeout``
is each replica's graceful shutdown (Serve stops routing to a stopping replica at once, and
gives its requests in flight that long).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.errors import InvalidConfig
from kvgate.launch.settings import Launch

log = logging.getLogger("kvgate.cluster")

ENGINE = "kvgate-engine"
INGRESS = "kvgate-ingress"
APP = "kvgate"


@dataclass(frozen=True)
class ClusterSpec:
    """``argv``: the replicas' ``kvgate serve`` arguments; ``routing``: ``affinity`` or
    ``least_loaded``; ``max_replicas`` above ``replicas`` turns on Serve's autoscaling on
    requests in flight per replica (``target_requests``)."""

    argv: tuple[str, ...]
    replicas: int = 2
    routing: str = "affinity"
    rates_unreachable: str = "open"
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 4 * 2**20
    max_replicas: int | None = None
    target_requests: float = 8.0
    #: Faults each replica injects on purpose (``replica.Fault``: ``errors=F,latency=S``),
    #: for tests and benchmarks of a rollback; never set by the command line.
    fault: str = ""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InvalidConfig(
                f"replicas must be at least 1, got {self.replicas}", param="replicas"
            )
        if self.routing not in ("affinity", "least_loaded"):
            raise InvalidConfig(
                f"routing must be 'affinity' or 'least_loaded', got {self.routing!r}",
                param="routing",
            )
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise InvalidConfig(
                f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})",
                param="max_replicas",
            )


def engine_application(spec: ClusterSpec) -> Any:
    """The engine deployment of ``spec``, bound: an application of its own, or a part of
    ``application``'s."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvgate.cluster.replica import EngineReplica
    from kvgate.cluster.router import PrefixAffinityRouter

    scaling: dict[str, Any] = {"num_replicas": spec.replicas}
    if spec.max_replicas is not None and spec.max_replicas > spec.replicas:
        scaling = {
            "autoscaling_config": {
                "min_replicas": spec.replicas,
                "max_replicas": spec.max_replicas,
                "target_ongoing_requests": spec.target_requests,
                # Queue depth and KV use (cluster/autoscale.py), Ray's delays around it.
                "policy": {"policy_function": "kvgate.cluster.autoscale:kv_aware_policy"},
            }
        }
    deployment: Any = serve.deployment  # its overloads do not type a class with options
    router: dict[str, Any] = {
        # By import path: a class object would be pickled by value, with copies of
        # ``RouteHint`` that the requests' own hints are not instances of.
        "request_router_class": f"{PrefixAffinityRouter.__module__}.PrefixAffinityRouter",
        "request_router_kwargs": {"policy": spec.routing},
        "request_routing_stats_period_s": 2.0,
    }
    return deployment(
        EngineReplica,
        name=ENGINE,
        # kvgate's own door (queue limits, fair shares, 503 with Retry-After) decides what
        # waits, so Serve does not queue in front of it.
        max_ongoing_requests=1024,
        graceful_shutdown_timeout_s=spec.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        ray_actor_options={"num_cpus": 0},  # the engine's threads are its own setting
        request_router_config=RequestRouterConfig(**router),
        **scaling,
    ).bind(list(spec.argv), spec.rates_unreachable, spec.fault)


def ingress_application(spec: ClusterSpec, engine: Any = None) -> Any:
    """The ingress, bound; ``engine``: a bound engine deployment in the same application
    (``serve run``), else it serves the engine application the rollout controller names
    stable."""
    from ray import serve

    from kvgate.cluster.ingress import Ingress

    deployment: Any = serve.deployment
    ingress = deployment(
        Ingress, name=INGRESS, num_replicas=1, max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
    )  # fmt: skip
    return ingress.bind(engine, spec.max_body_bytes)


def application(spec: ClusterSpec) -> Any:
    """Ingress and engine in one application (``serve run kvgate.cluster:app``)."""
    return ingress_application(spec, engine_application(spec))


def app(args: Mapping[str, Any]) -> Any:
    """``serve run kvgate.cluster:app KEY=VALUE ...``: ``args`` (the replicas' ``kvgate
    serve`` arguments, one string), ``replicas``, ``routing``, ``rates_unreachable``,
    ``shutdown_timeout``, ``max_replicas``."""
    known = {"args", "replicas", "routing", "rates_unreachable", "shutdown_timeout", "max_replicas"}
    unknown = set(args) - known
    if unknown:
        raise InvalidConfig(f"unknown argument(s) {sorted(unknown)}; known: {sorted(known)}")
    max_replicas = args.get("max_replicas")
    return application(
        ClusterSpec(
            argv=tuple(shlex.split(str(args.get("args", "")))),
            replicas=int(args.get("replicas", 2)),
            routing=str(args.get("routing", "affinity")),
            rates_unreachable=str(args.get("rates_unreachable", "open")),
            shutdown_timeout=float(args.get("shutdown_timeout", 30.0)),
            max_replicas=int(max_replicas) if max_replicas is not None else None,
        )
    )


#: The first engine application's name; a rollout's canaries are ``kvgate-engine-2``, ...
FIRST_ENGINE_APP = f"{ENGINE}-1"


def start(spec: ClusterSpec, host: str, port: int, *, ray_address: str | None = None) -> None:
    """Start (or join) Ray, deploy the engine (as ``FIRST_ENGINE_APP``, stable) and the
    ingress on ``host:port``. A local Ray gets a small object store: requests and
    responses are small. Ray itself takes calls from this host only (a local one), and
    only with its token (``private_ray.py``): refused (``InvalidConfig``) otherwise."""
    from kvgate.cluster import private_ray

    local = ray_address is None
    private_ray.prepare(os.environ, local=local)  # before Ray is imported: it reads them then

    import ray
    from ray import serve

    from kvgate.cluster.controller import controller_actor

    if not ray.is_initialized():
        ray.init(
            address=ray_address,
            include_dashboard=False,
            object_store_memory=None if ray_address else 256 * 2**20,
            namespace="kvgate",
            log_to_driver=os.environ.get("KVGATE_RAY_LOGS", "1") != "0",
        )
    private_ray.verify(local=local)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(engine_application(spec), name=FIRST_ENGINE_APP, route_prefix=None)
    except RuntimeError as exc:
        raise InvalidConfig(
            f"the replicas failed to start: {_why(FIRST_ENGINE_APP, exc)}"
        ) from None
    shared = {
        "routing": spec.routing,
        "rates_unreachable": spec.rates_unreachable,
        "shutdown_timeout": spec.shutdown_timeout,
    }
    ray.get(controller_actor().set_stable.remote(FIRST_ENGINE_APP, list(spec.argv), shared))
    serve.run(ingress_application(spec), name=APP, route_prefix="/")


def _why(app_name: str, exc: Exception) -> str:
    """The replicas' own error behind Serve's "failed to update the deployments"."""
    from ray import serve

    try:
        message = serve.status().applications[app_name].deployments[ENGINE].message
    except Exception:
        return str(exc)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if (
            line.startswith(("RuntimeError:", "InvalidConfig:", "ModelNotFound:"))
            or "Error:" in line
        ):
            return line.split(":", 1)[1].strip()
    return lines[-1] if lines else str(exc)


def stop() -> None:
    import contextlib

    import ray
    from ray import serve

    from kvgate.cluster.controller import CONTROLLER
    from kvgate.cluster.state import NAMESPACE, STATE_ACTOR

    if not ray.is_initialized():  # refused before Ray started (serve.shutdown would start one)
        return
    serve.shutdown()  # type: ignore[no-untyped-call]
    for name in (CONTROLLER, STATE_ACTOR):  # detached: they would outlive a shared cluster
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    ray.shutdown()


def run_cluster(launch: Launch, replicas: int) -> int:
    """``kvgate serve --replicas N``: serve until SIGINT/SIGTERM, then drain and stop. Each
    replica builds its server from ``launch.argv`` (checked already: ``launch`` is its
    result here)."""
    from kvgate.launch.server import setup_logging

    config = launch.config
    setup_logging(config)
    spec = ClusterSpec(
        launch.argv,
        replicas,
        rates_unreachable=config.rates_unreachable,
        shutdown_timeout=config.shutdown_timeout,
        max_body_bytes=config.limits.max_body_bytes,
    )
    try:
        start(spec, config.host, config.port)
    except BaseException:
        stop()
        raise
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: done.set())
    log.info(
        "kvgate serving %d replicas on http://%s:%d/v1 (Ray Serve; prefix-cache affinity routing)",
        replicas, config.host, config.port,
    )  # fmt: skip
    done.wait()
    log.info(
        "stopping: replicas finish their requests in flight (up to %.0f s)", spec.shutdown_timeout
    )
    stop()
    return 0
