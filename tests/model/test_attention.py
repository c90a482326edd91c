"""The torch attention backend's prefill paths against plain causal attention (with the native
softmax or without, with bf16 matmuls or computed in float32 where those are slow)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvgate.model.attention as attention_module
from kvgate import LLM
from kvgate.model.attention import AttentionMetadata, PrefillSlice, TorchAttention
from kvgate.model.cpu_kernels import PagedDecodeKernel, load_paged_decode
from kvgate.model.kv_codec import KVCodec
from kvgate.sampling_params import SamplingParams
from kvgate.tokenizer import Tokenizer
from tests.model.isa import vector_levels

#: The levels whose builds run the native prefill (``prefill_bf16.h``): on AMX tiles, or with
#: vdpbf16ps on AVX-512 registers; an AMX machine tests both.
PREFILL_LEVELS = [lv for lv in vector_levels() if lv in ("amx", "avx512bf16")]
prefill_levels = pytest.mark.parametrize("level", PREFILL_LEVELS or ["none"])


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention in float64: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1),
        is_causal=True, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize("length", [200, 256, 257, 300, 512, 513, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_prompt_is_causal_attention_on_every_path(length: int, dtype: torch.dtype) -> None:
    """Up to 256 tokens: the short path; up to 512: its first 256 queries there and the
    rest as a chunk that sees them; beyond: SDPA whole. Each is causal attention."""
    heads, kv_heads, d = 9, 3, 64
    torch.manual_seed(length)
    q = torch.randn(length, heads, d).to(dtype)
    k = torch.randn(length, kv_heads, d).to(dtype)
    v = torch.randn(length, kv_heads, d).to(dtype)
    # The prompt sits after another sequence's rows in the flat batch.
    pad = 3
    qb, kb, vb = (torch.cat([torch.zeros(pad, *t.shape[1:], dtype=dtype), t]) for t in (q, k, v))
    p = PrefillSlice(pad, pad + length, start_pos=0, block_table=torch.zeros(1, dtype=torch.long))
    empty = torch.empty(0, dtype=dtype)
    exact = _causal(q, k, v)
    for kernel, upcast in ((None, False), (load_paged_decode(), False), (None, True)):
        attention = TorchAttention(heads, kv_heads, d, kernel, upcast=upcast)
        got = attention._prefill(qb, kb, vb, empty, empty, p)
        assert got.shape == (length, heads, d)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
        else:  # bf16 scores and probabilities on the short path: bf16-sized errors
            torch.testing.assert_close(got.double(), exact, atol=3e-2, rtol=3e-2)


def _tiles(level: str | None = None) -> PagedDecodeKernel:
    """The native prefill of the build for ``level`` (None: this CPU's default)."""
    kernel = None if level == "none" else load_paged_decode(level)
    if kernel is None or not kernel.prefills:
        pytest.skip("no AVX512-BF16 here: prefills stay on PyTorch's paths")
    return kernel


def _pool_step(
    lens: list[tuple[int, int]], kv_heads: int, d: int, bs: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """A bf16 pool holding every sequence's K/V (blocks scattered) and a step of one decode row
    then one slice per (start_pos, rows) of ``lens``: caches, block tables, metadata."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(start + rows) // bs) for start, rows in lens]
    num_blocks = sum(need) + 8
    order = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(kv_heads, num_blocks, bs, d, generator=g).bfloat16()
    v_cache = torch.randn(kv_heads, num_blocks, bs, d, generator=g).bfloat16()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n].clone())
        at += n
    slices, row = [], 1  # row 0: a decode of the first sequence's first key
    for (start, rows), table in zip(lens, tables, strict=True):
        slices.append(PrefillSlice(row, row + rows, start, table))
        row += rows
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decodes=1,
        decode_blocks=tables[0][:1].clone(),
        decode_lens=torch.tensor([1]),
        prefills=tuple(slices),
    )
    return k_cache, v_cache, tables, meta


def _context(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows a table points at: [n, Hkv, D]."""
    hkv, _, _, d = cache.shape
    return cache[:, table].reshape(hkv, -1, d)[:, :n].transpose(0, 1)


@prefill_levels
@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "bs"),
    [(9, 3, 64, 16), (12, 2, 128, 16), (4, 1, 256, 16), (8, 8, 32, 8), (6, 1, 64, 32)],
)
def test_tiled_prefill_is_causal_attention_over_the_pool(
    heads: int, kv_heads: int, d: int, bs: int, kv: str | None, level: str
) -> None:
    """Every slice of a step at once natively (AMX tiles or AVX-512 registers), reading K/V
    from scattered pool blocks: fresh prompts and chunks after cached context, lengths on and
    off the 16-row tiles and the 64-row work items, against exact causal attention of each
    row over its context (for int8 / fp8 rows: over the values ``KVCodec.decode`` gives)."""
    kernel = _tiles(level)
    lens = [(0, 1), (0, 15), (0, 17), (0, 64), (0, 65), (5, 3), (16, 33), (100, 200), (31, 1)]
    k_cache, v_cache, tables, meta = _pool_step(lens, kv_heads, d, bs, seed=heads * d)
    codec = None if kv is None else KVCodec(kv, torch.bfloat16)
    if codec is not None:  # the pool as stored, and the values a read of it gives
        k_cache, v_cache = codec.encode(k_cache), codec.encode(v_cache)
        k_vals, v_vals = codec.decode(k_cache, d), codec.decode(v_cache, d)
    else:
        k_vals, v_vals = k_cache, v_cache
    rows = 1 + sum(n for _, n in lens)
    q = torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(1)).bfloat16()
    attention = TorchAttention(heads, kv_heads, d, kernel, kv_dtype=torch.bfloat16, codec=codec)
    got = attention.attend(q, q, q, k_cache, v_cache, meta)
    assert attention._tiled_prefill(q, k_cache, v_cache, meta, None)[1] == []  # all on tiles
    for p, table in zip(meta.prefills, tables, strict=True):
        keys = _context(k_vals, table, p.context_len)
        values = _context(v_vals, table, p.context_len)
        lq = p.token_end - p.token_start
        # row i sees keys 0 .. start_pos + i: the last lq rows of a causal square
        full_q = torch.cat([torch.zeros(p.start_pos, heads, d), q[p.token_start : p.token_end]])
        exact = _causal(full_q, keys, values)[p.start_pos :]
        assert exact.shape[0] == lq
        # bf16 probabilities and one bf16 rounding of the output
        torch.testing.assert_close(
            got[p.token_start : p.token_end].double(), exact, atol=2e-2, rtol=2e-2
        )
    # the decode row: the decode kernel's, untouched
    assert torch.equal(got[:1], attention._decode(q[:1], k_cache, v_cache, meta))


@prefill_levels
def test_a_tiled_prefill_row_does_not_depend_on_its_chunk_or_its_batch(
    monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """A prompt's rows come out bit-identical whole, in chunks of any size after cached
    context, or next to other prompts, also next to one the tiles leave to PyTorch: each
    row reads only its own q and causal keys."""
    kernel = _tiles(level)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    k_cache, v_cache, tables, _ = _pool_step([(0, 150), (150, 50)], kv_heads, d, bs, seed=7)
    q = torch.randn(150, heads, d, generator=torch.Generator().manual_seed(2)).bfloat16()
    attention = TorchAttention(heads, kv_heads, d, kernel, kv_dtype=torch.bfloat16)

    def step(parts: list[tuple[int, int]], lead: int) -> torch.Tensor:
        """Rows start..start+n of the prompt as slices after `lead` rows of another prompt."""
        other = PrefillSlice(0, lead, 0, tables[0]) if lead else None
        slices, row, qs = ([other] if other else []), lead, [q[:lead]]
        for start, n in parts:
            slices.append(PrefillSlice(row, row + n, start, tables[0]))
            qs.append(q[start : start + n])
            row += n
        empty = torch.empty(0, dtype=torch.long)
        meta = AttentionMetadata(empty, 0, empty, empty, tuple(slices))
        return attention.attend(torch.cat(qs), q, q, k_cache, v_cache, meta)[lead:]

    whole = step([(0, 150)], 0)
    chunked = torch.cat([step([(0, 37)], 0), step([(37, 16)], 0), step([(53, 97)], 5)])
    assert torch.equal(whole, chunked)
    # two chunks of the same prompt in one step (as a speculative verify would not, but any
    # batch may), and the prompt behind another one
    assert torch.equal(whole, step([(0, 70), (70, 80)], 0))
    assert torch.equal(whole, step([(0, 150)], 33))

    # Beside a chunk whose context (200 keys) passes the limit: that chunk goes to PyTorch
    # (SDPA over its gathered context), the prompt's rows stay on the tiles, unchanged.
    for limit in ("_TILED_PREFILL_MAX", "_REGISTERS_PREFILL_MAX"):
        monkeypatch.setattr(attention_module, limit, 150 * d)
    long_q = torch.randn(50, heads, d, generator=torch.Generator().manual_seed(3)).bfloat16()
    long = PrefillSlice(0, 50, 150, tables[1])
    empty = torch.empty(0, dtype=torch.long)
    meta = AttentionMetadata(empty, 0, empty, empty, (long, PrefillSlice(50, 200, 0, tables[0])))
    both_q = torch.cat([long_q, q])
    assert attention._tiled_prefill(both_q, k_cache, v_cache, meta, None)[1] == [long]
    both = attention.attend(both_q, both_q, both_q, k_cache, v_cache, meta)
    assert torch.equal(both[50:], whole)
    alone = AttentionMetadata(empty, 0, empty, empty, (long,))
    assert torch.equal(both[:50], attention.attend(long_q, q, q, k_cache, v_cache, alone))
    for limit in ("_TILED_PREFILL_MAX", "_REGISTERS_PREFILL_MAX"):
        monkeypatch.setattr(attention_module, limit, 0)
    assert torch.equal(both[:50], attention.attend(long_q, q, q, k_cache, v_cache, alone))


def test_a_prompt_scheduled_otherwise_gives_bit_identical_logprobs_on_tiles(
    tmp_path: Path, smollm2_tokenizer: Tokenizer
) -> None:
    """With prefill attention on tiles and batch-invariant linears, nothing in a prompt
    token's computation depends on the schedule: its prompt whole, in chunks of 16 next to
    other prompts, or continued from a prefix-cache hit gives the same logprobs bit for bit
    (bf16, a 64-wide head the tiles take)."""
    _tiles()
    from tests.tiny_model import build_tiny_llama

    directory = build_tiny_llama(tmp_path / "llama", smollm2_tokenizer, head_dim=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (23, 70, 150)]
    prompts.append(prompts[2] + prompts[0])  # a prefix hit of 144 tokens, then 23 more
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5)

    def run(llm: LLM, batch: list[list[int]]) -> list[tuple[object, ...]]:
        return [(o.token_ids, o.logprobs) for o in llm.generate(batch, params)]

    whole = LLM(str(directory), dtype="bfloat16", enable_prefix_caching=False)
    want = [run(whole, [p])[0] for p in prompts]
    chunked = LLM(str(directory), dtype="bfloat16", max_num_batched_tokens=16)
    assert run(chunked, prompts[:3]) == want[:3]
    hit = chunked.generate([prompts[3]], params)[0]
    assert hit.num_cached_tokens >= 144
    assert (hit.token_ids, hit.logprobs) == want[3]
