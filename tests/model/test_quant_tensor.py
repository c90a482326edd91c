"""GGML block tensors (``quant_tensor.py``): the values they stand for are exactly gguf-py's,
a tensor whose bytes do not fit its type and shape is refused, rows are taken whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvgate.model.quant_tensor import NATIVE_QTYPES, QuantTensor, dequantize_blocks
from tests.model.quant_blocks import QTYPES, random_blocks, random_quant

qtypes = pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)


def test_the_native_types_are_the_ones_the_kernels_multiply() -> None:
    names = {t.name for t in NATIVE_QTYPES}
    assert names == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
    assert len(QTYPES) == len(NATIVE_QTYPES)


@qtypes
@pytest.mark.parametrize(("rows", "k"), [(1, 256), (7, 512), (33, 1280)])
def test_random_blocks_dequantize_exactly_as_gguf_py(
    qtype: GGMLQuantizationType, rows: int, k: int
) -> None:
    """Every byte random (nibbles, high bits, 6-bit scales and mins, int8 values) but the
    float16 scales: the fast paths and gguf.quants agree bit for bit."""
    raw = random_blocks(qtype, rows, k, np.random.default_rng(int(qtype) * 100 + rows))
    expected = dequantize(raw, qtype)
    assert expected.shape == (rows, k)
    got = dequantize_blocks(raw.reshape(-1), qtype, (rows, k))
    assert got.dtype == np.float32 and got.flags.writeable
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(got).all()

    t = QuantTensor(qtype, (rows, k), torch.from_numpy(raw), "blk.0.w")
    values = t.dequantize()
    assert values.dtype == torch.float32 and values.shape == (rows, k)
    assert torch.equal(values, torch.from_numpy(expected))
    assert t.row_bytes == k // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    assert t.nbytes() == rows * t.row_bytes and t.numel() == rows * k


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "F32"])
def test_dequantize_fast_paths_equal_gguf_py(qtype: str) -> None:
    kind = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    packed = quantize(values, kind)
    raw = np.ascontiguousarray(packed).view(np.uint8).reshape(-1)
    got = dequantize_blocks(raw, kind, values.shape)
    expected = dequantize(packed, kind)
    assert got.dtype == np.float32 and got.flags.writeable
    np.testing.assert_array_equal(got, expected)


def test_dequantize_does_not_write_to_the_blocks() -> None:
    t = random_quant(GGMLQuantizationType.Q4_0, 4, 64, seed=5)
    before = t.data.clone()
    values = t.dequantize()
    values.fill_(0)  # a new array: the blocks stay as they were
    assert torch.equal(t.data, before)


@pytest.mark.parametrize(
    ("qtype", "shape", "data_shape"),
    [
        (GGMLQuantizationType.Q8_0, (4, 64), (4, 67)),  # a byte short per row
        (GGMLQuantizationType.Q8_0, (4, 64), (5, 68)),  # a row too many
        (GGMLQuantizationType.Q8_0, (4, 48), (4, 51)),  # inputs not whole blocks of 32
        (GGMLQuantizationType.Q4_K, (2, 128), (2, 72)),  # K-quants: blocks of 256
        (GGMLQuantizationType.Q6_K, (2, 256), (2, 144)),  # Q4_K's row size, not Q6_K's
        (GGMLQuantizationType.Q4_0, (3, 32), (54,)),  # the rows' bytes, but flat
    ],
)
def test_bytes_that_do_not_fit_the_type_and_shape_are_refused(
    qtype: GGMLQuantizationType, shape: tuple[int, int], data_shape: tuple[int, ...]
) -> None:
    data = torch.zeros(data_shape, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"'blk\.3\.w'.*{qtype.name}"):
        QuantTensor(qtype, shape, data, "blk.3.w")


@qtypes
def test_take_rows_gives_those_rows_values(qtype: GGMLQuantizationType) -> None:
    t = random_quant(qtype, 12, 512, seed=int(qtype), name="blk.0.attn_q.weight")
    everything = t.dequantize()
    for index in (torch.randperm(12, generator=torch.Generator().manual_seed(1)),
                  torch.tensor([11, 0, 5]), torch.tensor([3, 3])):  # fmt: skip
        rows = t.take_rows(index)
        assert rows.qtype == qtype and rows.name == t.name
        assert rows.shape == (index.numel(), 512) and rows.row_bytes == t.row_bytes
        assert torch.equal(rows.data, t.data[index])
        assert torch.equal(rows.dequantize(), everything[index])
        # copied out (of the file's map, in the loader): the source's bytes are not shared
        assert rows.data.untyped_storage().data_ptr() != t.data.untyped_storage().data_ptr()


def test_dense_weights_quantize_to_q8_0_blocks_within_half_a_step() -> None:
    """``quantize_q8_0`` (``--quantization int8``): GGUF's Q8_0 layout (gguf-py reads the
    bytes back to the same values), each weight within half a step of its block's stored
    float16 scale, an all-zero block zero, and K not a multiple of 32 refused."""
    from kvgate.model.quant_tensor import quantize_q8_0

    w = torch.randn(6, 96) * 3
    w[2, 32:64] = 0.0
    t = quantize_q8_0(w, "blk.0.w")
    assert t.qtype == GGMLQuantizationType.Q8_0 and t.data.shape == (6, 3 * 34)
    values = t.dequantize()
    np.testing.assert_array_equal(values.numpy(), dequantize(t.data.numpy(), t.qtype))
    d = torch.from_numpy(t.data.numpy().reshape(6, 3, 34)[:, :, :2].copy().view(np.float16))
    step = d.float().repeat_interleave(32, dim=-1).reshape(6, 96)
    assert ((values - w).abs() <= step / 2 + 1e-6).all()
    assert (values[2, 32:64] == 0).all()
    with pytest.raises(ValueError, match=r"blk\.0\.w"):
        quantize_q8_0(torch.randn(2, 40), "blk.0.w")
