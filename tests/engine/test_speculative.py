"""Speculative decoding (``engine/drafter.py``, ``engine/verify.py``): drafts verified inside
the normal step change no token. Greedy and seeded outputs are token-identical to decoding
without drafts, in batches that mix speculating and plain requests, under preemption, with a
grammar, with stops landing inside an accepted draft; rejected positions give their blocks
back. The tiny random-weight model rarely repeats itself, so most of these tests draft with
an oracle: the plain run's own continuation, corrupted at random places, so that every step
has drafts accepted in full, in part and not at all."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgate.config import EngineConfig, SpeculativeConfig
from kvgate.engine.drafter import NgramDrafter, StepCosts, lookup
from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.messages import RunnerOutput, SchedulerOutput
from kvgate.engine.request import Request
from kvgate.engine.sampler import Sampler
from kvgate.engine.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.stats import IterationStats
from kvgate.engine.verify import Drafted, DraftVerifier
from kvgate.errors import InvalidConfig, InvalidRequest
from kvgate.sampling_params import SamplingParams
from kvgate.structured.spec import json_schema_grammar
from tests.conftest import tiny_engine_config
from tests.engine.fakes import make_request

# ---------------------------------------------------------------------- the lookup


def _arr(tokens: Sequence[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_lookup_takes_what_followed_the_latest_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 22, 7, 2, 3]
    assert lookup(_arr(tokens), 3, 2, 4) == [20, 21, 22]
    assert lookup(_arr(tokens), 1, 2, 4) == [20]


def test_lookup_prefers_the_longest_suffix_that_recurs() -> None:
    # "5 2 3" recurs once (followed by 40); "2 3" recurs later (followed by 50).
    tokens = [5, 2, 3, 40, 41, 2, 3, 50, 51, 5, 2, 3]
    assert lookup(_arr(tokens), 2, 2, 3) == [40, 41]
    assert lookup(_arr(tokens), 2, 2, 2) == [50, 51]


def test_lookup_finds_nothing_where_nothing_recurs_and_clips_at_the_end() -> None:
    assert lookup(_arr([1, 2, 3, 4, 5]), 4, 2, 4) == []
    assert lookup(_arr([7]), 4, 1, 4) == []
    # The only earlier occurrence ends one token before the suffix: one token to propose.
    assert lookup(_arr([8, 8, 8]), 4, 2, 2) == [8]


def test_a_request_whose_drafts_are_refused_pauses_longer_each_time() -> None:
    cfg = SpeculativeConfig(num_tokens=4, window=2, min_acceptance=0.5, pause_steps=3)
    drafter = NgramDrafter(cfg)
    request = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=100))
    assert drafter.propose(request, 4) == [3, 1, 2]
    for _ in range(2):
        drafter.record("r", 3, 0)
    drafts = [drafter.propose(request, 4) for _ in range(4)]
    assert drafts == [[], [], [], [3, 1, 2]]  # paused for 3 of its decode steps
    for _ in range(2):
        drafter.record("r", 3, 0)
    assert [drafter.propose(request, 4) for _ in range(7)][-1:] == [[3, 1, 2]]
    assert drafter.propose(request, 0) == []
    opted_out = Request("o", [1, 2, 1, 2], SamplingParams(speculative=False))
    assert drafter.propose(opted_out, 4) == []


def test_step_costs_interpolate_between_measured_sizes_only() -> None:
    costs = StepCosts(weight=0.5)
    assert costs.estimate(1) is None
    costs.observe(1, 1.0)
    costs.observe(3, 2.0)
    costs.observe(3, 3.0)  # moving average: 2.5
    assert costs.estimate(3) == 2.5
    assert costs.estimate(2) == pytest.approx(1.75)
    assert costs.estimate(4) is None and costs.estimate(0) is None


def _drafter_with_costs(seconds: dict[int, float], drafted: int, accepted: int) -> NgramDrafter:
    drafter = NgramDrafter(SpeculativeConfig(num_tokens=4, window=1000))
    for rows, s in seconds.items():
        drafter.costs.observe(rows, s)
    drafter.propose(Request("r", [1, 2, 1, 2], SamplingParams()), 4)
    drafter.record("r", drafted, accepted)
    return drafter


def test_drafts_are_verified_only_as_far_as_their_rows_pay() -> None:
    # Rows nearly free (an AMX tile): the whole draft of a request that is mostly right.
    flat = {1: 0.060, 2: 0.061, 3: 0.062, 4: 0.063, 5: 0.064}
    assert _drafter_with_costs(flat, 40, 36).worth("r", 4, 1, 1) == 4
    # Zen 2's K-quant kernels (2 rows 1.4x one, 5 rows 3.4x): one draft token at most.
    steep = {1: 0.060, 2: 0.085, 3: 0.125, 4: 0.156, 5: 0.204}
    assert _drafter_with_costs(steep, 40, 36).worth("r", 4, 1, 1) == 1
    # A request whose drafts are mostly refused verifies none where rows cost anything.
    assert _drafter_with_costs(steep, 40, 4).worth("r", 4, 1, 1) == 0
    assert _drafter_with_costs(flat, 40, 4).worth("r", 4, 1, 1) <= 1
    # A step size never measured is tried (that is how it gets measured).
    assert _drafter_with_costs({1: 0.06}, 40, 36).worth("r", 4, 1, 1) == 1
    # The plain step's cost unknown: none verified, so that the plain step gets measured.
    assert _drafter_with_costs({}, 0, 0).worth("r", 3, 1, 1) == 0


# ---------------------------------------------------------------------- the scheduler


class AlwaysDrafter(NgramDrafter):
    """A draft of as many 7s as allowed for every request that speculates, always verified."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        k = min(max_tokens, self.config.num_tokens)
        return [7] * max(k, 0) if self.wants(request) else []

    def worth(self, request_id: str, draft_len: int, rows: int, tokens: float) -> int:
        return draft_len


def _answer(out: SchedulerOutput) -> RunnerOutput:
    """A runner that samples token 3 and refuses every draft."""
    return RunnerOutput(
        sampled_token_ids={s.request_id: 3 for s in out.sequences if s.sample or s.num_draft}
    )


def _scheduler(num_blocks: int, budget: int, k: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4)
    drafter = AlwaysDrafter(SpeculativeConfig(num_tokens=k))
    return Scheduler(SchedulerConfig(8, budget, 512), kv, None, drafter=drafter)


def test_drafts_take_only_the_budget_every_decode_left() -> None:
    sched = _scheduler(256, 64)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=200))
    out = sched.schedule()
    sched.update(out, _answer(out))
    sched.config = SchedulerConfig(8, 10, 512)  # room for every decode and 2 draft tokens
    sched.knobs = sched.configured_knobs
    for _ in range(4):
        out = sched.schedule()
        assert sorted(s.request_id for s in out.sequences) == [f"r{i}" for i in range(8)]
        assert out.num_batched_tokens == 10 and sum(s.num_draft for s in out.sequences) == 2
        sched.update(out, _answer(out))


def test_drafts_take_only_blocks_nobody_else_needs() -> None:
    """A pool of 4 blocks of 4: r0 drafts 2 tokens where a block is free, r1 (no drafts)
    needs more blocks as it grows. Every step runs and preempts exactly what it would with
    no drafter: a draft never takes a block another request needs."""
    drafts = []

    def steps(drafting: bool) -> list[tuple[list[str], tuple[str, ...]]]:
        sched = _scheduler(4, 64, k=2)
        if not drafting:
            sched.drafter = None
        sched.add_request(make_request("r0", [1, 2, 3], max_tokens=200))
        sched.add_request(make_request("r1", [5, 6, 7, 8], max_tokens=200, speculative=False))
        seen = []
        for _ in range(12):
            out = sched.schedule()
            seen.append((sorted(s.request_id for s in out.sequences), out.preempted_request_ids))
            drafts.extend(s.num_draft for s in out.sequences if s.num_draft)
            sched.update(out, _answer(out))
        return seen

    assert steps(True) == steps(False)
    assert drafts  # some steps had a block to spare for r0's draft


# ---------------------------------------------------------------------- the engine


class OracleDrafter(NgramDrafter):
    """Drafts the continuation a plain run produced (``truth``, by request id or by prompt),
    changing one token of a draft at random half the time; requests it has no truth for get
    the n-gram lookup."""

    def __init__(
        self,
        config: SpeculativeConfig,
        truth: Mapping[str | tuple[int, ...], list[int]],
        seed: int = 0,
    ) -> None:
        super().__init__(config)
        self.truth = truth
        self.rng = random.Random(seed)

    def worth(self, request_id: str, draft_len: int, rows: int, tokens: float) -> int:
        return draft_len  # every draft verified whole, whatever the steps cost here

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        truth = self.truth.get(request.request_id, self.truth.get(request.prompt_token_ids))
        if truth is None:
            return super().propose(request, max_tokens)
        if not self.wants(request):
            return []
        k = min(max_tokens, self.rng.randint(1, self.config.num_tokens))
        at = request.num_output_tokens
        draft = list(truth[at : at + k])
        if draft and self.rng.random() < 0.5:
            i = self.rng.randrange(len(draft))
            draft[i] = (draft[i] + 1 + self.rng.randrange(500)) % 49152
        return draft


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    finish: dict[str, tuple[str | None, object]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    #: Outputs each request got (one per step that gave it tokens).
    deltas: dict[str, int] = field(default_factory=dict)
    steps: int = 0


def _engine(model_dir: Path, speculative: bool, **overrides: object) -> LLMEngine:
    spec: dict[str, object] = {"speculative": "ngram"} if speculative else {}
    return LLMEngine(tiny_engine_config(model_dir, **{**spec, **overrides}))


def use_oracle(
    engine: LLMEngine, truth: Mapping[str | tuple[int, ...], list[int]], seed: int = 0
) -> OracleDrafter:
    """Replace ``engine``'s drafter by an oracle of ``truth``."""
    assert engine.drafter is not None
    oracle = OracleDrafter(engine.drafter.config, truth, seed)
    engine.drafter = engine.scheduler.drafter = oracle
    return oracle


def _run(engine: LLMEngine, jobs: Sequence[tuple[str, str | list[int], SamplingParams]]) -> Run:
    """Add every job at once, step to the end; after every step, each running request holds
    exactly the blocks of its known tokens (a rejected draft's blocks went back)."""
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt, params)
    run = Run()
    bs = engine.config.block_size
    while engine.has_unfinished():
        for out in engine.step():
            run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            run.text[out.request_id] = run.text.get(out.request_id, "") + out.text
            run.logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs)
            run.deltas[out.request_id] = run.deltas.get(out.request_id, 0) + 1
            if out.finished:
                run.finish[out.request_id] = (out.finish_reason, out.stop_reason)
                assert out.num_output_tokens == len(run.tokens[out.request_id])
        for request in engine.scheduler.running:
            held = engine.kv_cache.num_held(request.request_id)
            assert held <= math.ceil(request.num_tokens / bs), request
        run.steps += 1
        assert run.steps < 5000
    pool = engine.kv_cache.pool
    pool.check_invariants()
    assert pool.num_used_blocks == 0 and not engine.kv_cache.tenant_blocks
    return run


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 5000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _greedy(max_tokens: int = 48, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_greedy_with_drafts_is_token_identical_beside_plain_requests(
    tiny_llama_dir: Path,
) -> None:
    jobs = [
        (f"r{i}", p, _greedy(speculative=None if i % 3 else False, logprobs=0))
        for i, p in enumerate(_prompts(9))
    ]
    plain = _run(_engine(tiny_llama_dir, False), jobs)
    engine = _engine(tiny_llama_dir, True)
    oracle = use_oracle(engine, plain.tokens)
    stats: list[IterationStats] = []
    engine.listeners.append(type("L", (), {"on_step": lambda _, s: stats.append(s)})())
    spec = _run(engine, jobs)
    assert spec.tokens == plain.tokens
    assert spec.text == plain.text
    assert spec.finish == plain.finish
    for rid in plain.logprobs:
        assert spec.logprobs[rid] == pytest.approx(plain.logprobs[rid], abs=1e-4)
    # Drafts were accepted whole, in part and not at all: speculating requests got several
    # tokens in some steps, the others one a step.
    assert 0 < oracle.num_accepted_tokens < oracle.num_draft_tokens
    for i, (rid, _, params) in enumerate(jobs):
        assert (spec.deltas[rid] < plain.deltas[rid]) == (params.speculative is None), i
    assert sum(s.num_draft_tokens for s in stats) == oracle.num_draft_tokens
    assert sum(s.num_accepted_tokens for s in stats) == oracle.num_accepted_tokens
    # Every token received is counted once, draft-accepted or not.
    assert sum(s.num_generation_tokens for s in stats) == sum(map(len, plain.tokens.values()))


def test_greedy_with_drafts_is_token_identical_under_preemption(tiny_llama_dir: Path) -> None:
    # A pool of a few requests' blocks: requests are preempted and recomputed mid-draft.
    small = {"kv_cache_memory": "192KiB", "max_model_len": 160, "max_num_batched_tokens": 64}
    jobs = [(f"r{i}", p, _greedy(max_tokens=64)) for i, p in enumerate(_prompts(8, seed=1))]
    reference = _engine(tiny_llama_dir, False, **small)
    plain = _run(reference, jobs)
    engine = _engine(tiny_llama_dir, True, **small)
    oracle = use_oracle(engine, plain.tokens, seed=1)
    spec = _run(engine, jobs)
    assert engine.scheduler.num_preemptions > 0
    assert spec.tokens == plain.tokens
    assert oracle.num_accepted_tokens > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_sampling_with_drafts_draws_the_same_tokens(tiny_llama_dir: Path, seed: int) -> None:
    def params(i: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=40, temperature=0.9, top_p=0.95, top_k=40, seed=seed * 100 + i,
            ignore_eos=True, repetition_penalty=1.1, presence_penalty=0.3,
        )  # fmt: skip

    jobs = [(f"r{i}", p, params(i)) for i, p in enumerate(_prompts(5, seed=seed))]
    plain = _run(_engine(tiny_llama_dir, False), jobs)
    engine = _engine(tiny_llama_dir, True)
    oracle = use_oracle(engine, plain.tokens, seed=seed)
    assert _run(engine, jobs).tokens == plain.tokens
    assert oracle.num_accepted_tokens > 0


def test_stops_inside_an_accepted_draft_end_where_plain_decoding_ends(
    tiny_llama_dir: Path,
) -> None:
    prompt = _prompts(1, seed=3)[0]
    free = _run(_engine(tiny_llama_dir, False), [("free", prompt, _greedy(max_tokens=40))])
    tokens, text = free.tokens["free"], free.text["free"]
    stop_text = next(
        s for i in range(12, 30) if (s := text[i : i + 3]).strip() and text.find(s) == i
    )
    stop_id = next(t for t in tokens[9:] if tokens.index(t) >= 9)
    cases = {
        "string": _greedy(max_tokens=40, stop=[stop_text]),
        "string-kept": _greedy(max_tokens=40, stop=[stop_text], include_stop_str_in_output=True),
        "token": _greedy(max_tokens=40, stop_token_ids=[stop_id]),
        "length": _greedy(max_tokens=11),
    }
    jobs = [(name, prompt, params) for name, params in cases.items()]
    plain = _run(_engine(tiny_llama_dir, False), jobs)
    assert all(len(plain.tokens[name]) < 40 for name in cases)
    engine = _engine(tiny_llama_dir, True)
    oracle = use_oracle(engine, {name: tokens for name in cases})
    oracle.rng.random = lambda: 1.0  # type: ignore[method-assign]  # whole, true drafts
    spec = _run(engine, jobs)
    assert spec.tokens == plain.tokens
    assert spec.text == plain.text
    assert spec.finish == plain.finish


def test_a_stop_string_before_a_token_stop_in_the_same_draft_ends_the_request(
    tiny_llama_dir: Path,
) -> None:
    """A whole, true draft holds the token that completes a stop string and, after it, the
    one that reaches max_tokens (or a stop id): the stop string ends the request, as in
    plain decoding, and the tokens after it are not delivered."""
    prompt = _prompts(1, seed=3)[0]
    free = _run(_engine(tiny_llama_dir, False), [("free", prompt, _greedy(max_tokens=40))])
    tokens, text = free.tokens["free"], free.text["free"]
    stop_text = next(
        s for i in range(12, 30) if (s := text[i : i + 3]).strip() and text.find(s) == i
    )
    ended = _run(_engine(tiny_llama_dir, False), [("s", prompt, _greedy(stop=[stop_text]))])
    n = len(ended.tokens["s"])
    cases = {
        f"length+{extra}": _greedy(max_tokens=n + extra, stop=[stop_text]) for extra in (1, 2, 3)
    }
    cases["stop-id"] = _greedy(max_tokens=40, stop=[stop_text], stop_token_ids=[tokens[n]])
    jobs = [(name, prompt, params) for name, params in cases.items()]
    plain = _run(_engine(tiny_llama_dir, False), jobs)
    for start in range(4):  # drafts starting at every offset before the stop
        engine = _engine(tiny_llama_dir, True)
        drafter = use_oracle(engine, {name: tokens for name in cases})
        drafter.rng.random = lambda: 1.0  # type: ignore[method-assign]
        lengths = iter([start + 1, *[4] * 100])
        drafter.rng.randint = lambda a, b, it=lengths: next(it)  # type: ignore[method-assign,misc]
        spec = _run(engine, jobs)
        assert spec.tokens == plain.tokens and spec.finish == plain.finish, start
        assert spec.text == plain.text


def test_a_grammar_with_drafts_writes_the_same_valid_json(tiny_llama_dir: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    grammar = json_schema_grammar(schema, "response_format")
    jobs: list[tuple[str, str | list[int], SamplingParams]] = [
        ("greedy", "Write JSON:", SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar)),
        ("seeded", "Write JSON:", SamplingParams(max_tokens=80, seed=5, grammar=grammar)),
        ("free", "Write JSON:", _greedy(max_tokens=30)),
    ]
    plain = _run(_engine(tiny_llama_dir, False), jobs)
    engine = _engine(tiny_llama_dir, True)
    oracle = use_oracle(engine, plain.tokens, seed=2)
    spec = _run(engine, jobs)
    assert spec.tokens == plain.tokens and spec.finish == plain.finish
    assert oracle.num_accepted_tokens > 0
    # A draft token the grammar refuses is never accepted: an invalid draft changes nothing.
    engine = _engine(tiny_llama_dir, True)
    bad = {rid: [t + 1 for t in tokens] for rid, tokens in plain.tokens.items()}
    use_oracle(engine, bad)
    assert _run(engine, jobs).tokens == plain.tokens


def test_cancels_mid_draft_give_every_block_back(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, True)
    prompts = _prompts(6, seed=4)
    truth = {f"r{i}": [7] * 200 for i in range(6)}
    oracle = use_oracle(engine, truth)
    oracle.rng.random = lambda: 1.0  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _greedy(max_tokens=100))
    for _ in range(4):
        engine.step()
    assert oracle.num_drafts > 0
    engine.abort([f"r{i}" for i in range(3)])
    engine.step()
    engine.abort([f"r{i}" for i in range(3, 6)])
    engine.step()
    assert not engine.has_unfinished()
    engine.kv_cache.pool.check_invariants()
    assert engine.kv_cache.pool.num_used_blocks == 0 and not engine.kv_cache.req_blocks


def test_real_prompt_lookup_on_smollm2_changes_no_token() -> None:
    """SmolLM2 (bf16 on this CPU's kernels) asked to repeat a list: the n-gram drafts come
    from the prompt, most are accepted, and the output is the plain run's."""
    items = "apple, river, copper, lantern, violet, harbor, meadow, silver, thunder, maple"
    prompt = (
        "<|im_start|>user\nRepeat this list exactly, twice: "
        f"{items}<|im_end|>\n<|im_start|>assistant\n"
    )
    settings = {"kv_cache_memory": "64MiB", "max_model_len": 512}
    jobs = [("copy", prompt, _greedy(max_tokens=48)), ("free", "Once upon a time", _greedy())]
    plain = _run(LLMEngine(EngineConfig(**settings)), jobs)  # type: ignore[arg-type]
    engine = LLMEngine(EngineConfig(speculative="ngram", **settings))  # type: ignore[arg-type]
    # Every draft verified, whatever this machine's steps cost (no test depends on timing).
    engine.drafter.worth = lambda request_id, n, rows, tokens: n  # type: ignore[union-attr,method-assign]
    spec = _run(engine, jobs)
    assert spec.tokens == plain.tokens
    assert engine.drafter is not None and engine.drafter.num_accepted_tokens >= 10
    assert spec.steps < plain.steps


# ---------------------------------------------------------------------- the acceptance rule


def test_random_rows_keep_the_models_distribution() -> None:
    """ "Accept when the sample equals the draft" keeps each position's distribution: the
    first token of a draft whose first token is likely, unlikely or never sampled."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -30.0], [0.0, 1.0, 2.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(logits[0], dim=-1)
    verifier = DraftVerifier(Sampler(), lambda: None)  # type: ignore[arg-type,return-value]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    n = 6000
    for draft_token in (0, 3, 5):
        counts = torch.zeros(vocab)
        accepted = 0
        for _ in range(n):
            d = Drafted("r", (draft_token,), 0, params, None, (1,), [])
            got = verifier(logits, [d])["r"]
            counts[got.tokens[0]] += 1
            accepted += got.num_accepted
        freq = counts / n
        sigma = (p * (1 - p) / n).sqrt()
        assert torch.all((freq - p).abs() <= 4 * sigma + 1e-3), (draft_token, freq, p)
        assert abs(accepted / n - float(p[draft_token])) <= 4 * float(sigma[draft_token]) + 1e-3


# ---------------------------------------------------------------------- bad input


def test_a_request_asking_for_speculation_without_it_names_the_field(
    tiny_llama_dir: Path,
) -> None:
    engine = _engine(tiny_llama_dir, False)
    with pytest.raises(InvalidRequest) as info:
        engine.make_request("r", "hello", SamplingParams(speculative=True))
    assert info.value.param == "speculative"
    engine.make_request("r", "hello", SamplingParams(speculative=False))


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        ({"speculative": "eagle"}, "speculative"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {"speculative": "ngram", "speculative_ngram_min": 5, "speculative_ngram_max": 3},
            "speculative_ngram_min",
        ),
    ],
)
def test_bad_speculative_settings_fail_at_start(settings: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        replace(EngineConfig(), **settings)  # type: ignore[arg-type]
    assert info.value.param == param
