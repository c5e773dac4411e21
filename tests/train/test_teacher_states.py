"""Teacher states stored in float16 whatever their size (Gemma 3's residual stream reaches ~1e5)."""
from __future__ import annotations

import torch

from hispec.model.decoder import RMSNorm
from hispec.train.teacher import float16_states


def test_large_rows_scaled_by_a_power_of_two_small_rows_untouched():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 64, generator=g)
    h[1] *= 3e4  # past float16's 65,504
    h[3] *= 1e6
    out = float16_states(h)
    assert out.dtype == torch.float16 and bool(out.isfinite().all())
    for i in (0, 2, 4):
        assert torch.equal(out[i], h[i].half())
    for i in (1, 3):
        ratio = h[i] / out[i].float()
        k = torch.log2(ratio[out[i] != 0]).round()
        assert k.unique().numel() == 1 and k[0] > 0  # one power of two per row
        assert torch.allclose(out[i].float() * 2 ** k[0], h[i], rtol=2e-3, atol=0)


def test_what_exits_read_is_unchanged():
    """Exits read states through an RMSNorm: scaled rows give the same normalised values."""
    h = torch.randn(3, 64) * torch.tensor([[1.0], [5e4], [2e5]])
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        got, want = norm(float16_states(h).float()), norm(h)
    assert torch.allclose(got, want, rtol=2e-3, atol=2e-3)
