"""Tenant-aware scheduling with a fake runner: quotas, priority, fair shares, deadlines."""

from __future__ import annotations

import zlib
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.messages import SchedulerOutput
from kvgate.engine.policy import StepPlan, TenantFairPolicy, TenantShare
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.scheduler import Scheduler
from kvgate.sampling_params import SamplingParams
from tests.engine.fakes import FakeRunner, make_scheduler

CRITICAL, STANDARD, BATCH = 0, 1, 2


def req(rid: str, tenant: str, prompt_len: int = 8, max_tokens: int = 8, **kw: object) -> Request:
    # A stable hash: Python's own is salted per process, so a prompt could share a first
    # block with another request's in one run and not the next (a prefix hit, now and then).
    prompt = [zlib.crc32(f"{rid}:{i}".encode()) % 40 + 1 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, tenant=tenant, **kw)  # type: ignore[arg-type]


def step(sched: Scheduler, runner: FakeRunner, urgent: bool = False) -> SchedulerOutput:
    """One engine step (its schedule is returned); ``urgent``: run ``schedule_urgent``
    inside it, as the engine does at a pause between two layers, checking that it never
    writes a block the step in flight writes."""
    out = sched.schedule()
    if urgent:
        inner = sched.schedule_urgent()
        if inner is not None:
            bs = sched.kv_cache.block_size
            written = {
                seq.block_ids[pos // bs]
                for seq in out.sequences
                for pos in range(seq.start_pos, seq.start_pos + seq.num_tokens)
            }
            (seq,) = inner.sequences
            assert not written & set(seq.block_ids)
            assert seq.sample  # its whole prompt: it ends with the first token
            sched.update(inner, runner.execute(inner))
    sched.update(out, runner.execute(out))
    return out


def fair(shares: dict[str, TenantShare]) -> TenantFairPolicy:
    return TenantFairPolicy(shares, TenantShare())


# ------------------------------------------------------------------ quotas


@settings(max_examples=60, deadline=None)
@given(
    ceilings=st.lists(st.integers(2, 24), min_size=2, max_size=4),
    classes=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    guarantees=st.lists(st.integers(0, 12), min_size=4, max_size=4),
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 20), st.booleans()),
        min_size=5,
        max_size=60,
    ),
    seed=st.integers(0, 1000),
    urgent=st.booleans(),
)
def test_quotas_and_slots_are_never_exceeded(
    ceilings: list[int],
    classes: list[int],
    guarantees: list[int],
    ops: list[tuple[int, int, int, bool]],
    seed: int,
    urgent: bool,
) -> None:
    """Random load of tenants of random classes and guarantees (so priority and guarantee
    preemptions, spare slots and urgent steps all happen): no tenant ever holds more than
    its ceiling, and no more than max_num_seqs run in regular slots plus the spare ones."""
    tenants = [f"t{i}" for i in range(len(ceilings))]
    policy = fair(
        {
            t: TenantShare(priority=p, guaranteed_blocks=min(g, c), ceiling_blocks=c)
            for t, c, p, g in zip(tenants, ceilings, classes, guarantees, strict=False)
        }
    )
    sched = make_scheduler(num_blocks=48, block_size=4, max_num_seqs=6, policy=policy)

    def check() -> None:
        for tenant, ceiling in zip(tenants, ceilings, strict=True):
            assert sched.kv_cache.tenant_blocks.get(tenant, 0) <= ceiling
        running = {r.request_id for r in sched.running}
        assert sched.spare <= running
        assert len(running) - len(sched.spare) <= 6 and len(sched.spare) <= sched.num_spare_slots

    runner = FakeRunner(seed=seed)
    live: list[str] = []
    for i, (t, prompt_len, max_tokens, abort) in enumerate(ops):
        tenant = tenants[t % len(tenants)]
        # A request that alone needs more than its tenant's ceiling is refused at admission
        # (by the server); the scheduler is only given ones that fit.
        if -(-(prompt_len + max_tokens) // 4) <= ceilings[t % len(tenants)]:
            sched.add_request(req(f"r{i}", tenant, prompt_len, max_tokens))
            live.append(f"r{i}")
        if abort and live:
            sched.finish_requests([live.pop(seed % len(live))], RequestStatus.FINISHED_ABORTED)
        step(sched, runner, urgent)
        check()
    for _ in range(2000):
        if not sched.num_unfinished:
            break
        step(sched, runner, urgent)
        check()
    assert not sched.num_unfinished, "a request that fits its ceiling never finished"
    assert sched.kv_cache.tenant_blocks == {}
    sched.kv_cache.pool.check_invariants()


def test_a_tenant_at_its_ceiling_waits_while_the_pool_has_room() -> None:
    policy = fair({"capped": TenantShare(ceiling_blocks=3), "other": TenantShare()})
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, policy=policy)
    for i in range(3):
        sched.add_request(req(f"c{i}", "capped", prompt_len=8, max_tokens=4))  # 2 blocks to start
    sched.add_request(req("o0", "other", prompt_len=8, max_tokens=4))
    step(sched, FakeRunner())
    running = {r.request_id for r in sched.running}
    assert running == {"c0", "o0"}  # c1 would take "capped" past 3 blocks; "other" still runs
    assert sched.kv_cache.pool.num_free_blocks > 32


# ------------------------------------------------------------------ priority and reclaiming


def test_critical_request_preempts_batch_work_when_blocks_run_short() -> None:
    policy = fair({"crit": TenantShare(priority=CRITICAL), "bulk": TenantShare(priority=BATCH)})
    sched = make_scheduler(
        num_blocks=12, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, policy=policy
    )
    runner = FakeRunner()
    for i in range(4):
        sched.add_request(req(f"b{i}", "bulk", prompt_len=12, max_tokens=20))  # 3 blocks each
    step(sched, runner)
    assert sched.kv_cache.pool.num_free_blocks == 0
    sched.add_request(req("c", "crit", prompt_len=8, max_tokens=4))
    out = sched.schedule()
    assert "c" in {s.request_id for s in out.sequences}
    assert len(out.preempted_request_ids) >= 1
    assert all(rid.startswith("b") for rid in out.preempted_request_ids)
    sched.update(out, runner.execute(out))
    # The preempted batch work resumes and finishes once the critical request is done.
    for _ in range(500):
        if not sched.num_unfinished:
            break
        step(sched, runner)
    assert not sched.num_unfinished


def test_critical_request_takes_a_spare_slot_then_one_from_batch_work() -> None:
    """Every slot taken by batch work: the first critical request runs in the spare slot
    (nobody's work is thrown away); with the spare taken, the next one preempts batch work."""
    policy = fair({"crit": TenantShare(priority=CRITICAL), "bulk": TenantShare(priority=BATCH)})
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, policy=policy)
    assert sched.num_spare_slots == 1
    sched.add_request(req("b0", "bulk"))
    sched.add_request(req("b1", "bulk"))
    step(sched, FakeRunner())
    sched.add_request(req("c0", "crit"))
    out = sched.schedule()
    assert "c0" in {s.request_id for s in out.sequences} and not out.preempted_request_ids
    assert sched.spare == {"c0"} and len(sched.running) == 3
    sched.update(out, FakeRunner().execute(out))
    sched.add_request(req("c1", "crit"))
    out = sched.schedule()
    assert "c1" in {s.request_id for s in out.sequences} and len(out.preempted_request_ids) == 1
    assert sched.preemptions_by_reason == {"slot": 1} and len(sched.running) == 3


def test_a_spare_slot_is_held_until_its_request_ends() -> None:
    """While the critical request runs in the spare slot, batch work keeps all max_num_seqs
    regular slots: a batch request that ends is replaced by the next one."""
    policy = fair({"crit": TenantShare(priority=CRITICAL), "bulk": TenantShare(priority=BATCH)})
    sched = make_scheduler(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=64, policy=policy)
    runner = FakeRunner()
    for i in range(6):
        sched.add_request(req(f"b{i}", "bulk", max_tokens=3 + i))
    step(sched, runner)
    sched.add_request(req("c", "crit", max_tokens=30))
    step(sched, runner)  # the critical request's prefill, a step of its own
    assert sched.spare == {"c"}
    for _ in range(12):
        out = sched.schedule()
        bulk = [s.request_id for s in out.sequences if s.request_id.startswith("b")]
        assert len(bulk) == 2 and sched.spare == {"c"}, out.sequences
        sched.update(out, runner.execute(out))
    for _ in range(100):
        if "c" not in sched.requests:
            break
        step(sched, runner)
    assert sched.spare == set() and len(sched.running) <= 2


def test_idle_share_is_lent_then_taken_back() -> None:
    """Work-conserving: "quiet" is idle, so "busy" fills the pool past its own guarantee;
    when "quiet" returns, it reclaims its guaranteed blocks by preempting "busy"."""
    policy = fair(
        {"quiet": TenantShare(guaranteed_blocks=8), "busy": TenantShare(guaranteed_blocks=8)}
    )
    sched = make_scheduler(
        num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, policy=policy
    )
    runner = FakeRunner()
    for i in range(4):
        sched.add_request(req(f"b{i}", "busy", prompt_len=16, max_tokens=20))
    step(sched, runner)
    assert sched.kv_cache.tenant_blocks["busy"] == 16  # all of it, twice its guarantee
    sched.add_request(req("q", "quiet", prompt_len=8, max_tokens=4))
    out = sched.schedule()
    assert "q" in {s.request_id for s in out.sequences}
    assert out.preempted_request_ids  # taken back from "busy"
    assert sched.kv_cache.tenant_blocks["busy"] >= 8  # "busy" keeps at least its guarantee


# ------------------------------------------------------------------ fair shares


def test_saturated_shares_follow_the_weights() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    policy = fair({t: TenantShare(weight=w) for t, w in weights.items()})
    sched = make_scheduler(
        num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=256, policy=policy,
    )  # fmt: skip
    runner = FakeRunner()
    for i in range(400):
        for t in weights:
            sched.add_request(req(f"{t}{i}", t, prompt_len=6, max_tokens=10))
    served: Counter[str] = Counter()
    for _ in range(600):
        out = sched.schedule()
        for seq in out.sequences:
            served[sched.requests[seq.request_id].tenant] += seq.num_tokens
        sched.update(out, runner.execute(out))
    assert all(any(r.tenant == t for r in sched.waiting) for t in weights), "not saturated"
    total = sum(served.values())
    for t, w in weights.items():
        expected = w / sum(weights.values())
        assert abs(served[t] / total - expected) <= 0.1 * expected, (t, served, expected)


def test_a_returning_tenant_gets_no_credit_for_its_idle_time() -> None:
    policy = fair({"a": TenantShare(), "b": TenantShare()})
    sched = make_scheduler(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=64, policy=policy)
    runner = FakeRunner()
    for i in range(40):
        sched.add_request(req(f"a{i}", "a"))
    for _ in range(100):
        step(sched, runner)
    for i in range(40):
        sched.add_request(req(f"b{i}", "b"))
    served: Counter[str] = Counter()
    for _ in range(60):
        out = sched.schedule()
        for seq in out.sequences:
            served[sched.requests[seq.request_id].tenant] += seq.num_tokens
        sched.update(out, runner.execute(out))
    # Equal weights: after "b" returns, the two share about equally ("b" does not get to
    # monopolise the engine to catch up on the 100 steps it was away).
    assert served["a"] > 0.3 * sum(served.values())


# ------------------------------------------------------------------ deadlines


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_queue_timeout_and_deadline() -> None:
    clock = Clock()
    sched = make_scheduler(num_blocks=64, max_num_seqs=1, clock=clock)
    runner = FakeRunner()
    sched.add_request(req("runs", "t", max_tokens=100, deadline=clock.now + 5))
    sched.add_request(req("queued", "t", queue_deadline=clock.now + 2))
    step(sched, runner)
    clock.now += 3
    expired = sched.expire()
    assert [(r.request_id, r.status) for r in expired] == [
        ("queued", RequestStatus.FINISHED_QUEUE_TIMEOUT)
    ]
    step(sched, runner)
    clock.now += 3
    (late,) = sched.expire()
    assert late.request_id == "runs" and late.status == RequestStatus.FINISHED_DEADLINE
    assert late.num_output_tokens == 2  # ends with what it had
    assert sched.kv_cache.pool.num_used_blocks == 0 and not sched.num_unfinished


def test_a_tenant_back_from_idle_gets_its_first_prefill_step_to_itself() -> None:
    policy = fair({"busy": TenantShare(), "quiet": TenantShare(), "other": TenantShare()})
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, policy=policy)
    runner = FakeRunner()
    for i in range(4):
        sched.add_request(req(f"b{i}", "busy", max_tokens=50))
    for _ in range(3):
        step(sched, runner)
    sched.add_request(req("q", "quiet", max_tokens=5))
    sched.add_request(req("o", "other", max_tokens=5))
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["q"]  # busy's decodes sit out one step
    sched.update(out, runner.execute(out))
    out = sched.schedule()  # never two such steps in a row: everyone runs, "o" joins now
    assert {s.request_id for s in out.sequences} == {"b0", "b1", "b2", "b3", "q", "o"}


def _busy(
    policy: TenantFairPolicy, n: int, budget: int, max_tokens: int
) -> tuple[Scheduler, FakeRunner]:
    """A scheduler whose tenant "busy" has ``n`` requests running after one step."""
    sched = make_scheduler(
        num_blocks=256, max_num_seqs=8, max_num_batched_tokens=budget, policy=policy
    )
    runner = FakeRunner()
    for i in range(n):
        sched.add_request(req(f"b{i}", "busy", max_tokens=max_tokens))
    step(sched, runner)
    return sched, runner


def test_the_policy_answers_questions_and_is_told_what_ran() -> None:
    """``plan``, ``pick`` and ``urgent`` change nothing, however often or in whatever order they
    are asked; only the planner's ``on_step`` / ``on_urgent_offered`` make the next step a
    normal one."""
    policy = fair({})
    sched, _ = _busy(policy, 2, budget=64, max_tokens=50)
    sched.add_request(req("b-next", "busy"))
    sched.add_request(req("q", "quiet"))
    plans = [policy.planner.plan(sched.running) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    plan = plans[0]
    assert plan.exclusive == "quiet" and plan.running == ()  # busy's decodes sit out
    for _ in range(2):
        assert policy.planner.urgent(sched.running) is sched.requests["q"]
        assert policy.queue.pick(set(), plan) is sched.requests["q"]  # only quiet, in its step
        assert policy.queue.pick({"quiet"}, plan) is None
    normal = StepPlan(tuple(sched.running))  # a plan with no step set aside
    assert policy.queue.pick({"quiet"}, normal) is sched.requests["b-next"]
    policy.planner.on_step(plan)
    after = policy.planner.plan(sched.running)
    assert after.exclusive is None and len(after.running) == 2  # never two in a row
    assert policy.planner.urgent(sched.running) is None
    policy.planner.on_step(after)
    assert policy.planner.plan(sched.running) == plan  # still owed: the step after next is its own
    policy.planner.on_urgent_offered(sched.requests["q"])
    assert policy.planner.plan(sched.running).exclusive is None


def test_a_step_set_aside_for_a_prefill_takes_a_prompt_of_up_to_twice_the_budget() -> None:
    """As an urgent step does: a chunk would leave the prompt's last tokens to the next step,
    behind a full step of the busy tenant's work, and the first token with them. A prompt
    longer than that is chunked as usual."""
    policy = fair({})
    sched, runner = _busy(policy, 4, budget=16, max_tokens=60)
    for tenant, prompt_len, first_chunk in (("fits", 32, 32), ("long", 33, 16)):
        step(sched, runner)  # an ordinary step between the two set aside
        sched.add_request(req(tenant, tenant, prompt_len=prompt_len))
        out = sched.schedule()
        (seq,) = out.sequences  # the busy tenant's decodes sit out this step
        assert seq.request_id == tenant and seq.num_tokens == first_chunk
        assert seq.sample == (first_chunk == prompt_len)
        sched.update(out, runner.execute(out))


@settings(max_examples=40, deadline=None)
@given(
    guarantees=st.lists(st.integers(0, 8), min_size=2, max_size=3),
    priorities=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    sizes=st.lists(
        st.tuples(st.integers(0, 2), st.integers(4, 40), st.integers(1, 12)),
        min_size=4,
        max_size=25,
    ),
)
def test_contending_tenants_always_make_progress(
    guarantees: list[int], priorities: list[int], sizes: list[tuple[int, int, int]]
) -> None:
    """Guarantees, priorities and reclaiming never make two tenants preempt each other for
    ever: every schedule() returns, preempts fewer requests than are running, and all end."""
    tenants = [f"t{i}" for i in range(len(guarantees))]
    shares = {
        t: TenantShare(priority=priorities[i], guaranteed_blocks=g)
        for i, (t, g) in enumerate(zip(tenants, guarantees, strict=True))
    }
    sched = make_scheduler(
        num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
        policy=fair(shares),
    )  # fmt: skip
    runner = FakeRunner()
    for i, (t, prompt_len, max_tokens) in enumerate(sizes):
        sched.add_request(req(f"r{i}", tenants[t % len(tenants)], prompt_len, max_tokens))
    for _ in range(3000):
        if not sched.num_unfinished:
            break
        running_before = len(sched.running)
        out = sched.schedule()
        assert len(out.preempted_request_ids) <= running_before + len(out.sequences)
        sched.update(out, runner.execute(out))
    assert not sched.num_unfinished, "tenants kept preempting each other"
    sched.kv_cache.pool.check_invariants()


def test_blocks_enter_the_prefix_cache_only_once_their_step_ran() -> None:
    """A request preempted in the step that allocated its blocks must not leave cached
    blocks whose KV was never written."""
    policy = fair({"crit": TenantShare(priority=CRITICAL), "bulk": TenantShare(priority=BATCH)})
    sched = make_scheduler(
        num_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, policy=policy
    )
    runner = FakeRunner()
    sched.add_request(req("b", "bulk", prompt_len=32, max_tokens=4))  # 8 blocks
    out = sched.schedule()
    assert sched.kv_cache.pool.cached == {}  # allocated, not yet computed: nothing cached
    sched.update(out, runner.execute(out))
    assert len(sched.kv_cache.pool.cached) == 8


def test_a_request_over_a_lowered_ceiling_ends_instead_of_waiting_for_ever() -> None:
    policy = fair({"t": TenantShare()})
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, policy=policy)
    runner = FakeRunner()
    sched.add_request(req("r", "t", prompt_len=20, max_tokens=8))  # 5 blocks for its prompt
    step(sched, runner)
    policy.update({"t": TenantShare(ceiling_blocks=3)}, TenantShare())  # a reload lowers it
    refused = [r for _ in range(3) for r in step(sched, runner).refused]
    assert not sched.num_unfinished
    (ended,) = refused
    assert ended.status == RequestStatus.FINISHED_ERROR and "kv_ceiling" in (ended.error or "")
    assert sched.kv_cache.pool.num_used_blocks == 0


# ------------------------------------------------------------------ urgent steps


def test_who_is_urgent() -> None:
    """A tenant owed service (back from idle, or light beside a flooder) is; a tenant alone,
    a flooder beside a lighter tenant, a lower class or a preempted request is not."""
    policy = fair({"bulk": TenantShare(priority=BATCH)})
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, policy=policy)
    runner = FakeRunner()
    for i in range(3):
        sched.add_request(req(f"f{i}", "flood", max_tokens=60))
    step(sched, runner)
    sched.add_request(req("f-waiting", "flood"))
    assert policy.planner.urgent(sched.running) is None  # nobody else is running: nothing is owed

    sched.add_request(req("q1", "quiet"))
    assert policy.planner.urgent(sched.running) is sched.requests["q1"]  # back from idle
    assert policy.planner.urgent(sched.running) is sched.requests["q1"]  # a question only
    policy.planner.on_urgent_offered(sched.requests["q1"])  # offered an urgent step (not run here)
    assert policy.planner.urgent(sched.running) is None  # never twice before a normal step
    step(sched, runner)  # q1 runs now (the step after an urgent one is a normal one)
    assert sched.requests["q1"].status == RequestStatus.RUNNING
    step(sched, runner)
    sched.add_request(req("q2", "quiet"))
    # quiet has a request running but has been served far less than the flooder: owed.
    assert policy.planner.urgent(sched.running) is sched.requests["q2"]

    step(sched, runner)
    sched.add_request(req("b", "bulk"))
    assert policy.planner.urgent(sched.running) is None  # a lower class never jumps ahead


def test_urgent_step_takes_a_prompt_of_up_to_twice_the_budget() -> None:
    policy = fair({})
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=16, policy=policy)
    runner = FakeRunner()
    sched.add_request(req("f", "flood", max_tokens=60))
    step(sched, runner)
    sched.add_request(req("long", "quiet", prompt_len=33))
    assert sched.schedule_urgent() is None  # 33 > 2 x 16: it waits for normal steps
    # ... and the next step is a normal one: a step of its own would not take it whole either
    assert policy.planner.plan(sched.running).exclusive is None
    step(sched, runner)
    step(sched, runner)
    sched.add_request(req("fits", "quiet2", prompt_len=32))
    out = sched.schedule_urgent()
    assert out is not None and out.sequences[0].num_tokens == 32
