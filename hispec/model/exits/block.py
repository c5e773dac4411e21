"""Design ``block``: an exit that mixes context through one decoder layer of its own.

A per-token head sees one position's state and plateaus at bigram-level prediction; an exit
that attends over the exit layer's states at every earlier position does not (Kangaroo,
Balcony, EAGLE). Per exit layer ``L``::

    v = RMSNorm_g(h)                              # own gain g, initialised to 1
    z = DecoderLayer_B(v)                         # attention over B's own K/V of v at all
                                                  # positions <= t, then MLP (both residual)
    logits = lm_head(final_norm(z))               # the model's own, frozen and shared

Design ``block-final`` also reads the final state the full model computed for the *previous*
position (EAGLE's feature input, at no extra model compute: in a speculative round the
verifier has computed it for every verified position)::

    v = RMSNorm_g(h_t) + D RMSNorm_f(d_{t-1})    # D [H, H] starts at zero; d_{-1} = 0

For the first draft of a round ``d_{t-1}`` is exact; later drafts feed back the block's own
``z`` as EAGLE does.

``B`` starts as a copy of the model's last decoder layer (``init="copy"``, Balcony), or as
that copy with its two output projections zeroed (``init="zero"``): then ``z = v`` and the
exit starts exactly at the shared-head exit.

Its K/V lives in the paged KV pool like any other layer's, at pool index ``kv_layer`` (after
the model's layers): whenever a forward pass reaches layer ``L`` the runner writes B's K/V for
those positions (``write_kv``), rollback cuts it with the rest, and an accepted draft costs no
recomputation. The verifier still continues from the exit layer's own states ``h``.
Training runs the same weights on dense ``[B, T, H]`` batches (``forward_dense``).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ...cache.kv_cache import AttentionBatch, KVPool
from .head import SharedOutput
from ..decoder import DecoderLayer, LayerBackend, RMSNorm
from ...kernels.quant import act_dtype_of, float_state_dict, quantize_linears

INITS = ("copy", "zero")


class ExitBlock(SharedOutput):
    """RMSNorm -> one decoder layer with its own K/V -> the shared final norm + output head."""

    has_kv = True

    def __init__(self, model: nn.Module, vocab_ids: torch.Tensor | None = None, init: str = "copy",
                 reads_final: bool = False) -> None:
        super().__init__(model, vocab_ids)
        cfg = model.cfg
        self.reads_final = reads_final
        if reads_final:
            self.final_in_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.final_in = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
            nn.init.zeros_(self.final_in.weight)
        if init not in INITS:
            raise ValueError(f"block init must be one of {INITS}, got {init!r}")
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.layer = DecoderLayer(cfg)
        self.layer.load_state_dict(float_state_dict(model.layers[-1]))  # float copy of a quantized layer too
        if init == "zero":
            outs = [self.layer.o_proj] + ([self.layer.fc2] if cfg.family == "opt" else [self.layer.down_proj])
            for lin in outs:
                nn.init.zeros_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        self.kv_layer: int | None = None  # its index in the KV pool, set by the model (``attach_exits``)
        self._decode: tuple[DecoderLayer] | None = None  # the layer decoding runs (see prepare), unregistered

    def prepare(self) -> None:
        """Ready for decoding. On a model whose decoder runs on the quantized CPU kernels, the
        block decodes with a 4-bit copy of its layer too (group 32, on the model's 4-bit kernel): a
        draft's cost is what speculation pays for, and its values only steer drafting
        (verification keeps the output exact). The stored float weights are unchanged."""
        super().prepare()
        base = self.base
        if (self._decode is None and getattr(base, "weight_format", "none") != "none"
                and self.layer.qkv_proj.weight.device.type == "cpu"):
            fast = copy.deepcopy(self.layer)
            if quantize_linears(fast, "int4"):
                fast.act_dtype = act_dtype_of(fast)
                self._decode = (fast,)

    @property
    def kind(self) -> str:
        return "block-final" if self.reads_final else "block"

    def block_input(self, h: torch.Tensor, d: torch.Tensor | None = None) -> torch.Tensor:
        """``v`` for exit states ``h [..., H]`` and (``block-final``) the previous positions'
        final states ``d [..., H]`` (None: as if zero)."""
        v = self.norm(h)
        if self.reads_final and d is not None:
            v = v + self.final_in(self.final_in_norm(d))
        return v

    @property
    def decode_layer(self) -> DecoderLayer:
        return self._decode[0] if self._decode is not None else self.layer

    # ---- inference: over the paged pool --------------------------------------------------------
    def write_kv(self, h: torch.Tensor, batch: AttentionBatch, pool: KVPool, rope,
                 backend: LayerBackend | None = None) -> None:
        """Write B's K/V for the exit states ``h [T, H]`` of ``batch``'s new positions (its layer on
        ``backend``, the model runner's, where given; else its reference ``write_kv``)."""
        layer = self.decode_layer
        if backend is None:
            layer.write_kv(self.norm(h), self.kv_layer, rope, batch, pool)
        else:
            backend.write_kv(layer, self.norm(h), self.kv_layer, rope, batch, pool)

    def forward_paged(self, h: torch.Tensor, batch: AttentionBatch, pool: KVPool, rope,
                      backend: LayerBackend | None = None) -> torch.Tensor:
        """Logits ``[T, V]`` at ``batch``'s new positions (their K/V written, the earlier ones read;
        its layer on ``backend``, the model runner's, where given, else its reference ``forward``)."""
        layer, x = self.decode_layer, self.norm(h)
        if backend is None:
            return self.logits(layer(x, self.kv_layer, rope, batch, pool))
        return self.logits(backend.layer(layer, x, self.kv_layer, rope, batch, pool))

    # ---- training: dense batches -----------------------------------------------------------------
    def forward_dense(self, h: torch.Tensor, rope, d: torch.Tensor | None = None) -> torch.Tensor:
        """The state ``z [B, T, H]`` entering the final norm, for right-padded sequences
        ``h [B, T, H]`` that start at position 0 (causal attention; padding never attends back);
        ``d [B, T, H]``: the final state of the position before each (``block-final``)."""
        layer, cfg = self.layer, self.layer.cfg
        B, T, _ = h.shape
        x = self.block_input(h, d)
        q, k, v = layer.qkv(layer.input_norm(x), rope)  # [B, T, heads, D]
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=cfg.num_kv_heads != cfg.num_heads)  # [B, Hq, T, D]
        x = x + layer.o_proj(a.transpose(1, 2).reshape(B, T, layer.q_size))
        return x + layer.mlp(layer.post_norm(x))
