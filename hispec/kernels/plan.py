"""The CPU fast path: which of a model's layers the torch op (``layer_op.py``) can run, and how.

The model (``model/decoder.py``) stays the reference PyTorch computation; this module plans, for
a model with those layers, the calls that give the same bits in fewer steps:

- :func:`matmul_plan`: how the op runs one matmul module (its weight, parameters and kind);
- :func:`layer_plan`: a layer's norms and four matmuls, or None where the op cannot run it;
- :class:`FastPath` (one per model, :func:`fast_path`): a range of layers in one op call
  (``run_layers``), a whole decode step (``decode_step``) or several greedy ones
  (``decode_greedy``), with the plans kept while the layers and weights they read stay the same,
  and the op's handles on each KV pool (``OpRanges``).

- :func:`fusable`, :func:`runs_fused`: whether a layer, and a call of it, runs on the fused
  kernels at all (the per-layer fused route is the model runner's: ``model/fast_path.py``).

A model's layers are read, not imported (this package sits below ``model``): a layer offers
``projections()``, its norms (``input_norm``, ``post_norm``, ``q_norm``, ``k_norm``,
``attn_out_norm``, ``mlp_out_norm``: what its family adds, handed to the op as data,
``layer_op.NORMS``), ``act_dtype``, ``cfg`` and ``sliding`` (``layer_op.FLAGS``: a sliding window,
the local RoPE rows, GeGLU). A planned layer is watched (:func:`_watch`): replacing one of those
attributes, or ``.to()`` / ``.float()``, counts up its ``plan_epoch``, and its plans are made anew.
"""
from __future__ import annotations

import operator
import weakref

import torch
from torch import nn

from . import fused, layer_op, q8act, quant
from .layer_op import LayerPlans, OpRanges
from .matmul import SMALL_ROWS, Linear, panel_rows, small_route
from .norm import RMSNorm
from .quant import ACT_DTYPE, Q4_STORAGE, Q8_STORAGE, QuantLinear

_NORMS = ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")  # layer_op.NORMS' order
_PLANNED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "act_dtype") + _NORMS


def fusable(layer: nn.Module) -> bool:
    """Whether this layer's kind runs on the fused CPU kernels (RMSNorm, RoPE, a SiLU or GeGLU gate;
    the Llama family, Qwen2/3, Gemma 3: QK-norm, sandwich norms, sliding windows, their own
    attention scale; kernels built)."""
    cfg = layer.cfg
    return (cfg.family != "opt" and cfg.hidden_act in ("silu", "gelu_pytorch_tanh")
            and isinstance(layer.input_norm, RMSNorm) and fused.available())


def runs_fused(layer: nn.Module, h: torch.Tensor, rope, pool, index: int) -> bool:
    """Whether this call of the layer (``h [T, H]``, its K/V in layer ``index`` of ``pool``) runs on
    the fused CPU kernels: float32 residual stream and pool on the CPU, a fusable layer."""
    return (fusable(layer) and rope is not None and h.dtype == torch.float32 and h.device.type == "cpu"
            and pool.k[index].dtype in fused.KV_DTYPES and layer.input_norm.weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (h.requires_grad or layer.input_norm.weight.requires_grad)))


def op_norms(layer: nn.Module) -> tuple:
    """The RMSNorm weights the fused op reads, in ``layer_op.NORMS``'s order (None: none)."""
    return tuple(None if n is None else n.weight for n in (getattr(layer, name) for name in _NORMS))


def op_flags(layer: nn.Module) -> tuple[int, int, int]:
    """``layer_op.FLAGS``: the layer's sliding window (0: none), whether it rotates by the local
    RoPE rows (``DecoderModel.local_rope``: a sliding layer), its gated activation."""
    cfg = layer.cfg
    return (cfg.sliding_window if layer.sliding else 0, int(layer.sliding), layer_op.ACTS[cfg.hidden_act])


class _Watched:
    """Mixed into a planned layer's class (:func:`_watch`): counts up ``plan_epoch`` whenever what its
    plans read may have changed: a planned attribute replaced (quantization, another activation
    dtype), or ``.to()`` / ``.float()`` (which may replace the tensors the plans hold)."""

    plan_epoch = 0

    def __setattr__(self, name: str, value) -> None:
        if name in _PLANNED:
            self._replanned()
        super().__setattr__(name, value)

    def _apply(self, fn, *args, **kwargs):
        self._replanned()
        return super()._apply(fn, *args, **kwargs)

    def _replanned(self) -> None:
        """What the fast path planned for this layer no longer holds (``hugepages.gather`` calls it too)."""
        self.__dict__["plan_epoch"] = self.__dict__.get("plan_epoch", 0) + 1


_WATCHED: dict[type, type] = {}


def _watch(layer: nn.Module) -> None:
    """Have ``layer`` count its changes from now on (its class becomes a subclass with
    :class:`_Watched` mixed in; changes before its first plan do not matter)."""
    base = type(layer)
    if issubclass(base, _Watched):
        return
    if base not in _WATCHED:
        _WATCHED[base] = type(base.__name__, (_Watched, base), {"__module__": base.__module__,
                                                                  "__qualname__": base.__qualname__})
    layer.__class__ = _WATCHED[base]


def matmul_plan(m: nn.Module | None, act_dtype: torch.dtype | None, prefill: bool = False,
                batched: bool = False) -> tuple | None:
    """How ``decode_op.cpp`` runs the matmul module ``m`` on inputs of ``act_dtype`` (None: float32),
    ``(weight, parameters, kind, group)``, or None where it cannot (a bias, another module or dtype):
    the same kernel and inputs as ``m.forward`` takes. ``prefill``: prompt tokens (QuantLinear's
    dense prefill weights where it has them, on a q4 layer's float32 inputs cast to bfloat16 as
    ``QuantLinear.prefill_mm`` casts them); ``batched``: more than SMALL_ROWS rows (float32
    weights: the panel kernel, as ``Linear.forward`` takes it up to ``panel_rows()`` rows; None
    where it takes oneDNN)."""
    if type(m) is QuantLinear and m.bias is None:
        if act_dtype == ACT_DTYPE and prefill and m.dense is not None:
            return m.dense, m.dense, layer_op.MM_DENSE, 0  # the second is a placeholder
        if m.kernel in ("int4", "int8") and act_dtype == ACT_DTYPE:
            return (m.qweight, m.qparams, layer_op.MM_INT4 if m.kernel == "int4" else layer_op.MM_INT8,
                    m.group if m.kernel == "int4" else 0)
        if m.kernel in Q4_STORAGE and act_dtype in (None, torch.float32):  # q4, q8a: prompt chunks alike
            if prefill and m.dense is not None:
                return m.dense, m.dense, layer_op.MM_DENSE_BF16, 0  # the second is a placeholder
            if m.kernel == "q4":
                return m.qweight, m.qparams, layer_op.MM_Q4_PANELS if prefill else layer_op.MM_Q4, m.group
            if prefill and q8act.bf16_tiles():  # as QuantLinear.prefill_mm
                return m.qweight, m.qparams, layer_op.MM_Q8A4_TILES, m.group
            panels = prefill and not quant.q8a_prefills_on_rows()
            return m.qweight, m.qparams, layer_op.MM_Q8A4_PANELS if panels else layer_op.MM_Q8A4, m.group
        if m.kernel in Q8_STORAGE and act_dtype in (None, torch.float32):
            # group: 32, or 16 (a scale per 16 values: GGUF Q6_K)
            if m.kernel == "q8a8" and prefill and q8act.bf16_tiles():
                return m.qweight, m.qparams, layer_op.MM_Q8A8_TILES, m.group
            return m.qweight, m.qparams, layer_op.MM_Q8 if m.kernel == "q8" else layer_op.MM_Q8A8, m.group
        return None
    if (type(m) is Linear and m.bias is None and m.weight.dtype == torch.float32 and m.weight.is_contiguous()
            and act_dtype in (None, torch.float32)):
        # as Linear.forward: on <= SMALL_ROWS rows the timed route, above it the panel kernel or oneDNN
        panel = m.panel() if (panel_rows() > 0 if batched else small_route() == "panel") else None
        if batched and panel is None:
            return None
        if panel is not None:
            return panel, m.weight, layer_op.MM_PANEL, m.out_features  # the second is a placeholder
        return m.weight, m.weight, layer_op.MM_FLOAT_LINEAR if small_route() == "linear" else layer_op.MM_FLOAT, 0
    return None


# layer -> {(prefill, batched): (plan_epoch, float32 weight versions, plan or False)}
_layer_plans: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _float_weights(layer: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in layer.projections() if type(m) is Linear]


def layer_plan(layer: nn.Module, prefill: bool = False, batched: bool = False) -> tuple | None:
    """What ``layer_op.decode_layers`` needs of a decoder layer, ``(norms, weights, kinds, groups, flags)``,
    or None when the layer cannot run there (not fusable; a bias; a matmul other than float32
    ``Linear`` or q4 / q8a ``QuantLinear`` on float32 activations or int4/int8 ``QuantLinear`` on
    bfloat16 ones). ``prefill``: for prompt tokens (QuantLinear's dense prefill weights where it
    has them); ``batched``: for more than SMALL_ROWS tokens (float32 weights: the panel kernel, as
    ``Linear.forward`` takes it up to ``panel_rows()`` rows; None where it takes oneDNN). Kept
    until the layer's ``plan_epoch`` moves or a float32 weight changes in place (its panel copy is
    remade)."""
    _watch(layer)
    state = (layer.plan_epoch, tuple(w._version for w in _float_weights(layer)))
    held = _layer_plans.setdefault(layer, {})
    key = (prefill, batched)
    hit = held.get(key)
    if hit is None or hit[0] != state:
        hit = held[key] = (state, _make_layer_plan(layer, prefill, batched) or False)
    return hit[1] or None


def _make_layer_plan(layer: nn.Module, prefill: bool, batched: bool) -> tuple | None:
    if not fusable(layer) or layer_op.layers_op() is None:
        return None
    norms = [w if w is not None else layer_op.NO_NORM for w in op_norms(layer)]  # layer_op.NORMS
    if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
        return None
    weights, kinds, groups = [], [], []
    for m in layer.projections():
        planned = matmul_plan(m, layer.act_dtype, prefill, batched)
        if planned is None:
            return None
        weights += planned[:2]
        kinds.append(planned[2])
        groups.append(planned[3])
    return norms, weights, kinds, groups, list(op_flags(layer))


def _module_tensors(m: nn.Module) -> list[torch.Tensor]:
    """``m``'s parameters and buffers: read from its own dicts when it has no submodules (a
    linear layer; ~10x cheaper than ``m.parameters()``, which a decode step would pay each time)."""
    if m._modules:
        return [*m.parameters(), *m.buffers()]
    return [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]


class FastPath:
    """A model's calls of the torch op: its range plans, its op heads and its handles on KV pools
    (one per model, :func:`fast_path`). Holds the model weakly."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.ranges = OpRanges()  # the op's handles on each pool's cache layers
        self._range_plans: dict[tuple, tuple] = {}  # see plans_for
        self._head_ops: dict[bool, tuple] = {}  # see step_head

    @property
    def model(self) -> nn.Module:
        return self._model()

    # ---- a range of layers ------------------------------------------------------------------
    def layer_plans(self, h: torch.Tensor, start: int, end: int, rope, batch, pool) -> LayerPlans | None:
        """The layers' plans when ``[start, end)`` can run in one ``layer_op.decode_layers`` call:
        every layer planned with one activation dtype, on float32 weights at most as many tokens as the panel kernel serves
        (``panel_rows()``; more take oneDNN, in Python), and the per-layer fused path's own
        conditions (float32 residual stream and pool on the CPU)."""
        layers = self.model.layers
        if start == end or not runs_fused(layers[start], h, rope, pool, start) or not layer_op.layers_op():
            return None
        plans, has_float = self.plans_for(start, end, batch.prefill, h.shape[0] > SMALL_ROWS)
        if plans is None or (has_float and h.shape[0] > max(panel_rows(), SMALL_ROWS)):
            return None
        if pool.k[start].dtype not in fused.KV_DTYPES:  # a pool holds one dtype
            return None
        return plans

    def plans_for(self, start: int, end: int, prefill: bool, batched: bool) -> tuple:
        """``(LayerPlans or None, whether any matmul is on float32 weights)`` of layers ``[start, end)``,
        kept per range: checked on each call against the layers themselves (the same objects, their
        ``plan_epoch``: projections, activation dtype, ``.to()``) and the versions of their float32
        weights (changed in place: the panel copies are remade), which is cheaper than asking 30
        layers for their plans at every decoding step."""
        key = (start, end, prefill, batched)
        layers = list(self.model.layers._modules.values())[start:end]
        hit = self._range_plans.get(key)
        if hit is not None:  # (list equality, in C: the same layer objects, epochs and versions)
            objs, epochs, weights, versions, result = hit
            if (layers == objs and [layer.plan_epoch for layer in layers] == epochs
                    and [w._version for w in weights] == versions):
                return result
        plans = [layer_plan(layer, prefill, batched) for layer in layers]
        acts = {layer.act_dtype for layer in layers}
        if any(p is None for p in plans) or len(acts) != 1:
            result = (None, False)
        else:
            flat = LayerPlans.of(plans)
            result = (flat, bool(set(layer_op.MM_FLOAT_KINDS) & set(flat.kinds)))
        weights = [w for layer in layers for w in _float_weights(layer)]
        self._range_plans[key] = (layers, [layer.plan_epoch for layer in layers], weights,
                                  [w._version for w in weights], result)
        return result

    def run_layers(self, h: torch.Tensor, start: int, end: int, rope, batch, pool,
                   local_rope=None) -> torch.Tensor | None:
        """Layers ``[start, end)`` on ``h [T, H]`` in one op call (writing their K/V into ``pool``),
        the same values as layer by layer; None where the range cannot run there (nothing written).
        ``local_rope``: the rows of the layers that rotate by the local RoPE base (None: ``rope``)."""
        plans = self.layer_plans(h, start, end, rope, batch, pool)
        if plans is None:
            return None
        bf16 = self.model.layers[start].act_dtype == ACT_DTYPE
        op_range = self.ranges.get(plans, pool, start, end, self.model.cfg, bf16)
        return layer_op.decode_layers(h, op_range, rope, batch, self.model.cfg, local_rope)

    # ---- whole decode steps -------------------------------------------------------------------
    def decode_step(self, tokens: list[int], positions: list[int], tables: list[list[int]],
                    pool) -> torch.Tensor | None:
        """``model.fast_path.decode_step`` in one op call, or None where it does not apply."""
        op = self.step_op(len(tokens), pool)
        if op is None:
            return None
        op_range, head = op
        last = max(positions)
        return layer_op.decode_step(tokens, positions, tables, self.model.rope_table(last), op_range, head,
                                    pool.block_size, self.model.cfg, self._local_table(last))

    def decode_greedy(self, tokens: list[int], positions: list[int], tables: list[list[int]], pool, steps: int,
                      eos: list[int], stops: list[tuple[list[int], int]] | None = None,
                      sampling: layer_op.RowSampling | None = None) -> torch.Tensor | None:
        """``model.fast_path.decode_greedy`` in one op call, or None where it does not apply."""
        op = self.step_op(len(tokens), pool)
        if op is None:
            return None
        op_range, head = op
        last = max(positions) + steps - 1
        return layer_op.decode_steps(tokens, positions, tables, self.model.rope_table(last), op_range, head,
                                     pool.block_size, self.model.cfg, steps, eos, stops, sampling,
                                     self._local_table(last))

    def _local_table(self, last: int):
        """The local RoPE base's table (``rope_table(last, local=True)``), or None where the model has
        no other base."""
        model = self.model
        return model.rope_table(last, local=True) if getattr(model, "inv_freq_local", None) is not None else None

    def step_op(self, batch_size: int, pool) -> tuple | None:
        """``(op range of every layer, op head)`` for a decode step of ``batch_size`` sequences in
        one op call, or None where it does not apply: not a RoPE model on the fused CPU path with
        float32 embeddings and residual stream, layers or head not planned, exit blocks with K/V."""
        model = self.model
        batched = batch_size > SMALL_ROWS
        head = self.step_head(batched)
        if (head is None or pool.k[0].dtype not in fused.KV_DTYPES or pool.k[0].device.type != "cpu"
                or any(getattr(e, "has_kv", False) for e in model.exits.values()) or torch.is_grad_enabled()
                and embedding_trains(model)):
            return None
        plans, has_float = self.plans_for(0, model.num_layers, False, batched)
        if plans is None or (has_float and batch_size > max(panel_rows(), SMALL_ROWS)):
            return None
        bf16 = model.layers[0].act_dtype == ACT_DTYPE
        return self.ranges.get(plans, pool, 0, model.num_layers, model.cfg, bf16), head

    def step_head(self, batched: bool):
        """``layer_op.op_head`` of the model's embeddings, final norm and output head (its matmul as
        for more than SMALL_ROWS rows if ``batched``), kept while they are the same tensors at the
        same versions; None where ``decode_step`` does not apply."""
        model = self.model
        (emb, embed_type), norm, head = embedding_table(model.embed_tokens), model.norm, model.lm_head
        tensors = [emb, norm.weight, *_module_tensors(head)]
        hit = self._head_ops.get(batched)
        if (hit is not None and hit[0] is head and len(tensors) == len(hit[1])
                and all(map(operator.is_, tensors, hit[1])) and [t._version for t in tensors] == hit[2]):
            return hit[3]
        made = None
        if (model.inv_freq is not None and model.project_in is None and model.project_out is None
                and emb.device.type == "cpu" and emb.dtype in (torch.float32, torch.uint8) and emb.is_contiguous()
                and not isinstance(norm, nn.LayerNorm)  # an RMSNorm: the model's other norm kind
                and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
                and fusable(model.layers[0]) and layer_op.layers_op() is not None):
            planned = matmul_plan(head, None, batched=batched)
            if planned is not None:
                made = layer_op.op_head(emb, norm.weight, *planned, norm.eps, model.cfg.embed_scale, embed_type)
        self._head_ops[batched] = (head, tensors, [t._version for t in tensors], made)
        return made


def embedding_table(embed: nn.Module) -> tuple[torch.Tensor, int]:
    """What a decode step reads token embeddings from, and its GGML type id: an ``nn.Embedding``'s
    float table ``[V, H]`` (0), or a ``GGUFEmbedding``'s rows in the file's blocks ``[V, row bytes]``
    uint8 (their type)."""
    rows = getattr(embed, "rows", None)
    return (embed.weight, 0) if rows is None else (rows, embed.type_id)


def embedding_trains(model: nn.Module) -> bool:
    """Whether the model is being trained (its embedding table, where it has a float one, needs grad)."""
    weight = getattr(model.embed_tokens, "weight", None)
    return weight is not None and weight.requires_grad


_fast_paths: "weakref.WeakKeyDictionary[nn.Module, FastPath]" = weakref.WeakKeyDictionary()


def fast_path(model: nn.Module) -> FastPath:
    """The model's :class:`FastPath` (made on first use, kept while the model lives)."""
    path = _fast_paths.get(model)
    if path is None:
        path = _fast_paths[model] = FastPath(model)
    return path
