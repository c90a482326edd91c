"""What the engine needs of a model: the ``Model`` protocol the runner drives.

A model class (``models.py``) declares what each layer keeps in the KV pool (``kv_specs``,
before it is built), holds its weights and runs one step over the flat batch; the KV
cache's layout belongs to the attention backend chosen for those specs
(``attention_backends.py``: ``kv_cache_shape``, ``write_kv``), the grouping of layers into
block tables to ``KVLayout``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Protocol

import torch

from kvgate.model.attention import AttentionBackend, AttentionMetadata
from kvgate.model.config import ModelConfig
from kvgate.model.row_roles import RowRoles


class Model(Protocol):
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    #: Whether prompt tokens take other linears than generated ones (``row_roles``): the
    #: engine then tells each step's prompt rows, and keeps their cached blocks apart.
    prompt_tiles: bool
    attention: AttentionBackend

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V)
        meta: AttentionMetadata | Sequence[AttentionMetadata],  # the step's, or per layer
        roles: RowRoles | None = None,
    ) -> torch.Tensor:  # [T, H] final-normed hidden states
        ...

    def stepwise(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        pause: bool,
        roles: RowRoles | None = None,
    ) -> Generator[None, None, torch.Tensor]:
        """``forward`` as a generator pausing after each layer but the last (with ``pause``):
        the engine's step drives it and may run an urgent step at a pause. ``roles``: the
        step's prompt rows (``kvgate.model.row_roles``), where the model has ``prompt_tiles``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        ...

    def build_info(self, isa: str) -> dict[str, str]:
        """What runs each op (for the start-up log and ``kvgate:build_info``)."""
        ...

    def num_parameters(self) -> int: ...

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads."""
        ...
