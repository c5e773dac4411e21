"""The 8-bit-activation kernels (hispec/kernels/q8act.py): exact agreement with a NumPy reference
of the same arithmetic (int32 block sums, float32 roundings in the documented order), for every
weight format and every instruction-set path this CPU runs; rows independent of each other bit for
bit; the error against the float product of the dequantized weights within the activations' rounding;
clear errors on bad input."""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest
import torch

from hispec.kernels import binding, q8act
from hispec.kernels.quant import pack_nibbles

pytestmark = pytest.mark.skipif(not q8act.available(), reason="no C compiler for the q8act kernels")

F32 = np.float32
SHAPES = [(37, 96), (1, 32), (50, 160), (16, 64), (24, 1536)]  # (N, K): N not a multiple of the 16-column tile too


# ---- the reference ---------------------------------------------------------------------------------
def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (as C's fmaf): the product is exact in float64, the sum is
    rounded to odd in float64 (TwoSum gives its exact error), and that rounds correctly to float32."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.broadcast_to(c.astype(np.float64), p.shape)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    nudge = (err != 0) & even
    s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def quantize_ref(x: np.ndarray):
    """``x [T, K]`` float32 -> codes, dx, sx, dxs as the kernel defines them."""
    t, k = x.shape
    xb = x.reshape(t, k // 32, 32)
    amax = np.abs(xb).max(-1)
    dx = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, F32(127) / amax, F32(0)).astype(F32)
    codes = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int8)
    sx = codes.astype(np.int32).sum(-1, dtype=np.int32)
    dxs = (dx * sx.astype(F32)).astype(F32)
    return codes.reshape(t, k), dx, sx, dxs


def matmul_ref(q: np.ndarray, d: np.ndarray, m: np.ndarray | None, x: np.ndarray) -> np.ndarray:
    """``y [T, N]``: per block the exact int32 sum of codes times ``q [N, K]`` (the weight's integers:
    0..15 or -128..127), ``acc = fma(idot, d * dx, acc)`` and ``macc = fma(m, dxs, macc)`` in block
    order, ``y = acc + macc`` (no ``m``: ``acc``)."""
    codes, dx, sx, dxs = quantize_ref(x)
    t, k = codes.shape
    n, nb = q.shape[0], k // 32
    idot = np.einsum("tbj,nbj->tnb", codes.reshape(t, nb, 32).astype(np.int64),
                     q.reshape(n, nb, 32).astype(np.int64))
    acc = np.zeros((t, n), F32)
    macc = np.zeros((t, n), F32)
    for b in range(nb):
        c = (d[None, :, b] * dx[:, None, b]).astype(F32)
        acc = fma32(idot[:, :, b].astype(F32), c, acc)
        if m is not None:
            macc = fma32(np.broadcast_to(m[None, :, b], (t, n)), np.broadcast_to(dxs[:, None, b], (t, n)), macc)
    return acc + macc if m is not None else acc


# ---- weights in hispec's stored forms ---------------------------------------------------------------
def four_bit(n: int, k: int, kind: str, gen: torch.Generator):
    """``q [N, K]`` in 0..15, ``qs`` (the file's nibbles), ``dm [2, N, K/32]``: Q4_0 (``m = -8 d``,
    float16 d), Q4_1 (float16 d, m), int4 (``--quantize int4``: float32 d, m)."""
    q = torch.randint(0, 16, (n, k), generator=gen)
    d = torch.rand((n, k // 32), generator=gen) * 0.05 + 1e-3
    m = -torch.rand((n, k // 32), generator=gen) * 0.4
    if kind != "int4":
        d = d.half().float()
        m = (-8 * d) if kind == "Q4_0" else m.half().float()
    return q, pack_nibbles(q), torch.stack([d, m]).contiguous()


def eight_bit(n: int, k: int, gen: torch.Generator):
    q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    d = (torch.rand((n, k // 32), generator=gen) * 0.01 + 1e-4).half().float()
    return q, d


def activations(t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows with blocks of very different ranges, a zero block, and an exact maximum."""
    x = torch.randn((t, k), generator=gen) * torch.rand((t, k // 32, 1), generator=gen).repeat_interleave(32, 1).view(t, k) * 4
    x[0, :32] = 0.0
    if k > 32:
        x[-1, 32:64] = torch.linspace(-3, 3, 32)
    return x


def run(kind: str, x, w, isa: str):
    """The kernel on the weights ``w`` (as :func:`weights` gives them, in row order), tiled first as
    QuantLinear stores them."""
    if kind in ("Q8_0", "Q8_G16"):
        return q8act.q8_matmul(x, *q8act.tile8(w[0], w[1]), isa=isa)
    return q8act.q4_matmul(x, *q8act.tile4(w[1], w[2]), isa=isa)


def weights(kind: str, n: int, k: int, gen: torch.Generator):
    if kind == "Q8_G16":
        return eight_bit_g16(n, k, gen)
    return eight_bit(n, k, gen) if kind == "Q8_0" else four_bit(n, k, kind, gen)


def reference(kind: str, x: torch.Tensor, w) -> np.ndarray:
    """The kernel's result by the definition, on the scales as tiling keeps them (float16: GGUF's
    exactly, int4's rounded to nearest)."""
    def kept(t: torch.Tensor) -> np.ndarray:
        return t.half().float().numpy()
    if kind == "Q8_G16":
        return matmul_ref_g16(w[0].numpy(), kept(w[1]), x.numpy())
    if kind == "Q8_0":
        return matmul_ref(w[0].numpy(), kept(w[1]), None, x.numpy())
    return matmul_ref(w[0].numpy(), kept(w[2][0]), kept(w[2][1]), x.numpy())


KINDS = ["Q4_0", "Q4_1", "int4", "Q8_0"]
ISAS = q8act.supported_isas()


# ---- tests ---------------------------------------------------------------------------------------------
def test_reference_fma_rounds_once():
    a = np.array([1 + 2 ** -23, 3.0, 0.1], F32)
    b = np.array([1 - 2 ** -23, 1 / 3, 10.0], F32)
    c = np.array([-1.0, -1.0, -1.0], F32)
    exact = [float(x) * float(y) + float(z) for x, y, z in zip(a, b, c)]  # float64: exact for these
    assert fma32(a, b, c).tolist() == np.array(exact, F32).tolist()
    assert fma32(a[:1], b[:1], c[:1])[0] == F32(-2 ** -46)  # a * b rounded first would give 0


def test_quantize_matches_reference():
    gen = torch.Generator().manual_seed(1)
    x = activations(7, 160, gen)
    got = q8act.quantize(x)
    want = quantize_ref(x.numpy())
    for g, w, name in zip(got, want, ("codes", "dx", "sx", "dxs")):
        assert np.array_equal(g.numpy(), w), name
    assert got.codes.abs().max() == 127 and (got.dx[0, 0] == 0 and got.sx[0, 0] == 0)
    # each row alone
    assert all(torch.equal(q8act.quantize(x[i:i + 1]).codes[0], got.codes[i]) for i in range(7))


def test_quantize_blocks_with_nan_or_inf_follow_the_definition():
    """The vector quantizer hands a block holding a NaN or an infinity to the plain-C definition:
    a NaN is left out of the block's max and coded 0; an infinite max gives scale 1/0 = inf and
    codes 0. The block's neighbours are quantized as usual."""
    gen = torch.Generator().manual_seed(2)
    x = activations(2, 128, gen)
    x[0, 3], x[0, 40], x[1, 70], x[1, 100] = float("nan"), float("inf"), float("-inf"), float("nan")
    got = q8act.quantize(x)
    finite = x.clone()
    finite[0, :64], finite[1, 64:] = 1.0, 1.0  # the blocks without specials
    want = quantize_ref(finite.numpy())
    for b in (2, 3, 4, 5):  # row 0's blocks 2, 3 and row 1's blocks 0, 1 are finite
        r, blk = (0, b) if b < 4 else (1, b - 4)
        assert np.array_equal(got.codes[r, blk * 32:(blk + 1) * 32].numpy(), want[0][r, blk * 32:(blk + 1) * 32])
    nan_block = x[0, :32].numpy()
    amax = np.nanmax(np.abs(nan_block))
    codes = np.rint(np.nan_to_num(nan_block * (F32(127) / amax), nan=0.0)).astype(np.int8)
    assert np.array_equal(got.codes[0, :32].numpy(), codes) and got.dx[0, 0] == F32(amax / F32(127))
    assert got.sx[0, 0] == codes.astype(np.int32).sum()
    for r, blk in ((0, 1), (1, 2)):  # an infinite max: scale inf, codes 0
        assert got.dx[r, blk] == float("inf") and not got.codes[r, blk * 32:(blk + 1) * 32].any()
    assert got.codes[1, 96 + 4] == 0  # the NaN itself


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_exact_against_reference(kind, isa, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = weights(kind, n, k, gen)
    x = activations(19, k, gen)
    y = run(kind, x, w, isa)
    assert y.shape == (19, n) and y.dtype == torch.float32
    assert np.array_equal(y.numpy(), reference(kind, x, w))


@pytest.mark.parametrize("kind", KINDS)
def test_rows_independent_and_paths_agree(kind):
    """Rows 1..19 in one call equal each row alone, bit for bit, on every path; all paths agree."""
    gen = torch.Generator().manual_seed(7)
    n, k = 53, 128
    w = weights(kind, n, k, gen)
    x = activations(19, k, gen)
    first = None
    for isa in ISAS:
        alone = torch.cat([run(kind, x[i:i + 1], w, isa) for i in range(19)])
        for t in range(1, 20):
            assert torch.equal(run(kind, x[:t], w, isa), alone[:t]), (isa, t)
        if first is not None:
            assert torch.equal(alone, first), isa
        first = alone


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_input_and_float_input_agree(kind):
    """Float rows are quantized inside the kernel's parallel region (the threads sharing the blocks):
    the same bits as quantizing them first, on every path and row count."""
    gen = torch.Generator().manual_seed(3)
    w = weights(kind, 40, 96, gen)
    for t in (1, 5, 40):
        x = activations(t, 96, gen)
        for isa in ISAS:
            assert torch.equal(run(kind, q8act.quantize(x), w, isa), run(kind, x, w, isa)), (isa, t)


@pytest.mark.parametrize("kind", KINDS)
def test_error_within_activation_rounding(kind):
    """Against ``x @ W.T`` with the dequantized weights (float64), each output is off by at most the
    activations' rounding, half a step (``amax / 254``) per input times ``|w|``, plus float32 sums."""
    gen = torch.Generator().manual_seed(11)
    n, k = 64, 192
    w = weights(kind, n, k, gen)
    x = activations(6, k, gen)
    if kind == "Q8_0":
        wf = w[0].double() * w[1].double().repeat_interleave(32, 1)
    else:
        wf = w[0].double() * w[2][0].double().repeat_interleave(32, 1) + w[2][1].double().repeat_interleave(32, 1)
    exact = x.double() @ wf.T
    step = (x.abs().view(6, k // 32, 32).amax(-1) / 254).double().repeat_interleave(32, 1)  # [T, K]
    bound = step @ wf.abs().T + 1e-5 * (x.double().abs() @ wf.abs().T)
    err = (run(kind, x, w, None).double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # the activations are rounded: the test can see a difference


def test_bad_input_raises_clearly():
    gen = torch.Generator().manual_seed(0)
    q, qs, dm = four_bit(16, 64, "Q4_1", gen)
    dm = dm.half()  # the kernels' scales
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="x must be a CPU torch.float32"):
        q8act.q4_matmul(x.double(), qs, dm)
    with pytest.raises(ValueError, match="x has K = 32"):
        q8act.q4_matmul(torch.randn(2, 32), qs, dm)
    with pytest.raises(TypeError, match="qs must be a CPU torch.uint8"):
        q8act.q4_matmul(x, qs.to(torch.int8), dm)
    with pytest.raises(TypeError, match=r"dm must be a CPU torch.float16 tensor of shape \(2, 16, 2\)"):
        q8act.q4_matmul(x, qs, dm[:, :, :1])
    with pytest.raises(TypeError, match=r"dm must be a CPU torch.float16 tensor of shape \(2, 16, 2\), "
                       r"got torch.float32"):
        q8act.q4_matmul(x, qs, dm.float())
    with pytest.raises(ValueError, match="multiple of 32"):
        q8act.quantize(torch.randn(2, 40))
    with pytest.raises(TypeError, match="2-D"):
        q8act.quantize(torch.randn(64))
    q8, d8 = eight_bit(16, 64, gen)
    with pytest.raises(TypeError, match="d must be a CPU torch.float16"):
        q8act.q8_matmul(x, q8, d8)
    d8 = d8.half()
    with pytest.raises(TypeError, match="codes must be"):
        q8act.q8_matmul(q8act.QActs(*(a[:, :1] for a in q8act.quantize(x))), q8, d8)
    with pytest.raises(ValueError, match="unknown path"):
        q8act.q8_matmul(x, q8, d8, isa="sse9")
    missing = [i for i in q8act.ISAS if i not in ISAS]
    if missing:
        with pytest.raises(ValueError, match=f"cannot run the {missing[0]} path"):
            q8act.q8_matmul(x, q8, d8, isa=missing[0])


def test_empty_rows():
    gen = torch.Generator().manual_seed(0)
    q, qs, dm = four_bit(16, 64, "Q4_0", gen)
    assert q8act.q4_matmul(torch.empty(0, 64), qs, dm.half()).shape == (0, 16)


def test_best_path_is_said_once(caplog):
    q8act.best_isa.cache_clear()
    with caplog.at_level(logging.INFO, logger="hispec.kernels.q8act"):
        best = q8act.best_isa()
        q8act.best_isa()
    notes = [r.getMessage() for r in caplog.records]
    assert best == [i for i in ISAS if i not in ("vnni-emulated", "amx")][-1]
    if best == "avx512vnni":
        assert notes == []
    else:
        assert len(notes) == 1 and f"the {best} path" in notes[0]


class CpuWithout:
    """The C library as a CPU with only the plain C path would show it (``hs_q8a_best_isa`` and
    ``hs_q8a_isa_supported`` say scalar); every other call goes to the real library."""

    def __init__(self, lib) -> None:
        self.lib, self.scalar = lib, q8act._isa_ids()["scalar"]

    def hs_q8a_best_isa(self) -> int:
        return self.scalar

    def hs_q8a_isa_supported(self, isa: int) -> int:
        return int(isa == self.scalar)

    def __getattr__(self, name: str):
        return getattr(self.lib, name)


def test_cpu_without_avx2_runs_the_plain_c_path_with_one_warning(monkeypatch, caplog):
    """No AVX2: the plain C path, said in one warning, with the bits this CPU's best path gives."""
    gen = torch.Generator().manual_seed(5)
    _, qs, dm = four_bit(48, 128, "Q4_1", gen)
    qs, dm = q8act.tile4(qs, dm)
    x = activations(3, 128, gen)
    want = q8act.q4_matmul(x, qs, dm)  # this CPU's best path
    monkeypatch.setattr(q8act, "library", lambda lib=q8act.library(): CpuWithout(lib))
    q8act.best_isa.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hispec.kernels.q8act"):
            assert q8act.supported_isas() == ["scalar"] and q8act.best_isa() == "scalar"
            got = [q8act.q4_matmul(x, qs, dm) for _ in range(2)]
        notes = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(notes) == 1 and "the scalar path (no AVX2 on this CPU)" in notes[0], notes
        assert all(torch.equal(g, want) for g in got)
        with pytest.raises(ValueError, match="cannot run the avx2 path"):
            q8act.q4_matmul(x, qs, dm, isa="avx2")
    finally:
        q8act.best_isa.cache_clear()


def test_no_compiler_falls_back_with_a_note(monkeypatch, tmp_path, caplog):
    """q8act is part of the one C library: without a compiler there is none, said once, and a call says why."""
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    binding.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hispec.kernels.binding"):
            assert q8act.library() is None and not q8act.available()
        assert any("unavailable" in r.getMessage() for r in caplog.records)
        with pytest.raises(RuntimeError, match="not built"):
            q8act.quantize(torch.randn(1, 32))
    finally:
        binding.library.cache_clear()


def test_one_library_and_binding_table():
    """The q8act functions are the one library's, typed from the header (no second build or table)."""
    assert q8act.library() is binding.library()
    table = binding.signatures()
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    assert table["hs_q8a_matmul"] == ([i, p, p, p, p, p, p, p, i64, i64, i64, p, i, i], i)
    assert table["hs_q8a_q4_matmul"] == table["hs_q4_matmul"] and table["hs_q8a_q8_matmul"] == table["hs_q8_matmul"]
    assert table["hs_q8a_best_isa"] == ([], i)


def test_drop_in_entry_points():
    """``hs_q8a_q4_matmul`` / ``hs_q8a_q8_matmul`` (the signatures of gguf.c's hs_q4_matmul /
    hs_q8_matmul, for the C++ layer op) give the Python entry points' bits; bfloat16 x as its float32 value."""
    gen = torch.Generator().manual_seed(2)
    lib = q8act.library()
    x = activations(6, 96, gen)
    qs, dm = q8act.tile4(*four_bit(40, 96, "Q4_1", gen)[1:])
    y = torch.empty(6, 40)
    lib.hs_q8a_q4_matmul(qs.data_ptr(), dm[0].data_ptr(), dm[1].data_ptr(), x.data_ptr(), 6, 40, 96, y.data_ptr(), 1)
    assert torch.equal(y, q8act.q4_matmul(x, qs, dm))
    q8, d8 = q8act.tile8(*eight_bit(40, 96, gen))
    for xin in (x, x.bfloat16()):
        lib.hs_q8a_q8_matmul(q8.data_ptr(), d8.data_ptr(), xin.data_ptr(), int(xin.dtype == torch.bfloat16), 6, 40, 96,
                             y.data_ptr(), 1)
        assert torch.equal(y, q8act.q8_matmul(xin.float(), q8, d8))


@pytest.mark.parametrize("n", [16, 40, 7])
def test_tiled_layout_holds_the_same_bytes(n):
    """``tile4`` / ``tile8`` reorder the blocks (16 columns side by side, the last ``N % 16`` columns as
    rows), ``untile4`` / ``untile8`` give them back; a tile's dword i of column c lies where the kernel
    loads it."""
    gen = torch.Generator().manual_seed(3)
    _, qs, dm = four_bit(n, 96, "Q4_1", gen)
    tq, tdm = q8act.tile4(qs, dm)
    assert tq.shape == qs.shape and tdm.shape == dm.shape and tdm.dtype == torch.float16
    assert torch.equal(tq.flatten().sort().values, qs.flatten().sort().values)
    assert all(torch.equal(a, b) for a, b in zip(q8act.untile4(tq, tdm), (qs, dm)))  # Q4_1: float16 scales kept exactly
    full = n // 16 * 16
    assert torch.equal(tq[full:], qs[full:]) and torch.equal(tdm[:, full:].float(), dm[:, full:])
    if full:  # block 1, dword 2 of column 3: bytes 16 + 8 .. 16 + 11 of its row
        at = ((1 * 4 + 2) * 16 + 3) * 4
        assert torch.equal(tq[:16].flatten()[at:at + 4], qs[3, 16 + 8:16 + 12])
        assert tdm[0, :16].flatten()[1 * 16 + 3] == dm[0, 3, 1]
    q8, d8 = eight_bit(n, 96, gen)
    t8, td8 = q8act.tile8(q8, d8)
    assert all(torch.equal(a, b) for a, b in zip(q8act.untile8(t8, td8), (q8, d8)))
    assert not full or not torch.equal(t8, q8)


def test_tiling_rounds_float32_scales_to_float16():
    """The tiled scales are float16: GGUF's kept exactly (above), others (``--quantize int4``'s float32
    ones) rounded to nearest, and untiling gives those values back in float32."""
    gen = torch.Generator().manual_seed(6)
    _, qs, dm = four_bit(40, 96, "int4", gen)
    assert not torch.equal(dm.half().float(), dm)
    tq, tdm = q8act.tile4(qs, dm)
    back = q8act.untile4(tq, tdm)[1]
    assert back.dtype == torch.float32 and torch.equal(back, dm.half().float())
    q8, d8 = eight_bit(40, 96, gen)
    d8 = d8 * 1.001  # off the float16 grid
    assert torch.equal(q8act.untile8(*q8act.tile8(q8, d8))[1], d8.half().float())


def test_prompt_chunks_on_tiled_weights_take_the_q4_panels():
    """``q4_panel_matmul`` on the tiled weights gives ``fused.q4_matmul(panels=True)``'s bits on the rows."""
    from hispec.kernels import fused

    gen = torch.Generator().manual_seed(4)
    _, qs, dm = four_bit(40, 96, "Q4_1", gen)
    x = activations(9, 96, gen)
    got = q8act.q4_panel_matmul(x, *q8act.tile4(qs, dm))
    assert torch.equal(got, fused.q4_matmul(x, qs, dm, panels=True))



# ---- the 8-bit form with a scale per 16 values (GGUF Q6_K: gguf_weights) ------------------------------
def eight_bit_g16(n: int, k: int, gen: torch.Generator):
    """``q [N, K]`` int8 (Q6_K's -32..31 and the full range, half the rows each) and ``d [N, K / 16]``."""
    q = torch.randint(-128, 128, (n, k), generator=gen)
    q[: n // 2] = q[: n // 2].remainder(64) - 32
    d = ((torch.rand((n, k // 16), generator=gen) - 0.3) * 0.01).half().float()  # some negative: Q6_K's int8 scales
    return q.to(torch.int8), d


def matmul_ref_g16(q: np.ndarray, d: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per block of 32 activations, two exact int32 sums of 16 products, each with its own weight
    scale, the low half first: ``acc = fma(idot_lo, d_lo * dx, acc)``, ``acc = fma(idot_hi, d_hi * dx, acc)``."""
    codes, dx, _, _ = quantize_ref(x)
    t, k = codes.shape
    n, nh = q.shape[0], k // 16
    idot = np.einsum("thj,nhj->tnh", codes.reshape(t, nh, 16).astype(np.int64), q.reshape(n, nh, 16).astype(np.int64))
    acc = np.zeros((t, n), F32)
    for h in range(nh):
        c = (d[None, :, h] * dx[:, None, h // 2]).astype(F32)
        acc = fma32(idot[:, :, h].astype(F32), c, acc)
    return acc


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_group16_exact_against_reference(isa, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k + 16)
    w = weights("Q8_G16", n, k, gen)
    x = activations(19, k, gen)
    y = run("Q8_G16", x, w, isa)
    assert y.shape == (19, n)
    assert np.array_equal(y.numpy(), reference("Q8_G16", x, w))


def test_group16_rows_independent_paths_agree_quantized_input_too():
    """Rows 1..19 in one call equal each row alone, bit for bit, on every path; the paths agree; float
    rows give the bits of rows quantized first."""
    gen = torch.Generator().manual_seed(17)
    n, k = 53, 128
    w = weights("Q8_G16", n, k, gen)
    x = activations(19, k, gen)
    first = None
    for isa in ISAS:
        alone = torch.cat([run("Q8_G16", x[i:i + 1], w, isa) for i in range(19)])
        for t in range(1, 20):
            assert torch.equal(run("Q8_G16", x[:t], w, isa), alone[:t]), (isa, t)
        assert torch.equal(run("Q8_G16", q8act.quantize(x), w, isa), alone), isa
        if first is not None:
            assert torch.equal(alone, first), isa
        first = alone


def test_group16_error_within_activation_rounding():
    gen = torch.Generator().manual_seed(19)
    n, k = 64, 192
    q, d = weights("Q8_G16", n, k, gen)
    x = activations(6, k, gen)
    wf = q.double() * d.double().repeat_interleave(16, 1)
    exact = x.double() @ wf.T
    step = (x.abs().view(6, k // 32, 32).amax(-1) / 254).double().repeat_interleave(32, 1)
    bound = step @ wf.abs().T + 1e-5 * (x.double().abs() @ wf.abs().T)
    err = (run("Q8_G16", x, (q, d), None).double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0


def test_group16_differs_from_one_scale_per_block():
    """The two halves really take their own scales: with the low half's scales zero, the outputs are
    the high halves' alone (not the group-32 kernel reading every other scale)."""
    gen = torch.Generator().manual_seed(23)
    q, d = weights("Q8_G16", 32, 64, gen)
    x = activations(3, 64, gen)
    low_zero = d.clone()
    low_zero[:, 0::2] = 0
    hi_only = q.clone()
    hi_only.view(32, 2, 2, 16)[:, :, 0] = 0
    for isa in ISAS:
        assert torch.equal(run("Q8_G16", x, (q, low_zero), isa), run("Q8_G16", x, (hi_only, low_zero), isa))
        assert not torch.equal(run("Q8_G16", x, (q, d), isa), run("Q8_G16", x, (hi_only, d), isa))


@pytest.mark.parametrize("n", [16, 40, 7])
def test_group16_tiled_layout_round_trips(n):
    gen = torch.Generator().manual_seed(n)
    q, d = weights("Q8_G16", n, 96, gen)
    tq, td = q8act.tile8(q, d)
    assert tq.shape == q.shape and td.shape == (n, 6) and td.dtype == torch.float16
    assert sorted(td.flatten().tolist()) == sorted(d.half().flatten().tolist())  # the same scales, reordered
    uq, ud = q8act.untile8(tq, td)
    assert torch.equal(uq, q) and torch.equal(ud, d)
    if n >= 16:  # a tile's scales: per group of 16 values, the 16 columns side by side
        assert torch.equal(td[:16].flatten().view(6, 16).T, d[:16].half())


def test_group16_float_activation_kernel():
    """The q8 kernel (float32 activations in 16 bits per block, gguf.c) with a scale per 16 values:
    within half a 16-bit step per input of x @ W.T, each row alone the same bits, bfloat16 input too."""
    from hispec.kernels import fused

    gen = torch.Generator().manual_seed(29)
    n, k = 40, 256
    q, d = weights("Q8_G16", n, k, gen)
    x = activations(9, k, gen)
    wf = q.double() * d.double().repeat_interleave(16, 1)
    y = fused.q8_matmul(x, q, d)
    step = (x.abs().view(9, k // 32, 32).amax(-1) * (0.5 / 32767)).double().repeat_interleave(32, 1)
    bound = step @ wf.abs().T + 1e-5 * (x.double().abs() @ wf.abs().T)
    assert ((y.double() - x.double() @ wf.T).abs() <= bound).all()
    for t in range(9):
        assert torch.equal(fused.q8_matmul(x[t:t + 1], q, d), y[t:t + 1])
    xb = x.to(torch.bfloat16)
    assert torch.equal(fused.q8_matmul(xb, q, d), fused.q8_matmul(xb.float(), q, d))
    # a scale per 32 given as two equal ones per 16: the same products as the group-32 kernel's within rounding
    d32 = d[:, 0::2]
    y16, y32 = fused.q8_matmul(x, q, d32.repeat_interleave(2, 1)), fused.q8_matmul(x, q, d32)
    assert torch.allclose(y16, y32, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="K / 16"):
        fused.q8_matmul(x, q, d[:, :5])


def test_amx_rows_are_chosen_by_timing():
    """The tile path runs prompt chunks from the fewest timed rows where it was clearly faster, else never."""
    med = {"amx@64": 1.0, "vector@64": 1.0, "amx@256": 3.0, "vector@256": 4.0}
    assert q8act.amx_rows_choice(med) == 256
    assert q8act.amx_rows_choice({**med, "amx@64": 0.9}) == 64
    assert q8act.amx_rows_choice({**med, "amx@256": 3.9}) == 0


@pytest.mark.skipif("amx" not in ISAS, reason="no AMX path on this CPU")
@pytest.mark.parametrize("kind", KINDS)
def test_automatic_path_from_amx_rows_gives_the_same_bits(kind):
    """With the tile path taken from 16 rows, the automatic choice gives every row's bits of the vector
    path, above and below the threshold; the process's timed setting is put back."""
    gen = torch.Generator().manual_seed(11)
    w = weights(kind, 70, 256, gen)
    x = activations(40, 256, gen)
    lib, kept = q8act.library(), q8act.use_amx_rows()
    vector = [i for i in ISAS if i not in ("vnni-emulated", "amx")][-1]
    if kind in ("Q8_0", "Q8_G16"):
        q, d = q8act.tile8(w[0], w[1])
    else:
        q, dm = q8act.tile4(w[1], w[2])

    def automatic(x):  # the entry points the layer op calls (HS_Q8A_AUTO)
        y = torch.empty(x.shape[0], 70)
        if kind in ("Q8_0", "Q8_G16"):
            lib.hs_q8a_q8_group_matmul(q.data_ptr(), d.data_ptr(), 256 // d.shape[1], x.data_ptr(), 0, x.shape[0],
                                       70, 256, y.data_ptr(), 1)
        else:
            lib.hs_q8a_q4_matmul(q.data_ptr(), dm[0].data_ptr(), dm[1].data_ptr(), x.data_ptr(), x.shape[0], 70, 256,
                                 y.data_ptr(), 1)
        return y

    try:
        lib.hs_q8a_set_amx_rows(16)
        for t in (1, 15, 16, 40):
            assert torch.equal(automatic(x[:t].contiguous()), run(kind, x[:t], w, vector)), t
    finally:
        lib.hs_q8a_set_amx_rows(kept)
    assert lib.hs_q8a_amx_rows() == kept
