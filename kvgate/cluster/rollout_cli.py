"""``kvgate rollout start|status|promote|abort``: talk to the rollout controller of a
running ``kvgate serve --replicas`` (its Ray cluster: ``--address``, default ``auto``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import asdict
from typing import Any

from kvgate.cluster.rollout import Limits, load_golden, parse_duration, parse_steps


def add_rollout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["start", "status", "promote", "abort"],
        help="start a rollout; print its status; promote the canary now; abort (roll back)",
    )
    p.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", "auto"),
        help="the Ray cluster (default: $RAY_ADDRESS, else auto)",
    )
    p.add_argument("--model", default=None, help="start: the new model (alias, .gguf or dir)")
    p.add_argument("--steps", default="5,25,50,100", help="start: per cents to the canary")
    p.add_argument("--interval", default="60s", help="start: how long each step lasts")
    p.add_argument("--golden", default=None, help="start: JSON-lines golden prompts (required)")
    p.add_argument(
        "--key",
        default=os.environ.get("KVGATE_API_KEY"),
        help="start: the API key golden prompts are sent with (default: $KVGATE_API_KEY)",
    )
    p.add_argument("--replicas", type=int, default=1, help="start: the canary's replicas")
    p.add_argument(
        "--serve-args",
        default="",
        help="start: more `kvgate serve` options for the canary, one string",
    )


def plan_of(a: argparse.Namespace) -> dict[str, Any]:
    """What ``start`` sends; raises ``InvalidConfig`` for a bad one, before Ray is asked."""
    from kvgate.cluster.rollout import Plan
    from kvgate.errors import InvalidConfig

    if not a.model:
        raise InvalidConfig("rollout start needs --model NEW", param="model")
    if not a.golden:
        raise InvalidConfig(
            "rollout start needs --golden FILE (the canary's checks)", param="golden"
        )
    plan = Plan(parse_steps(a.steps), parse_duration(a.interval))
    goldens = [
        {
            "messages": [dict(m) for m in g.messages],
            "expect": g.expect,
            "regex": g.regex,
            "max_tokens": g.max_tokens,
        }
        for g in load_golden(a.golden)
    ]
    return {
        "model_argv": ["--model", a.model, *shlex.split(a.serve_args)],
        "steps": list(plan.steps),
        "interval_s": plan.interval_s,
        "golden": goldens,
        "key": a.key,
        "limits": asdict(Limits()),
        "replicas": a.replicas,
    }


def cmd_rollout(a: argparse.Namespace) -> int:
    from kvgate.errors import InvalidConfig

    plan = plan_of(a) if a.action == "start" else None
    import ray

    from kvgate.cluster.controller import CONTROLLER
    from kvgate.cluster.state import NAMESPACE

    try:
        ray.init(address=a.address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as exc:
        raise InvalidConfig(
            f"no Ray cluster at {a.address!r} ({exc}); start one with kvgate serve --replicas N"
        ) from None
    try:
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        raise InvalidConfig(
            "no kvgate cluster is running there (kvgate serve --replicas N)"
        ) from None
    try:
        if a.action == "start":
            assert plan is not None
            result = ray.get(controller.start.remote(**plan))
        else:
            result = ray.get(getattr(controller, a.action).remote())
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, InvalidConfig) else None
        if cause is not None:
            raise cause from None
        raise
    print(json.dumps(result, indent=2))
    return 0
