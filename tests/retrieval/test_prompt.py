"""Sources into the prompt (position-aware, labelled, fitted) and citations back out."""

from __future__ import annotations

from kvgate.retrieval.prompt import arrange, citations, fit, sources_block
from kvgate.retrieval.service import SearchResult


def _r(i: int, text: str = "x") -> SearchResult:
    return SearchResult(f"file-{i}", f"f{i}.md", 1.0 / (i + 1), text, {"section": f"S{i}"})


def test_the_best_sources_go_to_the_ends() -> None:
    order = [s.label for s in arrange([_r(i) for i in range(6)])]
    assert order == [1, 3, 5, 6, 4, 2]
    block = sources_block(arrange([_r(0, "第一条 内容"), _r(1)]))
    assert "[1] (f0.md) S0\n第一条 内容" in block and block.index("[1]") < block.index("[2]")


def test_fit_takes_the_widest_choice_that_fits_and_drops_from_the_bottom() -> None:
    wide, narrow = _r(0, "w" * 300), _r(0, "n" * 50)
    kept, dropped = fit([[wide, narrow], [_r(1, "y" * 50)], [_r(2, "z" * 500)]], len, 200)
    assert kept == [narrow, _r(1, "y" * 50)] and dropped == 1
    assert fit([[_r(0, "a" * 500)]], len, 100) == ([], 1)


def test_citations_follow_the_labels() -> None:
    results = [_r(0), _r(1)]
    text = "Ten days [2], see also [1] and [9]."
    got = citations(text, results)
    assert [(c["file_id"], c["index"]) for c in got] == [
        ("file-1", text.index("[2]") + 3), ("file-0", text.index("[1]") + 3),
    ]  # fmt: skip
    # A text that cites nothing points at the best source, at its end.
    assert citations("No labels.", results) == [
        {"type": "file_citation", "index": 10, "file_id": "file-0", "filename": "f0.md"}
    ]
