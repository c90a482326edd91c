"""A file's text: each format, and the files that have none refused with the reason."""

from __future__ import annotations

import io

import pytest

from kvgate.retrieval.chunking import chunk_auto
from kvgate.retrieval.text import UnreadableFile, _without_running_lines, extract_text


def _pdf(lines: list[str]) -> bytes:
    """A one-page PDF whose text layer holds ``lines``."""
    return _pdf_pages([lines])


def _pdf_pages(pages: list[list[str]]) -> bytes:
    """A PDF whose pages' text layers hold ``pages``' lines (ASCII, Helvetica), built by hand."""
    n = len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n))
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", f"<< /Type /Pages /Kids [{kids}] /Count {n} >>"]
    font = 3 + 2 * n
    for i, lines in enumerate(pages):
        ops = "".join(
            f"BT /F1 12 Tf 72 {720 - 16 * j} Td ({t}) Tj ET\n" for j, t in enumerate(lines)
        )
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R "
            f"/Resources << /Font << /F1 {font} 0 R >> >> >>"
        )
        objects.append(f"<< /Length {len(ops)} >>\nstream\n{ops}endstream")
    objects.append("<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out, offsets = io.BytesIO(), []
    out.write(b"%PDF-1.4\n")
    for i, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(f"{i} 0 obj\n{body}\nendobj\n".encode())
    xref = out.tell()
    out.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    for off in offsets:
        out.write(f"{off:010d} 00000 n \n".encode())
    out.write(
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return out.getvalue()


def test_markdown_and_text() -> None:
    assert (
        extract_text("a.md", "\ufeff# 标题\n\n第一条 内容。\n".encode())
        == "# 标题\n\n第一条 内容。\n"
    )
    assert extract_text("a.txt", "第一条 内容。".encode("utf-16")) == "第一条 内容。"


def test_html_headings_become_markdown_and_scripts_go() -> None:
    html = (
        "<html><head><title>t</title><style>p{}</style></head><body><h1>合同</h1>"
        "<p>一、标的</p><script>alert(1)</script><h2>Part &amp; two</h2><p>text</p></body></html>"
    )
    text = extract_text("c.html", html.encode())
    assert "# 合同" in text and "## Part & two" in text and "一、标的" in text
    assert "alert" not in text and "p{}" not in text


def test_html_code_blocks_are_fenced_and_table_cells_kept_apart() -> None:
    html = (
        "<h2>Install</h2><p>Run:</p><pre># not a heading\nmake install</pre>"
        "<table><tr><th>Port</th><th>Use</th></tr><tr><td>8000</td><td>API</td></tr></table>"
    )
    text = extract_text("m.html", html.encode())
    assert "```\n# not a heading\nmake install\n```" in text
    assert "Port | Use\n8000 | API" in text
    assert {c.section for c in chunk_auto(text, len)} == {("Install",)}
    # Code that shows a fence itself: the fence around it is longer, so it stays code.
    html = "<h2>Docs</h2><pre>```bash\n# not a heading\n```\n## nor this</pre><h2>Next</h2>"
    text = extract_text("d.html", html.encode())
    assert text.startswith("## Docs\n\n````\n```bash\n")
    assert [c.section for c in chunk_auto(text, len)] == [("Docs",)]


def test_html_cells_keep_what_they_hold_on_their_row() -> None:
    html = (
        "<table><tr><td><p>名称</p></td><td>说明<br>第二行</td></tr>"
        "<tr><td><pre>ls -l</pre></td><td><table><tr><td>内1</td><td>内2</td></tr></table></td>"
        "<tr><td>未闭合<td>单元</table><p>后文</p><pre>tail</pre></pre>"
    )
    text = extract_text("t.html", html.encode())
    lines = [" ".join(line.split()) for line in text.splitlines() if line]
    assert lines == [
        "名称 | 说明 第二行",
        "ls -l | 内1 | 内2",
        "未闭合 | 单元",
        "后文",
        "```",
        "tail",
        "```",
    ]


def test_pdf_text_layer() -> None:
    text = extract_text("r.pdf", _pdf(["Article 1 Scope", "Article 2 Terms"]))
    assert "Article 1 Scope" in text and "Article 2 Terms" in text


def test_pdf_running_headers_footers_and_page_numbers_go() -> None:
    pages = [
        [
            "ACME Router Guide",
            f"{i + 1} Section {i + 1}",
            ["Plug in the power.", "Connect the cable.", "Open the console.", "Save it."][i],
            f"- {i + 1} -",
        ]
        for i in range(4)
    ]
    pages[2][1] = "Article 3 Terms"  # content at a page's top edge stays
    text = extract_text("g.pdf", _pdf_pages(pages))
    assert text.startswith("ACME Router Guide\n") and text.count("ACME") == 1  # the title
    assert "- 2 -" not in text
    assert "2 Section 2" in text and "Article 3 Terms" in text and "Save it." in text
    sections = [c.section for c in chunk_auto(text, len)]
    assert ("1 Section 1",) in sections and ("2 Section 2",) in sections


def test_running_lines_by_their_repeats_and_page_number_forms() -> None:
    """Chinese forms (no CJK font in the hand-built PDFs): a header with the page's number in
    it, 第 N 页 footers; an article at a page's edge, and a line on too few pages, stay."""
    topics = ["总则", "招聘", "考勤", "薪酬", "福利", "附则"]
    pages = [
        f"某某公司员工手册（2024版）第{i}页\n{topic}的规定\n{topic}适用本章。\n第 {i} 页 共 6 页"
        for i, topic in enumerate(topics)
    ]
    pages[3] = "第十二条 试用期\n正文。\n只在两页上的一行"
    pages[4] = "正文。\n只在两页上的一行"
    out = _without_running_lines(pages)
    assert not any("员工手册" in p or "共 6 页" in p for p in out)
    assert out[3].startswith("第十二条 试用期") and out[4].endswith("只在两页上的一行")
    assert out[0] == "总则的规定\n总则适用本章。"
    assert _without_running_lines(["第 1 页"]) == ["第 1 页"]  # one page: nothing to compare


def test_docx_paragraphs_and_headings() -> None:
    import docx

    document = docx.Document()
    document.add_heading("Service agreement", level=1)
    document.add_paragraph("1. The parties agree.")
    buf = io.BytesIO()
    document.save(buf)
    text = extract_text("s.docx", buf.getvalue())
    assert text.startswith("# Service agreement") and "1. The parties agree." in text


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("e.txt", b"", "is empty"),
        ("b.txt", bytes(range(256)) * 4, "not UTF-8 text"),
        ("late-nul.txt", "第一条 ".encode() * 3000 + b"\x00tail", "NUL bytes"),
        ("w.txt", b"   \n\n ", "has no text"),
        ("x.exe", b"MZ", "unsupported file type"),
        ("n.pdf", b"%PDF-1.4 garbage", "not a readable PDF"),
        ("d.docx", b"PK not a zip", "not a readable .docx"),
    ],
)
def test_files_without_text_are_refused_with_the_reason(
    name: str, data: bytes, message: str
) -> None:
    with pytest.raises(UnreadableFile, match=message):
        extract_text(name, data)


def _blank_pdf() -> bytes:
    """A PDF of one page with no text layer, as a scan without OCR is."""
    from pypdf import PdfWriter

    writer = PdfWriter()
    writer.add_blank_page(612, 792)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def test_a_pdf_with_no_text_layer() -> None:
    with pytest.raises(UnreadableFile, match="no text layer"):
        extract_text("scan.pdf", _blank_pdf())


def test_what_repeats_at_page_edges_but_is_content_stays() -> None:
    """One appendix form a page (附件1, 附件2, ...), articles atop pages, numbers that are not
    the page's, and the title that the running header repeats."""
    forms = [f"附件{i + 1}\n申请表\n填表说明{'甲乙丙丁'[i]}。\n示范市人民政府" for i in range(4)]
    out = _without_running_lines(["示范市人民政府\n关于印发办法的通知", *forms])
    assert out[0].startswith("示范市人民政府")
    assert [p.splitlines()[0] for p in out[1:]] == ["附件1", "附件2", "附件3", "附件4"]
    assert not any("人民政府" in p for p in out[1:])
    laws = [f"第{n}条 内容{n}。\n{v}" for n, v in zip("一二三四", (100, 256, 2023, 7), strict=True)]
    assert _without_running_lines(laws) == laws
