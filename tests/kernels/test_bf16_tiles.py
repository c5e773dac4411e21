"""Prompt chunks' products on bfloat16 AMX tiles (``csrc/bf16_tiles.c``, ``q8act.tiles_matmul``): the
weights' exact values rounded once to bfloat16, each row alone, and the prompt path taking them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hispec.kernels import q8act

from .test_q8act import F32, activations, fma32, weights

pytestmark = pytest.mark.skipif(not q8act.available() or not q8act.bf16_tiles(),
                                reason="no AMX-BF16 tiles on this CPU")

KINDS = ["Q4_0", "Q4_1", "int4", "Q8_0", "Q8_G16"]
SHAPES = [(37, 96), (16, 32), (48, 160), (50, 64), (24, 1536)]  # (N, K): partial tiles, an odd tile count


def tiled(kind: str, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights as QuantLinear stores them for q8a / q8a8 (tiled)."""
    return q8act.tile8(w[0], w[1]) if kind in ("Q8_0", "Q8_G16") else q8act.tile4(w[1], w[2])


def bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=F32)).bfloat16().float().numpy()


def exact_weights(kind: str, w) -> np.ndarray:
    """``W [N, K]`` as the tiles hold it: ``bf16(fma(d, q, m))`` (8-bit: ``bf16(d * q)``), the scales
    as tiling keeps them (float16)."""
    q = w[0].numpy().astype(F32)
    n, k = q.shape
    if kind in ("Q8_0", "Q8_G16"):
        d = w[1].half().float().numpy()
        return bf16(q * np.repeat(d, k // d.shape[1], 1))
    d, m = (np.repeat(t.half().float().numpy(), 32, 1) for t in w[2])
    return bf16(fma32(q, d, m))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_weights_are_the_exact_values_rounded_once(kind, n, k):
    """Unit rows read the tiles' weights back: bit for bit ``bf16(fma(d, q, m))``, every column
    (the last partial tile's too)."""
    gen = torch.Generator().manual_seed(n * k)
    w = weights(kind, n, k, gen)
    got = q8act.tiles_matmul(torch.eye(k), *tiled(kind, w)).numpy().T
    assert np.array_equal(got, exact_weights(kind, w))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", [1, 17, 40])
def test_products_within_float32_accumulation(kind, t):
    """Against float64 products of the bfloat16 operands: only float32 addition's error is left."""
    gen = torch.Generator().manual_seed(t)
    n, k = 37, 1536
    w = weights(kind, n, k, gen)
    x = activations(t, k, gen)
    got = q8act.tiles_matmul(x, *tiled(kind, w)).numpy().astype(np.float64)
    a, wt = bf16(x.numpy()).astype(np.float64), exact_weights(kind, w).astype(np.float64)
    want, scale = a @ wt.T, np.abs(a) @ np.abs(wt).T
    assert np.all(np.abs(got - want) <= 2.0 ** -20 * scale + 1e-30)
    q8 = q8act.q8_matmul(x, *tiled(kind, w)) if kind in ("Q8_0", "Q8_G16") else q8act.q4_matmul(x, *tiled(kind, w))
    assert not np.array_equal(got, q8.numpy())  # another arithmetic than the 8-bit activations'


@pytest.mark.parametrize("kind", KINDS)
def test_rows_independent_of_the_chunking(kind):
    """A row's outputs are the same bits whatever rows share the call: one prompt cut into chunks
    any way gives the same K/V."""
    gen = torch.Generator().manual_seed(3)
    w = tiled(kind, weights(kind, 40, 96, gen))
    x = activations(70, 96, gen)
    whole = q8act.tiles_matmul(x, *w)
    for cut in ([1, 69], [16, 16, 38], [33, 37], [5, 60, 5]):
        parts = torch.split(x, cut)
        assert torch.equal(torch.cat([q8act.tiles_matmul(p.contiguous(), *w) for p in parts]), whole)


def test_bad_input_and_no_rows():
    gen = torch.Generator().manual_seed(0)
    w = tiled("Q4_1", weights("Q4_1", 16, 64, gen))
    assert q8act.tiles_matmul(torch.zeros(0, 64), *w).shape == (0, 16)
    with pytest.raises(ValueError, match="K = 32"):
        q8act.tiles_matmul(torch.zeros(2, 32), *w)
    with pytest.raises(TypeError, match="float32"):
        q8act.tiles_matmul(torch.zeros(2, 64, dtype=torch.float64), *w)


def test_prompt_chunks_take_the_tiles_and_the_switch_turns_them_off(monkeypatch):
    """QuantLinear's prompt product and the layer op's plan take the tiles for q8a and q8a8 layers;
    decode rows keep the 8-bit activations; ``HISPEC_BF16_TILES=0`` keeps them for prompts too."""
    from hispec.kernels import layer_op, plan
    from hispec.kernels.quant import QuantLinear

    gen = torch.Generator().manual_seed(1)
    layer = QuantLinear.from_float(torch.randn(48, 64, generator=gen) * 0.1, "int4", kernel="q8a")
    x = torch.randn(5, 64, generator=gen)
    assert torch.equal(layer.prefill_mm(x), q8act.tiles_matmul(x, layer.qweight, layer.qparams))
    assert torch.equal(layer.mm(x), q8act.q4_matmul(x, layer.qweight, layer.qparams))
    assert plan.matmul_plan(layer, torch.float32, prefill=True)[2] == layer_op.MM_Q8A4_TILES
    assert plan.matmul_plan(layer, torch.float32)[2] == layer_op.MM_Q8A4
    q, d = weights("Q8_0", 48, 64, gen)
    head = QuantLinear.from_q8_blocks(q, d.half(), kernel="q8a8")
    assert plan.matmul_plan(head, torch.float32, prefill=True)[2] == layer_op.MM_Q8A8_TILES
    assert torch.equal(head.prefill_mm(x), q8act.tiles_matmul(x, head.qweight, head.qparams))
    monkeypatch.setenv("HISPEC_BF16_TILES", "0")
    q8act.bf16_tiles.cache_clear()
    try:
        assert plan.matmul_plan(layer, torch.float32, prefill=True)[2] == layer_op.MM_Q8A4
        assert torch.equal(layer.prefill_mm(x), layer.mm(x))
    finally:
        monkeypatch.delenv("HISPEC_BF16_TILES")
        q8act.bf16_tiles.cache_clear()
