"""The model class of each architecture (``Architecture.model_class``); each satisfies the
``Model`` protocol (``protocol.py``) the runner drives, on the shared ``DecoderModel``."""

from __future__ import annotations

from typing import Any

from kvgate.model.config import ModelConfig
from kvgate.model.decoder import DecoderModel
from kvgate.model.gemma3 import Gemma3Model
from kvgate.model.llama import LlamaModel

_CLASSES: dict[str, type[DecoderModel[Any]]] = {"llama": LlamaModel, "gemma3": Gemma3Model}


def model_class(config: ModelConfig) -> type[DecoderModel[Any]]:
    """The class whose forward pass runs ``config``'s architecture."""
    return _CLASSES[config.arch.model_class]
