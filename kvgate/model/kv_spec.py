"""What one layer keeps per token in the paged KV pool: its spec, declared by the model
(``Model.kv_specs``), read by the layout (``kv_layout.py``), the pool sizing and the choice
of attention backend (``attention_backends.py``). Tensor-free.

A spec is the page format, not the arithmetic: a ``"full"`` layer keeps every position's K
and V; a ``"sliding"`` one the same format, of which only its last ``window`` positions are
read; a ``"latent"`` one (multi-head latent attention, DeepSeek) keeps one compressed vector
per token, read as the key of every head, whose first ``v_dim`` entries are the value too:
no V is stored. A ``"compressed"`` one (DeepSeek-V4) keeps two streams: per token, a
``k_dim`` vector read over the last ``window`` positions (its one KV head, K = V, and what its
compressor still needs), and per ``rate`` tokens one ``v_dim`` entry, kept for the whole
sequence (``rate`` None: a layer with the window alone). A new kind of cache (a
lower-precision copy) is a new spec kind and a backend that says it ``supports`` it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Bytes per element of the KV dtypes a spec may name (torch's names, without ``torch.``;
#: ``int8`` and ``fp8`` (e4m3) rows also carry a 4-byte scale each, ``kv_codec.py``).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
_SCALED = ("int8", "fp8")
#: Values a scale of an int8 or fp8 row covers: a row of a multiple of it has one scale per
#: this many values, a shorter or odd row one scale. Per 32 and not per row: an outlier
#: channel (Qwen2.5's keys have some ~50x the rest) costs only its own 32 values their
#: precision (int8 KV perplexity on Qwen2.5-Coder-1.5B: +1.4% with a scale a row).
SCALE_GROUP = 32


def scale_groups(dim: int) -> int:
    """Scales (float32, 4 bytes each) an int8 or fp8 row of ``dim`` values carries."""
    return dim // SCALE_GROUP if dim % SCALE_GROUP == 0 else 1


KINDS = ("full", "sliding", "latent", "compressed")


@dataclass(frozen=True)
class KVSpec:
    """One layer's KV page format: ``num_kv_heads`` heads of a ``k_dim`` key and a ``v_dim``
    value per token, stored as ``dtype``; ``window``: the positions a sliding layer reads
    (the query's own included)."""

    kind: str
    num_kv_heads: int
    k_dim: int
    v_dim: int
    dtype: str = "bfloat16"
    window: int | None = None
    #: Tokens a compressed entry stands for (``"compressed"`` only; None: no entries).
    rate: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KV spec kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind in ("sliding", "compressed")) != (self.window is not None):
            raise ValueError(f"a {self.kind} KV spec with window={self.window}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"a sliding window must be positive, got {self.window}")
        compressed = self.kind == "compressed"
        if self.rate is not None and (not compressed or self.rate <= 0):
            raise ValueError(f"a {self.kind} KV spec with rate={self.rate}")
        if compressed and (self.num_kv_heads != 1 or (self.rate is None) != (self.v_dim == 0)):
            raise ValueError(f"a compressed KV spec is one head, with entries iff a rate: {self}")
        if min(self.num_kv_heads, self.k_dim) <= 0 or self.v_dim < (0 if compressed else 1):
            raise ValueError(f"KV spec sizes must be positive: {self}")
        if self.kind == "latent" and (self.num_kv_heads != 1 or self.v_dim > self.k_dim):
            raise ValueError(f"a latent KV spec is one vector a token, its value within it: {self}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @staticmethod
    def attention(
        num_kv_heads: int, head_dim: int, window: int | None = None, dtype: str = "bfloat16"
    ) -> KVSpec:
        """Multi-head (or grouped-query) attention: K and V of ``head_dim`` per head."""
        kind = "full" if window is None else "sliding"
        return KVSpec(kind, num_kv_heads, head_dim, head_dim, dtype, window)

    def with_dtype(self, dtype: str) -> KVSpec:
        """The same pages stored as ``dtype`` (the engine's choice, not the model's)."""
        return replace(self, dtype=dtype)

    @property
    def page_format(self) -> tuple[int, int, int, str, bool]:
        """What two specs must share to keep their layers' pages in the same tensors."""
        return (self.num_kv_heads, self.k_dim, self.v_dim, self.dtype, self.stores_v)

    @staticmethod
    def compressed(
        window: int, token_dim: int, rate: int | None, entry_dim: int, dtype: str = "bfloat16"
    ) -> KVSpec:
        """A window of ``token_dim`` vectors, and an ``entry_dim`` entry every ``rate`` tokens."""
        return KVSpec("compressed", 1, token_dim, entry_dim if rate else 0, dtype, window, rate)

    @staticmethod
    def latent(dim: int, value_dim: int, dtype: str = "bfloat16") -> KVSpec:
        """Latent attention: one ``dim`` vector a token, its first ``value_dim`` the value."""
        return KVSpec("latent", 1, dim, value_dim, dtype)

    @property
    def stores_v(self) -> bool:
        """Whether V has pages of its own (not for a latent spec: V is within K)."""
        return self.kind not in ("latent", "compressed")

    def row_bytes(self, dim: int) -> int:
        """One head's ``dim`` values of one token, its scale included where it has one."""
        scales = 4 * scale_groups(dim) if self.dtype in _SCALED else 0
        return dim * DTYPE_BYTES[self.dtype] + scales

    def entry_bytes(self) -> int:
        """One compressed entry (0 where the layer keeps none)."""
        return self.row_bytes(self.v_dim) if self.rate else 0

    def bytes_per_token(self) -> int:
        """K and V of one token of one layer (compressed: of the window stream alone)."""
        if self.kind == "compressed":
            return self.row_bytes(self.k_dim)
        v = self.row_bytes(self.v_dim) if self.stores_v else 0
        return self.num_kv_heads * (self.row_bytes(self.k_dim) + v)

    def page_bytes(self, block_size: int) -> int:
        """One block of one layer: ``block_size`` tokens' K and V."""
        return block_size * self.bytes_per_token()
