"""Norm layers over the kernels (vLLM's ``layers/layernorm.py``): ``RMSNorm`` on the fused CPU
kernel where it applies, ``LayerNorm`` (OPT). Both take an ``out_dtype``: the norm hands a
quantized matmul its bfloat16 input directly.

The model (``model/decoder.py``) builds its layers from these, as it builds its projections from
``Linear`` and ``QuantLinear``; what runs a whole layer on the fused kernels is the model runner's
(``model/fast_path.py``).
"""
from __future__ import annotations

import torch
from torch import nn

from . import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., D]`` normalised in float32, scaled; returned in ``out_dtype`` (default: x's)."""
        if (x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and (out_dtype in (None, torch.float32, torch.bfloat16)) and fused.available()
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return fused.rms_norm(x, self.weight, self.eps, out_dtype or x.dtype)  # the layers' own kernel
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            y = torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused op, same values
        else:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            y = self.weight * x32.to(x.dtype)
        return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (OPT) with RMSNorm's ``out_dtype`` argument."""

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = super().forward(x)
        return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)
