"""A file's text: each format, and the files that have none refused with the reason."""

from __future__ import annotations

import io

import pytest

from kvgate.docs.text import UnreadableFile, extract_text


def _pdf(lines: list[str]) -> bytes:
    """A one-page PDF whose text layer holds ``lines`` (ASCII, Helvetica), built by hand."""
    ops = "".join(f"BT /F1 12 Tf 72 {720 - 16 * i} Td ({t}) Tj ET\n" for i, t in enumerate(lines))
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        "/Resources << /Font << /F1 5 0 R >> >> >>",
        f"<< /Length {len(ops)} >>\nstream\n{ops}endstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
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


def test_pdf_text_layer() -> None:
    text = extract_text("r.pdf", _pdf(["Article 1 Scope", "Article 2 Terms"]))
    assert "Article 1 Scope" in text and "Article 2 Terms" in text


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
