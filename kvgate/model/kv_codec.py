"""How K/V rows are stored when not in the model's dtype (``--kv-cache-dtype``).

A row is one token of one KV head, ``D`` values. ``int8`` and ``fp8`` (e4m3) store each row
quantized with a float32 scale per ``SCALE_GROUP`` (32) values, the group's largest
magnitude over the format's largest value (127; 448), after the values: a row of 128 is
128 + 16 bytes of a ``uint8`` cache (against 256 in bf16), so the scales travel with the
values through every gather and need no table of their own. A float dtype other than the
model's (``bfloat16`` KV under a float32 model) is a plain cast.

Scales per token, head and 32 channels keep an outlier token, head or channel from costing
the others their precision (the failure mode of a per-tensor scale without calibration).
fp8's error is relative (1/16 of a value at most, whatever the scale), so scales cannot help
a channel ~100x the rest, as some of Qwen2.5's keys are (its key bias: up to 354 against
keys of ~3 elsewhere, on channels RoPE hardly turns): e4m3 leaves such a channel an error
of ~12, which moves a score by more than most whole scores are. Quantized keys are therefore
stored less a constant per layer, KV head and channel (``key_offset``: that bias, where RoPE
leaves it in place), which changes no attention weight: every score of a query moves by the
same ``q . offset``, and softmax does not see a shift common to all its inputs. Measured
(Qwen2.5-Coder-1.5B, Intel Xeon AMX, per-op path): fp8 perplexity +146% -> +1.0% on English,
+45% -> -0.8% on Chinese; int8 within 1.2% either way (``tests/e2e/test_kv_dtype.py``).

Every path that reads K/V, a fresh prompt's own included, reads ``decode(encode(x))``: the
same prompt chunked, continued from a prefix hit or recomputed after preemption attends over
the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.model.kv_spec import scale_groups

#: The formats with a scale a row, and the largest value each represents.
_SCALED = {"int8": 127.0, "fp8": 448.0}
#: Each format's storage element, as ``KVSpec.dtype`` names them.
STORAGE = {
    "int8": torch.uint8,
    "fp8": torch.uint8,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}
SCALE_BYTES = 4  # a float32 scale a row


def is_scaled(name: str) -> bool:
    return name in _SCALED


@dataclass(frozen=True)
class KVCodec:
    """Rows of K/V stored as ``name`` for attention computed in ``compute_dtype``."""

    name: str  # a key of ``STORAGE``
    compute_dtype: torch.dtype

    @property
    def scaled(self) -> bool:
        """Quantized rows with scales (int8, fp8), not a cast."""
        return is_scaled(self.name)

    @property
    def storage_dtype(self) -> torch.dtype:
        return STORAGE[self.name]

    def row_width(self, dim: int) -> int:
        """Elements of the storage dtype a row of ``dim`` values takes."""
        return dim + SCALE_BYTES * scale_groups(dim) if is_scaled(self.name) else dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] in the compute dtype -> [..., row_width(D)] rows to store."""
        if not is_scaled(self.name):
            return x.to(self.storage_dtype)
        *lead, d = x.shape
        groups = scale_groups(d)
        xf = x.float().reshape(*lead, groups, d // groups)
        top = _SCALED[self.name]
        scale = xf.abs().amax(dim=-1, keepdim=True) / top  # [..., groups, 1]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
        scaled = (xf / scale).reshape(*lead, d)
        if self.name == "int8":
            values = scaled.round_().clamp_(-top, top).to(torch.int8).view(torch.uint8)
        else:
            values = scaled.clamp_(-top, top).to(torch.float8_e4m3fn).view(torch.uint8)
        scales = scale.reshape(*lead, groups).contiguous().view(torch.uint8)
        return torch.cat((values, scales), dim=-1)

    def decode(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """[..., row_width(dim)] stored rows -> [..., dim] in the compute dtype."""
        if not is_scaled(self.name):
            return rows.to(self.compute_dtype)
        *lead, _ = rows.shape
        groups = scale_groups(dim)
        kind = torch.int8 if self.name == "int8" else torch.float8_e4m3fn
        values = rows[..., :dim].contiguous().view(kind).float()
        scale = rows[..., dim:].contiguous().view(torch.float32)  # [..., groups]
        values = values.view(*lead, groups, dim // groups) * scale.unsqueeze(-1)
        return values.view(*lead, dim).to(self.compute_dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a later read of ``x`` from the pool gives."""
        return self.decode(self.encode(x), x.shape[-1])


#: A key channel whose RoPE pair turns by at most this many radians over the model's whole
#: context counts as unturned (``key_offset``); one radian leaves a bias b within |b| of
#: where it started, so subtracting it never widens the channel's range.
UNTURNED_RADIANS = 1.0


def key_offset(
    k_bias: torch.Tensor,  # [Hkv * D] the key projection's bias
    inv_freq: torch.Tensor,  # [D // 2] RoPE's inverse frequencies (rotate-half pairs j, j + D/2)
    max_positions: int,
) -> torch.Tensor | None:
    """[Hkv, D] float32 that quantized keys are stored less, after RoPE: the key bias on the
    channels RoPE turns by at most ``UNTURNED_RADIANS`` over ``max_positions``, 0 on the
    others; None where it is 0 everywhere. Any constant would leave attention as it is (see
    the module docstring); this one takes out what makes some keys ~100x the rest."""
    unturned = (inv_freq.float() * max_positions <= UNTURNED_RADIANS).repeat(2)  # [D]
    d = unturned.numel()
    offset = k_bias.detach().float().reshape(-1, d) * unturned
    return offset.contiguous() if bool(offset.any()) else None


def codec_for(name: str, compute_dtype: torch.dtype) -> KVCodec | None:
    """The codec for K/V stored as ``name`` (a ``KVSpec.dtype``) under attention in
    ``compute_dtype``; None where they are the same (stored as computed)."""
    if name not in STORAGE:
        raise ValueError(f"KV dtype must be one of {sorted(STORAGE)}, got {name!r}")
    if not is_scaled(name) and STORAGE[name] == compute_dtype:
        return None
    return KVCodec(name, compute_dtype)
