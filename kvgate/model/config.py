"""Architecture hyper-parameters of a decoder model, independent of where they were read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgate.errors import UnsupportedModel

if TYPE_CHECKING:
    from kvgate.model.architectures import Architecture


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF configs describe it.

    ``kind``: ``"linear"`` (positions divided by ``factor``), ``"llama3"`` (low frequencies
    divided by ``factor``, high ones kept, a smooth ramp in between) or ``"yarn"`` (the same
    idea with the ramp between ``beta_fast`` and ``beta_slow`` rotations over the original
    context, and cos/sin scaled by ``attention_factor``).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: YaRN's magnitude constants (``yarn_mscale``), where the config gives them.
    mscale: float | None = None
    mscale_all_dim: float | None = None
    #: cos/sin scale; None: from ``factor`` (and ``mscale`` / ``mscale_all_dim``).
    attention_factor: float | None = None
    truncate: bool = True

    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 mscale ln(factor) + 1 (1 for no stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of the forward pass. Built by a loader; holds no weights."""

    architecture: str  # a name in ``architectures.ARCHITECTURES``: "llama", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: Per layer: ``"full"`` attention or ``"sliding"`` (over the last ``sliding_window``
    #: tokens, the query's own included). Empty: every layer is full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    #: RoPE base of the sliding layers where it differs from ``rope_theta`` (Gemma 3: 10k local,
    #: 1M global); the sliding layers never use ``rope_scaling``.
    rope_local_theta: float | None = None
    #: Softmax scale of attention scores; None: ``head_dim ** -0.5``.
    attention_scale: float | None = None
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    #: logits <- tanh(logits / cap) * cap (Gemma 2 style); None: none.
    final_logit_softcapping: float | None = None
    #: The architecture's own settings, a frozen dataclass its model module defines and reads
    #: (DeepSeek's latent attention and experts); None: it has none.
    arch_fields: Any = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModel(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})",
                path="<config>",
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise UnsupportedModel(
                f"{len(self.layer_types)} layer types for {self.num_layers} layers",
                path="<config>",
            )
        if set(self.layer_types) - {"full", "sliding"}:
            raise UnsupportedModel(
                f"layer types must be 'full' or 'sliding', got {sorted(set(self.layer_types))}",
                path="<config>",
            )
        if "sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise UnsupportedModel("sliding layers need a positive sliding_window", path="<config>")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModel(
                f"activation {self.hidden_act!r} is not supported (silu, gelu_tanh)",
                path="<config>",
            )

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` in tokens (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "sliding":
            return self.sliding_window
        return None

    @property
    def arch(self) -> Architecture:
        """Its architecture's record (declared in its model module, ``architectures.py``)."""
        from kvgate.model.architectures import architecture  # the registry imports models

        return architecture(self.architecture)

    @property
    def attention_bias(self) -> bool:
        """Biases on the q, k and v projections (Qwen2)."""
        return self.arch.qkv_bias

    @property
    def qk_norm(self) -> bool:
        """A per-head RMSNorm on q and k before RoPE (Qwen3)."""
        return self.arch.qk_norm
