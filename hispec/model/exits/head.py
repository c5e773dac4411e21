"""Exit heads: how a hidden state after ``L`` decoder layers becomes next-token logits.

A model trained for early exit (LayerSkip) needs nothing here: its shared final norm and
output head already work at every layer. A standard model does not (SmolLM2-135M: layer 8
of 30 agrees with the final top-1 token ~2% of the time through its own head), so small
heads are trained after the fact, with the base model frozen (``hispec train-exits``).

Design ``linear`` (per exit layer ``L``)::

    v = RMSNorm_g(h)                  # own gain g, initialised to 1
    z = v + W v + b                   # residual linear adapter, W = 0, b = 0 at initialisation
    logits = lm_head(final_norm(z))   # the model's own, shared (never copied, never trained)

At initialisation the head is the identity: ``final_norm(v) == final_norm(h)`` (RMSNorm is
scale invariant), so an untrained head equals the shared-head exit. The added weights are
``H*H + 2H`` per exit (333k for H = 576, 0.25% of SmolLM2-135M).

A head may restrict its output to a subset of the vocabulary (the most frequent tokens, as
in FR-Spec, arXiv 2502.14856): the matmul covers only those rows of ``lm_head``, and the
logits are still returned full-vocabulary shaped ``[T, V]``, with ``-inf`` outside the
subset. The strategies and the lossless maths are unchanged: a draft/intermediate exit can
only propose subset tokens, and the final verification uses the model's full head.

Files: ``heads.safetensors`` + ``manifest.json`` (``files.py``, ``manifest.py``); which model
they belong to: ``fingerprint.py``; finding and attaching them: ``__init__.py``.
"""
from __future__ import annotations

import hashlib
import weakref

import torch
from torch import nn

from ..decoder import RMSNorm
from ...kernels.matmul import Linear, linear

# base model -> {(subset hash, device, dtype): the subset's rows of its output head [K, H]}
_SUBSET_ROWS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


class SharedOutput(nn.Module):
    """The frozen end of every exit: the model's final norm and output head, optionally over a
    vocabulary subset. Held by reference (not registered), so ``state_dict()`` holds only what
    a subclass adds (``ExitHead`` here, ``ExitBlock`` in ``model/exits/block.py``)."""

    has_kv = False  # True for exits that keep K/V in the paged pool

    def __init__(self, model: nn.Module, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self._base = (model,)  # a tuple, so nn.Module does not register (or save) the base model
        self.vocab_size = model.cfg.vocab_size
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long().clone())
        self._sub_weight: torch.Tensor | None = None
        self._sub_of: int | None = None  # id() of the output head the cached rows came from

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    @property
    def restricted(self) -> bool:
        return self.vocab_ids is not None

    def output_input(self, z: torch.Tensor) -> torch.Tensor:
        """The shared final norm (and OPT's output projection) on ``z [T, H]``."""
        base = self.base
        y = base.norm(z)
        if base.project_out is not None:
            y = base.project_out(y)
        return y

    def sub_weight(self) -> torch.Tensor:
        """The rows of the shared output head for the subset, ``[K, H]``: copied once (the head
        is frozen) and shared by every exit of the model with the same subset. A quantized head
        (``QuantLinear``) gives its exact source values here, in float32."""
        head = self.base.lm_head
        if self._sub_weight is None or self._sub_of != id(head) or self._sub_weight.device != self.vocab_ids.device:
            w = head.weight  # computed once for a quantized head
            key = (hashlib.sha1(self.vocab_ids.cpu().numpy().tobytes()).hexdigest(), w.device, w.dtype, id(head))
            shared = _SUBSET_ROWS.setdefault(self.base, {})
            if key not in shared:
                shared[key] = w.detach()[self.vocab_ids.to(w.device)].contiguous()
            self._sub_weight, self._sub_of = shared[key], id(head)
        return self._sub_weight

    def prepare(self) -> None:
        """Ready for decoding: a restricted exit builds its output rows now, not in the first draft
        (a quantized head takes ~1 s to dequantize), and, where the model's own head runs on the
        quantized CPU kernels, an int4 copy of those rows (``decode_rows``). A model whose output
        head holds only part of the vocabulary (a tensor-parallel rank) prepares its own part of
        the rows (its ``prepare_exit``)."""
        prepare_exit = getattr(self.base, "prepare_exit", None)
        if prepare_exit is not None:
            prepare_exit(self)
        elif self.restricted:
            self.sub_weight()
            self.decode_rows()

    def decode_rows(self) -> nn.Module | None:
        """The subset rows as an int4 ``QuantLinear`` (group 32) when the model's output head is
        quantized and on the CPU, else None. A draft exit's logits only steer drafting (what is
        kept is what the full model verifies), and this reads a quarter of the float32 rows."""
        from ...kernels.quant import QuantLinear, quantizable

        if not isinstance(self.base.lm_head, QuantLinear):
            return None
        w = self.sub_weight()
        key = ("int4", id(w))
        shared = _SUBSET_ROWS.setdefault(self.base, {})
        if key not in shared:
            probe = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            shared[key] = QuantLinear.from_float(w, "int4") if w.device.type == "cpu" and quantizable(probe) else None
        return shared[key]

    def train_logits(self, z: torch.Tensor) -> torch.Tensor:
        """Differentiable logits of the state ``z [..., H]``: over the subset ``[..., K]`` for
        restricted exits (cheaper), else the full vocabulary ``[..., V]``."""
        y = self.output_input(z)
        if self.restricted:
            return nn.functional.linear(y, self.sub_weight())
        return self.base.lm_head(y)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary shaped logits ``[T, V]`` of ``z [T, H]`` (``-inf`` outside a subset)."""
        y = self.output_input(z)
        if self.vocab_ids is None:
            return self.base.lm_head(y)
        rows = self.decode_rows() if not y.requires_grad else None
        sub = rows(y) if rows is not None else linear(y, self.sub_weight())  # [T, K]
        out = sub.new_full((z.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.vocab_ids, sub)

    def num_added_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class ExitHead(SharedOutput):
    """Design ``linear``: RMSNorm + residual linear adapter, then the shared final norm + output head."""

    kind = "linear"

    def __init__(self, model: nn.Module, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__(model, vocab_ids)
        h = model.cfg.hidden_size
        self.norm = RMSNorm(h, model.cfg.norm_eps)  # the adapter's own input normalisation
        self.proj = Linear(h, h, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def adapt(self, h: torch.Tensor) -> torch.Tensor:
        """``h [T, H]`` -> the adapted state ``z [T, H]`` that enters the shared final norm."""
        v = self.norm(h)
        return v + self.proj(v)

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the subset only ``[T, K]`` (restricted heads), e.g. for training."""
        return nn.functional.linear(self.output_input(self.adapt(h)), self.sub_weight())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [T, H] -> logits [T, V]
        return self.logits(self.adapt(h))
