"""rewrite_query's rule: the framing goes, the content stays."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.retrieval.query import rewrite


def test_the_framing_goes_and_the_content_stays() -> None:
    assert rewrite("请问工作满十年的职工一年能休几天年假？") == "工作满十年的职工一年能休几天年假"
    assert rewrite("我想知道，试用期最长是多少？") == "试用期最长"
    assert rewrite("用人单位可以随意解除劳动合同吗？") == "用人单位可以随意解除劳动合同"
    english = "What is the notice period for termination?"
    assert rewrite(english) == "the notice period for termination"
    assert rewrite("什么？") == "什么？"  # nothing would be left: searched as it was


@given(st.text(min_size=1).filter(str.strip))
def test_never_empty(query: str) -> None:
    assert rewrite(query).strip()
