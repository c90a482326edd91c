"""RoPE frequency scalings against transformers' own computation of them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvgate.model.hf_loader import read_rope
from kvgate.model.rope import inverse_frequencies

_YARN_CASES: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's and V2's settings, Qwen2.5's, and the optional keys left out, unset or 0.
    "deepseek-v3": {"factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "deepseek-v2": {"factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "qwen2.5": {"factor": 4.0, "original_max_position_embeddings": 32768},
    "no-truncation": {"factor": 4.0, "original_max_position_embeddings": 32768, "truncate": False},
    "truncate-null": {"factor": 4.0, "original_max_position_embeddings": 32768, "truncate": None},
    "zeros": {"factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 0,
              "beta_slow": None, "mscale": 0},
    "mscale-only": {"factor": 4.0, "original_max_position_embeddings": 32768, "mscale": 1.0},
    "no-original": {"factor": 4.0},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_YARN_CASES))
def test_yarn_equals_transformers(case: str) -> None:
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", **_YARN_CASES[case]}
    raw = {"rope_theta": 10000.0, "rope_scaling": dict(scaling), "max_position_embeddings": 163840}
    theta, got = read_rope(raw, "config.json")
    assert got is not None and got.kind == "yarn"
    config = DeepseekV3Config(
        qk_rope_head_dim=64,
        max_position_embeddings=163840,
        rope_parameters={**scaling, "rope_theta": 10000.0},
    )
    want, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(inverse_frequencies(64, theta, got), want)
    assert got.cos_sin_scale() == pytest.approx(attention_factor, rel=1e-12)
