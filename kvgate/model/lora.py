"""LoRA adapters in PEFT's format, applied per request on top of a shared base model.

An adapter (``LoraAdapter``) is a directory as ``peft``'s ``save_pretrained`` writes it:
``adapter_config.json`` and ``adapter_model.safetensors``. Each targeted projection ``m`` of
layer ``i`` has factors A [r, in] and B [out, r]; its output becomes
``y + scale * (x @ A^T) @ B^T``, ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``). Targets: q/k/v/o_proj and gate/up/down_proj, any subset; anything else PEFT
can express (biases, DoRA, embeddings, the LM head, ...) is refused at load, as is any
tensor whose shape does not fit the model (``check``).

The model's layers fuse projections (``decoder.AttentionMlp``): ``qkv`` is q, k, v
concatenated along the outputs, ``gate_up`` gate then up. An adapter keeps, per layer and
fused linear, one pair (``LoraFactors``): A of its targeted modules stacked [k r, in] and B
block-diagonal [out, k r] (B_m in module m's rows and columns; zero rows for the modules it
does not target), so a fused linear's delta is two matmuls whatever it targets. B costs up to
3x the bytes of the separate B_m (``nbytes`` counts what is held); at rank 16 it is ~1% of a
layer's weights. ``weights`` gives each module's A and B as views into them.

A step's rows (``LoraRows``) are grouped by adapter: the base linear runs once over all T
rows, then per adapter present one low-rank product over its rows only, added in place
(``LoraRows.add``). The delta is computed in float32 from the linear's input cast to float32
and added to its output in the output's dtype.

Shapes: T rows in the step, H hidden, Hq / Hkv heads, D head dim, I intermediate, r rank.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvgate.errors import InvalidConfig
from kvgate.model.config import ModelConfig

#: The projections an adapter may target, by PEFT's (HF's) module name, with their parent.
MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
#: The model's fused linears and the modules each concatenates, in output order.
FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
#: adapter_config.json settings that change what the adapter computes: refused when set.
_UNSUPPORTED = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "arrow_config",
    "use_qalora",
    "use_bdlora",
)
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight"
)
PARAM = "lora_adapter"


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of ``module`` in ``config``'s layers."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def tensor_name(layer: int, module: str, factor: str) -> str:
    """A factor's name in the safetensors file, less PEFT's ``base_model.model.``."""
    return f"model.layers.{layer}.{MODULES[module]}.{module}.lora_{factor}.weight"


@dataclass(frozen=True)
class LoraFactors:
    """One fused linear's factors (see the module docstring): y[:, :] += scale * x A^T B^T."""

    a: torch.Tensor  # [k r, in] float32: A of the k targeted modules, stacked
    b: torch.Tensor  # [out, k r] float32: block-diagonal, zero rows for untargeted modules


class LoraAdapter:
    """A PEFT LoRA adapter read from a directory and checked against a model's config.

    ``weights[(layer, module)]``: (A [r, in], B [out, r]) float32, views into ``factors``;
    ``factors[(layer, linear)]``: per fused linear (``FUSED``), where it targets any of its
    modules. Compared by identity: one object per loaded adapter."""

    def __init__(
        self,
        path: str | Path,
        config: ModelConfig,
        *,
        name: str | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Read the adapter in ``path`` for a model of ``config`` (refused with
        ``InvalidConfig`` where it does not fit) and keep its factors on ``device``."""
        self.path = Path(path)
        self.name = name if name is not None else self.path.name
        settings = self._settings()
        self.rank = _positive_int(settings, "r", self._where)
        alpha = settings.get("lora_alpha", 8)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise self._refuse("lora_alpha must be a positive number")
        self.alpha = float(alpha)
        self.use_rslora = bool(settings.get("use_rslora", False))
        self.scale = self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)
        layers = settings.get("layers_to_transform")
        if isinstance(layers, int):
            layers = [layers]
        if layers is not None and (
            not isinstance(layers, list) or not all(type(i) is int for i in layers)
        ):
            raise self._refuse(f"layers_to_transform must list layer indices, not {layers!r}")
        #: The layers the adapter says it changes (None: every layer it has factors for).
        self.layers_to_transform: tuple[int, ...] | None = None if layers is None else tuple(layers)
        raw = self._tensors()
        self.target_modules = frozenset(module for _, module in raw)
        self._check(raw, config)
        self.factors = _fuse(raw, config, self.rank, torch.device(device))
        self.weights = _views(self.factors, config, raw.keys(), self.rank)
        self.nbytes = sum(
            f.a.numel() * f.a.element_size() + f.b.numel() * f.b.element_size()
            for f in self.factors.values()
        )

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, r={self.rank}, modules={sorted(self.target_modules)})"

    @property
    def _where(self) -> str:
        return f"LoRA adapter {self.name!r} ({self.path})"

    def _refuse(self, why: str) -> InvalidConfig:
        return InvalidConfig(f"{self._where}: {why}", param=PARAM)

    def check(self, config: ModelConfig) -> None:
        """Refuse (``InvalidConfig``) a model this adapter does not fit: a layer past its
        layers, or a factor of another shape than its projections' (naming the tensor and
        the shapes expected and found)."""
        self._check(self.weights, config)
        for (layer, linear), f in self.factors.items():
            want = sum(module_shape(config, m)[1] for m in FUSED[linear])
            if f.b.shape[0] != want:  # an untargeted module of the fused linear differs
                raise self._refuse(
                    f"layer {layer}'s {linear} has {want} outputs in this model, "
                    f"{f.b.shape[0]} in the one it was loaded for"
                )

    # ------------------------------------------------------------------ reading
    def _settings(self) -> dict[str, Any]:
        file = self.path / "adapter_config.json"
        if not file.is_file():
            raise self._refuse("no adapter_config.json (a PEFT adapter directory is expected)")
        try:
            settings = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise self._refuse(f"adapter_config.json is not readable JSON: {exc}") from exc
        if not isinstance(settings, dict):
            raise self._refuse("adapter_config.json is not a JSON object")
        if settings.get("peft_type", "LORA") != "LORA":
            raise self._refuse(f"peft_type {settings['peft_type']!r} is not supported (LORA)")
        if settings.get("bias", "none") != "none":
            raise self._refuse(f"bias {settings['bias']!r} is not supported (only 'none')")
        for key in _UNSUPPORTED:
            if settings.get(key):
                raise self._refuse(f"{key} ({settings[key]!r}) is not supported")
        targets = settings.get("target_modules")
        if isinstance(targets, list):
            for target in targets:
                if str(target).rsplit(".", 1)[-1] not in MODULES:
                    raise self._refuse(
                        f"target module {target!r} is not supported (only {', '.join(MODULES)})"
                    )
        return settings

    def _tensors(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) float32 per (layer, module), as the file has them."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        file = self.path / "adapter_model.safetensors"
        if not file.is_file():
            bin_only = (self.path / "adapter_model.bin").exists()
            also = " (adapter_model.bin is not read)" if bin_only else ""
            raise self._refuse(f"no adapter_model.safetensors{also}")
        try:
            tensors = load_file(file)
        except (OSError, SafetensorError) as exc:
            raise self._refuse(f"adapter_model.safetensors is not readable: {exc}") from exc
        found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            m = _KEY.fullmatch(key)
            if m is None or m[3] not in MODULES or MODULES[m[3]] != m[2]:
                raise self._refuse(
                    f"tensor {key!r} is not supported (only lora_A / lora_B of a layer's "
                    f"{', '.join(MODULES)})"
                )
            found.setdefault((int(m[1]), m[3]), {})[m[4]] = tensor.float()
        if not found:
            raise self._refuse("adapter_model.safetensors holds no LoRA factors")
        pairs = {}
        for (layer, module), ab in sorted(found.items()):
            if set(ab) != {"A", "B"}:
                missing = "B" if "A" in ab else "A"
                raise self._refuse(f"tensor {tensor_name(layer, module, missing)!r} is missing")
            pairs[(layer, module)] = (ab["A"], ab["B"])
        return pairs

    def _check(
        self, weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        config: ModelConfig,
    ) -> None:  # fmt: skip
        n = config.num_layers
        beyond = [i for i in self.layers_to_transform or () if not 0 <= i < n]
        if beyond:
            raise self._refuse(f"layers_to_transform {beyond} are beyond the model's {n} layers")
        for (layer, module), (a, b) in weights.items():
            if layer >= n:
                raise self._refuse(
                    f"tensor {tensor_name(layer, module, 'A')!r} is for layer {layer}; "
                    f"the model has {n} layers"
                )
            fan_in, fan_out = module_shape(config, module)
            for factor, got, want in (
                ("A", a, (self.rank, fan_in)),
                ("B", b, (fan_out, self.rank)),
            ):
                if tuple(got.shape) != want:
                    raise self._refuse(
                        f"tensor {tensor_name(layer, module, factor)!r} has shape "
                        f"{list(got.shape)}, expected {list(want)} (r={self.rank}, "
                        f"hidden_size={config.hidden_size}, intermediate_size="
                        f"{config.intermediate_size}, heads={config.num_heads}/"
                        f"{config.num_kv_heads}x{config.head_dim})"
                    )


def _positive_int(settings: Mapping[str, Any], key: str, where: str) -> int:
    value = settings.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidConfig(
            f"{where}: {key} must be a positive integer, not {value!r}", param=PARAM
        )
    return value


def _fuse(
    raw: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    config: ModelConfig,
    r: int,
    device: torch.device,
) -> dict[tuple[int, str], LoraFactors]:
    """Each fused linear's stacked A and block-diagonal B (the module docstring)."""
    factors = {}
    for layer in sorted({i for i, _ in raw}):
        for linear, modules in FUSED.items():
            targeted = [m for m in modules if (layer, m) in raw]
            if not targeted:
                continue
            out = sum(module_shape(config, m)[1] for m in modules)
            b = torch.zeros(out, r * len(targeted))
            row, col = 0, 0
            for m in modules:
                size = module_shape(config, m)[1]
                if m in targeted:
                    b[row : row + size, col : col + r] = raw[(layer, m)][1]
                    col += r
                row += size
            a = torch.cat([raw[(layer, m)][0] for m in targeted])
            factors[(layer, linear)] = LoraFactors(a.to(device), b.to(device))
    return factors


def _views(
    factors: Mapping[tuple[int, str], LoraFactors],
    config: ModelConfig,
    keys: Collection[tuple[int, str]],
    rank: int,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each module's (A [r, in], B [out, r]) as views into its fused linear's factors."""
    views = {}
    for layer, linear in factors:
        f, row, col = factors[(layer, linear)], 0, 0
        for m in FUSED[linear]:
            size = module_shape(config, m)[1]
            if (layer, m) in keys:
                views[(layer, m)] = (f.a[col : col + rank], f.b[row : row + size, col : col + rank])
                col += rank
            row += size
    return views


@dataclass(frozen=True)
class LoraRows:
    """Which rows of a step take which adapter: ``groups`` pairs each adapter present with
    its rows ([n] int64 indices, or None where it has every row); rows of no group take the
    base model alone."""

    num_rows: int  # T
    groups: tuple[tuple[LoraAdapter, torch.Tensor | None], ...]

    @classmethod
    def of(
        cls, adapters: Sequence[LoraAdapter | None], device: torch.device | str = "cpu"
    ) -> LoraRows | None:
        """The step whose row t takes ``adapters[t]`` (None: none); None where no row
        takes one (the model then runs as without adapters)."""
        rows: dict[LoraAdapter, list[int]] = {}
        for t, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(adapter, []).append(t)
        if not rows:
            return None
        n = len(adapters)
        return cls(
            n,
            tuple(
                (a, None if len(r) == n else torch.tensor(r, dtype=torch.int64, device=device))
                for a, r in rows.items()
            ),
        )

    def add(self, layer: int, linear: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += each adapter's delta of fused ``linear`` (``FUSED``) in ``layer``
        on its rows of x [T, in]: scale * (x A^T) B^T in float32, added in y's dtype."""
        for adapter, rows in self.groups:
            f = adapter.factors.get((layer, linear))
            if f is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            delta = ((xs.float() @ f.a.T).mul_(adapter.scale) @ f.b.T).to(y.dtype)
            if rows is None:
                y.add_(delta)
            else:
                y.index_add_(0, rows, delta)


def add_lora(
    lora: LoraRows | None, layer: int, linear: str, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """y, the output of fused ``linear`` of ``layer`` on x, with the step's LoRA deltas
    added in place (``LoraRows.add``); y untouched where the step has no adapter."""
    if lora is not None:
        lora.add(layer, linear, x, y)
    return y
