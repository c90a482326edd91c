"""A quiet tenant's prefill run between two layers of a step in flight (``step_urgent``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvgate.engine.llm_engine import EngineStep, LLMEngine
from kvgate.engine.loop import Add, EngineLoop
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.policy import FifoPolicy, SchedulingPolicy, TenantFairPolicy, TenantShare
from kvgate.sampling_params import SamplingParams
from tests.conftest import tiny_engine_config
from tests.engine.stepping import paused_step

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
QUIET_PROMPT = list(range(300, 337))


def _engine(tiny_llama_dir: Path, policy: SchedulingPolicy, max_num_seqs: int = 8) -> LLMEngine:
    config = tiny_engine_config(
        tiny_llama_dir,
        kv_cache_memory="32MiB",
        max_num_batched_tokens=512,
        max_num_seqs=max_num_seqs,
    )
    return LLMEngine(config, policy=policy)


def _fair(quiet_guaranteed: int = 0) -> TenantFairPolicy:
    return TenantFairPolicy(
        {"quiet": TenantShare(guaranteed_blocks=quiet_guaranteed)}, TenantShare()
    )


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _run(engine: LLMEngine, arrive_in_step: int | None) -> dict[str, list[RequestOutput]]:
    """Two flooder requests; the quiet one arrives inside step ``arrive_in_step`` (between
    its layers, as ``AsyncLLM`` adds requests) or, when None, alone on an idle engine."""
    outs: dict[str, list[RequestOutput]] = {}
    inside: list[tuple[int, list[RequestOutput]]] = []
    step = 0

    def at_pause(in_flight: EngineStep) -> None:
        if step == arrive_in_step and not inside:
            engine.add(engine.make_request("quiet", QUIET_PROMPT, GREEDY, tenant="quiet"))
            inside.append((step, engine.step_urgent(in_flight)))

    if arrive_in_step is None:
        engine.add(engine.make_request("quiet", QUIET_PROMPT, GREEDY, tenant="quiet"))
    else:
        for i in range(2):
            prompt = list(range(100 + 40 * i, 160 + 40 * i))
            engine.add(engine.make_request(f"flood-{i}", prompt, GREEDY, tenant="flooder"))
    while engine.has_unfinished():
        for o in paused_step(engine, at_pause):
            outs.setdefault(o.request_id, []).append(o)
        step += 1
    for _, urgent in inside:
        for o in urgent:
            outs.setdefault(o.request_id, []).insert(0, o)
    outs["_inside"] = [o for _, urgent in inside for o in urgent]
    return outs


def test_quiet_request_gets_its_first_token_inside_the_step_in_flight(
    tiny_llama_dir: Path,
) -> None:
    solo = _run(_engine(tiny_llama_dir, _fair()), arrive_in_step=None)
    undisturbed = _run(_engine(tiny_llama_dir, _fair()), arrive_in_step=-1)  # never arrives
    engine = _engine(tiny_llama_dir, _fair())
    mixed = _run(engine, arrive_in_step=2)  # the flooders are decoding by then

    # Its first token came out of the urgent step, before the step in flight ended.
    assert [o.request_id for o in mixed["_inside"]] == ["quiet"]
    assert len(mixed["_inside"][0].new_token_ids) == 1
    # Nothing was disturbed: the interrupted step resumed from its own activations.
    assert _tokens(mixed["quiet"]) == _tokens(solo["quiet"])
    for rid in ("flood-0", "flood-1"):
        assert _tokens(mixed[rid]) == _tokens(undisturbed[rid])
        assert mixed[rid][-1].finish_reason == "length"
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_at_most_one_urgent_step_per_step_and_never_with_fifo(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, FifoPolicy())
    assert _run(engine, arrive_in_step=2)["_inside"] == []  # FIFO: nobody jumps the step

    engine = _engine(tiny_llama_dir, _fair())
    engine.add(engine.make_request("flood", list(range(100, 140)), GREEDY, tenant="flooder"))
    engine.step()
    urgent_outputs: list[list[Any]] = []

    in_flight: list[EngineStep] = []

    def at_pause(step: EngineStep) -> None:
        for i in range(2):
            rid = f"quiet-{len(urgent_outputs)}-{i}"
            engine.add(engine.make_request(rid, QUIET_PROMPT, GREEDY, tenant=f"quiet{i}"))
        urgent_outputs.append(engine.step_urgent(step))
        in_flight.append(step)

    paused_step(engine, at_pause)
    assert sum(len(o) for o in urgent_outputs) == 1  # one urgent step, then never again
    assert engine.step_urgent(in_flight[0]) == []  # after its step ended: nothing runs


@pytest.mark.parametrize("guaranteed", [0, 64])
def test_with_every_slot_taken_it_runs_one_over_only_where_it_could_preempt(
    tiny_llama_dir: Path, guaranteed: int
) -> None:
    """max_num_seqs full of a flooder: for a tenant within its guarantee a normal step would
    take the spare slot; so does the urgent step, and the flooder keeps its max_num_seqs.
    Without a guarantee, the quiet request waits as it would in a normal step."""
    engine = _engine(tiny_llama_dir, _fair(guaranteed), max_num_seqs=2)
    for i in range(2):
        prompt = list(range(100 + 50 * i, 140 + 50 * i))
        engine.add(engine.make_request(f"flood-{i}", prompt, GREEDY, tenant="flooder"))
    engine.step()
    assert len(engine.scheduler.running) == 2
    got: list[RequestOutput] = []

    def at_pause(step: EngineStep) -> None:
        if not engine.scheduler.requests.get("quiet"):
            engine.add(engine.make_request("quiet", QUIET_PROMPT, GREEDY, tenant="quiet"))
            got.extend(engine.step_urgent(step))

    paused_step(engine, at_pause)
    if guaranteed:
        assert [o.request_id for o in got] == ["quiet"]
        assert len(engine.scheduler.running) == 3 and engine.scheduler.spare == {"quiet"}
        engine.add(engine.make_request("late", list(range(50, 60)), GREEDY, tenant="flooder"))
        engine.step()  # regular slots full: no admission until a flooder request ends
        assert engine.scheduler.requests["late"].first_scheduled_time is None
    else:
        assert got == []
        assert len(engine.scheduler.running) == 2
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_cache.pool.num_used_blocks == 0


class _Collect:
    """A ``Sink`` that keeps what the loop hands it."""

    def __init__(self) -> None:
        self.got: list[RequestOutput] = []
        self.errors: list[tuple[str, BaseException]] = []

    def outputs(self, outputs: Sequence[RequestOutput]) -> None:
        self.got.extend(outputs)

    def error(self, request_id: str, exc: BaseException) -> None:
        self.errors.append((request_id, exc))

    def gone(self, request_ids: Sequence[str]) -> None:
        pass

    def published(self) -> None:
        pass

    def dead(self, exc: BaseException, *, shutdown: bool = False) -> None:
        raise AssertionError(f"the loop died: {exc!r}")


def test_a_failure_between_layers_fails_the_step_in_flight_not_the_engine(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work taken in between two layers that fails (a bug in the urgent path) fails the
    step in flight as a kernel error would: its requests end with an error, their blocks go
    back, the request that just arrived still waits, and nothing is recovered engine-wide."""
    engine = _engine(tiny_llama_dir, _fair())
    sink = _Collect()
    loop = EngineLoop(engine, sink)  # driven here, on this thread: not started
    engine.add(engine.make_request("flood", list(range(100, 160)), GREEDY, tenant="flooder"))
    loop._step()  # its prefill

    def broken() -> None:
        raise RuntimeError("urgent path bug")

    monkeypatch.setattr(engine.scheduler, "schedule_urgent", broken)
    loop.put(Add(engine.make_request("quiet", QUIET_PROMPT, GREEDY, tenant="quiet")))
    outs = loop._step()  # the quiet request arrives between two layers of this one
    (failed,) = [o for o in outs if o.finished]
    assert failed.request_id == "flood" and failed.finish_reason == "error"
    assert "urgent path bug" in (failed.error or "")
    assert engine.num_recoveries == 0
    assert "quiet" in engine.scheduler.requests  # taken in, still waiting its turn
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_a_step_ends_once(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, FifoPolicy())
    engine.add(engine.make_request("r", list(range(100, 110)), GREEDY))
    step = engine.begin_step()
    engine.end_step(step)
    with pytest.raises(RuntimeError, match="ended twice"):
        engine.end_step(step)
    assert engine.step_urgent(step) == []  # nothing runs inside a step that ended
