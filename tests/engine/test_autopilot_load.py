"""The SLO autopilot on the tiny model under a scripted load, in virtual time.

The engine runs on a virtual clock that each step advances by what a step costs on a
memory-bound CPU (a fixed part plus a part per token it runs), so every latency, window and
decision is the same on any machine, loaded or not. A critical tenant decodes short chats with
an inter-token p99 target that steps carrying a batch tenant's 64-token prefill chunks cannot
meet; the autopilot must meet it, keep the batch tenant progressing, lose no request, and put
every knob back once the load stops.
"""

from __future__ import annotations

from pathlib import Path

from kvgate.engine.autopilot import Knobs, SloPolicy, SloTarget, percentile
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.messages import SchedulerOutput
from kvgate.engine.policy import TenantFairPolicy, TenantShare
from kvgate.engine.stats import IterationStats
from kvgate.sampling_params import SamplingParams
from tests.conftest import tiny_engine_config

#: Seconds a step costs: 2 ms, plus 2 ms per token it runs.
STEP_FIXED, PER_TOKEN = 0.002, 0.002
ITL_TARGET = 0.07
WINDOW = 0.5


class VirtualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """(clock at the step's end, stats) of every step."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.steps: list[tuple[float, IterationStats]] = []

    def on_step(self, stats: IterationStats) -> None:
        self.steps.append((self.clock(), stats))

    def itl(self, tenant: str, start: float, end: float) -> list[float]:
        return [
            s
            for at, st in self.steps
            if start <= at < end
            for t, s in zip(st.itl_tenants, st.inter_token_latencies, strict=True)
            if t == tenant
        ]

    def tokens(self, tenant: str, start: float, end: float) -> int:
        return sum(
            st.generation_tokens_by_tenant[tenant] for at, st in self.steps if start <= at < end
        )


def _engine(model_dir: Path, clock: VirtualClock, recorder: Recorder) -> LLMEngine:
    shares = {"chat": TenantShare(priority=0), "bulk": TenantShare(priority=2)}
    engine = LLMEngine(
        tiny_engine_config(model_dir, max_num_batched_tokens=64, max_num_seqs=8),
        listeners=[recorder],
        policy=TenantFairPolicy(shares, TenantShare()),
        clock=clock,
    )
    start = engine.runner.start

    def costed(sched: SchedulerOutput, pause: bool = False):  # type: ignore[no-untyped-def]
        clock.now += STEP_FIXED + PER_TOKEN * sched.num_batched_tokens
        return start(sched, pause)

    engine.runner.start = costed  # type: ignore[method-assign]
    slo = SloPolicy(
        classes={0: SloTarget(itl_p99=ITL_TARGET)},
        class_names={0: "critical", 1: "standard", 2: "batch"},
        window_seconds=WINDOW,
        recover_windows=2,
        floor=0.25,
    )
    engine.update_shares(shares, TenantShare(), slo)
    return engine


def test_the_autopilot_meets_a_target_the_defaults_miss_and_gives_the_knobs_back(
    tiny_llama_dir: Path,
) -> None:
    clock = VirtualClock()
    recorder = Recorder(clock)
    engine = _engine(tiny_llama_dir, clock, recorder)
    configured = engine.scheduler.knobs
    assert configured == Knobs(64, 64, 8)
    chat = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    bulk = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    added: dict[str, str] = {}  # request id -> tenant
    done: set[str] = set()

    def add(rid: str, tenant: str, prompt: list[int], params: SamplingParams) -> None:
        request = engine.make_request(rid, prompt, params, tenant=tenant)
        request.arrival_time = clock()
        engine.add(request)
        added[rid] = tenant

    def unfinished(tenant: str) -> int:
        return sum(1 for rid, t in added.items() if t == tenant and rid not in done)

    start = clock()
    load_end = start + 12.0
    n = 0
    # The load: 4 chats always decoding; 2 long bulk prompts always waiting or prefilling.
    while clock() < load_end:
        while unfinished("chat") < 4:
            add(f"c{n}", "chat", [1 + n % 50, 2, 3, 4, 5, 6, 7, 8], chat)
            n += 1
        while unfinished("bulk") < 2:
            add(f"b{n}", "bulk", [(n * 7 + i) % 400 + 10 for i in range(120)], bulk)
            n += 1
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out
                done.add(out.request_id)
    # The defaults cannot meet the target: the first window's chat p99 is over it.
    first = recorder.itl("chat", start, start + WINDOW)
    assert first and percentile(first, 0.99) > ITL_TARGET
    tightened = engine.scheduler.knobs
    assert tightened.chunk_size < configured.chunk_size
    assert tightened.held == {"bulk"}
    # After adapting, the target holds: the last 4 seconds of the load meet it.
    late = recorder.itl("chat", load_end - 4.0, load_end)
    assert len(late) > 100 and percentile(late, 0.99) <= ITL_TARGET
    # Every class kept progressing while held: bulk finished requests in the late part too.
    assert recorder.tokens("bulk", load_end - 4.0, load_end) > 0
    assert engine.autopilot.breaches[("critical", "itl_p99")] >= 1
    # The load stops: whatever is in flight finishes, nothing is lost.
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length", out
                done.add(out.request_id)
    assert done == set(added)
    assert engine.kv_cache.pool.num_used_blocks == 0
    # Idle: windows pass without a step; the knobs go back to their configured values.
    for _ in range(40):
        clock.now += WINDOW
        engine.steer(clock())
    assert engine.scheduler.knobs == configured
    assert engine.autopilot.next_due(clock()) is None
    state = engine.snapshot.autopilot if engine.publish() is None else None
    assert state is not None and state.knobs == configured
    assert state.adjustments[("chunk_size", "relax")] >= 1
