"""Canary rollouts, the pure part: the plan, which version a request goes to, what each
version did in a window, and the judge that compares them. Ray-free (the controller that
drives a rollout on Ray Serve is ``cluster/controller.py``).

A rollout moves traffic to a new model version in steps (e.g. 5, 25, 50, 100 per cent,
``interval`` seconds each). Throughout each step the judge compares the canary with the
stable version over the same window: error rate, TTFT p99 and inter-token p99. At the end
of each step (and before any traffic) the canary answers the golden prompts. Any breach
rolls back at once; the last step's end promotes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.errors import InvalidConfig

STABLE = "stable"
CANARY = "canary"


@dataclass(frozen=True)
class Golden:
    """One golden prompt: a chat request and what its answer must hold."""

    messages: tuple[Mapping[str, str], ...]
    expect: str | None = None  # a substring
    regex: str | None = None
    max_tokens: int = 32

    def check(self, answer: str) -> bool:
        if self.expect is not None and self.expect.lower() not in answer.lower():
            return False
        return self.regex is None or re.search(self.regex, answer) is not None

    def body(self, model: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [dict(m) for m in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        if model is not None:
            body["model"] = model
        return body


def load_golden(path: str) -> tuple[Golden, ...]:
    """A JSON-lines file: ``{"prompt": ... | "messages": [...], "expect": ... | "regex": ...,
    "max_tokens": n}`` per line. Raises ``InvalidConfig`` naming the line at fault."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidConfig(f"golden prompts: cannot read {path}: {exc}", param="golden") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"golden prompts {path}:{n}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise InvalidConfig(f"{where}: not JSON: {exc}", param="golden") from None
        if not isinstance(item, dict):
            raise InvalidConfig(f"{where}: expected an object", param="golden")
        if "messages" in item:
            messages = item["messages"]
        elif isinstance(item.get("prompt"), str):
            messages = [{"role": "user", "content": item["prompt"]}]
        else:
            raise InvalidConfig(f"{where}: needs 'prompt' or 'messages'", param="golden")
        expect, regex = item.get("expect"), item.get("regex")
        if expect is None and regex is None:
            raise InvalidConfig(f"{where}: needs 'expect' or 'regex'", param="golden")
        if regex is not None:
            try:
                re.compile(regex)
            except re.error as exc:
                raise InvalidConfig(f"{where}: bad regex: {exc}", param="golden") from None
        out.append(Golden(tuple(messages), expect, regex, int(item.get("max_tokens", 32))))
    if not out:
        raise InvalidConfig(f"golden prompts: {path} has none", param="golden")
    return tuple(out)


@dataclass(frozen=True)
class Limits:
    """How much worse than stable the canary may do before it is rolled back."""

    #: Error rate above stable's, absolute (0.05: five points).
    error_margin: float = 0.05
    #: Errors the canary must have before its rate counts (one unlucky request is not one).
    min_errors: int = 2
    #: Latency p99s: breached past stable's times ``latency_ratio`` plus the slack.
    latency_ratio: float = 1.5
    ttft_slack_s: float = 0.25
    itl_slack_s: float = 0.05
    #: Samples each side needs before latencies are compared.
    min_samples: int = 5


@dataclass(frozen=True)
class Plan:
    steps: tuple[int, ...]  # per cent of traffic to the canary, rising, ending at 100
    interval_s: float
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not self.steps:
            raise InvalidConfig("rollout steps: give at least one, e.g. 5,25,50,100", param="steps")
        if any(not 0 < s <= 100 for s in self.steps):
            raise InvalidConfig(
                f"rollout steps must be per cents in (0, 100], got {list(self.steps)}",
                param="steps",
            )
        if list(self.steps) != sorted(set(self.steps)):
            raise InvalidConfig(f"rollout steps must rise, got {list(self.steps)}", param="steps")
        if self.steps[-1] != 100:
            raise InvalidConfig("the last rollout step must be 100", param="steps")
        if not self.interval_s > 0:
            raise InvalidConfig(
                f"rollout interval must be positive, got {self.interval_s}", param="interval"
            )


def parse_steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise InvalidConfig(
            f"rollout steps: expected per cents like 5,25,50,100, got {text!r}", param="steps"
        ) from None


def parse_duration(text: str) -> float:
    """``60s``, ``2m``, ``1.5`` (seconds)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", text)
    if m is None:
        raise InvalidConfig(f"a duration like 60s or 2m, got {text!r}", param="interval")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2) or "s"]
    return float(m.group(1)) * scale


def arm_for(weight: float, client: str, salt: str) -> str:
    """The version a client's request goes to at ``weight`` per cent canary: the same for
    the same client through a step (by a hash of the client's key), so a client does not
    flip between versions from one request to the next."""
    if weight <= 0:
        return STABLE
    if weight >= 100:
        return CANARY
    h = int.from_bytes(hashlib.blake2b(f"{salt}\x00{client}".encode(), digest_size=8).digest())
    return CANARY if (h % 10_000) < weight * 100 else STABLE


@dataclass(frozen=True)
class Outcome:
    """One request, as the ingress saw it: whether it failed (5xx, or a stream ended by an
    error), its time to first byte, and the gaps between its streamed chunks (seconds)."""

    arm: str
    failed: bool
    ttft_s: float | None = None
    gaps_s: tuple[float, ...] = ()


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True)
class WindowStats:
    requests: int
    errors: int
    ttft_p99: float | None
    itl_p99: float | None
    ttft_samples: int
    itl_samples: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @classmethod
    def of(cls, outcomes: Sequence[Outcome]) -> WindowStats:
        ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None and not o.failed]
        gaps = [g for o in outcomes if not o.failed for g in o.gaps_s]
        return cls(
            len(outcomes),
            sum(o.failed for o in outcomes),
            p99(ttft),
            p99(gaps),
            len(ttft),
            len(gaps),
        )

    def figures(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "ttft_p99_s": None if self.ttft_p99 is None else round(self.ttft_p99, 4),
            "itl_p99_s": None if self.itl_p99 is None else round(self.itl_p99, 4),
        }


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str | None = None  # the breached check


def judge(stable: WindowStats, canary: WindowStats, limits: Limits) -> Verdict:
    """The canary against stable over the same window."""
    if canary.errors >= limits.min_errors and canary.error_rate > (
        stable.error_rate + limits.error_margin
    ):
        return Verdict(False, "error_rate")
    checks = (
        ("ttft_p99", canary.ttft_p99, stable.ttft_p99, canary.ttft_samples,
         stable.ttft_samples, limits.ttft_slack_s),
        ("itl_p99", canary.itl_p99, stable.itl_p99, canary.itl_samples,
         stable.itl_samples, limits.itl_slack_s),
    )  # fmt: skip
    for name, mine, theirs, n_mine, n_theirs, slack in checks:
        if mine is None or theirs is None or min(n_mine, n_theirs) < limits.min_samples:
            continue
        if mine > theirs * limits.latency_ratio + slack:
            return Verdict(False, name)
    return Verdict(True)
