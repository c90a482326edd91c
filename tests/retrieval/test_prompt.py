"""Sources into the prompt (position-aware, labelled, fitted) and citations back out."""

from __future__ import annotations

from kvgate.retrieval.prompt import arrange, citations, cited, fit, sources_block
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


def test_an_unlabelled_answer_is_attributed_to_the_source_it_names_or_copies() -> None:
    results = [
        _r(0, "第四十条 有下列情形之一的，用人单位提前三十日以书面形式通知劳动者本人"),
        _r(1, "第五十条 用人单位应当在十五日内为劳动者办理档案和社会保险关系转移手续。"),
        _r(2, "第四十一条 延长工作时间每日不得超过三小时，但是每月不得超过三十六小时。"),
    ]
    # named: the source its article heads, though it copies nothing
    named = "依照第四十一条，最多36小时。"
    assert cited(named, results) == [(2, len(named))]
    # copied: the source sharing the most runs of characters, not the best-ranked one
    text = "公司应当在十五日内为劳动者办理社会保险关系转移手续。"
    assert cited(text, results) == [(1, len(text))]
    assert citations(text, results)[0]["file_id"] == "file-1"
    # a copied phrase wins over a (misnumbered) article name
    misnamed = "依照第四十一条，用人单位应当在十五日内为劳动者办理档案和社会保险关系转移手续。"
    assert cited(misnamed, results) == [(1, len(misnamed))]
    # a label wins over both; an answer that neither names nor copies cites nothing
    assert cited("见[1]，第四十一条", results) == [(0, 4)]
    assert cited("不知道。", results) == []
    assert citations("不知道。", results)[0]["file_id"] == "file-0"  # the last resort


def test_a_label_under_another_sources_words_points_at_the_source_quoted() -> None:
    results = [
        _r(0, "第三十八条 用人单位应当保证劳动者每周至少休息一日。"),
        _r(1, "第三十九条 企业因生产特点不能实行本法第三十六条的规定的，可以实行其他办法。"),
        _r(2, "第三十六条 国家实行劳动者每日工作时间不超过八小时的工时制度。"),
    ]  # fmt: skip
    # the label closes a sentence copied from [1]: it points at [1]
    closes = "每周至少休息一日。用人单位应当保证劳动者每周至少休息一日。[3]"
    assert cited(closes, results) == [(0, len(closes))]
    # the label stands inside the sentence it cites
    inside = "根据[3]的规定，用人单位应当保证劳动者每周至少休息一日。"
    assert cited(inside, results) == [(0, inside.index("]") + 1)]
    # a sentence that copies its own label's source, or nothing much, keeps the label
    own = "国家实行劳动者每日工作时间不超过八小时[3]，且每周至少休息一日。"
    assert cited(own, results) == [(2, own.index("]") + 1)]
    assert cited("答案见[2]。", results) == [(1, 6)]


def test_which_sentence_a_label_cites() -> None:
    results = [
        _r(0, "第三十八条 用人单位应当保证劳动者每周至少休息一日。"),
        _r(1, "第三十六条 国家实行劳动者每日工作时间不超过八小时的工时制度。"),
    ]
    # at the start of a line, a label opens the sentence after it, not the line above
    opens = "国家实行劳动者每日工作时间不超过八小时。\n[1] 用人单位应当保证劳动者每周休息一日。"
    assert cited(opens, results) == [(0, opens.index("]") + 1)]
    # the second of two labels after a stop closes the same sentence as the first
    pair = "用人单位应当保证劳动者每周至少休息一日。[1][2]国家实行……"
    assert [i for i, _ in cited(pair, results)] == [0, 0]
    # English: a full stop ends a sentence, and runs are of three words
    en = [
        _r(0, "Orders are shipped within two business days of payment."),
        _r(1, "You may return an unused item within 30 days of delivery for a full refund."),
    ]
    text = "Shipping takes two business days [1]. You may return an unused item within 30 days [1]."
    assert [i for i, _ in cited(text, en)] == [0, 1]


def test_labels_out_of_range_count_as_none_and_only_the_first_labels_are_checked() -> None:
    results = [
        _r(0, "第五十条 用人单位应当在十五日内为劳动者办理档案和社会保险关系转移手续。"),
        _r(1, "第三十八条 用人单位应当保证劳动者每周至少休息一日。"),
    ]
    # a made-up label [7]: the text is attributed as if it had none
    made_up = "用人单位应当在十五日内为劳动者办理档案和社会保险关系转移手续[7]。"
    assert cited(made_up, results) == [(0, len(made_up))]
    # a looping answer: labels past the first 32 point where they say
    loop = "用人单位应当保证劳动者每周至少休息一日[1]。" * 40
    got = [i for i, _ in cited(loop, results)]
    assert got[:32] == [1] * 32 and got[32:] == [0] * 8
