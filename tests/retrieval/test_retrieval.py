"""The hybrid index on its own: fusion, modes, masks, scores, idempotent adds."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.retrieval import retrieval
from kvgate.retrieval.retrieval import HybridIndex, words

DOCS = {
    "law#0": "劳动者解除劳动合同，应当提前三十日以书面形式通知用人单位。",
    "law#1": "用人单位应当在十五日内为劳动者办理档案和社会保险关系转移手续。",
    "law#2": "职工累计工作已满十年不满二十年的，年休假十天。",
}


def _index() -> HybridIndex:
    index = HybridIndex(3)
    index.add(list(DOCS), [words(t) for t in DOCS.values()], np.eye(3, dtype=np.float32))
    return index


def test_each_ranking_and_their_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retrieval, "NEIGHBOUR_WEIGHT", 0.0)  # the fusion alone
    index = _index()
    q = words("社会保险关系转移要多少天")
    assert index.search(q, None, 3, mode="bm25")[0].key == "law#1"
    dense = np.array([0, 0, 1], dtype=np.float32)  # points at law#2
    assert index.search(q, dense, 3, mode="dense")[0].key == "law#2"
    hits = index.search(q, dense, 3)
    # First in one ranking each: the dense one counts twice BM25's.
    assert [h.key for h in hits[:2]] == ["law#2", "law#1"]
    assert all(0 < h.score <= 1 for h in hits)
    both = index.search(words("年休假十天"), dense, 1)[0]
    assert both.key == "law#2" and abs(both.score - 1.0) < 1e-9  # first in both rankings


def test_masks_removal_and_adding_twice() -> None:
    index = _index()
    q = words("社会保险关系转移")
    assert [h.key for h in index.search(q, None, 3, {"law#0"}, "bm25")] == []
    index.add(["law#1"], [words(DOCS["law#1"])], np.eye(3, dtype=np.float32)[1:2])
    assert len(index) == 3  # a key already there is not added again
    index.remove({"law#1"})
    assert "law#1" not in [h.key for h in index.search(q, np.ones(3, np.float32), 3)]
    assert HybridIndex(3).search(q, None, 3) == []


def test_neighbours_lend_a_chunk_support() -> None:
    """Two chunks the query matches equally: the one whose neighbour in its file matches
    too comes first; chunks of other files, or not next to it, lend nothing."""
    index = HybridIndex(2)
    keys = ["b#0", "b#1", "a#0", "a#1", "a#5"]  # alone, b#1 would rank before a#1
    vectors = np.array([[0, 1], [0.9, 0.1], [1, 0], [0.9, 0.1], [0, 1]], dtype=np.float32)
    index.add(keys, [["x"]] * 5, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    hits = index.search([], np.array([1, 0], dtype=np.float32), 5, mode="dense")
    # a#1 and b#1 match equally; a#1's neighbour a#0 is the best match, b#1's nothing.
    assert [h.key for h in hits[:3]] == ["a#0", "a#1", "b#1"]
    assert all(0 < h.score <= 1 for h in hits)
