"""Quantized linear layers (hispec.kernels.quant), GGUF blocks read natively, kernel choice."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch.nn import functional as F

from hispec.kernels import fused, quant, select
from hispec.model.load.gguf_weights import _blocks, _q8_blocks
from hispec.kernels.quant import ACT_DTYPE, QuantLinear, quantize_linears


def _x(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


needs_fused = pytest.mark.skipif(not fused.available(), reason="needs the fused CPU kernels (a C compiler)")
SCHEMES = [("int4", "int4"), ("int8", None), pytest.param("int4", "q4", marks=needs_fused),
           pytest.param("int4", "q8a", marks=needs_fused)]


@pytest.mark.parametrize("scheme,kernel", SCHEMES)
def test_from_float_computes_its_dequantized_weight(scheme, kernel):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    layer = QuantLinear.from_float(w, scheme, kernel=kernel)
    deq = layer.dequantize()
    assert deq.shape == w.shape
    assert (deq - w).abs().max() <= (0.05 if scheme == "int4" else 0.005)  # quantization error
    x = _x(5, 64)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (5, 48)
    if kernel == "q4":  # float32 activations, put in 16 bits per block: close to the float product
        torch.testing.assert_close(out, F.linear(x, deq), rtol=1e-4, atol=1e-4)
    elif kernel == "q8a":  # float32 activations rounded to 8 bits per block (amax / 254 per input)
        torch.testing.assert_close(out, F.linear(x, deq), rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(out, F.linear(x.to(ACT_DTYPE).float(), deq), rtol=2e-2, atol=2e-2)  # bfloat16 output


@needs_fused
def test_q8a_quantizes_with_float16_scales_where_float32_ones_would_not_fit():
    """``q8a`` keeps its block scales in float16 (as GGUF's Q4_1): hispec's own quantization picks
    the codes for the rounded scales, and constant or tiny blocks (a scale below float16's normal
    range) still give finite weights within half a step."""
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    w[0, :32] = 0.25  # a constant block
    w[1, :32] *= 1e-6  # a block whose float32 scale is a float16 subnormal
    layer = QuantLinear.from_float(w, "int4", kernel="q8a")
    assert layer.qparams.dtype == torch.float16
    d, m = layer.blocks()[1]
    assert torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m)
    deq = layer.dequantize()
    assert torch.isfinite(deq).all()
    step = d.repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-3 * w.abs()).all()  # the codes fit the float16 scales
    assert (deq[1, :32] - w[1, :32]).abs().max() <= 2.0 ** -14


@pytest.mark.parametrize("scheme,kernel", SCHEMES)
def test_rows_do_not_depend_on_the_batch(scheme, kernel):
    """One-token decoding and batched verification must see bit-identical rows."""
    layer = QuantLinear.from_float(torch.randn(64, 96), scheme, kernel=kernel)
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
    layer = QuantLinear.from_blocks(q, d, m, kind, kernel="int4")
    assert torch.equal(layer.source_weight(), torch.from_numpy(want))  # exact: d * q + m
    # the kernel's copy differs only by the rounding of scale and zero to bfloat16
    rel = (layer.dequantize() - layer.source_weight()).abs().max() / layer.source_weight().abs().max()
    assert 0 < rel < 2 ** -7
    x = _x(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.from_numpy(want)), rtol=3e-2, atol=3e-2)


def _x16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far the q8 / q4 kernels may be from the exact ``x @ w.T``: half a 16-bit step of each
    input's block of 32 (the step: the block's largest |x| / 32767) times |w|, plus float sums."""
    scale = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1).double()  # [T, K]
    return (scale @ w.double().abs().T) * (0.5 / 32767) + 1e-5


def _check_x16_rows(layer: QuantLinear, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` within :func:`_x16_bound` of ``x @ w.T``, each row the same bits whatever the
    rows around it in the call and the number of threads; returns it."""
    out = layer(x)
    assert out.dtype == torch.float32
    assert ((out.double() - F.linear(x.double(), w.double())).abs() <= _x16_bound(x, w)).all()
    for t in range(1, x.shape[0] + 1):
        assert torch.equal(layer(x[:t]), out[:t]), t
        assert torch.equal(layer(x[t - 1:t]), out[t - 1:t]), t
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, out)
    return out


@needs_fused
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_kernel_multiplies_the_files_values_each_row_alone(kind):
    """hispec's q4 kernel: the file's nibbles and exact d, m (its weights are the float32 model's),
    float32 activations within 16-bit rounding per block, and each output row the same whatever
    the number of rows in the call (1..19 cover the 4-weight-row tiles of one row and the 8-row
    tiles of more, with remainders) or of threads."""
    tensor, want = _gguf_blocks(kind, n=86, k=96)
    layer = QuantLinear.from_blocks(*_blocks(tensor), kind, kernel="q4")
    assert layer.kernel == "q4" and layer.input_dtype == torch.float32
    w = torch.from_numpy(want)
    assert torch.equal(layer.dequantize(), w) and torch.equal(layer.source_weight(), w)
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(3))
    x[2, :32] = 0  # an all-zero block
    x[4, 40] = 1e4  # one large value: its block's others keep 1.5e-5 of it
    out = _check_x16_rows(layer, x, w)
    assert layer.describe() == f"q4 group 32 ({kind} weights, float32 activations)"


@needs_fused
def test_four_bit_kernel_choice(monkeypatch):
    """HISPEC_Q4_KERNEL forces the 4-bit kernel; otherwise both are timed once per process and
    layers built without a kernel named take the choice."""
    quant.four_bit_kernel.cache_clear()
    try:
        for forced in ("q4", "int4", "q8a"):
            monkeypatch.setenv("HISPEC_Q4_KERNEL", forced)
            quant.four_bit_kernel.cache_clear()
            assert quant.four_bit_kernel()[0] == forced
            assert QuantLinear.from_float(torch.randn(32, 64), "int4").kernel == forced
            # Q8_0 weights (an output head) round their activations as the 4-bit ones do
            assert quant.eight_bit_kernel() == ("q8a8" if forced == "q8a" else "q8")
        monkeypatch.setenv("HISPEC_Q4_KERNEL", "q8act")
        quant.four_bit_kernel.cache_clear()
        with pytest.raises(ValueError, match="HISPEC_Q4_KERNEL='q8act': choose from q4, int4, q8a"):
            quant.four_bit_kernel()
        monkeypatch.delenv("HISPEC_Q4_KERNEL")
        quant.four_bit_kernel.cache_clear()
        kind, why = quant.four_bit_kernel()
        assert kind in quant.TIMED_FOUR_BIT and " ms" in why
        assert quant.eight_bit_kernel() == ("q8a8" if kind == "q8a" else "q8")
    finally:
        quant.four_bit_kernel.cache_clear()


@pytest.mark.parametrize("times,want", [
    ({"q4": 10, "q4@4": 20, "int4": 12, "int4@4": 30, "q8a": 11, "q8a@4": 12}, "q4"),  # q8a slower on one row
    ({"q4": 10, "q4@4": 20, "int4": 12, "int4@4": 30, "q8a": 10, "q8a@4": 12}, "q8a"),  # level on one, faster on 4
    ({"q4": 10, "q4@4": 20, "int4": 12, "int4@4": 30, "q8a": 10.2, "q8a@4": 12}, "q4"),  # a little slower on one
    ({"q4": 10, "q4@4": 20, "int4": 12, "int4@4": 30, "q8a": 9, "q8a@4": 17}, "q4"),  # not clearly faster on 4
    ({"q4": 10, "q4@4": 20, "q4.head": 5, "q4.head@4": 5, "q8a": 9.5, "q8a@4": 12, "q8a.head": 8,
      "q8a.head@4": 9}, "q4"),  # a slower head: slower steps
    ({"q4": 10, "q4@4": 20, "int4": 8, "int4@4": 14, "q8a": 8, "q8a@4": 13}, "int4"),  # measured against int4
    ({"q4": 10, "q4@4": 20, "q8a": 10, "q8a@4": 10}, "q8a"),  # no PyTorch int4 kernel
])
def test_timed_choice_takes_q8a_only_where_a_plain_step_loses_nothing(times, want):
    """q8a's 8-bit activations move tokens further from float32's: the timed choice takes it only
    where a decode step's matmuls (5 x 12 weights and the head) are no slower on one row and clearly
    faster on four (0.8), and says both timings."""
    kind, why = quant.timed_choice(times)
    assert kind == want
    assert "q8a" in why and "on 4 rows" in why and why.count(" ms") == (5 if "int4" in times else 3)


# timings of one Zen 4 (AVX-512 VNNI and BF16), four loads, ms of a plain step and a four-row pass
# timings of one Zen 4 (AVX-512 VNNI and BF16) at four loads: ms of a plain step, of a four-row
# pass, and what the rule without integer dot products took
ZEN4_TIMINGS = [({"q4": 7.77, "int4": 6.70, "q8a": 7.24}, {"q4": 10.15, "int4": 8.90, "q8a": 8.18}, "q4"),
                ({"q4": 12.29, "int4": 8.85, "q8a": 11.83}, {"q4": 17.99, "int4": 11.92, "q8a": 13.65}, "int4"),
                ({"q4": 12.48, "int4": 10.95, "q8a": 10.65}, {"q4": 18.01, "int4": 15.15, "q8a": 13.24}, "q8a"),
                ({"q4": 12.65, "int4": 11.10, "q8a": 11.28}, {"q4": 18.70, "int4": 15.43, "q8a": 14.15}, "q8a")]


@pytest.mark.parametrize("one,four,without", ZEN4_TIMINGS)
def test_with_integer_dot_products_q8a_is_taken_unless_clearly_slower(one, four, without):
    """With VNNI, rows are nearly free on q8a: the choice takes it on all four timings of one Zen 4
    (its one-row step 0.97-1.34x int4's there), where the stricter rule kept for CPUs without
    integer dot products flips between all three kernels (q4, the slowest on both counts, once)."""
    times = {**one, **{f"{k}@4": v for k, v in four.items()}}
    kind, why = quant.timed_choice(times, int8_dots=True)
    assert kind == "q8a" and "integer dot products" in why
    assert quant.timed_choice(times, int8_dots=False)[0] == without


def test_with_integer_dot_products_a_clearly_slower_q8a_is_not_taken():
    slow = {"q4": 10, "q4@4": 20, "int4": 8, "int4@4": 14, "q8a": 12, "q8a@4": 16}  # (12 + 16) / (8 + 14) = 1.27
    assert quant.timed_choice(slow, int8_dots=True)[0] == "int4"
    assert quant.timed_choice({**slow, "q8a": 11}, int8_dots=True)[0] == "q8a"  # 27 / 22 = 1.23


@needs_fused
def test_forced_q8a_says_its_path_or_falls_back_with_a_note(monkeypatch, caplog):
    """HISPEC_Q4_KERNEL=q8a on a CPU without AVX2: q8a still (the plain C path, the same bits), said
    in one warning at the choice; without hispec's compiled kernels: int4, said in one warning."""
    import logging

    from hispec.kernels import q8act
    from tests.kernels.test_q8act import CpuWithout

    monkeypatch.setenv("HISPEC_Q4_KERNEL", "q8a")
    monkeypatch.setattr(q8act, "library", lambda lib=q8act.library(): CpuWithout(lib))
    quant.four_bit_kernel.cache_clear(), q8act.best_isa.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hispec.kernels"):
            assert quant.four_bit_kernel()[0] == "q8a"
        notes = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(notes) == 1 and "scalar path (no AVX2" in notes[0], notes
        caplog.clear()
        monkeypatch.setattr(fused, "available", lambda: False)
        quant.four_bit_kernel.cache_clear()
        with caplog.at_level(logging.WARNING, logger="hispec.kernels"):
            kind, why = quant.four_bit_kernel()
        assert kind == "int4" and "HISPEC_Q4_KERNEL=q8a" in why
        notes = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(notes) == 1 and notes[0].startswith("HISPEC_Q4_KERNEL=q8a: hispec's compiled kernels are "
                                                       "unavailable"), notes
    finally:
        quant.four_bit_kernel.cache_clear(), q8act.best_isa.cache_clear()


@needs_fused
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q8a_kernel_runs_the_q4_weights_on_8_bit_activations(kind):
    """``q8a``: the file's nibbles and exact d, m as ``q4`` keeps them (the same dequantized and
    source weights), multiplied by q8act's kernel (its bits, each row alone), within the
    activations' 8-bit rounding of the float product; prompt chunks on its own rows (integer dot
    products) or as ``q4``'s panels."""
    from hispec.kernels import q8act

    tensor, want = _gguf_blocks(kind, n=86, k=96)
    q4 = QuantLinear.from_blocks(*_blocks(tensor), kind, kernel="q4")
    layer = QuantLinear.from_blocks(*_blocks(tensor), kind, kernel="q8a")
    assert layer.kernel == "q8a" and layer.input_dtype == torch.float32
    w = torch.from_numpy(want)
    assert torch.equal(layer.dequantize(), w) and torch.equal(layer.source_weight(), w)
    assert all(torch.equal(a, b) for a, b in zip(layer.blocks(), (q4.qweight, q4.qparams)))  # stored tiled
    assert not torch.equal(layer.qweight, q4.qweight)
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    assert torch.equal(out, q8act.q4_matmul(x, layer.qweight, layer.qparams))
    assert torch.equal(layer(x.bfloat16()).float(), q8act.q4_matmul(x.bfloat16().float(), layer.qweight,
                                                                     layer.qparams).bfloat16().float())
    for t in (1, 2, 7):
        assert torch.equal(layer(x[:t]), out[:t])
    assert not torch.equal(out, q4(x))  # the activations are rounded differently
    step = (x.abs().view(19, 3, 32).amax(-1) / 254).repeat_interleave(32, 1)  # [T, K]: half a step per input
    assert ((out - x @ w.T).abs() <= step @ w.abs().T + 1e-4).all()
    # prompt chunks: bfloat16 AMX tiles where the CPU has them, else its own rows where it has integer
    # dot products, else q4's float32 panels
    want = (q8act.tiles_matmul(x, layer.qweight, layer.qparams) if q8act.bf16_tiles()
            else out if quant.q8a_prefills_on_rows() else q4.prefill_mm(x))
    assert torch.equal(layer.prefill_mm(x), want)
    assert layer.describe() == f"q8a group 32 ({kind} weights, 8-bit activations per block of 32)"


@needs_fused
def test_q8a8_kernel_runs_q8_0_weights_on_8_bit_activations():
    """``q8a8`` (a Q8_0 head beside q8a layers): the file's blocks as ``q8`` keeps them, on q8act's
    kernel; bfloat16 input as its float32 value."""
    from hispec.kernels import q8act

    tensor, want = _gguf_blocks("Q8_0", n=40, k=96)
    layer = QuantLinear.from_q8_blocks(*_q8_blocks(tensor), kernel="q8a8")
    q8 = QuantLinear.from_q8_blocks(*_q8_blocks(tensor), kernel="q8")
    assert layer.kernel == "q8a8" and torch.equal(layer.dequantize(), torch.from_numpy(want))
    assert all(torch.equal(a, b) for a, b in zip(layer.blocks(), (q8.qweight, q8.qparams)))  # stored tiled
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(4))
    assert torch.equal(layer.mm(x), q8act.q8_matmul(x, layer.qweight, layer.qparams))
    assert torch.equal(layer.mm(x.bfloat16()), layer.mm(x.bfloat16().float()))
    assert not torch.equal(layer.mm(x), q8.mm(x))
    assert "8-bit activations" in layer.describe()


@needs_fused
def test_q8a_every_strategy_gives_ar_s_tokens(tiny_model_dir, four_bit_kernel):
    """Lossless on q8a: with ``HISPEC_Q4_KERNEL=q8a`` a model of 4-bit weights as GGUF stores them
    (nibbles, d, m) and a Q8_0 output head runs them on q8a / q8a8, and every strategy's greedy tokens
    equal ``ar``'s on the same kernels (drafts accepted and rejected: verification runs several rows
    where ``ar`` runs one)."""
    from hispec.config import SamplingParams, SpecConfig
    from hispec.generate import Generator
    from hispec.model.load.checkpoint import load_model

    four_bit_kernel("q8a")
    model = load_model(tiny_model_dir("llama"))
    for layer in model.layers[1:]:  # later layers change the residual stream little: exits often agree
        layer.o_proj.weight.data.mul_(0.1)
        layer.down_proj.weight.data.mul_(0.1)
    assert quantize_linears(model.layers, "int4") > 0
    w = model.lm_head.weight.detach().float()
    d = w.view(w.shape[0], -1, 32).abs().amax(-1) / 127  # [N, K / 32]
    model.lm_head = QuantLinear.from_q8_blocks((w.view(w.shape[0], -1, 32) / d[..., None]).round().to(torch.int8)
                                               .view_as(w), d.half())
    kernels = {m.kernel for m in model.layers.modules() if isinstance(m, QuantLinear)}
    assert kernels == {"q8a"} and model.lm_head.kernel == "q8a8"
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = [5, 17, 99, 3, 42, 8]
    want = gen.generate(prompt, params, "ar").token_ids
    assert len(want) == 40
    spec = SpecConfig(draft_layer=1, verify_layer=3, num_draft=4, window=4)
    for strategy in ("selfspec", "hispec"):
        out = gen.generate(prompt, params, strategy, spec=spec)
        assert out.token_ids == want, strategy
        levels = out.stats.levels.values()
        accepted, drafted = sum(v.accepted_tokens for v in levels), sum(v.draft_tokens for v in levels)
        assert 0 < accepted < drafted, (strategy, accepted, drafted)


@needs_fused
def test_four_bit_kernel_choice_is_kept_for_later_loads(monkeypatch, tmp_path):
    """The timed choice is written under HISPEC_HOME and reused by the next load without timing
    again (the same command gives the same text from one run to the next on a noisy machine)."""
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    monkeypatch.delenv("HISPEC_Q4_KERNEL", raising=False)
    quant.four_bit_kernel.cache_clear()
    try:
        first = quant.four_bit_kernel()[0]
        saved = list((tmp_path / "kernels").glob("four_bit-*.json"))
        assert len(saved) == 1
        monkeypatch.setattr(quant, "format_timings", lambda: pytest.fail("timed again"))
        quant.four_bit_kernel.cache_clear()
        kind, why = quant.four_bit_kernel()
        assert kind == first and "earlier load" in why
        other = "q4" if first == "int4" else "int4"  # what the file says is what runs
        saved[0].write_text(saved[0].read_text().replace(f'"{first}"', f'"{other}"'))
        quant.four_bit_kernel.cache_clear()
        assert quant.four_bit_kernel()[0] == other
        saved[0].write_text("not json")  # a damaged file: timed again
        monkeypatch.setattr(quant, "format_timings", lambda: {"q4": 1.0})
        quant.four_bit_kernel.cache_clear()
        assert quant.four_bit_kernel()[0] == "q4"
    finally:
        quant.four_bit_kernel.cache_clear()


def test_q8_blocks_as_two_int4_halves():
    tensor, want = _gguf_blocks("Q8_0", n=48)
    layer = QuantLinear.from_q8_blocks(*_q8_blocks(tensor), kernel="int4x2")
    assert torch.equal(layer.source_weight(), torch.from_numpy(want))
    x = _x(4, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.from_numpy(want)), rtol=2e-2, atol=2e-2)
    assert torch.equal(layer(x[1:2]), layer(x)[1:2])


@pytest.mark.skipif(not fused.available(), reason="needs the fused CPU kernels (a C compiler)")
def test_q8_kernel_multiplies_the_files_values_each_row_alone():
    """The Q8_0 kernel: the file's exact values, float32 activations within 16-bit rounding per
    block, and each output row computed the same whatever the number of rows in the call (1..9
    cover its 4-weight-row tiles of one row and 8-row tiles of more, with remainders) or the
    number of threads: verification and batches stay bit-identical to one-token decoding."""
    tensor, want = _gguf_blocks("Q8_0", n=80, k=96)
    layer = QuantLinear.from_q8_blocks(*_q8_blocks(tensor), kernel="q8")
    assert layer.kernel == "q8" and layer.input_dtype == torch.float32
    w = torch.from_numpy(want)
    assert torch.equal(layer.source_weight(), w) and torch.equal(layer.dequantize(), layer.weight)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(3))
    out = _check_x16_rows(layer, x, w)
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
    select.quantized_kernels_pay.cache_clear()
    yield
    select.quantized_kernels_pay.cache_clear()


def test_avx512_uses_the_quantized_kernels_without_timing(monkeypatch, fresh_choice):
    monkeypatch.setattr(select, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(select, "time_matmuls", lambda: pytest.fail("no timing needed"))
    assert select.quantized_kernels_pay()[0]


@pytest.mark.parametrize("quant,dense,pays", [(1.0, 2.0, True), (1.0, 1.1, False), (3.0, 1.0, False)])
def test_other_cpus_time_both_and_keep_float32_unless_quantized_wins(monkeypatch, fresh_choice, quant, dense, pays):
    monkeypatch.setattr(select, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(select, "time_matmuls", lambda: (quant, dense))
    ok, why = select.quantized_kernels_pay()
    assert ok is pays and "AVX2" in why


def test_missing_kernel_keeps_float32(monkeypatch, fresh_choice):
    def missing():
        raise RuntimeError("no int4 kernel")
    monkeypatch.setattr(select, "cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(select, "time_matmuls", missing)
    assert select.quantized_kernels_pay()[0] is False


def test_timing_runs_here():
    quantized, dense = select.time_matmuls()
    assert quantized > 0 and dense > 0
    assert set(quant.format_timings()) >= {"float32", quant.four_bit_kernel()[0]}

