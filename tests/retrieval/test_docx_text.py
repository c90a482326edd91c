"""A Word document's text: automatic numbering drawn as Word draws it, tables in place,
headings, the table of contents left out. Documents are built with python-docx, numbering
written into its numbering part, and read back from the saved bytes as an upload is."""

from __future__ import annotations

import io
from typing import Any

import docx
import pytest
from docx.enum.style import WD_STYLE_TYPE
from docx.oxml import parse_xml
from docx.oxml.ns import nsdecls

from kvgate.retrieval.chunking import chunk_auto
from kvgate.retrieval.docx_text import chinese_number, format_number
from kvgate.retrieval.text import extract_text

W = nsdecls("w")


def _add_list(
    document: Any, abstract_id: int, levels: list[tuple[str, str, str]], style: str = ""
) -> None:
    """An abstractNum of ``levels`` (numFmt, lvlText, suff), its first level linked to the
    paragraph style ``style`` when given."""
    lvls = "".join(
        f'<w:lvl w:ilvl="{i}"><w:start w:val="1"/><w:numFmt w:val="{fmt}"/>'
        + (f'<w:pStyle w:val="{style}"/>' if style and i == 0 else "")
        + f'<w:suff w:val="{suff}"/><w:lvlText w:val="{text}"/></w:lvl>'
        for i, (fmt, text, suff) in enumerate(levels)
    )
    root = document.part.numbering_part.element
    # Schema order: every abstractNum before the first num.
    xml = f'<w:abstractNum {W} w:abstractNumId="{abstract_id}">{lvls}</w:abstractNum>'
    root.insert(0, parse_xml(xml))


def _add_num(document: Any, num_id: int, abstract_id: int, restart: int | None = None) -> None:
    override = (
        f'<w:lvlOverride w:ilvl="0"><w:startOverride w:val="{restart}"/></w:lvlOverride>'
        if restart is not None
        else ""
    )
    link = f'<w:abstractNumId w:val="{abstract_id}"/>'
    xml = f'<w:num {W} w:numId="{num_id}">{link}{override}</w:num>'
    document.part.numbering_part.element.append(parse_xml(xml))


def _numbered(document: Any, text: str, num_id: int, ilvl: int = 0) -> None:
    paragraph = document.add_paragraph(text)
    paragraph._p.get_or_add_pPr().insert(
        0, parse_xml(f'<w:numPr {W}><w:ilvl w:val="{ilvl}"/><w:numId w:val="{num_id}"/></w:numPr>')
    )


def _read(document: Any) -> str:
    buf = io.BytesIO()
    document.save(buf)
    return extract_text("upload.docx", buf.getvalue())


@pytest.mark.parametrize(
    ("n", "counting", "legal"),
    [
        (1, "一", "壹"),
        (10, "十", "壹拾"),
        (11, "十一", "壹拾壹"),
        (20, "二十", "贰拾"),
        (101, "一百零一", "壹佰零壹"),
        (110, "一百一十", "壹佰壹拾"),
        (1010, "一千零一十", "壹仟零壹拾"),
        (1260, "一千二百六十", "壹仟贰佰陆拾"),
        (10000, "一万", "壹萬"),
        (10010, "一万零一十", "壹萬零壹拾"),
    ],
)
def test_chinese_numbers_as_word_counts(n: int, counting: str, legal: str) -> None:
    assert chinese_number(n) == counting
    assert chinese_number(n, legal=True) == legal


@pytest.mark.parametrize(
    ("n", "fmt", "shown"),
    [
        (3, "chineseCounting", "三"),
        (3, "decimal", "3"),
        (27, "upperLetter", "AA"),
        (2, "lowerLetter", "b"),
        (1994, "upperRoman", "MCMXCIV"),
        (4, "lowerRoman", "iv"),
        (3, "ideographTraditional", "丙"),
        (1, "decimalEnclosedCircle", "①"),
        (21, "decimalEnclosedCircle", "21"),  # past the enclosed numerals
        (1, "ideographEnclosedCircle", "㈠"),
        (12, "decimalFullWidth", "１２"),
        (7, "decimalZero", "07"),
        (5, "ordinalText", "5"),  # not drawn by kvgate: decimal
    ],
)
def test_number_formats(n: int, fmt: str, shown: str) -> None:
    assert format_number(n, fmt) == shown


def test_a_contract_whose_articles_word_numbers() -> None:
    """第%1条 with items （%2） below: the labels are in the text, so every article starts
    a chunk of its own, with its label, under the chapter heading."""
    document = docx.Document()
    articles_and_items = [
        ("chineseCounting", "第%1条", "space"),
        ("chineseCounting", "（%2）", "nothing"),
    ]
    _add_list(document, 90, articles_and_items)
    _add_num(document, 91, 90)
    document.add_heading("总则", level=1)
    for i in range(3):
        _numbered(document, f"第{i}个条款的内容。", 91)
    _numbered(document, "甲方的义务。", 91, ilvl=1)
    _numbered(document, "乙方的义务。", 91, ilvl=1)
    for i in range(3, 11):
        _numbered(document, f"第{i}个条款的内容。", 91)
    _numbered(document, "再一项。", 91, ilvl=1)  # restarts below the new article
    text = _read(document)
    lines = [line for line in text.splitlines() if line]
    assert lines[:6] == [
        "# 总则",
        "第一条 第0个条款的内容。",
        "第二条 第1个条款的内容。",
        "第三条 第2个条款的内容。",
        "（一）甲方的义务。",
        "（二）乙方的义务。",
    ]
    assert lines[-2:] == ["第十一条 第10个条款的内容。", "（一）再一项。"]
    chunks = chunk_auto(text, len)
    labels = [c.section[-1] for c in chunks]
    articles = [f"第{chinese_number(i)}条" for i in range(1, 12)]
    assert labels == articles
    assert all(c.section[0] == "总则" and c.text.startswith(c.section[-1]) for c in chunks)
    assert "（二）乙方的义务。" in chunks[2].text


def test_multilevel_decimal_numbering_restarts_below() -> None:
    document = docx.Document()
    _add_list(document, 80, [("decimal", "%1.", "tab"), ("decimal", "%1.%2", "space")])
    _add_num(document, 81, 80)
    for text, ilvl in [("A", 0), ("B", 1), ("C", 1), ("D", 0), ("E", 1)]:
        _numbered(document, text, 81, ilvl)
    lines = [line for line in _read(document).splitlines() if line]
    assert lines == ["1. A", "1.1 B", "1.2 C", "2. D", "2.1 E"]


def test_a_num_that_restarts_its_list() -> None:
    """Two nums of one list share its counter; a startOverride restarts it."""
    document = docx.Document()
    _add_list(document, 70, [("lowerLetter", "%1)", "space")])
    _add_num(document, 71, 70)
    _add_num(document, 72, 70, restart=1)
    for text, num in [("x", 71), ("y", 71), ("z", 72), ("w", 72)]:
        _numbered(document, text, num)
    lines = [line for line in _read(document).splitlines() if line]
    assert lines == ["a) x", "b) y", "a) z", "b) w"]


def test_numbered_headings_by_their_style() -> None:
    """Heading 1 numbered through its style (第%1章), as Chinese regulations are drafted,
    below the Title; a paragraph of that style with numId 0 has its number switched off."""
    document = docx.Document()
    _add_list(document, 60, [("chineseCounting", "第%1章", "space")], style="Heading1")
    _add_num(document, 61, 60)
    heading = document.styles["Heading 1"]
    heading.element.get_or_add_pPr().insert(
        0, parse_xml(f'<w:numPr {W}><w:numId w:val="61"/></w:numPr>')
    )
    document.add_paragraph("管理办法", style="Title")  # the headings go below it
    document.add_heading("总则", level=1)
    document.add_paragraph("第一条 为了规范管理，制定本办法。")
    document.add_heading("附则", level=1)
    document.add_paragraph("第二条 本办法自发布之日起施行。")
    plain = document.add_heading("不编号的标题", level=1)
    plain._p.get_or_add_pPr().insert(0, parse_xml(f'<w:numPr {W}><w:numId w:val="0"/></w:numPr>'))
    text = _read(document)
    assert text.startswith("# 管理办法\n\n## 第一章 总则\n")
    assert "\n## 第二章 附则\n" in text and "\n## 不编号的标题\n" in text
    sections = [c.section for c in chunk_auto(text, len)]
    assert sections == [
        ("管理办法", "第一章 总则", "第一条"),
        ("管理办法", "第二章 附则", "第二条"),
    ]


def test_tables_in_place_contents_controls_read_and_the_toc_left_out() -> None:
    document = docx.Document()
    toc = document.styles.add_style("toc 1", WD_STYLE_TYPE.PARAGRAPH)
    document.add_paragraph("第一条 总则 ........ 1", style=toc)
    section = document.element.body.sectPr  # the body's blocks all come before it
    section.addprevious(
        parse_xml(
            f'<w:sdt {W}><w:sdtPr><w:docPartObj><w:docPartGallery w:val="Table of Contents"/>'
            "</w:docPartObj></w:sdtPr><w:sdtContent><w:p><w:r><w:t>第二条 付款 ... 2</w:t>"
            "</w:r></w:p></w:sdtContent></w:sdt>"
        )
    )
    document.add_paragraph("付款安排如下：")
    table = document.add_table(rows=3, cols=3)
    for r, row in enumerate([["阶段", "比例", "时间"], ["首付款", "30%", "签约后五日"]]):
        for c, value in enumerate(row):
            table.cell(r, c).text = value
    merged = table.cell(2, 0).merge(table.cell(2, 2))
    merged.text = "余款于验收后支付"
    section.addprevious(
        parse_xml(
            f"<w:sdt {W}><w:sdtPr/><w:sdtContent><w:p><w:r><w:t>控件里的条款文字。</w:t>"
            "</w:r></w:p></w:sdtContent></w:sdt>"
        )
    )
    document.add_paragraph("以上。")
    text = _read(document)
    assert text.split("\n\n") == [
        "付款安排如下：",
        "阶段 | 比例 | 时间\n首付款 | 30% | 签约后五日\n余款于验收后支付",
        "控件里的条款文字。",
        "以上。\n",
    ]


def test_bullets_and_unnumbered_levels() -> None:
    document = docx.Document()
    _add_list(document, 50, [("bullet", "\uf0b7", "tab"), ("none", "", "nothing")])
    _add_num(document, 51, 50)
    _numbered(document, "要点", 51)
    _numbered(document, "说明", 51, ilvl=1)
    lines = [line for line in _read(document).splitlines() if line]
    assert lines == ["• 要点", "说明"]


def test_merged_nested_and_numbered_cells() -> None:
    """A cell merged down is read where it begins (python-docx's row.cells raised on some
    merges, and was quadratic in the rows); a nested table's text stays in its cell; a
    numbered 序号 column shows its numbers."""
    document = docx.Document()
    _add_list(document, 40, [("decimal", "%1", "nothing")])
    _add_num(document, 41, 40)
    numbered = (
        '<w:p><w:pPr><w:numPr><w:ilvl w:val="0"/><w:numId w:val="41"/></w:numPr></w:pPr></w:p>'
    )

    def p(text: str) -> str:
        return f"<w:p><w:r><w:t>{text}</w:t></w:r></w:p>"

    nested = f"<w:tbl><w:tr><w:tc>{p('正本')}</w:tc></w:tr></w:tbl>"
    cells = [
        f'<w:tcPr><w:vMerge w:val="restart"/></w:tcPr>{p("营业执照")}',
        f"<w:tcPr><w:vMerge/></w:tcPr>{p('')}",
        p("身份证") + nested,
    ]
    rows = "".join(f"<w:tr><w:tc>{numbered}</w:tc><w:tc>{cell}</w:tc></w:tr>" for cell in cells)
    table = f"<w:tbl {W}><w:tblGrid><w:gridCol/><w:gridCol/></w:tblGrid>{rows}</w:tbl>"
    document.element.body.sectPr.addprevious(parse_xml(table))
    lines = [line for line in _read(document).splitlines() if line]
    assert lines == ["1 | 营业执照", "2 | ", "3 | 身份证 正本"]


def _style(kind: str, sid: str, num_pr: str) -> Any:
    return parse_xml(
        f'<w:style {W} w:type="{kind}" w:styleId="{sid}"><w:name w:val="{sid}"/>'
        f"<w:pPr><w:numPr>{num_pr}</w:numPr></w:pPr></w:style>"
    )


def test_numbering_through_style_links_level_overrides_and_split_sources() -> None:
    document = docx.Document()
    styles = document.styles.element
    root = document.part.numbering_part.element
    # numStyleLink: list 31's abstractNum holds no levels, only a link to the numbering style
    # "Articles", whose num (30) is the list that holds them.
    _add_list(document, 30, [("chineseCounting", "第%1条", "space")])
    link = '<w:numStyleLink w:val="Articles"/>'
    root.insert(0, parse_xml(f'<w:abstractNum {W} w:abstractNumId="31">{link}</w:abstractNum>'))
    _add_num(document, 30, 30)
    _add_num(document, 31, 31)
    styles.append(_style("numbering", "Articles", '<w:numId w:val="30"/>'))
    _numbered(document, "链接的列表。", 31)
    # A whole level in a num's lvlOverride: its own format and start.
    level = (
        '<w:lvl w:ilvl="0"><w:start w:val="5"/><w:numFmt w:val="decimal"/>'
        '<w:lvlText w:val="%1)"/></w:lvl>'
    )
    root.append(
        parse_xml(
            f'<w:num {W} w:numId="32"><w:abstractNumId w:val="30"/>'
            f'<w:lvlOverride w:ilvl="0">{level}</w:lvlOverride></w:num>'
        )
    )
    _numbered(document, "换了格式。", 32)
    # numId from the style, ilvl from the paragraph.
    _add_list(document, 20, [("decimal", "%1", "space"), ("decimal", "%1.%2", "space")])
    _add_num(document, 21, 20)
    styles.append(_style("paragraph", "Clause", '<w:numId w:val="21"/>'))
    document.add_paragraph("总", style="Clause")
    part = document.add_paragraph("分", style="Clause")
    part._p.get_or_add_pPr().append(parse_xml(f'<w:numPr {W}><w:ilvl w:val="1"/></w:numPr>'))
    lines = [line for line in _read(document).splitlines() if line]
    assert lines == ["第一条 链接的列表。", "5) 换了格式。", "1 总", "1.1 分"]
