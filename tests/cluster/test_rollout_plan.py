from pathlib import Path

import pytest

from kvgate.cluster.rollout import (
    CANARY,
    STABLE,
    Limits,
    Outcome,
    Plan,
    WindowStats,
    arm_for,
    judge,
    load_golden,
    p99,
    parse_duration,
    parse_steps,
)
from kvgate.errors import InvalidConfig


def test_plans_that_cannot_run_are_refused() -> None:
    Plan((5, 25, 50, 100), 60)
    for steps, match in (((), "at least one"), ((5, 0, 100), "per cents"), ((50, 25, 100), "rise"),
                         ((5, 25), "last"), ((5, 5, 100), "rise")):  # fmt: skip
        with pytest.raises(InvalidConfig, match=match):
            Plan(steps, 60)
    with pytest.raises(InvalidConfig, match="positive"):
        Plan((100,), 0)
    assert parse_steps("5, 25,100") == (5, 25, 100)
    with pytest.raises(InvalidConfig):
        parse_steps("5,x")
    assert (parse_duration("60s"), parse_duration("2m"), parse_duration("1.5")) == (60, 120, 1.5)
    with pytest.raises(InvalidConfig):
        parse_duration("soon")


def test_golden_files_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "golden.jsonl"
    path.write_text(
        '{"prompt": "Capital of France?", "expect": "paris"}\n\n'
        '{"messages": [{"role": "user", "content": "2+2?"}], "regex": "\\\\b4\\\\b"}\n'
    )
    first, second = load_golden(str(path))
    assert first.check("It is Paris.") and not first.check("Lyon")
    assert second.check("2+2 = 4") and not second.check("42")
    assert first.body()["temperature"] == 0
    for text, match in (("not json", "not JSON"), ('{"prompt": "x"}', "expect"),
                        ('{"expect": "x"}', "prompt"), ('{"prompt": "x", "regex": "("}', "regex"),
                        ("", "has none")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(InvalidConfig, match=match):
            load_golden(str(path))
    with pytest.raises(InvalidConfig, match="cannot read"):
        load_golden(str(tmp_path / "missing.jsonl"))


def test_a_client_stays_on_one_version_and_the_split_follows_the_weight() -> None:
    clients = [f"sk-{i}" for i in range(4000)]
    canary = [c for c in clients if arm_for(25, c, "salt") == CANARY]
    assert 800 < len(canary) < 1200
    assert all(arm_for(25, c, "salt") == CANARY for c in canary)  # sticky
    assert {arm_for(0, c, "s") for c in clients} == {STABLE}
    assert {arm_for(100, c, "s") for c in clients} == {CANARY}
    # A step up keeps the clients already on the canary there.
    assert all(arm_for(50, c, "salt") == CANARY for c in canary)


def _window(n: int, errors: int = 0, ttft: float = 0.1, gap: float = 0.02) -> WindowStats:
    outcomes = [Outcome("x", i < errors, ttft, (gap,) * 10) for i in range(n)]
    return WindowStats.of(outcomes)


def test_the_judge_rolls_back_on_each_breach_and_not_on_noise() -> None:
    limits = Limits()
    assert judge(_window(20), _window(20), limits).ok
    assert judge(_window(20), _window(10, errors=1), limits).ok  # one error: not yet a rate
    assert judge(_window(20), _window(10, errors=3), limits).reason == "error_rate"
    assert judge(_window(20, errors=4), _window(10, errors=2), limits).ok  # both as bad
    assert judge(_window(20), _window(10, ttft=0.6), limits).reason == "ttft_p99"
    assert judge(_window(20), _window(10, gap=0.2), limits).reason == "itl_p99"
    assert judge(_window(20), _window(3, ttft=5.0), limits).ok  # too few to compare
    assert _window(10, errors=2).figures()["error_rate"] == 0.2
    assert p99([]) is None and p99([1.0, 2.0, 3.0]) == 3.0
