"""The strict reader (``retrieval/grading.py``): verdicts, quantities read as numbers with
their units, and wording without punctuation, on answers a model might write."""

from __future__ import annotations

import pytest

from kvgate.retrieval.grading import (
    Quantity,
    chinese_number,
    grade,
    holds_article,
    opens_with_verdict,
    quantities,
    verdict,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [("十", 10), ("十五", 15), ("三十六", 36), ("一百零五", 105), ("五百", 500),
     ("二十万", 200_000), ("一〇五", 105), ("两", 2), ("十二", 12), ("第", None), ("", None)],
)  # fmt: skip
def test_chinese_numerals_read_as_numbers(text: str, value: int | None) -> None:
    assert chinese_number(text) == value


def test_quantities_are_normalized_and_ordinals_and_rates_are_not_quantities() -> None:
    assert quantities("十五天内") == [Quantity(15, "日")]
    assert quantities("15日内") == [Quantity(15, "日")]
    wage = quantities("离职前十二个月平均工资的百分之三十")
    assert wage == [Quantity(12, "月"), Quantity(30, "%")]
    assert quantities("最高不得超过５万元") == [Quantity(50_000, "元")]
    assert quantities("应当双倍返还定金") == [Quantity(2, "倍")]
    assert quantities("依照第四十二条，每月不得超过三十六小时") == [Quantity(36, "小时")]
    assert quantities("两个月") == [Quantity(2, "月")]
    assert quantities("本法第十条") == []


def test_the_first_verdict_word_of_the_first_clause_decides() -> None:
    assert verdict("不可以，因为……") is False
    assert verdict("可以。根据第十条") is True
    assert verdict("根据规定，用人单位不得解除") is None  # the first clause gives none
    assert verdict("用人单位不得以此为由解除劳动合同。") is False
    assert verdict("**不能**。") is False
    assert opens_with_verdict("不得约定试用期") is False
    assert opens_with_verdict("不得超过二个月") is None  # a limit: its number is the answer
    assert opens_with_verdict("应当双倍返还定金") is None


@pytest.mark.parametrize(
    ("answer", "correct"),
    [
        ("不能。该职工在本单位连续工作满十五年，且距法定退休年龄不足五年，依据第四十二条"
         "用人单位不得依照第四十条的规定解除劳动合同。", True),
        ("不能以此为由辞退他，但理由是他工作满16年。", False),  # 15 years, 5 years missing
        ("可以解除，但需提前三十日通知。", False),  # the wrong verdict
    ],
)  # fmt: skip
def test_a_verdict_with_quantities(answer: str, correct: bool) -> None:
    gold = "不能（连续工作满十五年且距法定退休年龄不足五年）"
    assert grade(answer, gold).correct is correct


def test_quantities_must_all_appear_with_their_units() -> None:
    gold = "离职前十二个月平均工资的30%按月支付"
    assert grade("按离职前12个月平均工资的百分之三十按月支付经济补偿。", gold).correct
    got = grade("按离职前12个月平均工资的一半按月支付。", gold)
    assert not got.correct and got.missing == ("30%",)
    assert grade("应在十五天内办理转移手续", "十五日内").correct
    assert not grade("应在十五个月内办理", "十五日内").correct


def test_wording_is_compared_without_punctuation_or_the_span_may_stand_in() -> None:
    gold, span = "对公司债务承担连带责任", "股东应当对公司债务承担连带责任"
    assert grade("股东应当对公司债务承担连带责任。", gold, span).correct
    assert grade("应当对公司债务，承担连带责任", gold, span).correct
    assert not grade("股东对公司债务不承担责任", gold, span).correct


def test_a_passage_holds_an_article_by_its_heading_or_most_of_its_text() -> None:
    evidence = "第十九条 劳动合同期限三个月以上不满一年的，试用期不得超过一个月；劳动合同期限"
    assert holds_article("（节）\n第十九条 劳动合同期限……", "第十九条", evidence)
    # not a passage that only mentions it
    assert not holds_article("依照本法第十九条的规定", "第十九条", evidence)
    # a window holding the article's middle without its heading
    middle = "……试用期不得超过一个月；劳动合同期限一年以上不满三年的"
    assert holds_article("前文" + evidence[4:] + "后文", "第十九条", evidence)
    assert not holds_article(middle[:10], "第十九条", evidence)
