"""Rotary position embeddings, with the linear, Llama-3 and YaRN frequency scalings."""

from __future__ import annotations

import math

import torch

from kvgate.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as the config asks."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones are kept,
        # and wavelengths in between are interpolated smoothly (Llama 3.1's recipe).
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if scaling.kind == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling {scaling.kind!r}")


def _yarn_inverse_frequencies(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those turning more than ``beta_fast`` times
    kept, with a linear ramp between (as transformers' ``_compute_yarn_parameters``)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (s.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        original = s.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each frequency kept as it was
    return interpolated * (1 - keep) + extrapolated * keep


class RotaryEmbedding:
    """Precomputed cos/sin tables, gathered per step by token position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim], HF's layout
        # Computed in float32 (YaRN's attention factor applied there), then cast: the same
        # values HF's rotary embeddings produce.
        scale = scaling.cos_sin_scale() if scaling is not None else 1.0
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(dtype=dtype, device=device)
        sin = sin.to(dtype=dtype, device=device)
        # HF rotates with rotate_half(x) = cat(-x2, x1). Folding the minus sign into the first
        # half of the table turns that into a plain roll of x: cat(x2, x1) * cat(-s1, s2).
        # Negation is exact, so the products are bit-identical to HF's.
        half = head_dim // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for these positions: [T, 1, head_dim] each, broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; tables from ``RotaryEmbedding.tables``: [T, 1, head_dim]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
