"""Each layer's KV spec, the layout built from them, and the attention-backend registry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvgate.engine.llm_engine import LLMEngine
from kvgate.errors import UnsupportedModel
from kvgate.model import attention_backends
from kvgate.model.attention import TorchAttention
from kvgate.model.attention_backends import (
    BackendEntry,
    BackendOptions,
    backend_names,
    select_backend,
)
from kvgate.model.kv_layout import KVLayout
from kvgate.model.kv_spec import KVSpec
from tests.conftest import tiny_engine_config

CPU = torch.device("cpu")


def test_a_spec_knows_its_page_bytes_and_refuses_what_it_cannot_be() -> None:
    spec = KVSpec.attention(num_kv_heads=2, head_dim=64, dtype="bfloat16")
    assert spec.kind == "full" and spec.window is None
    assert spec.bytes_per_token() == 2 * (64 + 64) * 2
    assert spec.page_bytes(16) == 16 * spec.bytes_per_token()
    assert spec.with_dtype("float32").page_bytes(16) == 2 * spec.page_bytes(16)
    assert KVSpec.attention(2, 64, window=128).kind == "sliding"
    latent = KVSpec.latent(dim=40, value_dim=32, dtype="float32")
    assert not latent.stores_v and latent.bytes_per_token() == 40 * 4  # V is within K
    compressed = KVSpec.compressed(window=8, token_dim=40, rate=4, entry_dim=12, dtype="float32")
    assert not compressed.stores_v and compressed.bytes_per_token() == 40 * 4  # the window's
    assert compressed.entry_bytes() == 12 * 4
    window_only = KVSpec.compressed(8, 10, None, 12)
    assert window_only.v_dim == 0 and window_only.entry_bytes() == 0
    for bad in (
        dict(kind="compressed", num_kv_heads=1, k_dim=8, v_dim=8),  # no window
        dict(kind="compressed", num_kv_heads=1, k_dim=8, v_dim=8, window=4),  # entries, no rate
        dict(kind="compressed", num_kv_heads=2, k_dim=8, v_dim=8, window=4, rate=4),
        dict(kind="compressed", num_kv_heads=1, k_dim=8, v_dim=0, window=4, rate=4),
        dict(kind="full", num_kv_heads=1, k_dim=8, v_dim=8, rate=4),  # a rate is compressed's
        dict(kind="latent", num_kv_heads=2, k_dim=8, v_dim=8),  # one vector a token
        dict(kind="latent", num_kv_heads=1, k_dim=8, v_dim=16),  # V within K
        dict(kind="sliding", num_kv_heads=1, k_dim=8, v_dim=8),  # no window
        dict(kind="full", num_kv_heads=1, k_dim=8, v_dim=8, window=4),
        dict(kind="full", num_kv_heads=0, k_dim=8, v_dim=8),
        dict(kind="full", num_kv_heads=1, k_dim=8, v_dim=8, dtype="int4"),
    ):
        with pytest.raises(ValueError):
            KVSpec(**bad)  # type: ignore[arg-type]


def test_the_layout_groups_layers_by_window_and_sizes_blocks_from_the_spec() -> None:
    full = KVSpec.attention(2, 16)
    sliding = KVSpec.attention(2, 16, window=32)
    one = KVLayout.for_specs([full] * 4)
    assert [(g.layers, g.window) for g in one.groups] == [((0, 1, 2, 3), None)]
    assert one.block_bytes(16) == 4 * full.page_bytes(16)
    # Gemma 3's pattern: five sliding layers to one global.
    mixed = KVLayout.for_specs([sliding] * 5 + [full] + [sliding] * 2)
    assert mixed.slots == 1 and [g.window for g in mixed.groups] == [None] + [32] * 7
    assert mixed.block_bytes(16) == full.page_bytes(16)
    with pytest.raises(UnsupportedModel, match="page formats"):
        KVLayout.for_specs([full, KVSpec.attention(1, 16)])
    with pytest.raises(UnsupportedModel, match="windows"):
        KVLayout.for_specs([sliding, KVSpec.attention(2, 16, window=64)])


@pytest.fixture
def registry() -> Iterator[None]:
    """Backends registered by a test leave with it."""
    saved = dict(attention_backends._BACKENDS)
    yield
    attention_backends._BACKENDS.clear()
    attention_backends._BACKENDS.update(saved)


def test_the_registry_chooses_a_backend_that_supports_the_spec_or_says_why_none_does(
    registry: None,
) -> None:
    options = BackendOptions(num_heads=4, device=CPU)
    name, backend = select_backend(KVSpec.attention(2, 16, dtype="float32"), options)
    assert name == "torch-paged" and isinstance(backend, TorchAttention)
    assert backend.kv_cache_shape(10, 16) == (2, 10, 16, 16)
    assert backend.kv_dtype == torch.float32
    # Keys and values of different sizes: torch-paged says no.
    odd = KVSpec("full", 1, 24, 16)
    with pytest.raises(UnsupportedModel, match="torch-paged: its K and V have one head size"):
        select_backend(odd, options)
    with pytest.raises(UnsupportedModel, match="share 3 KV heads"):
        select_backend(KVSpec.attention(3, 16), options)
    # A backend for that shape is one registration; it is chosen by spec, or by name.
    built: list[KVSpec] = []

    def build(spec: KVSpec, _: BackendOptions) -> TorchAttention:
        built.append(spec)
        return TorchAttention(4, 1, 16)

    def supports(spec: KVSpec, _: BackendOptions) -> str | None:
        return None if spec.k_dim != spec.v_dim else "only for unequal K and V"

    attention_backends.register(BackendEntry("test-latent", supports, build))
    assert backend_names()[-1] == "test-latent"
    assert select_backend(odd, options)[0] == "test-latent" and built == [odd]
    assert select_backend(KVSpec.attention(2, 16), options)[0] == "torch-paged"
    with pytest.raises(UnsupportedModel, match="test-latent: only for unequal"):
        select_backend(KVSpec.attention(2, 16), options, name="test-latent")
    with pytest.raises(UnsupportedModel, match="no attention backend 'nope'"):
        select_backend(KVSpec.attention(2, 16), options, name="nope")


def test_the_engine_sizes_its_pool_from_the_models_specs(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(tiny_engine_config(tiny_llama_dir))
    config = engine.model_config
    assert engine.build_info["kv_backend"] == "torch-paged"
    spec = engine.kv_layout.spec
    assert spec == KVSpec.attention(config.num_kv_heads, config.head_dim, dtype="float32")
    per_block = config.num_layers * spec.page_bytes(engine.config.block_size)
    assert engine.kv_pool.bytes == engine.kv_pool.num_blocks * per_block
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.shape == v_cache.shape
    assert k_cache.numel() * 4 * 2 * config.num_layers == engine.kv_pool.bytes
