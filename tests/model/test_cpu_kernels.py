"""Native CPU kernels against the plain-PyTorch paths they replace."""

from __future__ import annotations

import pytest
import torch

from kvgate.model.attention import AttentionMetadata, TorchAttention
from kvgate.model.cpu_kernels import PagedDecodeKernel, load_fused_ops_lib, load_paged_decode
from kvgate.model.kv_codec import KVCodec
from kvgate.model.kv_spec import scale_groups
from kvgate.model.ops import FusedCpuLayerOps, TorchLayerOps
from kvgate.model.rope import RotaryEmbedding
from tests.model.isa import vector_levels

#: Every vector path this CPU can run (a higher machine also runs the lower paths).
levels = pytest.mark.parametrize("level", vector_levels())


def _kernel(level: str) -> PagedDecodeKernel:
    kernel = load_paged_decode(level)
    if kernel is None:
        pytest.skip("no C compiler: kernels unavailable")
    return kernel


def _decode_meta(lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randint(0, num_blocks, (len(lens) * max_blocks,), generator=g)
    lens_t = torch.tensor(lens)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_blocks=tables,
        decode_lens=lens_t,
        prefills=(),
    )


@levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
#: Head shapes the AVX-512 kernel compiles its own body for (SmolLM2's 9/3 x 64, Qwen 1.5B's
#: 12/2 x 128, Gemma 3 270M's 4/1 x 256, 4/4 x 64) and one it runs on the generic body (8/1 x 64).
@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "d"),
    [(9, 3, 16, 64), (4, 4, 8, 64), (8, 1, 32, 64), (12, 2, 16, 128), (4, 1, 16, 256)],
)
def test_paged_decode_kernel_matches_torch(
    level: str, dtype: torch.dtype, heads: int, kv_heads: int, block_size: int, d: int
) -> None:
    num_blocks = 64
    lens = [1, 5, block_size, block_size + 1, 97, 200]
    meta = _decode_meta(lens, block_size, num_blocks, seed=heads)
    torch.manual_seed(0)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, d).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, d).to(dtype)
    q = torch.randn(len(lens), heads, d).to(dtype)
    plain = TorchAttention(heads, kv_heads, d)
    fast = TorchAttention(heads, kv_heads, d, decode_kernel=_kernel(level))
    ref = plain.attend(q, q, q, k_cache, v_cache, meta).float()
    got = fast.attend(q, q, q, k_cache, v_cache, meta).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the output
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@levels
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 100, 256])
def test_short_prefill_with_the_native_softmax_matches_torch(
    level: str, heads: int, kv_heads: int, length: int
) -> None:
    torch.manual_seed(length)
    d = 64
    q = (torch.randn(length, heads, d) * 2).bfloat16()
    k = (torch.randn(length, kv_heads, d) * 2).bfloat16()
    v = torch.randn(length, kv_heads, d).bfloat16()
    plain = TorchAttention(heads, kv_heads, d)._short_prefill(q, k, v).float()
    fast = TorchAttention(heads, kv_heads, d, decode_kernel=_kernel(level))
    fast = fast._short_prefill(q, k, v)
    # bf16 probabilities: one rounding each, so the outputs agree to bf16 precision.
    torch.testing.assert_close(fast.float(), plain, atol=2e-2, rtol=2e-2)
    # The causal mask: the first query sees only the first key, so it returns that value.
    group = heads // kv_heads
    assert torch.equal(fast[0], v[0].repeat_interleave(group, dim=0))


@levels
def test_native_softmax_refuses_what_it_cannot_take(level: str) -> None:
    kernel = _kernel(level)
    assert kernel.causal_softmax(torch.zeros(4, 4), 1.0) is None  # float32
    too_long = kernel.MAX_SOFTMAX_KEYS + 1
    assert kernel.causal_softmax(torch.zeros(1, too_long, dtype=torch.bfloat16), 1.0) is None


def _ops(level: str) -> tuple[FusedCpuLayerOps, TorchLayerOps]:
    fused_lib = load_fused_ops_lib(level)
    if fused_lib is None:
        pytest.skip("no C compiler: kernels unavailable")
    rope = RotaryEmbedding(64, 4096, 1e5, None, torch.bfloat16, torch.device("cpu"))
    heads = (9, 3, 64)
    plain = TorchLayerOps(rope, TorchAttention(*heads), heads)
    fused = FusedCpuLayerOps(fused_lib, rope, heads, plain)
    return fused, plain


@levels
def test_fused_rope_and_kv_write_are_bit_exact(level: str) -> None:
    fused, plain = _ops(level)
    torch.manual_seed(1)
    t, n, bs = 41, 24, 16
    qkv = (torch.randn(t, 15 * 64) * 2).bfloat16()
    positions = torch.randint(0, 4096, (t,))
    slots = torch.randperm(n * bs)[:t]
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=0,
        decode_blocks=torch.empty(0, dtype=torch.long),
        decode_lens=torch.empty(0, dtype=torch.long),
        prefills=(),
    )
    caches = [torch.zeros(3, n, bs, 64, dtype=torch.bfloat16) for _ in range(4)]
    got = fused.rope_write_kv(qkv, positions, caches[0], caches[1], meta)
    ref = plain.rope_write_kv(qkv, positions, caches[2], caches[3], meta)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


class _RowMajorAttention(TorchAttention):
    """A backend with another cache layout, ``[num_blocks, block_size, Hkv, D]``: native
    code must not write it in place, and ``write_kv`` is the only way in."""

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def native_layout(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        return None

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)


@levels
def test_the_fused_write_goes_through_a_backend_whose_layout_it_cannot_write(level: str) -> None:
    """The KV layout is the backend's: where ``native_layout`` says no, the fused op leaves
    the cache to the backend's ``write_kv`` (and the result is still exact)."""
    fused_lib = load_fused_ops_lib(level)
    if fused_lib is None:
        pytest.skip("no C compiler: kernels unavailable")
    rope = RotaryEmbedding(64, 4096, 1e5, None, torch.bfloat16, torch.device("cpu"))
    heads = (9, 3, 64)
    backend = _RowMajorAttention(*heads)
    fused = FusedCpuLayerOps(fused_lib, rope, heads, TorchLayerOps(rope, backend, heads))
    plain, _ = _ops(level)
    torch.manual_seed(2)
    t, n, bs = 9, 4, 16
    qkv = (torch.randn(t, 15 * 64) * 2).bfloat16()
    positions = torch.randint(0, 4096, (t,))
    meta = AttentionMetadata(
        slot_mapping=torch.randperm(n * bs)[:t],
        num_decodes=0,
        decode_blocks=torch.empty(0, dtype=torch.long),
        decode_lens=torch.empty(0, dtype=torch.long),
        prefills=(),
    )
    k_rows, v_rows = (
        torch.zeros(backend.kv_cache_shape(n, bs), dtype=torch.bfloat16) for _ in "kv"
    )
    k_heads, v_heads = (torch.zeros(3, n, bs, 64, dtype=torch.bfloat16) for _ in "kv")
    got = fused.rope_write_kv(qkv, positions, k_rows, v_rows, meta)
    ref = plain.rope_write_kv(qkv, positions, k_heads, v_heads, meta)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    # The same keys and values, each in its backend's layout.
    assert torch.equal(k_rows.permute(2, 0, 1, 3), k_heads)
    assert torch.equal(v_rows.permute(2, 0, 1, 3), v_heads)
    assert TorchAttention(*heads).native_layout(k_heads, v_heads) is not None
    assert fused.writes(TorchAttention(*heads).native_layout(k_heads, v_heads))
    assert not fused.writes(TorchAttention(*heads).native_layout(k_heads.float(), v_heads.float()))


@levels
@pytest.mark.parametrize("hidden", [576, 960, 2048, 100, 8, 3])
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("with_x", [True, False])
def test_fused_add_rms_norm_is_bit_exact(level: str, hidden: int, rows: int, with_x: bool) -> None:
    """The native norm sums squares in torch's own order, so it rounds exactly as torch does
    (a different order changes the last bit of the scale now and then)."""
    fused, plain = _ops(level)
    torch.manual_seed(hidden * rows)
    # Rows of very different magnitudes, as residual streams are.
    scale = torch.logspace(-3, 3, rows)[:, None]
    residual = (torch.randn(rows, hidden) * scale).bfloat16()
    x = (torch.randn(rows, hidden) * scale).bfloat16() if with_x else None
    weight = torch.randn(hidden).bfloat16()
    res_fused, res_plain = residual.clone(), residual.clone()
    got = fused.add_norm(x, res_fused, weight, 1e-5)
    ref = plain.add_norm(x, res_plain, weight, 1e-5)
    assert torch.equal(res_fused, res_plain)
    assert torch.equal(got, ref)


@levels
def test_fused_silu_is_bit_exact_on_every_bf16_value(level: str) -> None:
    """SiLU's input is bf16, so all 65,536 inputs can be checked: the native exp follows
    torch's (SLEEF's) steps, and the rounding keeps subnormals as torch does."""
    fused, plain = _ops(level)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate_up = torch.cat([every, torch.ones_like(every)])[None, :]  # one row: gate, then up = 1
    got, ref = fused.silu_mul(gate_up), plain.silu_mul(gate_up)
    finite = torch.isfinite(every.float())
    assert torch.equal(got[0][finite], ref[0][finite])
    assert torch.isnan(got[0][every.float().isnan()]).all()


@levels
@pytest.mark.parametrize(("rows", "intermediate"), [(1, 1536), (33, 1536), (300, 1536), (5, 40)])
def test_fused_silu_mul_is_bit_exact(level: str, rows: int, intermediate: int) -> None:
    fused, plain = _ops(level)
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * intermediate) * 4).bfloat16()
    assert torch.equal(fused.silu_mul(gate_up), plain.silu_mul(gate_up))


@levels
def test_loading_the_kernels_keeps_subnormal_floats(level: str) -> None:
    """A library linked with -ffast-math turns on flush-to-zero for the thread that loads it;
    ours must leave the process's floating-point state alone."""
    import numpy as np

    _kernel(level), _ops(level)  # loaded (built) in this process

    tiny = np.array([1e-40], dtype=np.float32)  # subnormal in float32
    assert (tiny * np.float32(1.0))[0] != 0.0
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


@levels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_is_batch_invariant(level: str, dtype: torch.dtype) -> None:
    """A sequence's attention output is the same bits alone or in any batch."""
    kernel = _kernel(level)
    lens, bs, num_blocks, heads, kv_heads, d = [3, 40, 17, 129, 64], 16, 48, 9, 3, 64
    meta = _decode_meta(lens, bs, num_blocks, seed=7)
    torch.manual_seed(7)
    k_cache = torch.randn(kv_heads, num_blocks, bs, d).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, bs, d).to(dtype)
    q = torch.randn(len(lens), heads, d).to(dtype)
    scale = d**-0.5
    batched = kernel(q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, scale)
    tables = meta.decode_blocks.view(len(lens), -1)
    for i in range(len(lens)):
        alone = kernel(
            q[i : i + 1], k_cache, v_cache, tables[i], meta.decode_lens[i : i + 1], scale
        )
        assert torch.equal(alone, batched[i : i + 1])


@levels
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("d", [64, 128, 256, 16, 48])
def test_quantized_rows_decode_natively_to_the_codecs_bf16(level: str, kv: str, d: int) -> None:
    """``decode_rows`` (a prefill's gathered context) gives ``KVCodec.decode``'s bf16 values
    bit for bit: the vector bodies (a scale per 32 values) and the generic one (a scale a
    row: 16, 48). Rows of every magnitude, zeros, and fp8's subnormals beside an outlier."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, 700, d, generator=g) * torch.rand(3, 700, 1, generator=g) * 20
    x[0, 0] = 0.0
    x[1, 3, : min(d, 32)] = torch.linspace(-1e-3, 1e-3, min(d, 32))
    x[1, 3, 0] = 300.0  # the rest of its group: fp8 subnormals
    codec = KVCodec(kv, torch.bfloat16)
    rows = codec.encode(x.bfloat16())
    got = _kernel(level).decode_rows(rows, d, scale_groups(d), kv == "fp8")
    assert got is not None and got.shape == x.shape and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), codec.decode(rows, d).view(torch.int16))
    # And through the attention backend's gather, as a prefill over cached rows reads them.
    attn = TorchAttention(4, 2, d, decode_kernel=_kernel(level), codec=codec)
    cache = rows[:2].reshape(2, 70, 10, -1).contiguous()  # [Hkv, blocks, block size, row]
    blocks = torch.tensor([5, 0, 69, 12])
    want = codec.decode(cache[:, blocks].reshape(2, 40, -1), d)
    assert torch.equal(attn._gather(cache, blocks, d).view(torch.int16), want.view(torch.int16))


@levels
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "d"),
    [(9, 3, 16, 64), (12, 2, 16, 128), (4, 1, 16, 256), (4, 2, 8, 16)],
)
def test_quantized_paged_decode_matches_torch(
    level: str, kv: str, dtype: torch.dtype, heads: int, kv_heads: int, block_size: int, d: int
) -> None:
    """int8 / fp8 rows with their scales (one per 32 values; one a row of 16) read in place
    by the kernel, against PyTorch decoding the gathered rows."""
    num_blocks = 64
    lens = [1, 5, block_size, block_size + 1, 97, 200]
    meta = _decode_meta(lens, block_size, num_blocks, seed=d)
    torch.manual_seed(1)
    codec = KVCodec(kv, dtype)
    k_cache = codec.encode(torch.randn(kv_heads, num_blocks, block_size, d).to(dtype))
    v_cache = codec.encode(torch.randn(kv_heads, num_blocks, block_size, d).to(dtype))
    q = torch.randn(len(lens), heads, d).to(dtype)
    plain = TorchAttention(heads, kv_heads, d, codec=codec)
    fast = TorchAttention(heads, kv_heads, d, decode_kernel=_kernel(level), codec=codec)
    ref = plain.attend(q, q, q, k_cache, v_cache, meta).float()
    got = fast.attend(q, q, q, k_cache, v_cache, meta).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
