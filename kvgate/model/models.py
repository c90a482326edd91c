"""The model class of a config's architecture (``Architecture.model``, declared in its model
module); each satisfies the ``Model`` protocol (``protocol.py``) the runner drives, on the
shared ``DecoderModel``."""

from __future__ import annotations

from typing import Any

from kvgate.model.config import ModelConfig
from kvgate.model.decoder import DecoderModel


def model_class(config: ModelConfig) -> type[DecoderModel[Any]]:
    """The class whose forward pass runs ``config``'s architecture."""
    return config.arch.model
