"""Quantized linear layers (hispec.model.quant), GGUF blocks read natively, kernel choice."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from hispec.model import fused, kernels
from hispec.model.gguf_weights import _blocks, _q8_blocks
from hispec.model.quant import ACT_DTYPE, QuantLinear, quantize_linears


def _x(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_from_float_computes_its_dequantized_weight(scheme):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    layer = QuantLinear.from_float(w, scheme)
    deq = layer.dequantize()
    assert deq.shape == w.shape
    assert (deq - w).abs().max() <= (0.05 if scheme == "int4" else 0.005)  # quantization error
    x = _x(5, 64)
    want = F.linear(x.to(ACT_DTYPE).float(), deq)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (5, 48)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)  # bfloat16 output rounding


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_rows_do_not_depend_on_the_batch(scheme):
    """One-token decoding and batched verification must see bit-identical rows."""
    layer = QuantLinear.from_float(torch.randn(64, 96), scheme)
    x = _x(9, 96, seed=2)
    full = layer(x)
    for lo, hi in [(0, 1), (3, 4), (2, 6), (1, 9)]:
        assert torch.equal(layer(x[lo:hi]), full[lo:hi])


def _gguf_blocks(kind: str, n: int = 32, k: int = 64):
    """A tensor quantized by the gguf package, as GGUFReader would present it."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.1
    raw = gguf.quants.quantize(w, qtype)

    class Tensor:
        tensor_type, data = qtype, raw
    return Tensor, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_four_bit_blocks_keep_the_files_values(kind):
    tensor, want = _gguf_blocks(kind)
    q, d, m = _blocks(tensor)
    layer = QuantLinear.from_blocks(q, d, m, kind)
    assert torch.equal(layer.source_weight(), torch.from_numpy(want))  # exact: d * q + m
    # the kernel's copy differs only by the rounding of scale and zero to bfloat16
    rel = (layer.dequantize() - layer.source_weight()).abs().max() / layer.source_weight().abs().max()
    assert 0 < rel < 2 ** -7
    x = _x(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.from_numpy(want)), rtol=3e-2, atol=3e-2)


def test_q8_blocks_as_two_int4_halves():
    tensor, want = _gguf_blocks("Q8_0", n=48)
    layer = QuantLinear.from_q8_blocks(*_q8_blocks(tensor), kernel="int4x2")
    assert torch.equal(layer.source_weight(), torch.from_numpy(want))
    x = _x(4, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.from_numpy(want)), rtol=2e-2, atol=2e-2)
    assert torch.equal(layer(x[1:2]), layer(x)[1:2])


@pytest.mark.skipif(not fused.available(), reason="needs the fused CPU kernels (a C compiler)")
def test_q8_kernel_multiplies_the_files_values_each_row_alone():
    """The Q8_0 kernel: the file's exact values, float32 activations, and each output row computed
    the same whatever the number of rows in the call (1..9 cover its 4-row groups and remainders)
    or the number of threads: verification and batches stay bit-identical to one-token decoding."""
    tensor, want = _gguf_blocks("Q8_0", n=80, k=96)
    layer = QuantLinear.from_q8_blocks(*_q8_blocks(tensor))
    assert layer.kernel == "q8" and layer.input_dtype == torch.float32
    assert torch.equal(layer.source_weight(), torch.from_numpy(want)) and torch.equal(layer.dequantize(), layer.weight)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(3))
    ref = F.linear(x.double(), torch.from_numpy(want).double()).float()
    out = layer(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for t in range(1, 10):
        assert torch.equal(layer(x[:t]), out[:t]), t
        assert torch.equal(layer(x[t - 1:t]), out[t - 1:t]), t
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, out)
    xb = x.bfloat16()
    assert torch.equal(layer(xb), layer(xb.float()).bfloat16())  # bfloat16 in: read exactly, result rounded
    assert "q8 group 32 (Q8_0 weights, float32 activations)" == layer.describe()


def test_quantize_linears_replaces_every_linear_in_any_module():
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                            torch.nn.Sequential(torch.nn.Linear(32, 48, bias=True)), torch.nn.Linear(30, 16))
    assert quantize_linears(m, "int4") == 2  # the 30-input layer does not split into groups of 32
    assert isinstance(m[0], QuantLinear) and isinstance(m[2][0], QuantLinear) and not isinstance(m[3], QuantLinear)
    assert m[:3](torch.randn(2, 64)).shape == (2, 48)


@pytest.fixture
def fresh_choice():
    kernels.quantized_kernels_pay.cache_clear()
    yield
    kernels.quantized_kernels_pay.cache_clear()


def test_avx512_uses_the_quantized_kernels_without_timing(monkeypatch, fresh_choice):
    monkeypatch.setattr(kernels, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(kernels, "time_matmuls", lambda: pytest.fail("no timing needed"))
    assert kernels.quantized_kernels_pay()[0]


@pytest.mark.parametrize("quant,dense,pays", [(1.0, 2.0, True), (1.0, 1.1, False), (3.0, 1.0, False)])
def test_other_cpus_time_both_and_keep_float32_unless_quantized_wins(monkeypatch, fresh_choice, quant, dense, pays):
    monkeypatch.setattr(kernels, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(kernels, "time_matmuls", lambda: (quant, dense))
    ok, why = kernels.quantized_kernels_pay()
    assert ok is pays and "AVX2" in why


def test_missing_kernel_keeps_float32(monkeypatch, fresh_choice):
    def missing():
        raise RuntimeError("no int4 kernel")
    monkeypatch.setattr(kernels, "cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(kernels, "time_matmuls", missing)
    assert kernels.quantized_kernels_pay()[0] is False


def test_timing_runs_here():
    quant, dense = kernels.time_matmuls(reps=1)
    assert quant > 0 and dense > 0
