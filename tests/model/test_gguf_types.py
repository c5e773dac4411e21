"""GGUF types on hispec's block kernels (``hispec/model/load/gguf_weights.py``), checked against the
gguf package's own dequantization:

* each type's block form (4-bit ``w = d q + m``: Q4_0, Q4_1, Q4_K; 8-bit ``w = d q``: Q8_0, Q5_0,
  and Q4_0 again; Q6_K with a scale per 16 values) gives gguf's weights (exactly, Q4_K and Q6_K
  within their one float16 rounding) and each kernel of that form multiplies by them within its
  documented error, each row the same bits alone as in a batch, on every path;
* fused layers take one form when all their parts share it; other layers (Q5_1, parts of
  different forms) run in the 8-bit form, the parts without an exact one requantized from their float
  values within amax / 254 per weight (named in a warning), so that no layer stays on float32;
* a tiny llama GGUF of Q4_K / Q5_0 / Q8_0 tensors loads with ``--quantize native`` on those kernels,
  and a Q4_K_M-like one (Q4_K + Q6_K parts) with no float layers.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from hispec.kernels import fused, q8act  # noqa: E402
from hispec.kernels.quant import Q4_STORAGE, Q8_STORAGE, QuantLinear  # noqa: E402
from hispec.model.load import gguf_weights as gw  # noqa: E402

Q = gguf.GGMLQuantizationType
QK_SIZES = gguf.constants.GGML_QUANT_SIZES


class _Tensor:
    """What ``gguf_weights`` reads of a tensor: its type and its rows of blocks."""

    def __init__(self, kind: str, data: np.ndarray) -> None:
        self.tensor_type, self.data = Q[kind], data


def _random_k_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[N, K / 256 * bytes]`` random Q4_K / Q6_K blocks (the gguf package cannot quantize
    K-quants) with float16 scales in a sane range: Q4_K's d, dmin in [1e-5, 4e-4] (so |w| <~ 0.4),
    Q6_K's d in [1e-6, 1e-5]."""
    block, size = QK_SIZES[Q[kind]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    if kind in ("Q4_K", "Q5_K"):
        for at in (0, 2):  # d, dmin
            raw[..., at:at + 2] = rng.uniform(1e-5, 4e-4, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        raw[..., 208:210] = rng.uniform(1e-6, 1e-5, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _quantized(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the file's rows of ``kind`` blocks for a random ``[N, K]`` weight, gguf's dequantization)."""
    rng = np.random.default_rng(seed)
    if kind in ("Q4_K", "Q6_K"):
        raw = _random_k_blocks(kind, n, k, rng)
    else:
        raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.1).astype(np.float32), Q[kind])
    return raw, gguf.quants.dequantize(raw, Q[kind]).astype(np.float32)


def _q6_k_bound(raw: np.ndarray) -> np.ndarray:
    """``[N, K]``: 2^-11 |d sc (q - 32)|, how far Q6_K's 8-bit form (``d16 = d sc`` rounded once to
    float16) may move each weight from the exact value."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 210)
    d = b[..., 208:210].copy().view(np.float16).astype(np.float64)  # [N, K/256, 1]
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float64)  # [N, K/256, 16]
    q = torch.as_tensor(gw._q8_blocks(_Tensor("Q6_K", raw))[0]).double().numpy()
    return 2.0 ** -11 * np.abs((d * sc).reshape(n, -1).repeat(16, 1) * q)


def _q4_k_bound(raw: np.ndarray) -> np.ndarray:
    """``[N, K]``: 2^-11 (|d sc q| + |dmin mn|), how far Q4_K's 4-bit form may move each weight
    (``d' = d sc`` and ``m' = -dmin mn`` rounded once to float16), from the exact values."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
    sc, mn = sc.reshape(n, -1, 8), mn.reshape(n, -1, 8)
    ds = (d[..., None] * sc).reshape(n, -1).repeat(32, 1)
    ms = (dmin[..., None] * mn).reshape(n, -1).repeat(32, 1)
    q = torch.as_tensor(gw._blocks(_Tensor("Q4_K", raw))[0]).double().numpy()
    return 2.0 ** -11 * (ds * q + ms)


def _requant_bound(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``[N, K]``: how far requantization may move each weight (``gguf_weights.requantize_q8``): half
    a step d / 2, d = amax / 127 rounded to float16 (at most one float16 step up)."""
    n, k = w.shape
    amax = w.double().abs().reshape(n, k // group, group).amax(-1)
    return (amax / 254 * (1 + 2.0 ** -10) + 2.0 ** -25).repeat_interleave(group, 1)


FOUR_BIT_KERNELS = ["q4", "q8a", "int4"]
EIGHT_BIT_KERNELS = ["q8", "q8a8", "int4x2"]


def _kernel_or_skip(kernel: str) -> None:
    if kernel in ("q4", "q8") and not fused.available():
        pytest.skip("needs the fused CPU kernels (a C compiler)")
    if kernel in ("q8a", "q8a8") and not (fused.available() and q8act.available()):
        pytest.skip("needs the q8act kernels (a C compiler)")


def _check_output(layer: QuantLinear, w_ref: torch.Tensor, x: torch.Tensor) -> None:
    """``layer(x)`` within its kernel's documented error of ``x @ w_ref.T`` (float64), plus what the
    layer's weights differ from ``w_ref`` by (|x| |dW|: zero where the form is exact)."""
    w = layer.source_weight().double()
    ref = x.double() @ w_ref.double().T
    out = layer(x).double()
    moved = x.double().abs() @ (w - w_ref.double()).abs().T
    xb = x.abs().view(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1).double()  # each input's block max
    if layer.kernel in ("q4", "q8"):  # 16-bit activations per block: half a step of 1/32767 of its largest
        bound = xb * (0.5 / 32767) @ w.abs().T + 1e-5
    elif layer.kernel in ("q8a", "q8a8"):  # 8-bit activations per block: half a step of amax / 127
        bound = (xb / 254) @ w.abs().T + 1e-4
    else:  # int4, int4x2: bfloat16 activations, scales and output (2^-9 each, with margin)
        bound = (x.double().abs() @ w.abs().T) * 2 ** -6 + 1e-3
    assert ((out - ref).abs() <= bound + moved * (1 + 1e-6)).all(), (out - ref).abs().max()
    for t in (1, 3):  # each row the same whatever the rows beside it
        assert torch.equal(layer(x[:t]), layer(x)[:t])


# ---- each type's block form -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_four_bit_form_equals_gguf_dequantization(kind):
    raw, want = _quantized(kind, 48, 512)
    q, d, m = gw._blocks(_Tensor(kind, raw))
    assert q.shape == (48, 512) and int(q.max()) <= 15 and d.shape == m.shape == (48, 16)
    assert d.dtype == m.dtype == torch.float16
    got = (q.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)).numpy()
    if kind != "Q4_K":  # exact: the file's d, m (Q4_0: m = -8 d)
        assert np.array_equal(got.astype(np.float32), want)
        return
    err = np.abs(got - want)
    assert (err <= _q4_k_bound(raw) * (1 + 1e-6) + 1e-12).all()  # d', m' rounded once to float16
    assert err.max() > 0  # the rounding is real (the bound is not vacuous)
    # the nibble order matters: K-quants' chunk of 64 is 32 low nibbles then 32 high ones
    blocks = raw.reshape(48, -1, 144)
    assert np.array_equal(q.numpy()[:, 32:64], blocks[:, 0, 16:48] >> 4)


def test_q4_k_scales_round_once_to_float16():
    """d' = d sc and m' = -dmin mn: within half a float16 step of the exact products (2^-11 of them,
    where they are normal), 4.88e-4 measured; a d' that overflows float16 is refused, not inf."""
    raw, _ = _quantized("Q4_K", 256, 1024, seed=3)
    _, d, m = gw._blocks(_Tensor("Q4_K", raw))
    b = raw.reshape(256, -1, 144)
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
    exact_d = b[..., 0:2].copy().view(np.float16).astype(np.float64).reshape(-1, 1) * sc
    exact_m = -b[..., 2:4].copy().view(np.float16).astype(np.float64).reshape(-1, 1) * mn
    for got, exact in ((d, exact_d), (m, exact_m)):
        exact = exact.reshape(256, -1)
        nz = exact != 0
        rel = np.abs(got.double().numpy() - exact)[nz] / np.abs(exact[nz])
        assert 2 ** -12 < rel.max() <= 2 ** -11
    big = raw.copy().reshape(256, -1, 144)
    big[0, 0, 0:2] = np.array([60000], np.float16).view(np.uint8)  # d * sc > 65504 (sc > 1 likely)
    big[0, 0, 4] |= 63
    with pytest.raises(ValueError, match="overflows float16"):
        gw._blocks(_Tensor("Q4_K", big.reshape(256, -1)))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0"])
def test_eight_bit_form_equals_gguf_dequantization(kind):
    raw, want = _quantized(kind, 48, 256)
    q, d = gw._q8_blocks(_Tensor(kind, raw))
    assert q.dtype == torch.int8 and q.shape == (48, 256) and d.dtype == torch.float16
    lo, hi = {"Q8_0": (-128, 127), "Q5_0": (-16, 15), "Q4_0": (-8, 7)}[kind]
    assert lo <= int(q.min()) and int(q.max()) <= hi
    got = q.float() * d.float().repeat_interleave(32, 1)
    assert np.array_equal(got.numpy(), want)  # exact


def test_forms_of_types():
    assert gw.form_of(["Q4_0"]) == "4-bit" and gw.form_of(["Q4_K", "Q4_0", "Q4_1"]) == "4-bit"
    assert gw.form_of(["Q5_0", "Q8_0"]) == "8-bit" and gw.form_of(["Q4_0", "Q8_0"]) == "8-bit"
    assert gw.form_of(["Q6_K"]) == "8-bit" and gw.form_of(["Q6_K", "Q8_0", "Q5_0"]) == "8-bit"
    for mixed in (["Q4_1", "Q5_0"], ["Q4_K", "Q8_0"], ["Q5_1"], ["Q5_K"], ["F16"], ["Q4_K", "Q6_K"]):
        assert gw.form_of(mixed) is None, mixed


def test_q6_k_form_equals_gguf_dequantization():
    """Q6_K in the 8-bit form with a scale per 16 values: q = q6 - 32 in -32..31 (the bits as gguf
    reads them), d16 = d * sc rounded once to float16 (relative error <= 2^-11, reached: 4.88e-4 max
    on these random super-blocks; 4.8757e-4 over Gemma 3 270M's Q6_K scales)."""
    raw, want = _quantized("Q6_K", 48, 512, seed=8)
    q, d = gw._q8_blocks(_Tensor("Q6_K", raw))
    assert q.dtype == torch.int8 and q.shape == (48, 512) and d.dtype == torch.float16 and d.shape == (48, 32)
    assert int(q.min()) == -32 and int(q.max()) == 31
    got = q.double().numpy() * d.double().numpy().repeat(16, 1)
    err = np.abs(got - want)
    assert (err <= _q6_k_bound(raw) * (1 + 1e-6) + 1e-12).all() and err.max() > 0
    b = raw.reshape(48, -1, 210)
    exact = (b[..., 208:210].copy().view(np.float16).astype(np.float64)
             * b[..., 192:208].copy().view(np.int8).astype(np.float64)).reshape(48, -1)
    nz = exact != 0
    rel = np.abs(d.double().numpy() - exact)[nz] / np.abs(exact[nz])
    assert 2 ** -12 < rel.max() <= 2 ** -11
    # the bit layout: with every scale 1 and d 1, the codes are gguf's values themselves
    ones = b.copy()
    ones[..., 192:208] = 1
    ones[..., 208:210] = np.array([1.0], np.float16).view(np.uint8)
    ones = ones.reshape(48, -1)
    q1, _ = gw._q8_blocks(_Tensor("Q6_K", ones))
    assert np.array_equal(q1.numpy(), gguf.quants.dequantize(ones, Q.Q6_K).astype(np.int8))
    big = b.copy()
    big[0, 0, 208:210] = np.array([60000], np.float16).view(np.uint8)
    big[0, 0, 192] = 100
    with pytest.raises(ValueError, match="overflows float16"):
        gw._q8_blocks(_Tensor("Q6_K", big.reshape(48, -1)))


@pytest.mark.parametrize("kind,kernel", [(k, kn) for k in ("Q4_0", "Q4_1", "Q4_K") for kn in FOUR_BIT_KERNELS]
                         + [(k, kn) for k in ("Q8_0", "Q5_0") for kn in EIGHT_BIT_KERNELS]
                         + [("Q6_K", "q8"), ("Q6_K", "q8a8")])
def test_kernels_multiply_by_the_files_weights(kind, kernel):
    _kernel_or_skip(kernel)
    raw, want = _quantized(kind, 32, 256, seed=1)
    t = _Tensor(kind, raw)
    layer = QuantLinear.from_blocks(*gw._blocks(t), kind, kernel=kernel) if kernel in FOUR_BIT_KERNELS \
        else QuantLinear.from_q8_blocks(*gw._q8_blocks(t), kind, kernel=kernel)
    assert layer.kernel == kernel and layer.source == kind and layer.group == (16 if kind == "Q6_K" else 32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    _check_output(layer, torch.from_numpy(want), x)


def test_q6_k_rows_alone_equal_a_batch_on_every_path():
    """Q6_K's 8-bit form (group 16): rows computed alone equal the same rows in a batch of 5, bit for
    bit, on q8 and on q8a8 by every path this CPU has (which all give the same bits); int4x2 has no
    group of 16 and refuses it."""
    _kernel_or_skip("q8a8")
    raw, want = _quantized("Q6_K", 48, 512, seed=9)
    q, d = gw._q8_blocks(_Tensor("Q6_K", raw))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    layer = QuantLinear.from_q8_blocks(q, d, "Q6_K", kernel="q8")
    y = layer(x)
    assert all(torch.equal(layer(x[t:t + 1]), y[t:t + 1]) for t in range(5))
    tq, td = q8act.tile8(q, d.float())
    first = None
    for isa in q8act.supported_isas():
        y8 = q8act.q8_matmul(x, tq, td, isa=isa)
        assert all(torch.equal(q8act.q8_matmul(x[t:t + 1], tq, td, isa=isa), y8[t:t + 1]) for t in range(5)), isa
        assert first is None or torch.equal(y8, first), isa
        first = y8
    assert torch.equal(QuantLinear.from_q8_blocks(q, d, "Q6_K", kernel="q8a8")(x), first)
    with pytest.raises(ValueError, match="per 16 values"):
        QuantLinear.from_q8_blocks(q, d, "Q6_K", kernel="int4x2")


# ---- fused layers, the head --------------------------------------------------------------------------
HIDDEN, N_HEAD, N_KV, FFN = 256, 4, 2, 512


def _write(path, tensors: dict[str, tuple[str, np.ndarray]], arch: str = "llama") -> None:
    """A GGUF file of raw tensors ``name -> (type, rows of blocks or float32 array)`` (no metadata
    beyond the architecture: ``gguf_weights`` reads tensors only)."""
    w = gguf.GGUFWriter(str(path), arch)
    for name, (kind, data) in tensors.items():
        if kind == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SHAPES = {"attn_q": HIDDEN, "attn_k": HIDDEN // N_HEAD * N_KV, "attn_v": HIDDEN // N_HEAD * N_KV,
          "attn_output": HIDDEN, "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": HIDDEN}


def _layer_tensors(types: dict[str, str], layer: int = 0, seed: int = 0):
    """``{gguf name: (type, raw)}`` and ``{gguf name: gguf's dequantization}`` of one decoder layer."""
    raws, refs = {}, {}
    for i, (part, kind) in enumerate(types.items()):
        k = FFN if part == "ffn_down" else HIDDEN
        raw, want = _quantized(kind, SHAPES[part], k, seed=seed + 7 * layer + i)
        name = f"blk.{layer}.{part}.weight"
        raws[name], refs[name] = (kind, raw), want
    return raws, refs


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return torch.as_tensor(w).reshape(n_head, -1, 2, w.shape[1]).transpose(1, 2).reshape(w.shape).numpy()


@pytest.mark.parametrize("permuted", [True, False])
def test_fused_layers_share_a_form_or_are_requantized(tmp_path, four_bit_kernel, permuted):
    four_bit_kernel("int4")  # no timed choice (and the 8-bit kernel follows from it: q8, or int4x2 without C)
    q8 = "q8" if fused.available() else "int4x2"
    layer0 = {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "Q4_K",
              "ffn_gate": "Q4_K", "ffn_up": "Q4_0", "ffn_down": "Q6_K"}
    layer1 = {"attn_q": "Q4_1", "attn_k": "Q5_0", "attn_v": "Q5_0", "attn_output": "Q5_1",
              "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q4_K"}
    raws, refs = _layer_tensors(layer0, 0)
    more = _layer_tensors(layer1, 1)
    raws.update(more[0]), refs.update(more[1])
    src = tmp_path / "mixed.gguf"
    _write(src, raws)
    native, kinds = gw.native_linears(src, N_HEAD, N_KV, permuted=permuted)
    assert len(native) == 8 and gw.float_layers(src, native) == []  # nothing stays on float32
    assert kinds == "Q4_0+Q4_1+Q4_K+Q5_0+Q5_1+Q6_K+Q8_0"
    g16 = fused.available()  # without hispec's kernels (int4x2) Q6_K is requantized
    # int4 (bfloat16 activations) beside q8 layers (float32 ones): the 4-bit layers take q4
    four = "q4" if fused.available() else "int4"
    forms = {"layers.0.o_proj": ("Q4_K", four, ()),
             "layers.0.gate_up_proj": ("Q4_0+Q4_K", four, ()), "layers.1.down_proj": ("Q4_K", four, ()),
             "layers.1.gate_up_proj": ("Q4_0+Q8_0", q8, ()),  # Q4_0 beside Q8_0: in the 8-bit form
             # Q6_K beside Q5_0 and Q8_0: all in the 8-bit form with a scale per 16 values
             "layers.0.qkv_proj": ("Q5_0+Q6_K+Q8_0", q8, () if g16 else ("Q6_K",)),
             "layers.0.down_proj": ("Q6_K", q8, () if g16 else ("Q6_K",)),
             # no exact form: requantized from the float values, in the 8-bit form
             "layers.1.o_proj": ("Q5_1", q8, ("Q5_1",)),
             # Q4_1 has no 8-bit form, Q5_0 no 4-bit one: the Q4_1 part requantized, the Q5_0 ones exact
             "layers.1.qkv_proj": ("Q4_1+Q5_0", q8, ("Q4_1",))}
    fused_parts = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
                   "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}
    for name, layer in native.items():
        assert (layer.source, layer.kernel, layer.requantized) == forms[name], name
        if "Q6_K" in layer.source and g16:
            assert layer.group == 16, name
        i, fused_name = name.split(".")[1:]
        parts, exact = [], []
        for p in fused_parts[fused_name]:
            w = refs[f"blk.{i}.{p}.weight"]
            if permuted and p in ("attn_q", "attn_k"):
                w = _unpermute(w, N_HEAD if p == "attn_q" else N_KV)
            parts.append(w)
            exact.append(np.full(w.shape[0], raws[f"blk.{i}.{p}.weight"][0] not in layer.requantized + ("Q6_K",)))
        want, exact = torch.from_numpy(np.concatenate(parts)), torch.from_numpy(np.concatenate(exact))
        got = layer.source_weight()
        if layer.requantized:
            err = (got - want).abs()
            assert (err <= _requant_bound(want)).all() and err.max() > 0, name
            assert torch.equal(got[exact], want[exact]), name  # the parts with an exact form as in the file
        elif "Q6_K" in layer.source:  # d * sc rounded once to float16; the other parts exact
            assert ((got - want).abs() <= 2 ** -11 * want.abs() * (1 + 1e-6)).all(), name
            assert torch.equal(got[exact], want[exact]) and not torch.equal(got, want), name
        elif "Q4_K" in layer.source:
            assert (got - want).abs().max() <= 2 ** -11 * want.abs().max() * 4
        else:
            assert torch.equal(got, want), name
    msg = gw.float_message("mixed.gguf", [], native)
    assert msg.startswith(f"mixed.gguf: {2 if g16 else 4} of 8 decoder linears run on 8-bit blocks requantized "
                          "from their float values"), msg
    assert "Q5_1 has no exact native form: o_proj in 1 layer" in msg and ("Q6_K" not in msg.split("; the")[0]) == g16
    assert "Q4_1 requantized beside parts of another form: qkv_proj in 1 layer" in msg
    assert "amax / 254" in msg and "float32" not in msg
    exact_only = {k: v for k, v in native.items() if not v.requantized}
    assert gw.float_message("mixed.gguf", [], exact_only) is None  # nothing to say


def test_requantize_q8_moves_each_weight_by_at_most_half_a_step():
    """Q8_0-style requantization: d = amax / 127 in float16 (never below it: codes stay in
    -127..127), each weight within d / 2 <= amax / 254 (1 + 2^-10) (+ 2^-25 where d is subnormal); a
    zero block gives zero codes and scale; values that are not finite are refused."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-6, 1, 64)[:, None]  # rows from tiny to large
    w[3, 32:64] = 0.0
    q, d = gw.requantize_q8(w)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (64, 8)
    assert int(q.abs().max()) <= 127
    amax = w.abs().reshape(64, 8, 32).amax(-1)
    assert (d.float() * 127 >= amax).all() and d[3, 1] == 0 and (q[3, 32:64] == 0).all()
    got = q.float() * d.float().repeat_interleave(32, 1)
    err = (got.double() - w.double()).abs()
    assert (err <= d.double().repeat_interleave(32, 1) / 2 * (1 + 1e-6)).all()
    assert (err <= _requant_bound(w)).all()
    assert (err / d.double().repeat_interleave(32, 1).clamp(min=1e-30)).max() > 0.49  # nearly reached
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        gw.requantize_q8(bad)


@pytest.mark.parametrize("kernel", EIGHT_BIT_KERNELS)
def test_requantized_q6_k_on_the_kernels(kernel):
    """Q6_K blocks requantized to the 8-bit form: within the bound of gguf's values, each kernel within
    its documented error of x @ W.T, and each row the same bits alone as in a batch of 5."""
    _kernel_or_skip(kernel)
    raw, want = _quantized("Q6_K", 32, 512, seed=4)
    q, d = gw._requantized_blocks(_Tensor("Q6_K", raw))
    want = torch.from_numpy(want)
    layer = QuantLinear.from_q8_blocks(q, d, "Q6_K", kernel=kernel)
    assert ((layer.source_weight() - want).abs() <= _requant_bound(want)).all()
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    _check_output(layer, want, x)
    for t in range(5):
        assert torch.equal(layer(x[t:t + 1]), layer(x)[t:t + 1])


def test_sixteen_row_tiles_are_kept(tmp_path):
    """The packed layout needs rows in tiles of 16: a layer of 40 rows stays float, saying why."""
    raw, _ = _quantized("Q8_0", 40, 256)
    src = tmp_path / "odd.gguf"
    _write(src, {"blk.0.attn_output.weight": ("Q8_0", raw)})
    native, _ = gw.native_linears(src, N_HEAD, N_KV)
    assert native == {}
    assert [f.why for f in gw.float_layers(src, native)] == ["its rows are not a multiple of 16"]


@pytest.mark.parametrize("kind,name,kernels", [("Q5_0", "output.weight", Q8_STORAGE + ("int4x2",)),
                                               ("Q4_K", "token_embd.weight", Q4_STORAGE + ("int4",)),
                                               ("Q6_K", "output.weight", Q8_STORAGE + ("int4x2",)),
                                               ("Q5_1", "output.weight", Q8_STORAGE + ("int4x2",)),
                                               ("F32", "output.weight", None)])
def test_native_head(tmp_path, kind, name, kernels):
    """The head on the file's blocks where its type maps (a Q6_K head in the 8-bit form, group 16),
    else requantized to the 8-bit form (Q5_1); an F32 head is the file's own precision and stays float."""
    if kind == "F32":
        raw = want = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32)
    else:
        raw, want = _quantized(kind, 64, 256, seed=5)
    src = tmp_path / f"head-{kind}.gguf"
    _write(src, {name: (kind, raw)})
    head = gw.native_head(src)
    if kernels is None:
        assert head is None
        return
    assert head.kernel in kernels and head.source == kind and head.out_features == 64
    got, want = head.source_weight(), torch.from_numpy(want)
    if kind == "Q4_K":
        assert ((got.double() - want.double()).abs().numpy() <= _q4_k_bound(raw) * (1 + 1e-6) + 1e-12).all()
    elif kind == "Q6_K" and head.kernel in Q8_STORAGE:
        assert head.requantized == () and head.group == 16 and gw.float_message("head.gguf", [], {}, head) is None
        assert ((got.double() - want.double()).abs().numpy() <= _q6_k_bound(raw) * (1 + 1e-6) + 1e-12).all()
    elif kind in ("Q6_K", "Q5_1"):  # Q6_K: without hispec's kernels (int4x2 has no group of 16)
        assert head.requantized == (kind,) and ((got - want).abs() <= _requant_bound(want)).all()
        msg = gw.float_message("head.gguf", [], {}, head)
        assert f"the output head ({kind}) runs on 8-bit blocks requantized" in msg and "float32" not in msg
    else:
        assert torch.equal(got, want) and head.requantized == ()


# ---- end to end: a tiny llama GGUF ------------------------------------------------------------------
DECODER_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q5_0",
                 "ffn_gate": "Q8_0", "ffn_up": "Q5_0", "ffn_down": "Q4_K"}


def _tiny_llama_gguf(path, types: dict[str, str], arch: str = "llama", embed: str = "F32", tied: bool = False,
                     vocab: int | None = None) -> None:
    """A 2-layer llama (or ``arch``: qwen2 with its q/k/v biases; hidden 256: Q4_K's super-blocks)
    with decoder tensors of ``types``, F32 norms and biases, an embedding of type ``embed`` and
    (unless ``tied``) an F32 head, and the byte-level tokenizer of ``test_gguf_convert`` (261
    tokens; ``vocab``: padded with unused ones to that many)."""
    from tests.model.test_gguf_convert import CHAT_TEMPLATE, _tiny_tokens

    tokens, token_types, merges = _tiny_tokens()
    pad = (vocab or len(tokens)) - len(tokens)
    tokens, token_types = tokens + [f"[PAD{i}]" for i in range(pad)], token_types + [5] * pad  # 5: unused
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // N_HEAD)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)
    f32 = {"token_embd.weight": (rng.standard_normal((len(tokens), HIDDEN)) * 0.5).astype(np.float32),
           "output.weight": (rng.standard_normal((len(tokens), HIDDEN)) * 0.05).astype(np.float32),
           "output_norm.weight": np.ones(HIDDEN, np.float32)}
    if tied:
        del f32["output.weight"]
    if embed in ("Q4_K", "Q5_K", "Q6_K"):
        raw = _random_k_blocks(embed, len(tokens), HIDDEN, rng)
        w.add_tensor("token_embd.weight", raw, raw_dtype=Q[embed])
        del f32["token_embd.weight"]
    elif embed != "F32":
        raw = gguf.quants.quantize(f32.pop("token_embd.weight"), Q[embed])
        w.add_tensor("token_embd.weight", raw, raw_dtype=Q[embed])
    for name, arr in f32.items():
        w.add_tensor(name, arr)
    for i in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        if arch == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{part}.bias", rng.standard_normal(SHAPES[part]).astype(np.float32))
        for name, (kind, raw) in _layer_tensors(types, i, seed=11)[0].items():
            w.add_tensor(name, raw, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids):
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool
    from hispec.model.runner import LayerRunner

    blocks, pool = BlockManager(4, 16, 2), KVPool(2, 4, 16, N_KV, HIDDEN // N_HEAD, torch.float32, "cpu")
    blocks.add_sequence(0)
    h = LayerRunner(model, blocks, pool).forward(0, 0, ids, 0, 2)
    return model.exit_logits(h, 2)


@pytest.mark.parametrize("down,kernel", [("Q4_K", "q4"), ("Q6_K", "q4"), ("Q4_K", "q8a")])
def test_tiny_llama_loads_natively(tmp_path, four_bit_kernel, caplog, down, kernel):
    """Q4_K / Q5_0 / Q8_0 decoder tensors run on the block kernels with gguf's values (the float32
    copy's): the 4-bit form on ``kernel``, the 8-bit one on its partner (q8, q8a8); a Q6_K ffn_down
    runs in the 8-bit form with a scale per 16 values (d * sc rounded once to float16), no warning."""
    from hispec.model.load.checkpoint import load_model
    from hispec.model.load.gguf_convert import convert_gguf

    _kernel_or_skip(kernel)
    four_bit_kernel(kernel)
    src = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(src, {**DECODER_TYPES, "ffn_down": down})
    out = convert_gguf(src, tmp_path / "out", progress=False)
    ref = load_model(out)
    with caplog.at_level(logging.WARNING, logger="hispec.model.load.checkpoint"):
        native = load_model(out, quantize="native", gguf=src)
    assert native.weight_format == "native"
    q8 = "q8a8" if kernel == "q8a" else "q8"
    want = {"qkv_proj": ("Q4_K", kernel), "o_proj": ("Q5_0", q8), "gate_up_proj": ("Q5_0+Q8_0", q8),
            "down_proj": ("Q4_K", kernel) if down == "Q4_K" else (down, q8)}
    for layer, float_layer in zip(native.layers, ref.layers):
        for name, (source, kernel) in want.items():
            lin, w = getattr(layer, name), getattr(float_layer, name).weight
            assert isinstance(lin, QuantLinear) and (lin.source, lin.kernel) == (source, kernel), name
            if source == "Q6_K":  # d * sc rounded once to float16
                assert lin.requantized == () and lin.group == 16
                assert 0 < (lin.source_weight() - w).abs().max() and ((lin.source_weight() - w).abs()
                                                                      <= 2 ** -11 * w.abs() * (1 + 1e-6)).all()
            elif source == "Q4_K":  # d', m' rounded once to float16
                assert 0 < (lin.source_weight() - w).abs().max() <= 2 ** -11 * 4 * w.abs().max()
            else:
                assert torch.equal(lin.source_weight(), w), name
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "hispec.model.load.checkpoint"]
    assert warnings == []
    ids = torch.tensor([1, 40, 50, 60, 70, 80, 90, 100])
    a, b = _logits(ref, ids), _logits(native, ids)
    tol = 0.05 if kernel == "q8a" else 0.02  # q8a, q8a8: activations in 8 bits per block
    assert torch.isfinite(a).all() and (a - b).abs().max() < tol * a.abs().max()


Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def test_q4_k_m_like_llama_has_no_float_layers(tmp_path, four_bit_kernel, caplog):
    """A Q4_K_M-like file (Q4_K, with Q6_K attn_v and ffn_down): every decoder linear runs on a block
    kernel, none on float32: ffn_down on Q6_K's own 8-bit form (group 16), q/k/v in that form too
    with its Q4_K parts requantized (Q4_K has no 8-bit form) beside the exact Q6_K one, said in one
    warning; the logits stay close to the float32 copy's."""
    from hispec.model.load.checkpoint import load_model
    from hispec.model.load.gguf_convert import convert_gguf

    _kernel_or_skip("q8")
    four_bit_kernel("q4")
    src = tmp_path / "q4km.gguf"
    _tiny_llama_gguf(src, Q4_K_M)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    ref = load_model(out)
    with caplog.at_level(logging.WARNING, logger="hispec.model.load.checkpoint"):
        native = load_model(out, quantize="native", gguf=src)
    for layer, float_layer in zip(native.layers, ref.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin, w = getattr(layer, name), getattr(float_layer, name).weight
            assert isinstance(lin, QuantLinear), name
            assert ((lin.source_weight() - w).abs() <= _requant_bound(w, 16)).all(), name
        assert (layer.qkv_proj.kernel, layer.qkv_proj.group, layer.qkv_proj.requantized) == ("q8", 16, ("Q4_K",))
        assert (layer.down_proj.kernel, layer.down_proj.group, layer.down_proj.requantized) == ("q8", 16, ())
        v_rows = slice(HIDDEN + 2 * SHAPES["attn_k"], None)  # the Q6_K part: within its float16 rounding
        v_err = (layer.qkv_proj.source_weight()[v_rows] - float_layer.qkv_proj.weight[v_rows]).abs()
        assert (v_err <= 2 ** -11 * float_layer.qkv_proj.weight[v_rows].abs() * (1 + 1e-6)).all()
        assert layer.o_proj.kernel == "q4" and layer.gate_up_proj.kernel == "q4"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name == "hispec.model.load.checkpoint"]
    assert len(warnings) == 1 and "float32" not in warnings[0], warnings
    assert warnings[0].startswith("q4km.gguf: 2 of 8 decoder linears run on 8-bit blocks requantized")
    assert "Q4_K requantized beside parts of another form: qkv_proj in 2 layers" in warnings[0]
    ids = torch.tensor([1, 40, 50, 60, 70, 80, 90, 100])
    a, b = _logits(ref, ids), _logits(native, ids)
    assert torch.isfinite(a).all() and (a - b).abs().max() < 0.02 * a.abs().max()


def test_tiny_qwen2_keeps_its_biases_and_row_order(tmp_path, four_bit_kernel):
    """A qwen2 file: Q and K rows are in the model's order (not un-permuted) and the q/k/v biases
    are added after the kernel; logits stay close to the float32 copy's."""
    from hispec.model.load.checkpoint import load_model
    from hispec.model.load.gguf_convert import convert_gguf

    four_bit_kernel("int4")
    src = tmp_path / "qwen2.gguf"
    _tiny_llama_gguf(src, {**DECODER_TYPES, "attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q8_0"}, arch="qwen2")
    out = convert_gguf(src, tmp_path / "out", progress=False)
    ref = load_model(out)
    assert ref.cfg.family == "qwen2"
    native = load_model(out, quantize="native", gguf=src)
    for layer, float_layer in zip(native.layers, ref.layers):
        lin, want = layer.qkv_proj, float_layer.qkv_proj
        assert isinstance(lin, QuantLinear) and lin.source == "Q5_0+Q8_0"
        assert torch.equal(lin.source_weight(), want.weight)  # exact, in the file's row order
        assert lin.bias is not None and torch.equal(lin.bias, want.bias)
    ids = torch.tensor([1, 40, 50, 60, 70, 80, 90, 100])
    a, b = _logits(ref, ids), _logits(native, ids)
    assert (a - b).abs().max() < 0.02 * a.abs().max()


NO_EXACT_FORM = {"q5_1": {p: "Q5_1" for p in DECODER_TYPES},
                 "mixed": {"attn_q": "Q4_1", "attn_k": "Q5_0", "attn_v": "Q5_0", "attn_output": "Q5_1",
                           "ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q5_1"}}


@pytest.mark.parametrize("case", NO_EXACT_FORM)
def test_layers_without_an_exact_form_run_requantized(tmp_path, four_bit_kernel, monkeypatch, case):
    """``native`` on a file of which no layer maps exactly runs every layer requantized (none on
    float32); ``auto`` still runs the float32 copy where the file has no tensor of an exact native
    type (Q5_1 alone), and natively where it has one."""
    from hispec.kernels import select
    from hispec.model.load.checkpoint import apply_quantization, load_model
    from hispec.model.load.gguf_convert import convert_gguf

    four_bit_kernel("int4")
    src = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(src, NO_EXACT_FORM[case])
    out = convert_gguf(src, tmp_path / "out", progress=False)
    model = load_model(out)
    assert apply_quantization(model, "native", src) == "native"
    assert all(isinstance(getattr(layer, n), QuantLinear) and getattr(layer, n).requantized
               for layer in model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    monkeypatch.setattr(select, "quantized_kernels_pay", lambda *a, **k: (True, "patched"))
    assert apply_quantization(load_model(out), "auto", src) == ("none" if case == "q5_1" else "native")


@pytest.mark.parametrize("kernel", ["q4", "q8a"])
def test_q6_k_layers_and_head_in_one_op_call(tmp_path, four_bit_kernel, kernel):
    """The fused op (``decode_step``: every layer and the head in one C++ call) runs the Q4_K_M-like
    model's group-16 layers (q8 / q8a8, the group passed by ``plan.matmul_plan``) and a group-16 head
    with the logits and K/V of the general path, bit for bit, for 1 and 3 sequences."""
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool
    from hispec.model.runner import LayerRunner
    from hispec.kernels import layer_op, plan
    from hispec.model.load.checkpoint import load_model
    from hispec.model.load.gguf_convert import convert_gguf

    _kernel_or_skip(kernel)
    four_bit_kernel(kernel)
    src = tmp_path / "q4km.gguf"
    _tiny_llama_gguf(src, Q4_K_M)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    model = load_model(out, quantize="native", gguf=src)
    q, d = gw.requantize_q8(model.lm_head.weight.detach(), 16)
    model.lm_head = QuantLinear.from_q8_blocks(q, d, "Q6_K")
    q8 = "q8a8" if kernel == "q8a" else "q8"
    assert (model.lm_head.kernel, model.lm_head.group) == (q8, 16)
    if layer_op.layers_op() is None:
        pytest.skip("no C++ op here")
    kinds = plan.fast_path(model).plans_for(0, 2, False, False)[0]
    assert kinds is not None and (layer_op.MM_Q8A8 if q8 == "q8a8" else layer_op.MM_Q8) in kinds.kinds
    assert 16 in kinds.groups
    cfg = model.cfg
    for batch_size in (1, 3):
        starts = [0, 5, 9][:batch_size]
        runs = []
        for _ in range(2):
            blocks = BlockManager(16, 4, 2)
            pool = KVPool(2, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            g = torch.Generator().manual_seed(1)
            for i in range(2):
                pool.k[i].copy_(torch.randn(pool.k[i].shape, generator=g))
                pool.v[i].copy_(torch.randn(pool.v[i].shape, generator=g))
            for s, start in enumerate(starts):
                blocks.add_sequence(s)
                blocks.ensure_capacity(s, start + 1)
                blocks.set_filled(s, 0, 2, start)
            runs.append((LayerRunner(model, blocks, pool), pool))
        tokens = [40, 77, 123][:batch_size]
        with torch.no_grad():
            one_call = runs[0][0].decode_logits(list(zip(range(batch_size), starts, tokens)))
            assert one_call is not None, "decode_step was not chosen"
            items = [(s, start, torch.tensor([t])) for s, start, t in zip(range(batch_size), starts, tokens)]
            ref = model.exit_logits(torch.cat(runs[1][0].forward_many(items, 0, 2)), 2)
        assert torch.equal(one_call, ref), batch_size
        for i in range(2):
            assert torch.equal(runs[0][1].k[i], runs[1][1].k[i]) and torch.equal(runs[0][1].v[i], runs[1][1].v[i])
