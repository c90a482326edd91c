"""Load a llama.cpp GGUF file (the architectures of ``architectures.py``; byte-level BPE or
SentencePiece vocabularies) as a Checkpoint.

Tensors are dequantized to float32 (F16/BF16 ones keep their dtype), or with
``keep_quantized`` the matrices in a block format ``csrc/qlinear.c`` multiplies stay in their
blocks as ``QuantTensor`` views of the file's memory map (nothing copied or dequantized); they
are renamed to Hugging Face names, attn_q/attn_k rows are un-permuted back to HF's
``rotate_half`` layout where llama.cpp permuted them (Llama), and norms stored as ``1 + w``
go back to ``w`` (Gemma).
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvgate.errors import CorruptWeights, UnsupportedModel
from kvgate.model.architectures import (
    GGUF_GLOBAL_NAMES,
    Architecture,
    architectures,
    from_gguf_name,
    gguf_layer_name,
)
from kvgate.model.checkpoint import Checkpoint, check_weights, make_config
from kvgate.model.config import ModelConfig, RopeScaling
from kvgate.model.quant_tensor import NATIVE_QTYPES, QuantTensor, dequantize_blocks
from kvgate.tokenizer import GGUF_PRE_TOKENIZERS, Tokenizer
from kvgate.tokenizer_spm import spm_backend

__all__ = ["GGUFTensor", "is_gguf_file", "load_gguf", "load_gguf_tokenizer", "read_gguf_header"]

_MAGIC = b"GGUF"
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf_file(path: Path) -> bool:
    """A ``.gguf`` suffix, or a file that starts with the GGUF magic."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def load_gguf(path: str | os.PathLike[str], *, keep_quantized: bool = False) -> Checkpoint:
    """Read config, tokenizer and weights from a GGUF file.

    ``keep_quantized``: 2-D tensors in a type of ``NATIVE_QTYPES`` become ``QuantTensor``s
    over the file's memory map (start-up reads only the header; pages come in as the kernels
    touch them); every other tensor is read as without it.

    Raises:
        CorruptWeights: the file does not parse (truncated, not GGUF), a tensor lies past the
            end of the file, or a tensor is missing or has the wrong shape; the message names
            the file (and tensor).
        UnsupportedModel: an architecture, tokenizer, tensor type or RoPE variant we cannot run.
    """
    file = str(path)
    buf = _map(file)
    fields, infos, data_start = _parse_header(buf, file)
    # Every tensor's extent against the file's size before any is read: a map of a short
    # file faults (SIGBUS) on the first access past its end, inside a step.
    extents = {info.name: _extent(buf, data_start, info, file) for info in infos}
    config = _config_from_fields(fields, {t.name for t in infos}, file)
    tokenizer = _tokenizer_from_fields(fields, file)

    weights: dict[str, torch.Tensor | QuantTensor] = {}
    arch = config.arch
    for info in infos:
        name = _hf_name(arch, info.name, file)
        start, nbytes = extents[info.name]
        t: torch.Tensor | QuantTensor
        if keep_quantized and info.qtype in NATIVE_QTYPES and len(info.dims) in (2, 3):
            # A stack of matrices (experts) stays one tensor of all their rows: the
            # architecture slices it (``Architecture.gguf_tensors``), still without a copy.
            n = math.prod(info.dims[1:])
            rows = buf[start : start + nbytes].reshape(n, -1)
            t = QuantTensor(info.qtype, (n, info.dims[0]), torch.from_numpy(rows), info.name)
        else:
            t = _read_tensor(buf, start, nbytes, info, file)
        if arch.gguf_permutes_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
            t = _unpermute(t, heads, file, info.name)
        if arch.norm_offset and name.endswith("norm.weight"):
            assert isinstance(t, torch.Tensor)  # norms are 1-D: never kept in blocks
            t = t.float() - arch.norm_offset  # transformers undoes it the same way
        weights[name] = t
    weights = arch.gguf_tensors(weights, config)
    check_weights(weights, config, file)
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, path=file)


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Only the tokenizer of a GGUF file (reads the header, not the weights).

    Raises:
        CorruptWeights / UnsupportedModel: as :func:`load_gguf`.
    """
    file = str(path)
    fields, _, _ = _parse_header(_map(file), file)
    return _tokenizer_from_fields(fields, file)


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor as a GGUF header describes it, under its Hugging Face name."""

    name: str
    shape: tuple[int, ...]  # HF order: [out, in]
    qtype: GGMLQuantizationType
    nbytes: int  # in the file


def read_gguf_header(path: str | os.PathLike[str]) -> tuple[ModelConfig, list[GGUFTensor]]:
    """The config and every tensor's name, shape, type and size, from the header alone: no
    tensor is read (sizing a model before loading it, ``kvgate plan``).

    Raises:
        CorruptWeights / UnsupportedModel: as :func:`load_gguf`.
    """
    file = str(path)
    buf = _map(file)
    fields, infos, data_start = _parse_header(buf, file)
    config = _config_from_fields(fields, {t.name for t in infos}, file)
    return config, [
        GGUFTensor(
            _hf_name(config.arch, info.name, file),
            tuple(reversed(info.dims)),
            info.qtype,
            _extent(buf, data_start, info, file)[1],
        )
        for info in infos
    ]


def _map(file: str) -> np.ndarray:
    # Copy-on-write: torch takes a writable view without copying or warning; nothing writes
    # to it, so its pages stay the file's (shared with the page cache, never swapped).
    try:
        return np.memmap(file, dtype=np.uint8, mode="c")
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise CorruptWeights(f"{file}: cannot read ({exc})", path=file) from exc


def _unpermute(
    w: torch.Tensor | QuantTensor, n_heads: int, file: str, name: str
) -> torch.Tensor | QuantTensor:
    """Invert llama.cpp's convert permutation of Q/K rows.

    llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs:
    ``w.reshape(n_heads, 2, hd // 2, in).swapaxes(1, 2)``; HF wants the two halves
    (``rotate_half``), so reshape as ``(n_heads, hd // 2, 2, in)`` and swap back. A row
    permutation: blocks move whole (a ``QuantTensor``'s rows are copied out of the map).
    """
    out = w.shape[0]
    if out % (2 * n_heads) != 0:
        raise CorruptWeights(
            f"{file}: tensor {name!r} has {out} rows, not a multiple of 2 x {n_heads} heads",
            path=file,
        )
    index = torch.arange(out).reshape(n_heads, out // n_heads // 2, 2).transpose(1, 2).flatten()
    if isinstance(w, QuantTensor):
        return w.take_rows(index)
    return w.index_select(0, index) if w.dim() > 1 else w[index]


def _hf_name(arch: Architecture, gguf_name: str, file: str) -> str:
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and (suffix := gguf_layer_name(arch, m.group(2))) is not None:
        return f"model.layers.{m.group(1)}.{suffix}"
    if gguf_name == "rope_freqs.weight":
        raise UnsupportedModel(
            f"{file}: llama3-style RoPE scaling stored as 'rope_freqs.weight' is not supported",
            path=file,
        )
    raise UnsupportedModel(f"{file}: unexpected tensor {gguf_name!r}", path=file)


# ----------------------------------------------------------------------------- file format
# Our own header parser: gguf.GGUFReader builds a numpy view per array element, which takes
# seconds for a 49k-token vocabulary; this reads the same layout with struct/frombuffer.


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the contiguous (input) axis
    qtype: GGMLQuantizationType
    offset: int  # from the start of the data section


# GGUF value type -> little-endian numpy dtype, for scalars and numeric arrays.
_NUMERIC = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


class _Cursor:
    """Sequential little-endian reads from a byte buffer; every overrun raises ValueError."""

    def __init__(self, buf: np.ndarray) -> None:
        # A memoryview slices without the per-slice cost of numpy (the vocab is ~100k strings).
        self.mv: memoryview = buf.data
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise ValueError(f"unexpected end of file at byte {self.pos} (wanted {n} more)")
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        value: int = _U32.unpack(self.take(4))[0]
        return value

    def u64(self) -> int:
        value: int = _U64.unpack(self.take(8))[0]
        return value

    def string(self) -> str:
        return str(self.take(self.u64()), "utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary, its merges: ~150k each for Qwen2.5), in
        one loop over local names: ~4x faster than ``string`` per item."""
        mv, pos, end = self.mv, self.pos, len(self.mv)
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"unexpected end of file at byte {pos} (wanted 8 more)")
            n = unpack(mv, pos)[0]
            pos += 8
            if pos + n > end:
                raise ValueError(f"unexpected end of file at byte {pos} (wanted {n} more)")
            append(str(mv[pos : pos + n], "utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            # Real files nest arrays one level at most; a file nesting thousands would exhaust
            # the stack (RecursionError) instead of being reported as corrupt.
            if depth >= _MAX_ARRAY_DEPTH:
                raise ValueError(f"metadata arrays nested deeper than {_MAX_ARRAY_DEPTH} levels")
            item_type, count = self.u32(), self.u64()
            if item_type in _NUMERIC:
                dtype = np.dtype(_NUMERIC[GGUFValueType(item_type)])
                items = np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
                return [bool(v) for v in items] if item_type == GGUFValueType.BOOL else items
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(item_type, depth + 1) for _ in range(count)]
        if vtype not in _NUMERIC:
            raise ValueError(f"unknown metadata value type {vtype}")
        dtype = np.dtype(_NUMERIC[GGUFValueType(vtype)])
        v = np.frombuffer(self.take(dtype.itemsize), dtype)[0].item()
        return bool(v) if vtype == GGUFValueType.BOOL else v


_MAX_ARRAY_DEPTH = 8
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _parse_header(buf: np.ndarray, file: str) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    """(metadata, tensor infos, byte offset of the data section)."""
    cur = _Cursor(buf)
    try:
        if bytes(cur.take(4)) != _MAGIC:
            raise CorruptWeights(f"{file}: not a GGUF file (bad magic)", path=file)
        version = cur.u32()
        if version not in (2, 3):
            raise UnsupportedModel(
                f"{file}: GGUF version {version} is not supported (2 or 3, little-endian)",
                path=file,
            )
        n_tensors, n_fields = cur.u64(), cur.u64()
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.u32())
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.u64() for _ in range(cur.u32()))
            qtype = GGMLQuantizationType(cur.u32())
            infos.append(_TensorInfo(name, dims, qtype, cur.u64()))
    except ValueError as exc:  # overruns, unknown enum values
        raise CorruptWeights(f"{file}: not a readable GGUF file ({exc})", path=file) from exc
    align = fields.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        raise CorruptWeights(f"{file}: invalid general.alignment {align!r}", path=file)
    data_start = -(-cur.pos // align) * align
    return fields, infos, data_start


def _extent(buf: np.ndarray, data_start: int, info: _TensorInfo, file: str) -> tuple[int, int]:
    """(first byte, byte count) of a tensor, checked to lie inside the file.

    Raises:
        UnsupportedModel: a tensor type this reader does not know.
        CorruptWeights: rows that are not whole blocks, or bytes past the end of the file.
    """
    if info.qtype not in GGML_QUANT_SIZES:
        raise UnsupportedModel(
            f"{file}: tensor {info.name!r} has type {info.qtype.name}, which is not supported",
            path=file,
        )
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    n = math.prod(info.dims)
    start = data_start + info.offset
    nbytes = n // block * type_size
    # Quantized rows are whole blocks: the contiguous axis (dims[0]) is a multiple of the block.
    if (info.dims and info.dims[0] % block != 0) or start + nbytes > len(buf):
        raise CorruptWeights(
            f"{file}: tensor {info.name!r} is truncated or malformed "
            f"({nbytes} bytes at offset {start}, file has {len(buf)})",
            path=file,
        )
    return start, nbytes


def _read_tensor(
    buf: np.ndarray, start: int, nbytes: int, info: _TensorInfo, file: str
) -> torch.Tensor:
    """One tensor as a CPU torch tensor of shape ``reversed(dims)`` (row-major, HF order).

    Quantized types are dequantized to float32; F16/BF16 keep their dtype. Always a copy.
    """
    shape = tuple(reversed(info.dims))
    raw = buf[start : start + nbytes]
    try:
        if info.qtype == GGMLQuantizationType.F16:
            return torch.from_numpy(raw.view(np.float16).reshape(shape).copy())
        if info.qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(raw.view(np.int16).reshape(shape).copy()).view(torch.bfloat16)
        # Damaged scales can be inf/NaN; check_weights rejects non-finite weights by name.
        with np.errstate(all="ignore"):
            values = dequantize_blocks(raw, info.qtype, shape)
    except (ValueError, NotImplementedError) as exc:
        raise CorruptWeights(
            f"{file}: cannot dequantize tensor {info.name!r} ({info.qtype.name}: {exc})",
            path=file,
        ) from exc
    return torch.from_numpy(values)


def _f32(value: float) -> float:
    # GGUF stores float32; print-round-trip to the shortest decimal (9.99999974e-06 -> 1e-05),
    # which is the value the original config.json held.
    return float(str(np.float32(value)))


class _Fields:
    """Typed reads of GGUF metadata: a missing or ill-typed value is CorruptWeights naming the
    file and key, never a bare TypeError/ValueError from a damaged file
    (``architectures.GGUFMetadata``)."""

    def __init__(self, fields: dict[str, Any], file: str) -> None:
        self.fields = fields
        self.file = file

    def pos_f32(self, key: str, default: float | None = None) -> float:
        """A positive float as the original config held it (``_f32``)."""
        return _f32(self.pos_float(key, default))

    def _bad(self, key: str, what: str) -> CorruptWeights:
        value = self.fields.get(key)
        shown = repr(value) if len(repr(value)) < 80 else type(value).__name__
        return CorruptWeights(
            f"{self.file}: metadata {key} must be {what}, got {shown}", path=self.file
        )

    def pos_int(self, key: str, default: int | None = None) -> int:
        value = self.fields.get(key, default)
        if value is None:
            raise CorruptWeights(f"{self.file}: metadata key {key} is missing", path=self.file)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self._bad(key, "a positive integer")
        return value

    def opt_int(self, key: str) -> int | None:
        value = self.fields.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self._bad(key, "a non-negative integer")
        return value

    def opt_bool(self, key: str) -> bool | None:
        value = self.fields.get(key)
        if value is not None and not isinstance(value, bool):
            raise self._bad(key, "a bool")
        return value

    def pos_float(self, key: str, default: float | None = None) -> float:
        value = self.fields.get(key, default)
        if value is None:
            raise CorruptWeights(f"{self.file}: metadata key {key} is missing", path=self.file)
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise self._bad(key, "a positive number")
        return float(value)

    def opt_pos_float(self, key: str) -> float | None:
        return None if self.fields.get(key) is None else self.pos_float(key)

    def opt_str(self, key: str) -> str | None:
        value = self.fields.get(key)
        if value is not None and not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def opt_list(self, key: str, item: type) -> list[Any] | None:
        value = self.fields.get(key)
        if value is None:
            return None
        # the types present, in C (a vocabulary is ~150k items): then one check per type
        if not isinstance(value, list) or not all(
            issubclass(t, item) for t in set(map(type, value))
        ):
            raise self._bad(key, f"a list of {item.__name__}")
        return value


def _config_from_fields(fields: dict[str, Any], tensors: set[str], file: str) -> ModelConfig:
    architecture = from_gguf_name(fields.get("general.architecture"), file)
    arch = architecture.gguf_name  # the prefix of its metadata keys
    assert arch is not None  # from_gguf_name matched it
    f = _Fields(fields, file)
    hidden = f.pos_int(f"{arch}.embedding_length")
    heads = f.pos_int(f"{arch}.attention.head_count")
    kv_heads = f.pos_int(f"{arch}.attention.head_count_kv", heads)
    num_layers = f.pos_int(f"{arch}.block_count")
    # The architecture's own fields (Gemma 3's windows; DeepSeek's latent attention, whose
    # rotary dims are a part of its heads).
    extra = architecture.gguf_fields(f, arch, num_layers)
    head_dim = f.pos_int(f"{arch}.attention.key_length", hidden // heads)
    rope_dim = f.pos_int(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim and "head_dim" not in extra:
        raise UnsupportedModel(
            f"{file}: partial rotary embeddings (rope dim {rope_dim} of head dim {head_dim}) "
            "are not supported",
            path=file,
        )
    if f"{arch}.attn_logit_softcapping" in fields:
        raise UnsupportedModel(f"{file}: attention logit soft-capping is not supported", path=file)
    # The vocab size: stated, else the token list's length (check_weights compares it with the
    # embedding's rows).
    tokens = f.opt_list("tokenizer.ggml.tokens", str) or []
    fields_: dict[str, Any] = dict(
        architecture=architecture.name,
        vocab_size=f.pos_int(f"{arch}.vocab_size", len(tokens) or None),
        hidden_size=hidden,
        intermediate_size=f.pos_int(f"{arch}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(f.pos_float(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(f.pos_float(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=f.pos_int(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=None if "rope_scaling" in extra else _rope_scaling(f, arch),
        bos_token_id=f.opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(f, architecture, tokens),
    )
    fields_.update(extra)  # the architecture's own readings win
    return make_config(file, **fields_)


def _eos_ids(f: _Fields, arch: Architecture, tokens: list[str]) -> tuple[int, ...]:
    """The file's EOS and end-of-turn ids, and the architecture's end-of-turn token where the
    file names none (Gemma's files name only ``<eos>``; its chats end with ``<end_of_turn>``)."""
    ids = [f.opt_int("tokenizer.ggml.eos_token_id"), f.opt_int("tokenizer.ggml.eot_token_id")]
    if arch.end_of_turn is not None and arch.end_of_turn in tokens:
        ids.append(tokens.index(arch.end_of_turn))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _rope_scaling(f: _Fields, arch: str) -> RopeScaling | None:
    kind = f.opt_str(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise UnsupportedModel(
            f"{f.file}: rope scaling type {kind!r} is not supported", path=f.file
        )
    factor = f.pos_float(f"{arch}.rope.scaling.factor", 1.0)
    return None if factor == 1.0 else RopeScaling(kind="linear", factor=factor)


def _tokenizer_from_fields(fields: dict[str, Any], file: str) -> Tokenizer:
    f = _Fields(fields, file)
    model = fields.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedModel(
            f"{file}: tokenizer type {model!r} is not supported (byte-level BPE 'gpt2', "
            "SentencePiece BPE 'llama')",
            path=file,
        )
    tokens = f.opt_list("tokenizer.ggml.tokens", str)
    if not tokens:
        raise CorruptWeights(f"{file}: tokenizer tokens are missing", path=file)
    token_types = f.opt_list("tokenizer.ggml.token_type", int)
    if token_types is not None and len(token_types) != len(tokens):
        raise CorruptWeights(f"{file}: token_type and tokens differ in length", path=file)
    # The architecture may be unknown here (load_gguf_tokenizer): its defaults are optional.
    name = fields.get("general.architecture")
    arch = next(
        (a for a in architectures() if a.gguf_name is not None and a.gguf_name == name), None
    )
    template = f.opt_str("tokenizer.chat_template")
    if template is None and arch is not None:
        template = arch.default_chat_template
    eos_ids = _eos_ids(f, arch, tokens) if arch is not None else ()
    bos = f.opt_int("tokenizer.ggml.bos_token_id")
    eos = f.opt_int("tokenizer.ggml.eos_token_id")
    # convert_hf_to_gguf writes the flag; absent, do as transformers does for BPE: no BOS.
    add_bos = fields.get("tokenizer.ggml.add_bos_token") is True
    if model == "llama":
        try:
            backend = spm_backend(tokens, token_types, f.opt_int("tokenizer.ggml.unknown_token_id"))
        except ValueError as exc:
            raise CorruptWeights(f"{file}: {exc}", path=file) from exc
        return Tokenizer(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos_token=add_bos,
            chat_template=template,
            extra_eos_token_ids=eos_ids,
            vocab_size=len(tokens),
        )
    pre = f.opt_str("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise UnsupportedModel(
            f"{file}: tokenizer pre-tokenizer type {pre!r} is not supported "
            f"(supported: {sorted(p for p in GGUF_PRE_TOKENIZERS if p)})",
            path=file,
        )
    merges = f.opt_list("tokenizer.ggml.merges", str)
    if merges is None:
        raise CorruptWeights(f"{file}: tokenizer merges are missing", path=file)
    eot = f.opt_int("tokenizer.ggml.eot_token_id")
    try:
        return Tokenizer.from_gguf_fields(
            tokens,
            merges,
            token_types,
            pre=pre,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos_token=add_bos,
            chat_template=template,
            extra_eos_token_ids=list(eos_ids) or ([] if eot is None else [eot]),
        )
    except ValueError as exc:  # malformed merges / vocabulary
        raise CorruptWeights(f"{file}: {exc}", path=file) from exc
