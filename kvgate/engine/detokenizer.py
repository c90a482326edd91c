"""Incremental detokenization with stop strings, safe to stream.

Decoding keeps a small window of token ids (vLLM/TGI's prefix and read offsets): each append
decodes only the window, ``ids[prefix:]``, and emits what it adds to ``decode(ids[prefix:read])``.
The window's first tokens are context, so decoders that treat the first token specially
(Metaspace drops its leading space) do not touch the emitted text. The window starts on the
tail of the prompt; for byte-level BPE (SmolLM2, GPT-2, Llama 3) the text is then exactly
``decode(output_ids)``, since that decoder is a plain concatenation of bytes.

A window whose decode ends in U+FFFD may end inside a multi-byte character: it is held until
the character completes, and ``read`` normally moves only to a point where the decode ended on
a complete character. A complete character's lead byte can never continue an earlier sequence,
so such a point is a character boundary whatever came before it, and decoding from there on
gives the same characters as decoding the whole output.

A model can also emit bytes that never complete (a lead byte followed by a space, over and
over: Qwen2.5 does so on random-text prompts). Holding those until they complete would hold
the whole answer to its end, so the hold is bounded: a character still completable at the end
has at most 3 bytes, and every token that decodes to something on its own carries at least
one, so it starts within the last 3 such tokens. Everything before them is settled and is
sent (its replacement characters included) once the decode of the tokens before them is a
prefix of the window's decode: at most 3 tokens of delay, however long the invalid run.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

#: Prompt tokens kept as decoding context (vLLM uses 5 too).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into streamable text, one token at a time.

    Use: ``append`` each generated token, then ``take_delta(finished)`` for the text that is safe
    to send. The concatenation of all deltas is ``decode(output_ids)`` cut at the first stop
    string (see :attr:`matched_stop`); no delta ends inside a character or inside a possible
    stop string, except the final one (``finished=True``), which flushes everything.

    When several stop strings occur, the one whose first occurrence *ends* first wins (what a
    character-at-a-time stream would see first, so the result does not depend on how the text
    was split into tokens); among those ending at the same place, the one starting first.
    """

    def __init__(
        self,
        tokenizer_backend: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool,
        stop: Sequence[str],
        include_stop_str_in_output: bool,
    ) -> None:
        self._tokenizer = tokenizer_backend
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # While unfinished, hold back this many chars: the start of a stop string still arriving.
        self._holdback = max((len(s) for s in self._stop), default=1) - 1

        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its end is no boundary, so decode the output
            # on its own rather than glue the output's first bytes to the prompt's last ones.
            context, context_text = [], ""
        # Decode window: ids[:read] decoded to ``_prefix_text``; ids[read:] not yet emitted.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text = context_text

        self._sent: list[str] = []  # text already returned by take_delta
        self._unsent = ""  # decoded text not yet returned (the held-back tail lives here)
        self._tail = ""  # the last ``_holdback`` chars of all decoded text, for stop search
        self._matched_stop: str | None = None
        self._finished = False

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        return text

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, or ``None``."""
        return self._matched_stop

    @property
    def output_text(self) -> str:
        """All text decoded so far, cut at the stop string when one matched.

        Tokens that end inside a character are not in it until they complete or the output
        is finished.
        """
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]  # so repeated calls cost O(new text)
        return "".join(self._sent) + self._unsent

    def append(self, token_id: int) -> None:
        """Add one generated token. Ignored once a stop string matched."""
        if self._matched_stop is not None:
            return
        if self._finished:
            raise RuntimeError("append() after take_delta(finished=True)")
        self._ids.append(token_id)
        text = self._decode(self._ids)
        # Emit only when the window decodes to more text and does not end inside a character.
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
            self._slide(len(self._ids), text)
        elif len(self._ids) - self._read > 3 and text.endswith(_REPLACEMENT):
            self._settle(text)  # valid text never holds more than 3 tokens

    def _slide(self, end: int, text: str) -> None:
        """Emit ``text[len(prefix):]`` (the decode of ``ids[:end]``); the newly read tokens
        become the context for the next ones."""
        new_text = text[len(self._prefix_text) :]
        self._ids = self._ids[self._read :]
        self._read = end - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        self._add_text(new_text)

    def _settle(self, text: str) -> None:
        """Emit what lies before the last 3 tokens that decode to something, when the window
        ends in U+FFFD: no character still completable at the end starts before them."""
        end, carrying = len(self._ids), 0
        while end > self._read and carrying < 3:
            end -= 1
            carrying += self._decode([self._ids[end]]) != ""
        if carrying < 3 or end <= self._read:
            return
        settled = self._decode(self._ids[:end])
        if len(settled) > len(self._prefix_text) and text.startswith(settled):
            self._slide(end, settled)

    def _add_text(self, new_text: str) -> None:
        """Append decoded text, cutting it at the first stop string that completes in it."""
        if self._stop:
            window = self._tail + new_text
            best: tuple[int, int, str] | None = None  # (end, start, stop string)
            for stop in self._stop:
                # Only occurrences that end in the new text; older ones were found before.
                start = window.find(stop, max(0, len(self._tail) - len(stop) + 1))
                if start >= 0:
                    cand = (start + len(stop), start, stop)
                    best = cand if best is None or cand[:2] < best[:2] else best
            if best is not None:
                # The stop ending first wins (what a char-by-char stream would see first);
                # among those ending together, the one starting first.
                end, start, stop = best
                cut = end if self._include_stop else start
                # ``cut`` is at most ``_holdback`` chars before the new text, so it lies in
                # ``_unsent``: text already sent never contains part of a stop string.
                keep = len(self._unsent) - len(self._tail) + cut
                self._unsent = (self._unsent + new_text)[:keep]
                self._matched_stop = stop
                return
            self._tail = window[-self._holdback :] if self._holdback else ""
        self._unsent += new_text

    def take_delta(self, finished: bool) -> str:
        """The text that became safe to send since the last call.

        With ``finished=True`` everything left is returned, including tokens still waiting on
        an incomplete character (decoded as they are, with U+FFFD, so nothing is lost).
        """
        if finished and not self._finished and self._matched_stop is None:
            text = self._decode(self._ids)
            if len(text) > len(self._prefix_text):
                self._add_text(text[len(self._prefix_text) :])
            self._ids, self._read, self._prefix_text = [], 0, ""
        if finished:
            self._finished = True
        holdback = 0 if finished or self._matched_stop is not None else self._holdback
        n = len(self._unsent) - holdback
        if n <= 0:
            return ""
        delta, self._unsent = self._unsent[:n], self._unsent[n:]
        self._sent.append(delta)
        return delta
