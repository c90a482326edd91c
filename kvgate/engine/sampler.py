"""Turn one step of logits into one token per sequence.

Order per row: repetition penalty, frequency/presence penalties, temperature, then top-k, top-p
and min-p filtering. Greedy rows (``temperature == 0``) take the argmax of the penalised logits.
Random rows use the exponential race: ``token = argmax(probs / q)`` with ``q ~ Exp(1)``, drawn
as ``-log(u)``, ``u ~ U[0, 1)``, from the row's own ``torch.Generator`` when the request is
seeded. Every step a row takes depends only on its own logits and parameters, so a seeded row
gets the same tokens whatever else shares its batch and wherever it sits in it.

Logprobs are taken from the raw model logits (``log_softmax`` before penalties and
temperature), as vLLM does by default: they describe the model, not the sampling settings.

Cost per step (it runs every decode step, up to 256 x 49152): penalties touch only the
(row, token) pairs they concern; filtered rows (top-k, top-p or min-p) avoid a full-vocabulary
sort by looking at the ``topk`` candidates of a fixed width (64, then 1024) and sort only when
the filter could keep a token outside that window. A row's window depends only on its own
top-k and logits, never on the batch. Other work on a row is a copy, a max and an exp pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvgate.engine.messages import TokenLogprobs
from kvgate.sampling_params import SamplingParams
from kvgate.structured.masks import apply_masks

#: Candidate widths tried, in order, before sorting the whole vocabulary. Fixed (not taken from
#: the batch) so a seeded row's candidate set and random draws never depend on other rows.
_CANDIDATE_WIDTHS = (64, 1024)


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence for one step."""

    params: SamplingParams
    #: The request's own generator when it is seeded (on the logits' device); ``None`` uses the
    #: default generator.
    generator: torch.Generator | None = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for a seeded request, on the device the logits will live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplerOutput:
    """One entry per input row, in input order."""

    token_ids: list[int]
    #: ``None`` for rows whose ``params.logprobs`` is ``None``.
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Stateless: all per-request state comes in through :class:`SamplingState`."""

    def __call__(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        allowed: tuple[Sequence[int], np.ndarray] | None = None,
    ) -> SamplerOutput:
        """Pick one token per row of ``logits`` ([num_seqs, vocab], any float dtype).

        ``allowed``: (rows, bitmask [len(rows), ceil(vocab / 32)] int32): those rows sample
        only among the tokens their mask allows (after penalties, before temperature and
        filters). Other rows are untouched, so they sample exactly as in a batch without
        constrained rows."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [num_seqs, vocab] with one state per row, got "
                f"{tuple(logits.shape)} for {len(states)} states"
            )
        device = logits.device
        num_seqs = logits.shape[0]
        # float32; the caller's tensor itself when it already is float32, so copy before writing.
        x = logits.detach().to(torch.float32)

        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            # Raw model distribution, before any penalty or temperature.
            raw_logprobs = torch.log_softmax(x.index_select(0, _index(lp_rows, device)), dim=-1)

        pen_rows = [i for i, s in enumerate(states) if s.params.uses_penalties]
        if pen_rows:
            if x.data_ptr() == logits.data_ptr():
                x = x.clone()
            _penalise_(x, pen_rows, states)

        if allowed is not None:
            if x.data_ptr() == logits.data_ptr():
                x = x.clone()
            apply_masks(x, *allowed)

        greedy_rows = [i for i, s in enumerate(states) if s.params.greedy]
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if not random_rows:
            tokens = x.argmax(dim=-1)
        else:
            tokens = torch.empty(num_seqs, dtype=torch.long, device=device)
            if greedy_rows:
                g_idx = _index(greedy_rows, device)
                if 2 * len(greedy_rows) >= num_seqs:  # one pass over all rows beats a copy
                    tokens[g_idx] = x.argmax(dim=-1).index_select(0, g_idx)
                else:
                    tokens[g_idx] = x.index_select(0, g_idx).argmax(dim=-1)
            _sample_random(x, random_rows, states, tokens)

        token_ids: list[int] = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * num_seqs
        if raw_logprobs is not None:
            _fill_logprobs(raw_logprobs, lp_rows, states, tokens, token_ids, logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """``logits`` [P, vocab] with each row's penalties applied, as float32 (input untouched).

    Repetition penalty first (HF: over prompt + output ids, positive logits divided, negative
    ones multiplied), then frequency and presence (OpenAI: over output ids only,
    ``logit -= frequency * count + presence * (count > 0)``).
    """
    x = logits.detach().to(torch.float32, copy=True)
    _penalise_(x, range(x.shape[0]), states)
    return x


def _penalise_(x: torch.Tensor, rows: Sequence[int], states: Sequence[SamplingState]) -> None:
    """Apply the penalties of ``states[r]`` to ``x[r]`` for ``r`` in ``rows``, in place.

    Only the (row, token) pairs a penalty concerns are read and written, so the cost is
    O(prompt + output ids), not O(rows x vocab).
    """
    rep_rows = [r for r in rows if states[r].params.repetition_penalty != 1.0]
    if rep_rows:
        # Every token seen in prompt + output, once per row.
        seen = [[*states[r].prompt_token_ids, *states[r].output_token_ids] for r in rep_rows]
        r_idx, t_idx, _ = _unique_pairs(rep_rows, seen, x)
        penalty = _per_row(x, rep_rows, [states[r].params.repetition_penalty for r in rep_rows])
        p = penalty[r_idx]
        v = x[r_idx, t_idx]
        x[r_idx, t_idx] = torch.where(v > 0, v / p, v * p)

    fp_rows = [
        r
        for r in rows
        if states[r].params.frequency_penalty != 0.0 or states[r].params.presence_penalty != 0.0
    ]
    if fp_rows:
        outputs = [list(states[r].output_token_ids) for r in fp_rows]
        r_idx, t_idx, counts = _unique_pairs(fp_rows, outputs, x)
        freq = _per_row(x, fp_rows, [states[r].params.frequency_penalty for r in fp_rows])
        presence = _per_row(x, fp_rows, [states[r].params.presence_penalty for r in fp_rows])
        x[r_idx, t_idx] -= freq[r_idx] * counts + presence[r_idx]


def _unique_pairs(
    rows: Sequence[int], ids: Sequence[Sequence[int]], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs among ``ids[j]`` for row ``rows[j]``: rows, tokens, counts."""
    vocab = x.shape[1]
    keys = torch.cat(
        [
            torch.tensor(t, dtype=torch.long, device=x.device) + r * vocab
            for r, t in zip(rows, ids, strict=True)
        ]
    )
    unique, counts = torch.unique(keys, return_counts=True)
    return unique // vocab, unique % vocab, counts.to(x.dtype)


def _per_row(x: torch.Tensor, rows: Sequence[int], values: Sequence[float]) -> torch.Tensor:
    """A [num_rows of x] tensor holding ``values`` at ``rows`` (zeros elsewhere)."""
    out = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    out[_index(rows, x.device)] = torch.tensor(values, dtype=x.dtype, device=x.device)
    return out


def _top_k(params: SamplingParams, vocab: int) -> int:
    """The effective top-k: ``vocab`` when disabled."""
    return params.top_k if 0 < params.top_k < vocab else vocab


def _top_k_or_one(params: SamplingParams, vocab: int) -> int:
    """The narrowest candidate window a row may be tried at: its top-k, or any without one."""
    k = _top_k(params, vocab)
    return k if k < vocab else 1


def _is_filtered(params: SamplingParams, vocab: int) -> bool:
    return _top_k(params, vocab) < vocab or params.top_p < 1.0 or params.min_p > 0.0


def _tempered(
    x: torch.Tensor, rows: Sequence[int], states: Sequence[SamplingState]
) -> torch.Tensor:
    """A private copy of ``x[rows]`` divided by each row's temperature, [len(rows), vocab]."""
    temps = torch.tensor([states[r].params.temperature for r in rows], device=x.device)
    return x.index_select(0, _index(rows, x.device)).div_(temps[:, None])


def _sample_random(
    x: torch.Tensor, rows: Sequence[int], states: Sequence[SamplingState], tokens: torch.Tensor
) -> None:
    """Sample ``tokens[r]`` for each random row ``r`` of ``x`` [num_seqs, vocab]."""
    device = x.device
    vocab = x.shape[1]
    plain = [r for r in rows if not _is_filtered(states[r].params, vocab)]
    if plain:
        w = _tempered(x, plain, states)
        # Unnormalised probabilities: the race argmax(p / q) does not care about scale.
        w.sub_(w.amax(dim=-1, keepdim=True)).exp_()
        q = _exponential(w.shape, [states[r].generator for r in plain], device)
        tokens[_index(plain, device)] = w.div_(q).argmax(dim=-1)

    # Filtered rows: widen the candidate window until the filter provably drops everything
    # outside it. A row is first tried at the narrowest window that holds its top-k.
    pending = [r for r in rows if _is_filtered(states[r].params, vocab)]
    for width in [w for w in _CANDIDATE_WIDTHS if w < vocab] + [vocab]:
        here = [r for r in pending if _top_k_or_one(states[r].params, vocab) <= width]
        if not here:
            continue
        chosen, resolved = _sample_window(
            _tempered(x, here, states), [states[r] for r in here], width
        )
        done = [r for r, ok in zip(here, resolved, strict=True) if ok]
        if done:
            tokens[_index(done, device)] = chosen
        finished = set(done)
        pending = [r for r in pending if r not in finished]


def _sample_window(
    x: torch.Tensor, states: Sequence[SamplingState], width: int
) -> tuple[torch.Tensor, list[bool]]:
    """Apply top-k, top-p and min-p to the ``width`` best candidates of each row of ``x``.

    ``x`` is [m, vocab] tempered logits (a private copy, overwritten here), each row's top-k at
    most ``width``. A row is resolved when its kept set provably lies inside the window; only
    resolved rows are sampled (and only they draw from their generator). Returns
    ([number resolved] token ids, resolved per row).
    """
    device = x.device
    vocab = x.shape[1]
    params = [s.params for s in states]
    if width < vocab:
        vals, idx = x.topk(width, dim=-1)  # [m, width], largest first
    else:
        vals, idx = x.sort(dim=-1, descending=True)

    top_k = torch.tensor([_top_k(p, vocab) for p in params], device=device)
    top_k_active = top_k < vocab  # [m]
    in_top_k = torch.arange(width, device=device)[None, :] < top_k[:, None]  # [m, width]
    vals = vals.masked_fill(~in_top_k, float("-inf"))

    # Top-p renormalises after top-k: over the top-k set when it is active (it lies inside the
    # window), else over the whole row, which the window may not cover.
    lse = vals.logsumexp(dim=-1)  # [m]
    whole = [k for k, p in enumerate(params) if p.top_p < 1.0 and _top_k(p, vocab) == vocab]
    if whole and width < vocab:
        if len(whole) == len(params):
            rows, row_max = x, vals[:, :1]
        else:
            w_idx = _index(whole, device)
            rows, row_max = x.index_select(0, w_idx), vals.index_select(0, w_idx)[:, :1]
        # log sum exp over the whole row, in place: x is not needed after topk.
        row_lse = row_max[:, 0] + rows.sub_(row_max).exp_().sum(dim=-1).log_()
        if len(whole) == len(params):
            lse = row_lse
        else:
            lse[w_idx] = row_lse
    probs = torch.exp(vals - lse[:, None])  # [m, width]
    cum = probs.cumsum(dim=-1)

    # Disabled filters get neutral thresholds: top_p = inf keeps all (a cumsum that rounds past
    # 1.0 must not drop the tail), min_p = 0 keeps all.
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device
    )
    min_p = torch.tensor([p.min_p for p in params], device=device)
    floor = min_p * probs[:, 0]  # min-p threshold relative to the most likely token, [m]
    # A token stays if the mass strictly before it is below top_p (so the first always stays).
    keep = in_top_k & (cum - probs < top_p[:, None]) & (probs >= floor[:, None])

    if width == vocab:
        resolved = [True] * len(params)
    else:
        # Everything past the window is dropped if top-k already cut inside it, if the window's
        # mass reaches top_p, or if the window's last (largest left-out) prob is below min-p.
        res = top_k_active | (cum[:, -1] >= top_p) | (probs[:, -1] < floor)
        resolved = res.tolist()
    done = [k for k, ok in enumerate(resolved) if ok]
    if not done:
        return torch.empty(0, dtype=torch.long, device=device), resolved
    d_idx = _index(done, device)
    weights = probs.index_select(0, d_idx).masked_fill_(~keep.index_select(0, d_idx), 0.0)
    q = _exponential(weights.shape, [states[k].generator for k in done], device)
    choice = weights.div_(q).argmax(dim=-1, keepdim=True)  # [d, 1] position in the window
    return idx.index_select(0, d_idx).gather(1, choice)[:, 0], resolved


def _exponential(
    shape: torch.Size, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise of ``shape`` [rows, n]; row i drawn from ``generators[i]`` when set.

    Drawn as ``-log(u)`` with ``u ~ U[0, 1)`` (several times faster than ``exponential_`` on
    CPU). ``u == 0`` gives ``+inf``, a score of 0 for that token, never a division by zero.
    """
    u = torch.empty(shape, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        u.uniform_()
    else:
        for i, g in enumerate(generators):
            if g is not None:
                u[i].uniform_(generator=g)  # a seeded row's draws depend on nothing else
        if unseeded:
            u[_index(unseeded, device)] = torch.empty(
                len(unseeded), shape[1], device=device
            ).uniform_()
    return u.log_().neg_()


def _fill_logprobs(
    raw_logprobs: torch.Tensor,
    rows: Sequence[int],
    states: Sequence[SamplingState],
    tokens: torch.Tensor,
    token_ids: Sequence[int],
    out: list[TokenLogprobs | None],
) -> None:
    """Fill ``out[rows]`` from ``raw_logprobs`` [len(rows), vocab] and the chosen ``tokens``."""
    device = raw_logprobs.device
    chosen = tokens.index_select(0, _index(rows, device))[:, None]  # [L, 1]
    chosen_lp: list[float] = raw_logprobs.gather(1, chosen)[:, 0].tolist()
    ks = [states[i].params.logprobs or 0 for i in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lps: list[list[float]] = [[] for _ in rows]
    if max(ks) > 0:
        values, indices = raw_logprobs.topk(max(ks), dim=-1)  # sorted, most likely first
        top_ids, top_lps = indices.tolist(), values.tolist()
    for j, (i, k) in enumerate(zip(rows, ks, strict=True)):
        top = tuple(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
        out[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen_lp[j], top_logprobs=top)
