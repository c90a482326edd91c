"""A SentencePiece BPE vocabulary as GGUF stores it (``tokenizer.ggml.model == "llama"``), rebuilt
as a ``tokenizers`` BPE model.

GGUF keeps SentencePiece's pieces (``▁`` for a space, ``<0xNN>`` byte tokens for byte fallback)
with scores and types, but no merges. SentencePiece BPE merges, among the adjacent pairs, the one
whose result ranks highest; rank is the piece's position in the vocabulary (Gemma's scores do not
follow it, its order does, and for other SentencePiece BPE models the score is minus the
position anyway). So every split of a piece into two pieces of the vocabulary is a merge, ranked
by the merged piece's position: the same merges transformers derives for these files.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["spm_backend"]

_SPACE = "\u2581"
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def spm_backend(
    tokens: Sequence[str], token_types: Sequence[int] | None, unk_id: int | None
) -> BackendTokenizer:
    """The backend tokenizer of a GGUF SentencePiece vocabulary.

    Raises:
        ValueError: the vocabulary cannot make a BPE model (the loader names the file).
    """
    # Pieces of only spaces are stored with real spaces, but text reaches the model with spaces
    # already replaced by "▁" (the normalizer below): spell them the way they will be looked up.
    pieces = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    unk = pieces[unk_id] if unk_id is not None and 0 <= unk_id < len(pieces) else None
    try:
        bpe = models.BPE(
            vocab=vocab, merges=_merges(pieces, vocab), unk_token=unk, fuse_unk=True,
            byte_fallback=True,
        )  # fmt: skip
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ValueError(f"invalid SentencePiece vocabulary: {exc}") from exc
    backend = BackendTokenizer(bpe)
    # No prefix space: Gemma's files say add_space_prefix = false, and so do its tokenizers.
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    types = list(token_types) if token_types is not None else [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError("token_type and tokens differ in length")
    special = [
        AddedToken(pieces[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_TYPE_CONTROL
    ]
    # User-defined pieces ("\n\n", "<start_of_image>", HTML tags) match whole in raw text, as
    # llama.cpp matches them.
    user = [
        AddedToken(pieces[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _merges(pieces: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best first: by the merged piece's position, then
    (for the splits of one piece) the longer left part first, then the longer right part."""
    ranked: list[tuple[int, int, int, str, str]] = []
    for rank, piece in enumerate(pieces):
        if vocab.get(piece) != rank:  # a duplicate spelling: the first one counts
            continue
        splits = [
            (piece[:i], piece[i:]) for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]  # fmt: skip
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((rank, -len(left), -len(right), left, right) for left, right in splits)
    # Stable: splits of one piece with equal lengths keep their (left id, right id) order.
    ranked.sort(key=lambda m: m[:3])
    return [(left, right) for _, _, _, left, right in ranked]
