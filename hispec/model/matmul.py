"""Linear layers in the layout that is fastest on CPU for decode-sized inputs.

On the 2-core AMD EPYC test machine, with the MKL that ships in the torch CPU wheel, ``F.linear``
(``x @ W.T``) on a few rows runs at a fraction of memory bandwidth. Two other routes to the same
product are faster: ``(W @ x.T).T`` (MKL's other GEMM layout; a single row must be padded to two,
or it goes down MKL's slow matrix-vector path) and oneDNN's linear kernel on the same dense
weights. Measured over the 120 decoder matmuls of SmolLM2-135M (weights far larger than the
cache, float32, 2 threads, ms per pass, outputs made contiguous):

    rows             1     2     4     6     8    12    16    48    64   256  1024
    F.linear        35    59    46    39    41    46    49    84   104   323  1167
    (W @ x.T).T     15    15    22    31    34    55    43    79    98   420  1714   (1 row padded)
    oneDNN          21    23    26    28    29    33    37    71    86   275  1035

So :func:`linear` uses ``(W @ x.T).T`` for up to ``SMALL_ROWS`` rows (decode steps, short
verification windows) and oneDNN above (batched steps, prefill) on CPU in float32, and
``F.linear`` otherwise (other devices and dtypes, autograd, or a torch without oneDNN). The
values agree with ``F.linear`` up to float rounding (different summation order, |diff| ~ 1e-5 on
unit-scale inputs). Keeping a prepacked oneDNN copy of each weight would be faster still for
4-32 rows (16 rows: 25 ms) but doubles the weights' memory, so it is not done.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


SMALL_ROWS = 4
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias[N])`` -> ``[..., N]``, contiguous."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous()
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [T, K]
    t = rows.shape[0]
    if t == 0:
        return F.linear(x, weight, bias)
    if t > SMALL_ROWS:
        if not _ONEDNN:
            return F.linear(x, weight, bias)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [None], "")
        return out.reshape(*lead, weight.shape[0])
    if t == 1:
        rows = torch.cat([rows, rows])  # [2, K]: keeps MKL off its slow matrix-vector path
    out = (weight @ rows.T).T[:t]  # [T, N], a column-major view
    out = (out + bias if bias is not None else out).contiguous()
    return out.reshape(*lead, weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
