"""Sampler: greedy, filters, penalties, seeded reproducibility, distributions, logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingState,
    apply_penalties,
    make_generator,
)
from kvgate.sampling_params import SamplingParams

SAMPLER = Sampler()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """These tensors are small: one thread avoids OpenMP stalls when the CPU is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
    return SAMPLER(logits, states)


def state(seed: int | None = None, **kw: object) -> SamplingState:
    """A state for ``SamplingParams(**kw)``, with its own generator when seeded."""
    params = SamplingParams(seed=seed, **kw)  # type: ignore[arg-type]
    gen = make_generator(seed) if seed is not None else None
    return SamplingState(params=params, generator=gen)


def reference_probs(row: torch.Tensor, params: SamplingParams, slack: float = 0.0) -> torch.Tensor:
    """Float64 full-sort reference: the distribution a random row samples from, [vocab].

    ``slack`` loosens top-p and min-p, giving the set of tokens that may be kept when float32
    rounding decides a boundary token.
    """
    x = row.double() / params.temperature
    vocab = x.numel()
    vals, idx = x.sort(descending=True)
    k = params.top_k if 0 < params.top_k < vocab else vocab
    vals[k:] = -math.inf
    p = vals.softmax(0)
    keep = torch.arange(vocab) < k
    if params.top_p < 1.0:
        keep &= (p.cumsum(0) - p) < params.top_p + slack
    keep &= p >= (params.min_p - slack) * p[0]
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    out = torch.zeros(vocab, dtype=torch.float64)
    out[idx] = p
    return out


def empirical(row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """Counts of ``n`` draws (one batch of ``n`` identical unseeded rows), [vocab]."""
    logits = row[None, :].expand(n, -1).contiguous()
    out = sample(logits, [SamplingState(params=params)] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=row.numel()).double()


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Every frequency within 5 sigma of its probability; impossible tokens never drawn."""
    n = counts.sum().item()
    freq = counts / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert torch.all(counts[probs == 0] == 0), "sampled a token the filters drop"
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-3), (freq - probs).abs().max()


# --- greedy and the filters that reduce to it ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(16, 1000) * 4).to(dtype)
    out = sample(logits, [state(temperature=0.0)] * 16)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize(
    "kw",
    [
        {"top_k": 1},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"top_k": 1, "top_p": 0.5, "min_p": 0.1},
    ],
)
def test_filters_that_keep_one_token_equal_greedy(kw: dict[str, float]) -> None:
    torch.manual_seed(1)
    logits = torch.randn(12, 5000) * 2
    states = [state(seed=i if i % 2 else None, temperature=1.5, **kw) for i in range(12)]
    assert sample(logits, states).token_ids == logits.argmax(-1).tolist()


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    torch.manual_seed(2)
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    params = SamplingParams(min_p=0.2)  # floor 0.1: tokens 3 and 4 go
    counts = empirical(probs.log(), params, 20000)
    assert counts[3] == counts[4] == 0
    assert torch.all(counts[:3] > 0)
    assert_matches(counts, torch.tensor([0.5, 0.3, 0.12, 0, 0], dtype=torch.float64) / 0.92)


def test_caller_logits_are_not_modified() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    states = [
        SamplingState(SamplingParams(repetition_penalty=1.5, temperature=0.5), None, [1, 2], [3]),
        state(seed=3, temperature=0.7, top_p=0.9, frequency_penalty=1.0),
        state(temperature=0.0, presence_penalty=-1.0),
    ]
    sample(logits, states)
    assert torch.equal(logits, before)


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="one state per row"):
        sample(torch.zeros(2, 10), [state()])


# --- penalties -----------------------------------------------------------------------------------


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    st_ = SamplingState(params, None, prompt_token_ids=[0, 1], output_token_ids=[1, 2, 2])
    # Repetition over prompt+output {0, 1, 2}: 2.0/2, -1.0*2, 0.5/2. Then output counts
    # {1: 1, 2: 2}: token 1 -= 0.5*1 + 0.25, token 2 -= 0.5*2 + 0.25. Tokens 3, 4 untouched.
    expected = torch.tensor([[1.0, -2.75, -1.0, 3.0, -2.0]])
    assert torch.equal(apply_penalties(logits, [st_]), expected)


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 1.0]])
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    st_ = SamplingState(params, None, prompt_token_ids=[0, 0, 0], output_token_ids=[1])
    assert apply_penalties(logits, [st_]).tolist() == [[1.0, -1.0]]


def test_neutral_rows_are_untouched_next_to_penalised_ones() -> None:
    torch.manual_seed(3)
    logits = torch.randn(2, 100)
    states = [
        SamplingState(SamplingParams(repetition_penalty=1.3), None, [1, 2, 3], [4, 4]),
        SamplingState(SamplingParams(frequency_penalty=0.7), None, [5, 6], [7, 7, 8]),
    ]
    out = apply_penalties(logits, states)
    # Row 0 has no frequency penalty, row 1 no repetition penalty.
    changed0 = (out[0] != logits[0]).nonzero().flatten().tolist()
    changed1 = (out[1] != logits[1]).nonzero().flatten().tolist()
    assert changed0 == [1, 2, 3, 4]
    assert changed1 == [7, 8]
    assert out[1, 7].item() == pytest.approx(logits[1, 7].item() - 1.4)


@pytest.mark.parametrize(
    ("logits", "kw", "prompt", "output", "expected"),
    [
        # 3.0 / 1.2 = 2.5 < 2.9: the repeated token loses.
        ([3.0, 2.9], {"repetition_penalty": 1.2}, [0], [], 1),
        # Negative logits are multiplied: -1.0 * 1.2 = -1.2 < -1.1.
        ([-1.0, -1.1], {"repetition_penalty": 1.2}, [0], [], 1),
        # A penalty < 1 favours repeats.
        ([2.0, 2.1], {"repetition_penalty": 0.9}, [], [0], 0),
        # Frequency scales with the count: 3.0 - 2 * 0.1 = 2.8 < 2.9.
        ([3.0, 2.9], {"frequency_penalty": 0.1}, [], [0, 0], 1),
        # Presence does not: 3.0 - 0.05 = 2.95 > 2.9.
        ([3.0, 2.9], {"presence_penalty": 0.05}, [], [0, 0, 0], 0),
        ([3.0, 2.9], {"presence_penalty": 0.15}, [], [0, 0, 0], 1),
    ],
)
def test_penalties_change_the_greedy_choice(
    logits: list[float], kw: dict[str, float], prompt: list[int], output: list[int], expected: int
) -> None:
    params = SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]
    out = sample(torch.tensor([logits]), [SamplingState(params, None, prompt, output)])
    assert out.token_ids == [expected]


# --- seeded reproducibility ----------------------------------------------------------------------

VOCAB = 49152


def _target_logits(kind: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    base = torch.randn(VOCAB, generator=g)
    if kind == "peaked":  # resolved in the 64-wide window
        return base * 2 + torch.arange(VOCAB, 0, -1).float().log() * 3
    return base * 3  # flat: top-p needs the full sort


TARGETS = {
    "top_p_peaked": ("peaked", {"temperature": 0.8, "top_p": 0.9}),
    "top_p_flat": ("flat", {"temperature": 1.0, "top_p": 0.9}),
    "top_k": ("flat", {"temperature": 1.0, "top_k": 200}),
    "plain": ("flat", {"temperature": 1.0}),
    "min_p": ("flat", {"temperature": 1.0, "min_p": 0.05}),
}


def _others(n: int, salt: int) -> tuple[torch.Tensor, list[SamplingState]]:
    g = torch.Generator().manual_seed(salt)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    kinds: list[SamplingState] = [
        state(temperature=0.0),
        state(temperature=0.7, top_p=0.8),
        state(seed=salt, temperature=1.0, top_k=5),
        SamplingState(SamplingParams(repetition_penalty=1.3), None, [1, 2], [3]),
        state(seed=salt + 1, temperature=0.9, min_p=0.1, top_p=0.95),
        state(temperature=1.2),
    ]
    return logits, [kinds[(i + salt) % len(kinds)] for i in range(n)]


def _run_seeded(kind: str, kw: dict[str, float], seed: int, layout: str) -> list[int]:
    """The target row's tokens over 3 steps, with other rows around it as ``layout`` says."""
    target = state(seed=seed, **kw)
    tokens = []
    for step in range(3):
        row = _target_logits(kind, step)[None, :]
        if layout == "alone":
            logits, states, pos = row, [target], 0
        elif layout == "first":
            others, ostates = _others(5, salt=step)
            logits, states, pos = torch.cat([row, others]), [target, *ostates], 0
        else:
            others, ostates = _others(7, salt=10 + step)
            logits, pos = torch.cat([others[:4], row, others[4:]]), 4
            states = [*ostates[:4], target, *ostates[4:]]
        tokens.append(sample(logits, states).token_ids[pos])
    return tokens


@pytest.mark.parametrize("name", list(TARGETS))
def test_seeded_row_ignores_the_rest_of_the_batch(name: str) -> None:
    kind, kw = TARGETS[name]
    alone = _run_seeded(kind, kw, 1234, "alone")
    assert _run_seeded(kind, kw, 1234, "first") == alone
    assert _run_seeded(kind, kw, 1234, "middle") == alone
    # The test can fail: the seed matters and the draws are not just the argmax.
    others = [_run_seeded(kind, kw, s, "alone") for s in (1, 2, 3)]
    if kind == "flat":
        assert any(o != alone for o in others)
        argmaxes = [_target_logits(kind, step).argmax().item() for step in range(3)]
        assert alone != argmaxes


# --- distributions -------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 500.0, -500.0])
def test_temperature_sampling_matches_softmax(offset: float) -> None:
    """Large offsets check the sampler is shift-invariant (no exp overflow or underflow)."""
    torch.manual_seed(4)
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0, 0.2, 1.5]) + offset
    params = SamplingParams(temperature=0.7)
    assert_matches(empirical(row, params, 40000), reference_probs(row, params))


def test_seeded_draws_follow_the_distribution() -> None:
    row = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    st_ = state(seed=7, temperature=1.0)
    counts = torch.zeros(4, dtype=torch.float64)
    for _ in range(3000):
        counts[sample(row, [st_]).token_ids[0]] += 1
    assert_matches(counts, reference_probs(row[0], st_.params))


@pytest.mark.parametrize(
    ("shape", "kw"),
    [
        ("peaked", {"temperature": 0.9, "top_k": 3}),
        ("peaked", {"temperature": 1.0, "top_p": 0.7}),
        ("peaked", {"temperature": 1.3, "top_k": 6, "top_p": 0.8, "min_p": 0.05}),
        ("flat", {"temperature": 1.0, "top_k": 40}),
    ],
)
def test_filtered_sampling_matches_reference(shape: str, kw: dict[str, float]) -> None:
    torch.manual_seed(5)
    vocab = 2000
    base = torch.randn(vocab)
    row = base * 0.3 if shape == "flat" else base - torch.arange(vocab).float() * 0.5
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    assert_matches(empirical(row, params, 4000), reference_probs(row, params))


def _ranks(row: torch.Tensor, counts: torch.Tensor) -> list[int]:
    order = row.argsort(descending=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(row.numel())
    return rank[counts > 0].tolist()


def test_top_p_reaching_past_the_windows_uses_the_full_vocabulary() -> None:
    torch.manual_seed(6)
    # 1100 near-equal tokens hold 99.9% of the mass: top_p = 0.95 keeps about 1045 of them.
    row = torch.cat([2.0 + torch.linspace(0.01, 0.0, 1100), torch.full((900,), -5.0)])
    params = SamplingParams(top_p=0.95)
    counts = empirical(row, params, 4000)
    loose = reference_probs(row, params, slack=1e-4)
    assert torch.all(counts[loose == 0] == 0)
    assert max(_ranks(row, counts)) >= 1024  # a 1024-wide window would have cut these


def test_min_p_reaching_past_the_first_window() -> None:
    torch.manual_seed(7)
    row = torch.cat([1.0 + torch.linspace(0.01, 0.0, 100), torch.full((1900,), -1.0)])
    counts = empirical(row, SamplingParams(min_p=0.5), 4000)
    ranks = _ranks(row, counts)
    assert max(ranks) < 100
    assert max(ranks) >= 64


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 1500),
    temperature=st.floats(0.05, 2.0),
    top_k=st.sampled_from([0, -1, 1, 2, 5, 50, 70, 1100]),
    top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.01]),
    min_p=st.sampled_from([0.0, 0.01, 0.3, 0.9]),
    scale=st.sampled_from([0.1, 1.0, 5.0]),
    seed=st.integers(0, 2**31),
)
def test_sampled_token_is_always_one_the_filters_keep(
    vocab: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    scale: float,
    seed: int,
) -> None:
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
    )
    n = 16
    states = [SamplingState(params, make_generator(seed + i)) for i in range(n)]
    out = sample(row[None, :].expand(n, -1).contiguous(), states)
    loose = reference_probs(row, params, slack=1e-4)
    assert all(loose[t] > 0 for t in out.token_ids)


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_top_k_is_ordered() -> None:
    torch.manual_seed(8)
    logits = torch.randn(4, 300) * 3
    top = int(logits[2].argmax())
    states = [
        state(temperature=0.0, logprobs=5),
        state(seed=1, temperature=0.5, top_p=0.9, logprobs=0),
        # The penalty moves the greedy choice away from the raw argmax; logprobs stay raw.
        SamplingState(
            SamplingParams(temperature=0.0, repetition_penalty=100.0, logprobs=20), None, [top], []
        ),
        state(temperature=1.0),
    ]
    out = sample(logits, states)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[2] != top
    assert out.logprobs[3] is None
    for i, k in [(0, 5), (1, 0), (2, 20)]:
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top_logprobs) == k
        values, ids = raw[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in lp.top_logprobs] == ids.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
        lps = [v for _, v in lp.top_logprobs]
        assert lps == sorted(lps, reverse=True)
    assert out.logprobs[0] is not None
    assert out.logprobs[0].top_logprobs[0][0] == out.token_ids[0]  # greedy picks the top one
