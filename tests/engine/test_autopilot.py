"""The SLO autopilot as a pure controller: windows of latency samples in, knobs out."""

from __future__ import annotations

import pytest

from kvgate.engine.autopilot import (
    Autopilot,
    Knobs,
    SloPolicy,
    SloTarget,
    percentile,
)

CONFIGURED = Knobs(token_budget=512, chunk_size=512, max_running=32)
NAMES = {0: "critical", 1: "standard", 2: "batch"}
RANKS = {"chat": 0, "docs": 1, "bulk": 2}


def _pilot(
    classes: dict[int, SloTarget] | None = None,
    tenants: dict[str, SloTarget] | None = None,
    *,
    recover: int = 2,
    floor: float = 0.25,
    spare: int = 4,
) -> Autopilot:
    pilot = Autopilot(CONFIGURED, num_spare=spare, start=0.0)
    policy = SloPolicy(
        classes=classes if classes is not None else {0: SloTarget(itl_p99=0.1)},
        tenants=tenants or {},
        class_names=NAMES,
        window_seconds=1.0,
        recover_windows=recover,
        floor=floor,
    )
    pilot.configure(policy, RANKS, default_rank=1)
    return pilot


def _window(
    pilot: Autopilot,
    end: float,
    itl: list[tuple[str, float]] = (),  # type: ignore[assignment]
    ttft: list[tuple[str, float]] = (),  # type: ignore[assignment]
    waiting: list[tuple[str, float]] = (),  # type: ignore[assignment]
) -> Knobs:
    pilot.observe(ttft, itl)
    pilot.tick(end, waiting)
    return pilot.knobs


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.9) == 90.0
    assert percentile([3.0, 1.0], 0.99) == 3.0  # fewer than 100 samples: the maximum
    assert percentile([5.0], 0.9) == 5.0


def test_no_target_no_move() -> None:
    pilot = Autopilot(CONFIGURED)
    pilot.configure(SloPolicy(class_names=NAMES), RANKS, 1)
    assert not pilot.active
    pilot.observe([("chat", 99.0)], [("chat", 99.0)])
    assert pilot.tick(10.0) is None and pilot.knobs == CONFIGURED
    assert pilot.next_due(10.0) is None


def test_itl_breach_cuts_the_step_down_to_floors_then_the_sequences() -> None:
    pilot = _pilot()
    slow = [("chat", 0.3)] * 10
    seen = [_window(pilot, t, itl=slow) for t in range(1, 7)]
    budgets = [k.token_budget for k in seen]
    chunks = [k.chunk_size for k in seen]
    # 3x over the target: the step scaled by 0.9 / 3 (512 -> 153), then the floors: budget
    # max(512 * 0.25, 32 running + 4 spare) = 128, chunk 512 * 0.25 = 128.
    assert budgets == [153, 128, 128, 128, 128, 128]
    assert chunks == [153, 128, 128, 128, 128, 128]
    # Then a quarter fewer sequences a window, never below 32 * 0.25 = 8.
    assert [k.max_running for k in seen] == [32, 32, 24, 18, 13, 9]
    for _ in range(6):
        knobs = _window(pilot, pilot._window_start + 1, itl=slow)
    assert knobs.max_running == 8
    assert knobs.token_budget >= knobs.max_running
    assert pilot.adjustments[("token_budget", "tighten")] == 2
    assert pilot.breaches[("critical", "itl_p99")] == 12


def test_a_calm_band_between_margin_and_target_moves_nothing() -> None:
    pilot = _pilot(recover=1)
    _window(pilot, 1.0, itl=[("chat", 0.3)])
    tightened = pilot.knobs
    for t in range(2, 6):  # 0.09 s: within the 0.1 s target but over 0.8 of it
        assert _window(pilot, float(t), itl=[("chat", 0.09)]) == tightened
    assert _window(pilot, 6.0, itl=[("chat", 0.05)]) != tightened  # calm: relaxes


def test_knobs_return_after_the_load_stops_even_with_no_step() -> None:
    pilot = _pilot(recover=2)
    for t in range(1, 9):
        _window(pilot, float(t), itl=[("chat", 0.5)])
    assert pilot.knobs != CONFIGURED
    assert pilot.next_due(8.5) == pytest.approx(0.5)
    # An idle engine: one tick long after, every whole window in between had no traffic.
    pilot.tick(40.0)
    assert pilot.knobs == CONFIGURED
    assert pilot.next_due(41.0) is None  # settled: nothing to wait for
    assert pilot.adjustments[("max_running", "relax")] >= 1


def test_a_breach_of_a_higher_class_holds_the_lower_classes() -> None:
    pilot = _pilot({0: SloTarget(ttft_p99=0.5), 2: SloTarget(ttft_p90=30.0)})
    knobs = _window(pilot, 1.0, ttft=[("chat", 2.0)])
    # TTFT alone does not shrink the step: shorter steps would only slow the queue down.
    assert (knobs.token_budget, knobs.chunk_size, knobs.max_running) == (512, 512, 32)
    assert knobs.held == {"docs", "bulk"}
    assert pilot.state().held_ranks == (1, 2)
    # Calm windows: one class back at a time.
    knobs = _window(pilot, 2.0)
    knobs = _window(pilot, 3.0)
    assert knobs.held == {"bulk"}
    knobs = _window(pilot, 4.0)
    knobs = _window(pilot, 5.0)
    assert knobs.held == frozenset()


def test_the_lowest_class_breaching_holds_nobody() -> None:
    pilot = _pilot({2: SloTarget(ttft_p99=1.0)})
    knobs = _window(pilot, 1.0, ttft=[("bulk", 5.0)])
    assert knobs == CONFIGURED
    assert pilot.breaches[("batch", "ttft_p99")] == 1


def test_a_request_waiting_past_its_target_is_a_breach_before_it_is_served() -> None:
    pilot = _pilot({0: SloTarget(ttft_p90=0.5)})
    assert _window(pilot, 1.0, waiting=[("chat", 0.8)]) == CONFIGURED  # 0.2 s old: fine
    knobs = _window(pilot, 2.0, waiting=[("chat", 0.8)])  # 1.2 s old, no first token yet
    assert knobs.held == {"docs", "bulk"}
    assert pilot.state().groups["critical"]["ttft_p90"] == (0.5, pytest.approx(1.2))


def test_a_tenant_of_its_own_is_judged_apart_from_its_class() -> None:
    pilot = _pilot(
        {1: SloTarget(itl_p99=1.0)}, {"docs": SloTarget(itl_p99=0.05)}
    )  # docs is standard, with a tighter target of its own
    _window(pilot, 1.0, itl=[("docs", 0.2)])
    state = pilot.state()
    assert state.groups["tenant:docs"]["itl_p99"] == (0.05, 0.2)
    assert state.groups["standard"]["itl_p99"] == (1.0, None)
    assert state.knobs.token_budget == 128 and state.knobs.held == {"bulk"}  # 4x: to the floor


def test_a_reload_without_targets_puts_every_knob_back() -> None:
    pilot = _pilot()
    _window(pilot, 1.0, itl=[("chat", 1.0)])
    assert pilot.knobs != CONFIGURED
    pilot.configure(SloPolicy(class_names=NAMES), RANKS, 1)
    assert pilot.knobs == CONFIGURED and not pilot.active


def test_targets_must_be_positive() -> None:
    with pytest.raises(ValueError, match="itl_p99"):
        SloTarget(itl_p99=0.0)
    with pytest.raises(ValueError, match="floor"):
        SloPolicy(floor=0.0)


def test_a_step_back_that_breaches_at_once_doubles_the_next_wait() -> None:
    pilot = _pilot(recover=2)
    slow, fine = [("chat", 0.3)], [("chat", 0.01)]
    t = 0.0

    def window(samples: list[tuple[str, float]]) -> Knobs:
        nonlocal t
        t += 1.0
        return _window(pilot, t, itl=samples)

    tight = window(slow)
    assert window(fine) == tight
    relaxed = window(fine)  # 2 calm windows: one step back
    assert relaxed.token_budget > tight.token_budget
    tight = window(slow)  # the step back breached at once: tighten again
    assert tight.token_budget < relaxed.token_budget
    assert window(fine) == tight and window(fine) == tight and window(fine) == tight
    assert window(fine) != tight  # now 4 calm windows were needed
    # Windows without any traffic (the load is gone) reset the wait to 2.
    window([])
    window([])
    assert pilot._relax_wait == 2


def test_ttft_alone_raises_a_sequence_cap_an_itl_breach_lowered() -> None:
    pilot = _pilot({0: SloTarget(itl_p99=0.1, ttft_p99=1.0)})
    for t in range(1, 5):  # to the step floors, then the sequence cap goes down
        knobs = _window(pilot, float(t), itl=[("chat", 0.3)])
    assert knobs.max_running < 32
    lowered = knobs.max_running
    # Both missed at once: the cap stays (fewer sequences would queue the TTFT more).
    knobs = _window(pilot, 5.0, itl=[("chat", 0.3)], ttft=[("chat", 3.0)])
    assert knobs.max_running == lowered
    # TTFT alone: queueing; the cap goes back up a stage, the step stays where it is.
    knobs = _window(pilot, 6.0, itl=[("chat", 0.05)], ttft=[("chat", 3.0)])
    assert knobs.max_running > lowered
    assert knobs.token_budget == 128
