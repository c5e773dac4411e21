"""Linear layers in the layout that is fastest on CPU for decode-sized inputs.

On the 2-core AMD EPYC test machine, with the MKL that ships in the torch CPU wheel, ``F.linear``
(``x @ W.T``) on a few rows runs at a fraction of memory bandwidth, while the same product as
``(W @ x.T).T`` streams the weights 2-4x faster -- but only from two rows up: a single row goes
down MKL's matrix-vector path, which is as slow as ``F.linear``. Measured over the 120 decoder
matmuls of SmolLM2-135M (weights far larger than the cache, float32, 2 threads, ms per pass):

    rows           1     2     3     4     8    16    32    64   512  1024
    F.linear      35    57    67    47    52    49    68   103   632  1198
    (W @ x.T).T   37    14    19    27    34    43    61   107   808  1379   (made contiguous)
    ... 1 row padded to 2:  15

So :func:`linear` pads a single row to two and uses ``(W @ x.T).T`` for CPU inputs of up to
``SMALL_ROWS`` rows (decode steps and verification windows); prefill-sized inputs and other
devices use ``F.linear``. The values agree with ``F.linear`` up to float rounding (different
summation order, |diff| ~ 1e-5 on unit-scale inputs).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


SMALL_ROWS = 48


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias[N])`` -> ``[..., N]``, contiguous."""
    if x.device.type != "cpu" or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [T, K]
    t = rows.shape[0]
    if t == 0 or t > SMALL_ROWS:
        return F.linear(x, weight, bias)
    if t == 1:
        rows = torch.cat([rows, rows])  # [2, K]: keeps MKL off its slow matrix-vector path
    out = (weight @ rows.T).T[:t]  # [T, N], a column-major view
    out = out + bias if bias is not None else out.contiguous()
    return out.reshape(*lead, weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
