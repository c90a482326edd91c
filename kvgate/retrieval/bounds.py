"""What one file's ingestion may cost: its limits, and the checks made before the work.

A file is checked where its cost is known before it is paid: a ``.docx``'s zip members by
the sizes its central directory declares (Python's ``zipfile`` never inflates a member past
its declared size, so the declared sizes bound what reading costs), a PDF by its page count,
any file's text by its characters as it is extracted. What the checks cannot see (XML that
is slow to walk, a PDF's content streams) is bounded by the ingestion process's time and
memory limits (``docs/ingest.py``). A file over any of them fails alone, with
``file_too_complex`` and the limit it passed.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass

from kvgate.errors import InvalidConfig, KVGateError

MiB = 2**20

#: A zip member this large (bytes, inflated) or larger must not inflate more than
#: ``IngestLimits.max_zip_ratio`` times its compressed size. Below 1 MiB a ratio costs
#: nothing worth refusing.
RATIO_FLOOR_BYTES = 1 * MiB


class UnreadableFile(KVGateError):
    """A file kvgate cannot take the text of (its ``last_error`` in a vector store)."""

    code = "unreadable_file"


class FileTooComplex(UnreadableFile):
    """A file whose ingestion would pass one of its limits (``IngestLimits``)."""

    code = "file_too_complex"


@dataclass(frozen=True)
class IngestLimits:
    """Per file: what its ingestion may take. Defaults: a 2-million-character law library at
    ~2,000 characters/s (``auto`` chunks with their paragraph vectors, bench/longdoc.py on 2
    cores of an AVX2 or slower machine; 4,380 on a Zen 4) is ~1,000 s, inside ``job_seconds``."""

    #: Bytes a ``.docx``'s members may inflate to, together (declared sizes, checked first).
    max_unzipped_bytes: int = 128 * MiB
    #: How many times a ``.docx``'s part (of 1 MiB or more) may inflate: Word's XML deflates
    #: 5-20x, a run of zeros or spaces (a bomb) about 1000x.
    max_zip_ratio: float = 100.0
    #: Pages of a PDF (its page tree's count, checked before any page is read).
    max_pdf_pages: int = 5000
    #: Characters of extracted text (checked as it grows, page by page, paragraph by paragraph).
    max_text_chars: int = 2_000_000
    #: Seconds one job may run in the ingestion process before it is stopped (wall clock, from
    #: when the job is handed to it; the process's start-up does not count).
    job_seconds: float = 1200.0
    #: Bytes of memory the ingestion process may hold (its data segment, RLIMIT_DATA, and its
    #: resident set, watched from the server). Its baseline with PyTorch, the e5 embedder and
    #: jieba loaded is ~750 MiB (VmData 735, VmRSS 764 on Linux 6.18, torch 2.13).
    memory_bytes: int = 2048 * MiB

    def __post_init__(self) -> None:
        for name in ("max_unzipped_bytes", "max_pdf_pages", "max_text_chars", "memory_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfig(f"{name} must be a positive integer", param=name)
        if not self.max_zip_ratio >= 1:
            raise InvalidConfig("max_zip_ratio must be at least 1", param="max_zip_ratio")
        if not self.job_seconds > 0:
            raise InvalidConfig("job_seconds must be positive", param="job_seconds")


def check_zip(filename: str, data: bytes, limits: IngestLimits) -> None:
    """Refuse a zip (``.docx``) whose members, as declared, inflate past the limits; before
    any member is read. Raises ``UnreadableFile`` for what is no zip at all."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise UnreadableFile(f"{filename!r} is not a readable .docx (not a zip archive)") from None
    total = 0
    for member in members:
        total += member.file_size
        if total > limits.max_unzipped_bytes:
            raise FileTooComplex(
                f"{filename!r} inflates to more than {limits.max_unzipped_bytes // MiB} MiB "
                "(the limit on a .docx's uncompressed size)"
            )
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size >= RATIO_FLOOR_BYTES and ratio > limits.max_zip_ratio:
            raise FileTooComplex(
                f"{filename!r}: its part {member.filename!r} inflates {ratio:.0f} times "
                f"(more than {limits.max_zip_ratio:.0f}: a decompression bomb?)"
            )


def check_chars(filename: str, chars: int, limits: IngestLimits) -> None:
    if chars > limits.max_text_chars:
        raise FileTooComplex(
            f"{filename!r} has more than {limits.max_text_chars:,} characters of text "
            "(the limit per file)"
        )
