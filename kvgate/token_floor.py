"""The fewest tokens a text can encode to, bounded from the vocabulary alone, without
tokenizing it: the server's size gate for prompts (``server/door.py``).

A bound by the longest token (81 characters for SmolLM2) lets text of about one token per
character (Chinese, digits, symbols) pass at 160 times the context: 1.33 M characters were
tokenized whole, seconds of CPU per request. This one weighs each character by the longest
token that holds it, so every script is bounded by its own tokens.

Why it is a lower bound. ``L(c)`` is the length, in characters, of the longest vocabulary
token whose text holds the character ``c`` whole (1 for a character no token holds whole:
it is spelled in byte tokens). Give each character of a text to the token that holds its
first byte. A token of ``n`` whole characters gets those, each with ``L(c) >= n``, so
``sum 1 / L(c) <= 1`` over them, and at most one more character that it only begins (its
last bytes in the next token), worth at most 1. So every token carries at most 2 of the
text's weight ``W = sum 1 / L(c)``, and the text has at least ``W / 2`` tokens. Normalizers
that merge characters (NFC composing an accent) could shrink a text before it is split: a
further factor of 2 covers them, as the old bound's did. ``tokens >= W / 4``.

Measured (AMD EPYC, 2026-12-03), actual tokens over ``W``: SmolLM2 1.8 on Chinese law text,
4.5 on English, 1.0 on digits; Gemma 3 2.6, 4.7 and 12. Weighing 1.32 M Chinese characters
whole takes 61 ms (numpy over their code points): the gate stops once the bound passes the
context, and weighs only prompts longer than 4 x the context in characters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

#: See the module docstring: 2 for a character a token only begins, 2 for normalizers.
SLACK = 4
#: Characters weighed at a time (a 256 KiB buffer of code points).
PIECE = 65536


class TokenFloor:
    """``tokens(texts)``: a number of tokens that the texts, encoded one by one, have at
    least (ignoring special tokens a template adds: those only add)."""

    def __init__(self, longest: dict[str, int], dropped: Iterable[str] = ()) -> None:
        """``longest``: for each character, the longest token text (in characters) holding
        it whole; characters missing weigh 1. ``dropped``: characters the tokenizer drops,
        weighing 0 (SmolLM2's vocabulary has no token for 6 C0 controls: "\\x16" encodes to
        no token, and weighed 1 it broke the bound)."""
        dropped = list(dropped)
        top = max((ord(c) for c in [*longest, *dropped]), default=0) + 1
        # weight[cp] = 1 / L(cp); the last entry, 1.0, stands for every code point past top.
        weight = np.ones(top + 1, dtype=np.float64)
        for c, n in longest.items():
            weight[ord(c)] = 1.0 / n
        for c in dropped:
            weight[ord(c)] = 0.0
        self._weight: npt.NDArray[np.float64] = weight

    @classmethod
    def from_vocab(
        cls, size: int, token_bytes: Callable[[int], bytes], dropped: Iterable[str] = ()
    ) -> TokenFloor:
        """From each token's bytes (ids 0 .. size-1); a token's partial UTF-8 characters
        (its first or last bytes of a character it shares with a neighbour) are not its own
        (the proof above counts them)."""
        longest: dict[str, int] = {}
        for i in range(size):
            text = token_bytes(i).decode("utf-8", errors="ignore")
            n = len(text)
            for c in set(text):
                if longest.get(c, 0) < n:
                    longest[c] = n
        return cls(longest, dropped)

    def weight(self, text: str, stop_above: float = math.inf) -> float:
        """``W`` of one text: the sum of its characters' weights; weighed a piece at a time,
        and no further once past ``stop_above`` (what it returns is still a lower bound)."""
        total = 0.0
        for start in range(0, len(text), PIECE):
            piece = text[start : start + PIECE].encode("utf-32-le", errors="surrogatepass")
            cps = np.frombuffer(piece, dtype=np.uint32)
            total += float(self._weight[np.minimum(cps, len(self._weight) - 1)].sum())
            if total > stop_above:
                break
        return total

    def tokens(self, texts: Iterable[str], stop_above: int | None = None) -> int:
        """At least this many tokens, over all the texts (each encoded on its own). With
        ``stop_above``, weighing stops once the bound passes it: a 1.32 M-character Chinese
        prompt took 61 ms to weigh whole, of the event loop's time, for a context of 8192."""
        limit = math.inf if stop_above is None else (stop_above + 1) * SLACK
        total = 0.0
        for text in texts:
            total += self.weight(text, limit - total)
            if total > limit:
                break
        return int(total / SLACK)
