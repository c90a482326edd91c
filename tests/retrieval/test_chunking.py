"""Chunking: exact offsets, the cap, structure (articles, headings, clauses), overlap."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.retrieval.chunking import Chunk, _heading, chunk_auto, chunk_static

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "longdoc" / "corpus"
ARTICLE = re.compile(r"(?m)^第[零〇一二三四五六七八九十百千]+条")


def _exact(text: str, chunks: list[Chunk]) -> None:
    for c in chunks:
        assert text[c.start : c.end] == c.text and c.text.strip() == c.text


def corpus_files() -> list[Path]:
    files = sorted(CORPUS.glob("*.md"))
    if not files:
        pytest.skip(f"the shared corpus is not at {CORPUS}")
    return files


@pytest.fixture(scope="module")
def e5_tokens():  # type: ignore[no-untyped-def]
    from kvgate.retrieval.retrieval import E5Embedder

    return E5Embedder().count_tokens


def test_every_article_of_every_law_starts_a_chunk_under_the_cap(e5_tokens) -> None:  # type: ignore[no-untyped-def]
    for path in corpus_files():
        text = path.read_text(encoding="utf-8")
        chunks = chunk_auto(text, e5_tokens, max_tokens=512, overlap_tokens=64)
        _exact(text, chunks)
        assert all(e5_tokens(c.text) <= 512 for c in chunks), path.name
        starts = {c.start for c in chunks}
        missing = [m.group() for m in ARTICLE.finditer(text) if m.start() not in starts]
        assert not missing, (path.name, missing[:3])


def test_the_section_path_of_a_civil_code_article() -> None:
    path = CORPUS / "minfadian.md"
    if not path.exists():
        pytest.skip("no shared corpus")
    text = path.read_text(encoding="utf-8")
    (chunk,) = [c for c in chunk_auto(text, len) if c.section[-1:] == ("第五百零九条",)]
    assert chunk.section_path == (
        "中华人民共和国民法典 / 第三编 合同 / 第一分编 通则 / 第四章 合同的履行 / 第五百零九条"
    )
    assert chunk.text.startswith("第五百零九条 当事人应当按照约定全面履行自己的义务。")
    assert "第五百一十条" not in chunk.text


def test_plain_text_law_headings_and_an_appendix() -> None:
    text = (
        "某某条例\n\n第一章 总则\n\n第一条 为了规范，制定本条例。\n\n第二条 本条例适用于全国。\n"
        "（一）甲；\n（二）乙。\n\n第二章 附则\n\n第三条 本条例自公布之日起施行。\n\n附录：\n\n"
        "一、禁忌从事的劳动：\n（一）矿山井下作业；\n\n二、经期禁忌：\n（一）冷水作业。\n"
    )
    chunks = chunk_auto(text, len)
    _exact(text, chunks)
    sections = [c.section for c in chunks]
    assert ("第一章 总则", "第一条") in sections and ("第二章 附则", "第三条") in sections
    (second,) = [c for c in chunks if c.section[-1:] == ("第二条",)]
    assert "（二）乙。" in second.text  # an article's items stay in it
    assert ("附录", "一、") in sections and ("附录", "二、") in sections


def test_markdown_headings_but_not_inside_code_fences() -> None:
    text = (
        "# Manual\n\nIntro.\n\n## Install\n\nRun this:\n\n```bash\n# not a heading\n"
        "第一条 not an article either\n```\n\nDone.\n\n## 2.1 Usage\n\nUse it.\n"
    )
    chunks = chunk_auto(text, len)
    _exact(text, chunks)
    install = [c for c in chunks if c.section == ("Manual", "Install")]
    assert len(install) == 1 and "# not a heading" in install[0].text
    assert "Done." in install[0].text
    assert [c.section for c in chunks if "Use it." in c.text] == [("Manual", "2.1 Usage")]
    # A longer fence holds a shorter one (a Markdown example inside a code block).
    text = "# Doc\n\n````md\n```sh\n# no\n```\n## nor this\n````\n\n## After\n\nText.\n"
    assert [c.section for c in chunk_auto(text, len)] == [("Doc",), ("Doc", "After")]


def test_numbered_headings_of_a_manual() -> None:
    text = "1 Overview\n\nWhat it is.\n\n1.1 Scope\n\nWhat it covers.\n\n2 Setup\n\nSteps.\n"
    sections = [c.section for c in chunk_auto(text, len)]
    assert sections == [("1 Overview",), ("1 Overview", "1.1 Scope"), ("2 Setup",)]


@pytest.mark.parametrize("space", [" ", ". ", "\u3000"])
def test_numbered_headings_as_chinese_manuals_write_them(space: str) -> None:
    """1.2 标题, 1.2. 标题 and 1.2　标题 (ideographic space): one heading path; a list item
    "1. ...", a quantity "3.5倍" and a table's row "1 | ..." are not headings."""
    text = (
        f"1 概述\n\n简介。\n\n1.1{space}适用对象\n\n管理员。\n\n1. 打开电源\n2. 按下开关\n\n"
        f"2 安装\n\n2.1{space}软件包\n\n执行命令。\n\n2.1.1{space}离线安装\n\n复制文件。\n"
        "3.5倍于默认值时，请调整参数。\n2.5亿元\n\n1 | 营业执照 | 复印件\n"
    )
    chunks = chunk_auto(text, len)
    _exact(text, chunks)

    def title(number: str, name: str) -> str:  # as the path holds it: one plain space
        return re.sub(r"\s+", " ", f"{number}{space}{name}")

    assert [c.section for c in chunks] == [
        ("1 概述",),
        ("1 概述", title("1.1", "适用对象")),
        ("2 安装", title("2.1", "软件包")),
        ("2 安装", title("2.1", "软件包"), title("2.1.1", "离线安装")),
    ]
    assert "1. 打开电源\n2. 按下开关" in chunks[1].text
    assert "3.5倍于默认值" in chunks[3].text and "1 | 营业执照 | 复印件" in chunks[3].text


def test_a_contract_s_clause_titles_and_headings_set_in_bold() -> None:
    """A clause whose line is a title carries it in its label (一、合同标的); one that is a
    sentence carries its number; a bold line "**4.1 交付地点**" is a heading, a bold
    sentence is not."""
    text = (
        "# 设备采购合同\n\n甲方：某公司\n\n一、合同标的\n\n服务器十台。\n\n二、价款与支付\n\n"
        "（一）总价五十万元。\n\n三、甲方应当按时付款，逾期支付违约金。\n\n**4.1 交付地点**\n\n"
        "北京市。\n\n**注意：本条为重点条款**\n"
    )
    chunks = chunk_auto(text, len)
    _exact(text, chunks)
    assert [c.section[1:] for c in chunks] == [
        (),
        ("一、合同标的",),
        ("二、价款与支付",),
        ("三、",),
        ("4.1 交付地点",),
    ]
    assert chunks[-1].text == "北京市。\n\n**注意：本条为重点条款**"


def test_a_long_article_is_cut_at_sentence_ends_with_overlap() -> None:
    sentences = [f"第{i}句话讲的是一件事情。" for i in range(40)]  # 10-12 characters each
    text = "第一条 " + "".join(sentences)
    chunks = chunk_auto(text, len, max_tokens=100, overlap_tokens=30)
    _exact(text, chunks)
    assert len(chunks) > 4 and all(len(c.text) <= 100 for c in chunks)
    assert all(c.section == ("第一条",) for c in chunks)
    for a, b in itertools.pairwise(chunks):
        assert a.text.endswith("。")  # never inside a sentence while sentences fit
        assert b.start < a.end  # with some overlap
        assert a.end - b.start <= 30


def test_a_sentence_over_the_cap_is_cut_inside() -> None:
    text = "第一条 " + "很" * 250 + "。"
    chunks = chunk_auto(text, len, max_tokens=100, overlap_tokens=10)
    _exact(text, chunks)
    assert all(len(c.text) <= 100 for c in chunks)
    assert chunks[0].start == 0 and chunks[-1].end == len(text)


def test_static_windows() -> None:
    text = "".join(f"Sentence number {i} is here. " for i in range(300))
    words = lambda s: len(s.split())  # noqa: E731
    chunks = chunk_static(text, words, max_tokens=100, overlap_tokens=40)
    _exact(text, chunks)
    assert all(words(c.text) <= 100 for c in chunks)
    assert chunks[-1].end == len(text.rstrip())
    for a, b in itertools.pairwise(chunks):
        shared = text[b.start : a.end]
        assert 0 < words(shared) <= 41  # a word cut at the window's edge counts twice
    with pytest.raises(ValueError):
        chunk_static(text, words, 100, 60)


@given(st.text(alphabet=st.sampled_from(list("第一二条章节编#\n 。，abc123、（）`")), max_size=400))
def test_any_text_gives_exact_chunks_under_the_cap(text: str) -> None:
    for chunks in (chunk_auto(text, len, 40, 8), chunk_static(text, len, 40, 10)):
        _exact(text, chunks)
        assert all(0 < len(c.text) <= 40 for c in chunks)
    # Nothing is lost but whitespace and heading lines (which are in the section paths).
    covered = set()
    for c in chunk_auto(text, len, 40, 8):
        covered.update(range(c.start, c.end))
    pos = 0
    for line in text.splitlines(keepends=True):
        if (
            _heading(line.rstrip("\r\n"), True) is None
            and _heading(line.rstrip("\r\n"), False) is None
        ):
            assert all(ch.isspace() or i in covered for i, ch in enumerate(line, pos)), line
        pos += len(line)


def test_english_contracts_and_underlined_headings() -> None:
    text = (
        "Master Services Agreement\n=========================\n\nPreamble text.\n\n"
        "CHAPTER I Definitions\n\nARTICLE 1. Scope\nThe supplier provides the services.\n\n"
        "Article 2: Fees\nFees are due monthly.\n\n```\nnot a heading\n-------------\n```\n\n"
        "CHAPTER II Termination\n\nArticle 3 Notice\nEither party may end it.\n"
    )
    chunks = chunk_auto(text, len)
    _exact(text, chunks)
    by_label = {c.section[-1]: c for c in chunks}
    assert by_label["ARTICLE 1"].section == (
        "Master Services Agreement", "CHAPTER I Definitions", "ARTICLE 1",
    )  # fmt: skip
    assert by_label["Article 2"].text.startswith("Article 2: Fees")
    assert "not a heading" in by_label["Article 2"].text  # the fence keeps its lines
    assert by_label["Article 3"].section == (
        "Master Services Agreement", "CHAPTER II Termination", "Article 3",
    )  # fmt: skip
    assert [c.section for c in chunks if c.text == "Preamble text."] == [
        ("Master Services Agreement",)
    ]
    # Under a --- title line: a level-2 heading.
    sections = [c.section for c in chunk_auto("Guide\n=====\n\nSetup\n-----\n\nRun it.\n", len)]
    assert sections == [("Guide", "Setup")]


def test_chunking_reads_about_each_window_not_the_whole_rest() -> None:
    """Long files stay linear: the text the counter reads is a small multiple of the file."""
    text = "x" * 200_000  # no sentence ends at all: the worst case for both chunkers
    read = 0

    def counting(s: str) -> int:
        nonlocal read
        read += len(s)
        return len(s)

    for chunker in (chunk_static, chunk_auto):
        read = 0
        chunks = chunker(text, counting, 400, 100)
        assert chunks and all(len(c.text) <= 400 for c in chunks)
        assert read < 60 * len(text), (chunker.__name__, read)


@pytest.mark.parametrize(
    ("text", "sections"),
    [
        ("```\ncode\n``` end\n第二条 内容。\n", [(), ("第二条",)]),  # no fence closes it
        ("第一条 甲。\n~~~~~ 分隔 ~~~~~\n第二条 乙。\n~~~~~ 分隔 ~~~~~\n第三条 丙。\n",
         [("第一条",), ("第二条",), ("第三条",)]),  # a rule, not a fence
        ("一、甲方应当在本合同签订后十日内向乙方支付\n全部货款。\n", [("一、",)]),  # wraps on
        ("一、付款方式：\n\n按月支付。\n", [("一、付款方式",)]),
        ("**一、合同标的**\n\n服务器。\n\n**二、价款**\n\n十万元。\n",
         [("一、合同标的",), ("二、价款",)]),
        ("第一条 甲。\n\n**第二章** 附则\n\n第二条 乙。\n",
         [("第一条",), ("第二章 附则", "第二条")]),
    ],
)  # fmt: skip
def test_fences_nothing_closes_wrapped_clauses_and_bold_markers(
    text: str, sections: list[tuple[str, ...]]
) -> None:
    chunks = chunk_auto(text, len)
    _exact(text, chunks)
    assert [c.section for c in chunks] == sections
