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


def test_neighbours_lend_a_chunk_support(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chunks the query matches equally: the one whose neighbour in its file matches
    too comes first; chunks of other files, or not next to it, lend nothing."""
    monkeypatch.setattr(retrieval, "NEIGHBOUR_WEIGHT", 0.1)  # off by default
    index = HybridIndex(2)
    keys = ["b#0", "b#1", "a#0", "a#1", "a#5"]  # alone, b#1 would rank before a#1
    vectors = np.array([[0, 1], [0.9, 0.1], [1, 0], [0.9, 0.1], [0, 1]], dtype=np.float32)
    index.add(keys, [["x"]] * 5, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    hits = index.search([], np.array([1, 0], dtype=np.float32), 5, mode="dense")
    # a#1 and b#1 match equally; a#1's neighbour a#0 is the best match, b#1's nothing.
    assert [h.key for h in hits[:3]] == ["a#0", "a#1", "b#1"]
    assert all(0 < h.score <= 1 for h in hits)


def _unit(*rows: list[float]) -> np.ndarray:
    v = np.array(rows, dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_a_paragraph_lifts_its_chunk_by_half_its_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's dense score is its whole vector's cosine, or the mean of that and its best
    paragraph's where that is higher: an item that matches lifts its article above one that
    matches a little better as a whole, but an item alone does not outrank a whole match."""
    monkeypatch.setattr(retrieval, "NEIGHBOUR_WEIGHT", 0.0)
    index = HybridIndex(2)
    q = np.array([1, 0], dtype=np.float32)
    # law#0 as a whole: cos 0.6; its second paragraph: cos 1.0 -> 0.8.
    # law#1 as a whole: cos 0.7 and no paragraphs -> 0.7.
    # law#2 as a whole: cos 0.9; a paragraph at 0.2 never lowers it -> 0.9.
    index.add(
        ["law#0", "law#1", "law#2"],
        [["x"]] * 3,
        [_unit([0.6, 0.8], [0, 1], [1, 0]), _unit([0.7, 0.714]), _unit([0.9, 0.436], [0.2, 0.98])],
    )
    assert np.allclose(index._dense_scores(q), [0.8, 0.7, 0.9], atol=1e-3)
    assert [h.key for h in index.search([], q, 3, mode="dense")] == ["law#2", "law#0", "law#1"]
    # Flat rows as the store reads them back are the same entry.
    flat = HybridIndex(2)
    flat.add(["law#0"], [["x"]], [_unit([0.6, 0.8], [0, 1], [1, 0]).reshape(-1)])
    assert np.allclose(flat._dense_scores(q), [0.8], atol=1e-3)


def test_removing_entries_keeps_each_ones_own_paragraphs() -> None:
    """Removal renumbers rows: every entry left keeps exactly its own vectors."""
    rng = np.random.default_rng(0)
    index = HybridIndex(4)
    vectors = [_unit(*rng.normal(size=(n, 4)).tolist()) for n in (1, 3, 2, 1, 4)]
    keys = [f"f{i % 2}#{i}" for i in range(5)]
    index.add(keys, [["x"]] * 5, vectors)
    index.remove({"f1#1"})
    index.remove_files({"f0"})  # f0#0, f0#2, f0#4
    index.add(["g#0"], [["y"]], [vectors[4]])
    q = _unit(rng.normal(size=4).tolist())[0]
    left = {"f1#3": vectors[3], "g#0": vectors[4]}
    for key, got in zip(index._keys, index._dense_scores(q), strict=True):
        rows = left[key] @ q
        want = rows[0] if len(rows) == 1 else max(rows[0], (rows[0] + rows[1:].max()) / 2)
        assert got == pytest.approx(want, abs=1e-6)
    assert len(index._vectors) == 5 and sorted(index._keys) == ["f1#3", "g#0"]


def test_paragraph_texts_carry_the_heading_and_the_lead_in() -> None:
    from kvgate.retrieval.chunking import chunk_auto

    text = (
        "# 劳动合同法\n\n## 第四章 劳动合同的解除和终止\n\n"
        "第四十二条 劳动者有下列情形之一的，用人单位不得解除劳动合同：\n\n"
        "（一）从事接触职业病危害作业的；\n\n（二）在孕期、产期、哺乳期的。\n\n"
        "第四十三条 用人单位单方解除劳动合同，应当事先将理由通知工会。\n"
    )
    chunks = chunk_auto(text, len)
    by_label = {c.section[-1]: c for c in chunks}
    pieces = retrieval.piece_texts("劳动合同法", by_label["第四十二条"])
    assert len(pieces) == 2
    assert pieces[1].splitlines() == [
        by_label["第四十二条"].section_path,
        "第四十二条 劳动者有下列情形之一的，用人单位不得解除劳动合同：",
        "（二）在孕期、产期、哺乳期的。",
    ]
    assert retrieval.piece_texts("劳动合同法", by_label["第四十三条"]) == []  # one paragraph


class _CountingEmbedder:
    dim = 2

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def passages(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        return np.array([[len(t), i] for i, t in enumerate(texts)], dtype=np.float32)


def test_chunk_vectors_embed_wholes_and_paragraphs_in_one_call() -> None:
    from kvgate.retrieval.chunking import Chunk

    one = Chunk("第一条 总则。", 0, 7, ("第一条",))
    two = Chunk("第二条 下列：\n\n（一）甲；\n\n（二）乙。", 8, 30, ("第二条",))
    embedder = _CountingEmbedder()
    out = retrieval.chunk_vectors(embedder, "法", [two, one])  # type: ignore[arg-type]
    assert len(embedder.calls) == 1 and len(embedder.calls[0]) == 4
    assert [v.shape for v in out] == [(3, 2), (1, 2)]
    assert out[0][:, 1].tolist() == [0, 2, 3] and out[1][:, 1].tolist() == [1]
    flat = retrieval.chunk_vectors(embedder, "法", [two, one], paragraphs=False)  # type: ignore[arg-type]
    assert [v.shape for v in flat] == [(1, 2), (1, 2)]
