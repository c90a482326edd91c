"""What a checkpoint stores, read from its headers alone: the config, and each weight the
forward pass reads with its shape, storage type and bytes in the file. Nothing is
dequantized or copied; a GGUF file's header (its vocabulary included) and a safetensors
file's JSON header are all that is read. For sizing a model before loading it
(``kvgate plan``, ``launch/plan.py``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvgate.errors import CorruptWeights, ModelNotFound, UnsupportedModel
from kvgate.hf_files import read_json_object
from kvgate.model.config import ModelConfig

__all__ = ["StoredModel", "StoredWeight", "read_stored_model"]

#: Bytes per element of the dense storage types (safetensors' names, which GGUF's match):
#: floats, and the integer tables some architectures keep (DeepSeek-V4's expert choices).
DENSE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1}  # fmt: skip
INTEGER_KINDS = frozenset({"I64", "I32", "I16", "I8", "U8", "BOOL"})


@dataclass(frozen=True)
class StoredWeight:
    name: str  # Hugging Face name (``Architecture.weights``)
    shape: tuple[int, ...]  # HF order: [out, in]
    #: ``F32``, ``F16``, ``BF16``, or a GGML block type's name (``Q4_K``, ``Q8_0``, ...).
    kind: str
    nbytes: int  # bytes in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StoredModel:
    config: ModelConfig
    weights: tuple[StoredWeight, ...]  # in ``Architecture.weights`` order
    path: str  # the file or directory read
    gguf: bool  # a GGUF file (else a Hugging Face directory)


def read_stored_model(model: str | os.PathLike[str]) -> StoredModel:
    """The stored weights of a model alias, GGUF file or Hugging Face directory, as
    ``load_checkpoint`` would find them, restricted to the weights the forward pass reads
    (a tied head stored anyway, ``rotary_emb.inv_freq`` and the like are never resident).

    Raises:
        ModelNotFound / CorruptWeights / UnsupportedModel: as ``load_checkpoint``.
    """
    from kvgate.model.gguf_loader import is_gguf_file, read_gguf_header
    from kvgate.model.registry import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        config, stored = _read_hf_dir(path)
        return StoredModel(config, _expected(config, stored, str(path)), str(path), gguf=False)
    if not is_gguf_file(path):
        raise UnsupportedModel(
            f"{path}: not a GGUF file (no GGUF magic) nor a Hugging Face model directory",
            path=str(path),
        )
    config, tensors = read_gguf_header(path)
    stored = {t.name: StoredWeight(t.name, t.shape, t.qtype.name, t.nbytes) for t in tensors}
    return StoredModel(config, _expected(config, stored, str(path)), str(path), gguf=True)


def _expected(
    config: ModelConfig, stored: dict[str, StoredWeight], where: str
) -> tuple[StoredWeight, ...]:
    out = []
    for name, _ in config.arch.weights(config):
        if name not in stored:
            raise CorruptWeights(f"{where}: missing tensor {name!r}", path=where)
        out.append(stored[name])
    return tuple(out)


def _read_hf_dir(root: Path) -> tuple[ModelConfig, dict[str, StoredWeight]]:
    from safetensors import safe_open

    from kvgate.model.hf_loader import config_from_hf

    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(
            f"{root}: no config.json (not a Hugging Face model directory)", path=str(config_file)
        )
    raw = read_json_object(config_file)
    generation = read_json_object(root / "generation_config.json", missing_ok=True)
    config = config_from_hf(raw, str(config_file), generation=generation)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{root}: no *.safetensors weights", path=str(root))
    stored: dict[str, StoredWeight] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    piece = f.get_slice(key)
                    kind, shape = piece.get_dtype(), tuple(piece.get_shape())
                    if kind not in DENSE_BYTES:
                        raise UnsupportedModel(
                            f"{file}: tensor {key!r} is {kind}, which is not supported",
                            path=str(file),
                        )
                    name = config.arch.hf_name(key)
                    stored[name] = StoredWeight(
                        name, shape, kind, math.prod(shape) * DENSE_BYTES[kind]
                    )
        except (UnsupportedModel, ModelNotFound):
            raise
        except Exception as exc:  # SafetensorError, OSError on truncated/garbage files
            raise CorruptWeights(
                f"{file}: cannot read safetensors ({exc})", path=str(file)
            ) from exc
    return config, stored
