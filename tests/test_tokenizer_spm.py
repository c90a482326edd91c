"""The SentencePiece rebuild on a vocabulary small enough to reason about by hand (the real
one, Gemma's 262k pieces, is checked against transformers in tests/e2e/test_gemma3_270m.py)."""

from __future__ import annotations

from kvgate.tokenizer import Tokenizer
from kvgate.tokenizer_spm import spm_backend

# Control pieces, byte pieces for 0x00-0xFF, then merges' results in rank order.
_PIECES = (
    ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
    + [f"<0x{b:02X}>" for b in range(256)]
    + ["\u2581", "a", "b", "c", "ab", "\u2581ab", "bc", "abc", "  "]
)
_TYPES = [3] * 5 + [6] * 256 + [1] * 9


def _tok() -> Tokenizer:
    backend = spm_backend(_PIECES, _TYPES, unk_id=3)
    return Tokenizer(backend, bos_token_id=2, eos_token_id=1, add_bos_token=True)


def test_merges_follow_vocabulary_order() -> None:
    tok = _tok()
    ids = tok.encode("abc ab", add_special_tokens=False)
    # "ab" (rank 4) merges before "bc" (rank 6), then "abc" from "ab" + "c"; " ab" is one piece.
    assert [_PIECES[i] for i in ids] == ["abc", "\u2581ab"]
    assert tok.decode(ids) == "abc ab"


def test_unknown_characters_fall_back_to_bytes_and_decode_back() -> None:
    tok = _tok()
    ids = tok.encode("a\u00e9", add_special_tokens=False)
    assert [_PIECES[i] for i in ids] == ["a", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "a\u00e9"
    assert tok.token_bytes(ids[1]) == b"\xc3"


def test_space_only_pieces_are_respelled_and_control_pieces_stay_whole() -> None:
    tok = _tok()
    ids = tok.encode("<start_of_turn>  a")
    assert ids[:2] == [2, 4]  # BOS, then the control piece whole
    assert [_PIECES[i] for i in ids[2:]] == ["  ", "a"]
    assert tok.decode(ids) == "  a"
