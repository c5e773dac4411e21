"""The teacher pass: the model's own decoder layers over a ragged batch of whole sequences.

One pass is a prefill of sequences packed end to end through :class:`hispec.decode.base.LayerRunner`
(the engine's runner: ``DecoderModel.run_layers`` over a private paged KV pool, the layers' own
code), keeping the states entering the chosen layers and reducing the final layer's
log-probabilities to their top-k on the fly (:class:`ExactTopK` on the bfloat16 CPU teacher).
No per-token Python work. On CPU the linear layers may run as dense bfloat16 matrices of the
model's weights (:func:`teacher_model`): a prefill is compute-bound, and that is where this CPU
is fastest; the layers' code stays the model's own.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import KVPool
from ..decode.base import LayerRunner
from .config import TEACHER_PRECISIONS, TrainConfig


class DenseLinear(nn.Module):
    """A linear layer as one dense bfloat16 matrix: ``x [..., K] -> [..., N]`` in ``x``'s dtype.

    Prefill-sized inputs are compute-bound, and this CPU multiplies bfloat16 (AVX512-BF16) ~3x
    faster than float32 and far faster than the int4 decode kernel does at 2,048 rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight, self.bias)
        return out if out.dtype == x.dtype else out.to(x.dtype)


def teacher_model(model, precision: str):
    """The model the teacher pass runs. ``model``: the model itself, bit for bit what it serves
    (the default model's native 4-bit weights run on the int4 kernel, built for decode-sized
    inputs: ~130 positions/s per thread at prefill). ``bfloat16`` (on CPU): a copy whose linear
    layers (decoder and output head) are dense bfloat16 matrices of the *same* weights (quantized
    ones dequantized, as :meth:`QuantLinear.dequantize` gives what the kernel multiplies by); the
    residual stream, norms and attention stay as the model runs them. With the default model this
    copy's final-layer argmax equals the served model's at ~98% of positions (the rest are
    near-ties: only the rounding of the weights to bfloat16 and the summation order differ)."""
    if precision not in TEACHER_PRECISIONS:
        raise ValueError(f"unknown teacher precision {precision!r}; choose from {', '.join(TEACHER_PRECISIONS)}")
    if precision == "model" or model.device.type != "cpu":
        return model
    from ..model.quant import QuantLinear

    dense = copy.copy(model)  # shallow: the copies below replace linear layers, nothing is shared mutably
    dense._modules = dict(model._modules)
    dense.layers = nn.ModuleList(_densify(copy.copy(layer)) for layer in model.layers)
    head = model.lm_head
    w = head.dequantize() if isinstance(head, QuantLinear) else head.weight
    dense.lm_head = DenseLinear(w, getattr(head, "bias", None))
    return dense


def _densify(module: nn.Module) -> nn.Module:
    """``module`` (a shallow copy) with every linear child replaced by a :class:`DenseLinear`."""
    from ..model.quant import QuantLinear

    module._modules = dict(module._modules)
    for name, child in list(module._modules.items()):
        if isinstance(child, QuantLinear):
            module._modules[name] = DenseLinear(child.dequantize(), child.bias)
        elif isinstance(child, nn.Linear):
            module._modules[name] = DenseLinear(child.weight, child.bias)
        elif child is not None and len(child._modules):
            module._modules[name] = _densify(copy.copy(child))
    return module


class TeacherPass:
    """Batched teacher passes (see the module docstring): ``pass_(seqs)`` -> per position, the
    states ``h.{L}`` ``[N, H]`` float16, the final top-k ``top_ids`` ``[N, K]`` int32 and
    ``top_logp`` ``[N, K]`` float16, and the input ``tokens`` ``[N]`` int32, on the CPU."""

    def __init__(self, model, cfg: TrainConfig) -> None:
        self.source, self.cfg = model, cfg
        self.model = teacher_model(model, cfg.teacher_precision)
        self.head = ExactTopK(model) if isinstance(self.model.lm_head, DenseLinear) else None

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        model, cfg = self.model, self.cfg
        states, final, _ = layer_pass(model, seqs, cfg.layers)  # final: [N, H]
        ids, logp = [], []
        for a in range(0, final.shape[0], cfg.logits_chunk):
            h = final[a:a + cfg.logits_chunk]
            if self.head is not None:
                top_logp, top_ids = self.head(model, h, cfg.topk)
            else:
                top_logp, top_ids = torch.log_softmax(model.final_logits(h).float(), dim=-1).topk(cfg.topk, dim=-1)
            ids.append(top_ids.to(torch.int32))
            logp.append(top_logp.to(torch.float16))
        out = {f"h.{L}": states[L].to(torch.float16) for L in cfg.layers}
        out.update(top_ids=torch.cat(ids), top_logp=torch.cat(logp))
        out = {k: v.cpu() for k, v in out.items()}
        out["tokens"] = torch.tensor([t for ids in seqs for t in ids], dtype=torch.int32)
        return out


def layer_pass(model, seqs: list[list[int]], layers=(), block_size: int = 16, prefill: bool = False
               ) -> tuple[dict[int, torch.Tensor], torch.Tensor, LayerRunner]:
    """A prefill of ``seqs`` (each from position 0) through the engine's layer runner over a
    private paged pool: ``({L: states entering layer L [N, H]}, final states [N, H], runner)``,
    rows packed in the order of ``seqs``. ``L = 0`` is the embeddings, ``L = num_layers`` the final
    state (entering the final norm). Exit blocks attached to the model write their K/V as in
    decoding, so ``runner.exit_logits`` gives each exit's logits as decoding computes them
    (sequence ``s`` is ``seq_id`` ``s``). ``prefill``: let quantized layers run their dense prefill
    weights (faster, not what decoding multiplies by)."""
    c, n = model.cfg, model.num_layers
    total = sum(len(s) for s in seqs)
    blocks = BlockManager(-(-total // block_size) + len(seqs) + 1, block_size, n, model.kv_layers - n)
    pool = KVPool(model.kv_layers, blocks.num_blocks, block_size, c.num_kv_heads, c.head_dim, model.kv_dtype,
                  model.device)
    runner = LayerRunner(model, blocks, pool)
    items = []
    for sid, ids in enumerate(seqs):
        blocks.add_sequence(sid)
        items.append((sid, 0, torch.tensor(ids, dtype=torch.long, device=model.device)))
    capture = {L: None for L in layers if 0 < L < n}
    final = torch.cat(runner.forward_many(items, 0, n, capture, prefill=prefill))
    states = dict(capture)
    if 0 in layers:
        tokens = torch.cat([x for _, _, x in items])
        positions = torch.cat([torch.arange(len(s), device=model.device) for s in seqs])
        states[0] = model.embed(tokens, positions)
    if n in layers:
        states[n] = final
    return states, final, runner


@torch.inference_mode()
def exit_logits_along(model, ids: list[int], first: int, layers: list[int]) -> dict[int, torch.Tensor]:
    """Logits ``[len(ids) - first, V]`` of each exit layer at positions ``first ..`` of ``ids``, as
    decoding computes them: one teacher pass with the exits attached (exit blocks write their K/V
    as in decoding), then each exit (``LayerRunner.exit_logits``)."""
    n = model.num_layers
    states, final, runner = layer_pass(model, [ids], [L for L in layers if L < n])
    out = {L: runner.exit_logits([(0, first, states[L][first:])], L) for L in layers if 0 < L < n}
    if n in layers:
        out[n] = model.final_logits(final[first:])
    return out


class ExactTopK:
    """The final layer's top-k log-probabilities from bfloat16 logits, made exact where it matters.

    A bfloat16 logit of ~20 is rounded to a step of 0.125, which would reorder near-ties. So the
    bfloat16 logits only *select* ``k + margin`` candidates; their logits are recomputed in float32
    against the head's float32 weights (as the model computes them: ``x`` rounded to bfloat16 first
    when the model's head is a quantized kernel), and the log-normaliser is
    ``log(sum_exact(candidates) + sum_bf16(rest))``."""

    def __init__(self, model, margin: int = 8, rows: int = 16) -> None:
        from ..model.quant import QuantLinear

        head = model.lm_head
        quantized = isinstance(head, QuantLinear)
        self.rounds_input = quantized and head.input_dtype == torch.bfloat16  # the kernel reads bfloat16
        self.weight = (head.dequantize() if quantized else head.weight).float()  # [V, H']
        self.bias = None if getattr(head, "bias", None) is None else head.bias.float()
        self.margin, self.rows = margin, rows

    def __call__(self, model, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # h: [n, H] final hidden states -> (log-probs [n, k] descending, ids [n, k])
        x = model.norm(h)
        if model.project_out is not None:
            x = model.project_out(x)
        rough = model.lm_head(x.to(torch.bfloat16))  # [n, V] bfloat16: one compute-bound product
        xin = x.to(torch.bfloat16).float() if self.rounds_input else x.float()
        c = min(k + self.margin, rough.shape[1])
        logp, ids = [], []
        for a in range(0, xin.shape[0], self.rows):  # rows [r, V] in float32 that stay in the cache
            r = rough[a:a + self.rows].float()
            cand = top_columns(r, c)  # [r, C]
            exact = torch.einsum("nh,nch->nc", xin[a:a + self.rows], self.weight[cand])  # [r, C]
            if self.bias is not None:
                exact = exact + self.bias[cand]
            r.scatter_(1, cand, float("-inf"))  # the rest, bfloat16-rounded
            m = r.amax(-1, keepdim=True)
            rest = r.sub_(m).exp_().sum(-1).log_() + m[:, 0]  # logsumexp in place (3 passes, no copies)
            lse = torch.logaddexp(torch.logsumexp(exact, -1), rest)  # [r]
            top = exact.topk(k, dim=-1)
            logp.append(top.values - lse[:, None])
            ids.append(cand.gather(1, top.indices))
        return torch.cat(logp), torch.cat(ids)


def top_columns(x: torch.Tensor, k: int, group: int = 64) -> torch.Tensor:
    """The columns of the ``k`` largest values of each row of ``x [n, V]`` -> ``[n, k]`` (unordered;
    the same set as ``x.topk(k)``). Each of the ``k`` largest lies in one of the ``k`` column groups
    with the largest maxima, so the full sort runs over ``k * group`` values instead of ``V``: on
    the 49,152-token vocabulary ~7x faster than ``topk``."""
    n, v = x.shape
    if v <= k * group:
        return x.topk(k, dim=-1, sorted=False).indices
    pad = -v % group
    xp = F.pad(x, (0, pad), value=float("-inf")) if pad else x
    groups = xp.view(n, -1, group).amax(-1).topk(k, dim=-1, sorted=False).indices  # [n, k]
    cols = (groups[..., None] * group + torch.arange(group, device=x.device)).view(n, -1)  # [n, k * group]
    return cols.gather(1, xp.gather(1, cols).topk(k, dim=-1, sorted=False).indices)
