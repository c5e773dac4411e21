"""The fused CPU path the model runner takes (``model/runner.py``): the same layers as the model's
reference PyTorch computation (``model/decoder.py``), on hispec's kernels (``kernels/fused.py``,
the torch op of ``kernels/layer_op.py``, planned by ``kernels/plan.py``); the same bits as one
another, the reference's values up to float rounding (``docs/design.md``, "The fused CPU path").

- :data:`FUSED` (a :class:`FusedLayers`, the model's ``LayerBackend``): a range of layers in one
  op call where the planner can run it, else layer by layer, each on the fused kernels where it
  runs there (:func:`layer_forward`, :func:`layer_write_kv`) and on its own ``forward`` elsewhere;
  the runner hands it to ``DecoderModel.run_layers`` and to exit blocks, so that a
  tensor-parallel leader, which intercepts ``run_layers``, still runs its layers on it;
- :func:`decode_step` and :func:`decode_greedy`: a whole decode step, or several greedy ones, in
  one op call (embeddings, every layer, final norm and head), or None where that does not apply.

The model holds no reference to any of it; the runner decides (``LayerRunner(fused=False)`` runs
the reference alone).
"""
from __future__ import annotations

import torch

from ..cache.kv_cache import AttentionBatch, KVPool
from ..kernels import fused
from ..kernels.layer_op import RowSampling
from ..kernels.plan import fast_path, runs_fused
from ..kernels.quant import QuantLinear
from .decoder import DecoderLayer, DecoderModel

Rope = tuple[torch.Tensor, torch.Tensor] | None


class FusedLayers:
    """``decoder.LayerBackend`` on the fused CPU kernels (stateless: the planner keeps the plans)."""

    def run_layers(self, model: DecoderModel, h: torch.Tensor, start: int, end: int, rope: Rope, local_rope: Rope,
                   batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
        """Layers ``[start, end)`` on ``h [T, H]``: in one op call where the planner can run the
        range (``kernels.plan.FastPath.run_layers``), else layer by layer (:func:`layer_forward`)."""
        out = fast_path(model).run_layers(h, start, end, rope, batch, pool, local_rope)  # one C++ call where it can
        if out is not None:
            return out
        for i in range(start, end):
            layer = model.layers[i]
            h = layer_forward(layer, h, i, local_rope if layer.sliding else rope, batch, pool)
        return h

    def layer(self, layer: DecoderLayer, h: torch.Tensor, index: int, rope: Rope, batch: AttentionBatch,
              pool: KVPool) -> torch.Tensor:
        return layer_forward(layer, h, index, rope, batch, pool)

    def write_kv(self, layer: DecoderLayer, h: torch.Tensor, index: int, rope: Rope, batch: AttentionBatch,
                 pool: KVPool) -> None:
        layer_write_kv(layer, h, index, rope, batch, pool)


FUSED = FusedLayers()


# ---- one layer ----------------------------------------------------------------------------------
def layer_forward(layer: DecoderLayer, h: torch.Tensor, index: int, rope: Rope, batch: AttentionBatch,
                  pool: KVPool) -> torch.Tensor:
    """``layer(h, index, rope, batch, pool)``: on the fused kernels where the call runs there
    (``plan.runs_fused``), else the layer's reference ``forward``."""
    if not runs_fused(layer, h, rope, pool, index):
        return layer(h, index, rope, batch, pool)
    # h: [T, H] float32; the matmul inputs are act_dtype (bfloat16 on the quantized kernels)
    dt = layer.act_dtype or h.dtype
    qkv_mm, o_mm, gate_up_mm, down_mm = _matmuls(layer, batch.prefill)
    x = fused.rms_norm(h, layer.input_norm.weight, layer.input_norm.eps, dt)
    q = _rope_write(layer, qkv_mm(x), index, rope, batch, pool)  # [T, Hq, D] float32
    out = _attend(layer, q, index, batch, pool, dt)  # [T, Hq * D]
    if layer.attn_out_norm is None:
        h, x = fused.add_rms_norm(h, o_mm(out), layer.post_norm.weight, layer.post_norm.eps, dt)
    else:  # h + norm(o): Gemma 3's sandwich norm
        h, x = fused.norm_add_rms_norm(h, o_mm(out), layer.attn_out_norm.weight, layer.post_norm.weight,
                                       layer.post_norm.eps, dt)
    gate_up = gate_up_mm(x)
    a = fused.silu_mul(gate_up, dt) if layer.cfg.hidden_act == "silu" else fused.gelu_tanh_mul(gate_up, dt)
    if layer.mlp_out_norm is None:
        return h + down_mm(a)
    return fused.norm_add(h, down_mm(a), layer.mlp_out_norm.weight, layer.mlp_out_norm.eps)


def layer_write_kv(layer: DecoderLayer, h: torch.Tensor, index: int, rope: Rope, batch: AttentionBatch,
                   pool: KVPool) -> None:
    """``layer.write_kv(h, index, rope, batch, pool)`` (only the layer's K/V for the input ``h``), on
    the fused kernels where the call runs there."""
    if not runs_fused(layer, h, rope, pool, index):
        layer.write_kv(h, index, rope, batch, pool)
        return
    x = fused.rms_norm(h, layer.input_norm.weight, layer.input_norm.eps, layer.act_dtype or h.dtype)
    _rope_write(layer, layer.qkv_proj(x), index, rope, batch, pool, queries=False)


def _matmuls(layer: DecoderLayer, prefill: bool = False) -> tuple:
    """The four projections as callables: a bias-free QuantLinear's kernel call directly (its
    input is already the 2-D tensor in the dtype it reads, so ``forward``'s reshaping and casts are no-ops;
    for prompt tokens its dense prefill weights where it has them), else the module. Looked up
    on each call (cheap), so replaced modules are always seen."""
    act = layer.act_dtype or torch.float32
    return tuple((m.prefill_mm if prefill else m.mm)
                 if type(m) is QuantLinear and m.bias is None and m.input_dtype == act else m
                 for m in layer.projections())


def _rope_write(layer: DecoderLayer, qkv: torch.Tensor, index: int, rope: Rope, batch: AttentionBatch, pool: KVPool,
                queries: bool = True) -> torch.Tensor | None:
    cfg = layer.cfg
    cos, ssin = (r.view(r.shape[0], r.shape[-1]) for r in rope)  # [T, D]
    if layer.q_norm is None:
        return fused.rope_write(qkv, cos, ssin, batch.write_slots, cfg.num_heads, cfg.num_kv_heads,
                                pool.k[index], pool.v[index], queries)
    return fused.rope_write(qkv, cos, ssin, batch.write_slots, cfg.num_heads, cfg.num_kv_heads,
                            pool.k[index], pool.v[index], queries, layer.q_norm.weight, layer.k_norm.weight,
                            layer.q_norm.eps)


def _attend(layer: DecoderLayer, q: torch.Tensor, index: int, batch: AttentionBatch, pool: KVPool,
            dt: torch.dtype) -> torch.Tensor:
    """Each query over exactly its own context (the paged kernel: no gather), prompt chunks of any
    length included: a prompt's K/V then do not depend on how it was cut into chunks (by the
    chunk budget, the batch beside it, a prefix-cache hit), so neither do the tokens after it.
    (SDPA's fused kernel, which long chunks took before, gave other bits: the same prompt
    decoded alone and after other requests gave different greedy tokens; it cost ~6% less on a
    3,000-token prompt.)"""
    window = layer.cfg.sliding_window if layer.sliding else 0  # the same keys as a one-token step's
    return fused.paged_attention(q, pool.k[index], pool.v[index], batch.kernel(), dt, window, layer.cfg.attn_scale,
                                 batch.prefill)


# ---- whole decode steps ---------------------------------------------------------------------------
def decode_step(model: DecoderModel, tokens: list[int], positions: list[int], tables: list[list[int]],
                pool: KVPool) -> torch.Tensor | None:
    """Logits ``[B, V]`` of the model's own head for one new token per sequence, ``tokens[b]`` at
    ``positions[b]`` of the sequence with block table ``tables[b]``, through every layer (writing
    their K/V into ``pool``) in one call of the fused op; the same values as ``embed``,
    ``run_layers`` and ``final_logits`` one after the other. None where that call does not
    apply (then nothing was written): not a RoPE model on the fused CPU path with float32
    embeddings and residual stream, layers or head not planned, exit blocks with K/V."""
    return fast_path(model).decode_step(tokens, positions, tables, pool)


def decode_greedy(model: DecoderModel, tokens: list[int], positions: list[int], tables: list[list[int]],
                  pool: KVPool, steps: int, eos: list[int], stops: list[tuple[list[int], int]] | None = None,
                  sampling: RowSampling | None = None) -> torch.Tensor | None:
    """Up to ``steps`` tokens per sequence in one call of the fused op (``decode_step``, then the
    argmax of each row, as ``sampler.argmax`` picks it, or the rows ``sampling`` samples as
    ``sampler.choose`` does, and again) -> ``[B, s]`` int64, ``s <= steps``: fewer once every
    sequence has chosen one of ``eos``, or where ``stops`` asks (``layer_op.decode_steps``: a row's
    text ends on an n-gram seen before). The K/V of positions ``positions[b] .. + s - 1`` are
    written. None where ``decode_step`` does not apply."""
    return fast_path(model).decode_greedy(tokens, positions, tables, pool, steps, eos, stops, sampling)
