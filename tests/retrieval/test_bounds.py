"""Per-file limits, checked before the work they bound: the audit's probes in small."""

from __future__ import annotations

import tracemalloc

import pytest

from kvgate.errors import InvalidConfig
from kvgate.retrieval.bounds import FileTooComplex, IngestLimits, UnreadableFile
from kvgate.retrieval.text import extract_text
from tests.retrieval.heavy_files import docx_bomb, long_docx, pdf_of_pages

MiB = 2**20


def _zip_of(members: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_a_docx_bomb_is_refused_before_any_part_is_inflated() -> None:
    bomb = docx_bomb(1100 * MiB)  # ~1.1 MiB that inflates to 1.1 GiB
    assert len(bomb) < 2 * MiB
    tracemalloc.start()
    try:
        with pytest.raises(FileTooComplex, match="inflates to more than 128 MiB") as refused:
            extract_text("bomb.docx", bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.code == "file_too_complex"
    assert peak < 16 * MiB  # the declared sizes were read; no part was


def test_a_smaller_bomb_is_refused_by_its_ratio() -> None:
    bomb = docx_bomb(64 * MiB)  # under the size limit, but it inflates ~1000 times
    with pytest.raises(FileTooComplex, match=r"inflates [0-9]+ times"):
        extract_text("bomb.docx", bomb)
    # With both checks off python-docx inflates it whole (64 MiB held) before lxml refuses
    # its one text node: the work the checks spare.
    loose = IngestLimits(max_unzipped_bytes=2**40, max_zip_ratio=1e12)
    tracemalloc.start()
    try:
        with pytest.raises(UnreadableFile) as refused:
            extract_text("bomb.docx", bomb, loose)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not isinstance(refused.value, FileTooComplex)
    assert peak > 64 * MiB


def test_a_pdf_of_99000_pages_is_refused_by_its_page_count() -> None:
    pdf = pdf_of_pages(99_000)
    with pytest.raises(FileTooComplex, match="more than 5,000 pages"):
        extract_text("big.pdf", pdf)
    assert extract_text("small.pdf", pdf_of_pages(3, "Hello")).startswith("Hello")


def test_a_pdf_whose_count_lies_is_refused_by_its_pages() -> None:
    pdf = pdf_of_pages(300).replace(b"/Count 300", b"/Count 3  ")
    with pytest.raises(FileTooComplex, match="more than 100 pages"):
        extract_text("liar.pdf", pdf, IngestLimits(max_pdf_pages=100))


def test_a_10_million_character_docx_is_refused_by_its_characters() -> None:
    with pytest.raises(FileTooComplex, match="more than 2,000,000 characters"):
        extract_text("long.docx", long_docx(10_000_000))


def test_text_files_and_pdfs_are_held_to_the_character_limit() -> None:
    limits = IngestLimits(max_text_chars=1000)
    assert extract_text("ok.txt", b"x" * 1000, limits) == "x" * 1000
    with pytest.raises(FileTooComplex, match="more than 1,000 characters"):
        extract_text("long.txt", b"x" * 1001, limits)
    with pytest.raises(FileTooComplex, match="characters"):
        extract_text("long.pdf", pdf_of_pages(300, "a" * 10), limits)


@pytest.mark.parametrize(
    ("name", "data", "says"),
    [
        ("broken.pdf", b"%PDF-1.4\n1 0 obj << /Type /Catalog >> garbage", "not a readable PDF"),
        ("broken.docx", b"PK\x03\x04 not really a zip", "not a readable .docx"),
        ("no-word.docx", _zip_of({"hello.txt": b"hi"}), "not a readable .docx"),
    ],
)  # fmt: skip
def test_damaged_files_fail_with_a_message_not_a_library_exception(
    name: str, data: bytes, says: str
) -> None:
    with pytest.raises(UnreadableFile) as refused:
        extract_text(name, data)
    message = refused.value.message
    assert says in message
    for dump in ("Error", "Exception", "KeyError", "Traceback", "<"):
        assert dump not in message


def test_limits_must_be_positive() -> None:
    with pytest.raises(InvalidConfig, match="max_text_chars"):
        IngestLimits(max_text_chars=0)
    with pytest.raises(InvalidConfig, match="job_seconds"):
        IngestLimits(job_seconds=0)
