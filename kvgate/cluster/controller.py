"""The rollout controller: a Ray actor that owns which engine application is stable, which
(if any) is the canary and how much traffic it gets, and drives a rollout step by step
(``rollout.py`` holds the plan and the judge).

The ingress reads ``routing()`` twice a second and reports each request's outcome to
``report``; ``kvgate rollout start|status|promote|abort`` call ``start``, ``status``,
``promote`` and ``abort``.

A rollout: the canary is deployed as an application of its own (``kvgate-engine-N``) and
must load and pass the golden prompts before it takes any traffic (else it is removed:
``rejected``). Each step, every half second, the judge compares canary and stable on the
step's window; a breach rolls back at once (weight 0: the ingress sends the canary nothing
new; its application is then deleted, Serve letting its requests in flight finish). A
step's end runs the golden prompts again and moves on; the last step's end promotes (the
canary's application becomes stable, the old one is deleted the same graceful way).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvgate.cluster.bridge import Forwarded
from kvgate.cluster.rollout import (
    CANARY,
    STABLE,
    Golden,
    Limits,
    Outcome,
    Plan,
    WindowStats,
    judge,
)

log = logging.getLogger("kvgate.cluster")

CONTROLLER = "kvgate-rollout"
ENGINE = "kvgate-engine"
#: Marks the controller's own requests (versions, golden prompts): ``--fault errors``
#: spares them, so an injected error rate meets the judge, not the golden check.
PROBE_HEADER = b"x-kvgate-probe"
#: Seconds between taking an application out of the routing and deleting it: several of
#: the ingress's reads of the routing (``ingress.SYNC_S``, 0.5 s).
DELETE_AFTER_S = 3.0
#: How long a canary may take to load before the rollout gives up on it.
LOAD_TIMEOUT_S = 600.0


def controller_actor() -> Any:
    import ray

    from kvgate.cluster.state import NAMESPACE

    actor_class = ray.remote(num_cpus=0, max_restarts=-1)(RolloutController)
    return actor_class.options(
        name=CONTROLLER, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` less every ``flag VALUE`` and ``flag=VALUE``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            out.append(arg)
    return out


async def call_engine(
    app_name: str, method: str, path: str, body: Any = None, key: str | None = None
) -> tuple[int, bytes]:
    """One request to an engine application, as the ingress would send it."""
    from ray import serve

    handle = serve.get_deployment_handle(ENGINE, app_name=app_name)
    headers = [(b"content-type", b"application/json"), (PROBE_HEADER, b"1")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    payload = b"" if body is None else json.dumps(body).encode()
    req = Forwarded(method, path, b"", tuple(headers), payload)
    status, chunks = 0, []
    stream: Any = handle.options(stream=True).handle.remote(req, route=((), None))
    async for part in stream:
        if isinstance(part, bytes):
            chunks.append(part)
        else:
            status = part.status
    return status, b"".join(chunks)


class RolloutController:
    def __init__(self) -> None:
        self.stable_app: str | None = None
        self.stable_argv: list[str] = []
        self.spec: dict[str, Any] = {}  # the engine deployment's settings (replicas, ...)
        self.canary_app: str | None = None
        self.versions: dict[str, str] = {}
        self.weight = 0.0
        self.salt = ""
        self.state = "idle"  # idle, loading, progressing, promoted, rolled_back, rejected
        self.step = -1
        self.plan: Plan | None = None
        self.decisions: Counter[str] = Counter()
        self.history: list[dict[str, Any]] = []
        self.outcomes: list[Outcome] = []
        self.baseline: WindowStats | None = None  # stable's last window with traffic
        self.step_started = 0.0
        self._task: asyncio.Task[None] | None = None
        self._apps = 1
        self._canary_argv: list[str] = []
        self._canary_fault = ""
        self._deleting: set[asyncio.Future[None]] = set()

    # ------------------------------------------------------------------ the ingress's side
    def set_stable(self, app_name: str, argv: Sequence[str], spec: dict[str, Any]) -> None:
        self.stable_app, self.stable_argv, self.spec = app_name, list(argv), dict(spec)

    def routing(self) -> dict[str, Any]:
        return {
            STABLE: self.stable_app,
            CANARY: self.canary_app if self.weight > 0 else None,
            "weight": self.weight,
            "salt": self.salt,
            "versions": dict(self.versions),
        }

    def report(self, outcomes: Sequence[tuple[str, bool, float | None, tuple[float, ...]]]) -> None:
        if self.state == "progressing":
            self.outcomes += [Outcome(*o) for o in outcomes]

    # ------------------------------------------------------------------ the operator's side
    def status(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "state": self.state,
            "stable": {"app": self.stable_app, "version": self.versions.get(STABLE)},
            "canary": {"app": self.canary_app, "version": self.versions.get(CANARY)},
            "weight": self.weight,
            "step": self.step,
            "steps": list(plan.steps) if plan else [],
            "interval_s": plan.interval_s if plan else None,
            "decisions": dict(self.decisions),
            "history": self.history[-20:],
            "window": self._stats(),
        }

    def _stats(self) -> dict[str, Any]:
        return {
            arm: WindowStats.of([o for o in self.outcomes if o.arm == arm]).figures()
            for arm in (STABLE, CANARY)
        }

    def _decide(self, decision: str, **figures: Any) -> None:
        self.decisions[decision] += 1
        entry = {"ts": round(time.time(), 3), "decision": decision, "step": self.step, **figures}
        self.history.append(entry)
        log.warning("rollout decision: %s", json.dumps(entry))

    async def start(
        self,
        model_argv: Sequence[str],
        steps: Sequence[int],
        interval_s: float,
        golden: Sequence[dict[str, Any]],
        key: str | None = None,
        limits: dict[str, Any] | None = None,
        replicas: int = 1,
        fault: str = "",
    ) -> dict[str, Any]:
        """Deploy the canary (``model_argv``: ``--model NEW`` and any serve options that
        differ from stable's) and start moving traffic; returns the status. Raises
        ``InvalidConfig`` for a bad plan and when a rollout is under way. ``fault``: faults
        the canary's replicas inject (``replica.Fault``), for trying a rollback."""
        from kvgate.errors import InvalidConfig

        plan = Plan(tuple(steps), float(interval_s), Limits(**(limits or {})))
        goldens = tuple(Golden(tuple(g["messages"]), g.get("expect"), g.get("regex"),
                               g.get("max_tokens", 32)) for g in golden)  # fmt: skip
        if not goldens:
            raise InvalidConfig("a rollout needs golden prompts", param="golden")
        if self.state in ("loading", "progressing"):
            raise InvalidConfig(f"a rollout is {self.state}: abort or promote it first")
        if self.stable_app is None:
            raise InvalidConfig(
                "no stable engine application to roll out from: rollouts need the engine in "
                "an application of its own, as `kvgate serve --replicas N` deploys it "
                "(`serve run kvgate.cluster:app` puts it beside the ingress)"
            )
        self.plan, self.step, self.weight, self.outcomes = plan, -1, 0.0, []
        self.versions.pop(CANARY, None)
        self.salt = uuid.uuid4().hex
        self.state = "loading"
        self._apps += 1
        self.canary_app = f"{ENGINE}-{self._apps}"
        argv = [*without_flag(self.stable_argv, "--model"), *model_argv]
        self._canary_argv = argv
        self._canary_fault = fault
        if STABLE not in self.versions:
            try:
                self.versions[STABLE] = await self._version(self.stable_app, key)
            except Exception as exc:  # stable not answering: no baseline to judge against
                self.state = "idle"
                raise InvalidConfig(f"the stable version does not answer: {exc}") from None
        self._task = asyncio.ensure_future(self._run(argv, goldens, key, replicas))
        return self.status()

    async def promote(self) -> dict[str, Any]:
        if self.state != "progressing":
            from kvgate.errors import InvalidConfig

            raise InvalidConfig(f"nothing to promote: the rollout is {self.state}")
        if self._task is not None:
            self._task.cancel()
        await self._promote("promoted_by_operator")
        return self.status()

    async def abort(self) -> dict[str, Any]:
        if self.state not in ("loading", "progressing"):
            from kvgate.errors import InvalidConfig

            raise InvalidConfig(f"nothing to abort: the rollout is {self.state}")
        if self._task is not None:
            self._task.cancel()
        await self._roll_back("aborted", "operator")
        return self.status()

    # ------------------------------------------------------------------ the steps
    async def _run(
        self, argv: list[str], goldens: Sequence[Golden], key: str | None, replicas: int
    ) -> None:
        assert self.plan is not None and self.canary_app is not None
        try:
            await self._deploy(self.canary_app, argv, replicas)
            self.versions[CANARY] = await self._version(self.canary_app, key)
        except Exception as exc:
            await self._roll_back("rejected", "load_failed", error=f"{type(exc).__name__}: {exc}")
            return
        failed = await self._golden(goldens, key)
        if failed is not None:
            await self._roll_back("rejected", "golden_failed", prompt=failed)
            return
        self.state = "progressing"
        for i, weight in enumerate(self.plan.steps):
            self.step, self.weight, self.outcomes = i, float(weight), []
            self.step_started = time.time()
            log.info("rollout step %d: %g%% to the canary %s", i, weight, self.versions[CANARY])
            end = time.monotonic() + self.plan.interval_s
            while time.monotonic() < end:
                await asyncio.sleep(0.5)
                stable, canary = self._windows()
                verdict = judge(stable, canary, self.plan.limits)
                if not verdict.ok:
                    await self._roll_back(
                        "rolled_back", verdict.reason or "breach",
                        stable=stable.figures(), canary=canary.figures(),
                    )  # fmt: skip
                    return
            failed = await self._golden(goldens, key)
            if failed is not None:
                await self._roll_back("rolled_back", "golden_failed", prompt=failed)
                return
            stable, canary = self._windows()
            if stable.requests:
                self.baseline = stable
            if i < len(self.plan.steps) - 1:
                self._decide("advanced", weight=weight, stable=stable.figures(),
                             canary=canary.figures())  # fmt: skip
        await self._promote("promoted")

    def _windows(self) -> tuple[WindowStats, WindowStats]:
        stable = WindowStats.of([o for o in self.outcomes if o.arm == STABLE])
        canary = WindowStats.of([o for o in self.outcomes if o.arm == CANARY])
        if not stable.requests and self.baseline is not None:
            stable = self.baseline  # all traffic on the canary: compare with stable's last
        return stable, canary

    async def _deploy(self, app_name: str, argv: list[str], replicas: int) -> None:
        from ray import serve

        from kvgate.cluster.app import ClusterSpec, engine_application

        spec = ClusterSpec(tuple(argv), replicas, **{**self.spec, "fault": self._canary_fault})
        await asyncio.wait_for(
            asyncio.to_thread(
                serve.run, engine_application(spec), name=app_name, route_prefix=None
            ),
            LOAD_TIMEOUT_S,
        )

    async def _version(self, app_name: str, key: str | None) -> str:
        status, body = await call_engine(app_name, "GET", "/v1/models", key=key)
        if status != 200:
            raise RuntimeError(f"/v1/models answered {status}: {body[:200]!r}")
        version: str = json.loads(body)["data"][0]["version"]
        return version

    async def _golden(self, goldens: Sequence[Golden], key: str | None) -> str | None:
        """The first golden prompt the canary fails (its content), or None."""
        assert self.canary_app is not None
        for g in goldens:
            try:
                status, body = await call_engine(
                    self.canary_app, "POST", "/v1/chat/completions", g.body(), key
                )
                answer = (
                    json.loads(body)["choices"][0]["message"]["content"] if status == 200 else ""
                )
            except Exception:  # a replica gone, a body that is not JSON: a failure
                status, answer = 0, ""
            if status != 200 or not g.check(answer):
                log.warning(
                    "golden prompt failed (status %s): %r -> %r", status, g.messages[-1], answer
                )
                return str(g.messages[-1].get("content", ""))[:200]
        return None

    async def _roll_back(self, state: str, reason: str, **figures: Any) -> None:
        self.weight = 0.0  # the ingress sends the canary nothing new from its next read
        self.state = state
        if state == "rolled_back" and self.step >= 0:
            figures["seconds_into_step"] = round(time.time() - self.step_started, 2)
        self._decide("rejected" if state == "rejected" else "rolled_back", reason=reason, **figures)
        app, self.canary_app = self.canary_app, None
        self.versions.pop(CANARY, None)
        if app is not None:
            self._spawn_delete(app)

    async def _promote(self, decision: str) -> None:
        old, self.stable_app = self.stable_app, self.canary_app
        self.versions[STABLE] = self.versions.pop(CANARY, "")
        self.canary_app, self.weight, self.state = None, 0.0, "promoted"
        self.stable_argv = self._canary_argv
        self._decide(decision)
        if old is not None:
            self._spawn_delete(old)

    def _spawn_delete(self, app_name: str) -> None:
        task = asyncio.ensure_future(self._delete(app_name))
        self._deleting.add(task)
        task.add_done_callback(self._deleting.discard)

    async def _delete(self, app_name: str) -> None:
        from ray import serve

        # First every ingress must have read that the application gets nothing new: a
        # request sent to an application being deleted waits for a replica that never
        # comes (seen: a client's 120 s timeout). Then Serve stops its replicas, letting
        # their requests in flight finish.
        await asyncio.sleep(DELETE_AFTER_S)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(serve.delete, app_name)
