"""The teacher pass: the model's own decoder layers over a ragged batch of whole sequences.

One pass is a prefill of sequences packed end to end through :class:`hispec.model.runner.LayerRunner`
(the engine's runner: ``DecoderModel.run_layers`` over a private paged KV pool, the model itself,
no copy of its layers), keeping the states entering the chosen layers and reducing the final
layer's log-probabilities to their top-k on the fly. No per-token Python work.

``TrainConfig.teacher_precision``: ``bfloat16`` runs the layers as a prompt is prefilled (a
quantized layer multiplies by its dense bfloat16 prefill weights where the loader made them: a
prefill is compute-bound, and the int4 kernel is built for decode-sized inputs; ~1.4x faster on
the default model on CPU); ``model`` runs them as decoding does (the decode kernels, bit for bit
what the engine computes at a generated position). On float weights the two are the same.
"""
from __future__ import annotations

import torch

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import KVPool
from ..model.runner import LayerRunner
from .config import TrainConfig


class TeacherPass:
    """Batched teacher passes (see the module docstring): called on ``seqs``, per position the
    states ``h.{L}`` ``[N, H]`` float16 (rows scaled by a power of two where they would overflow:
    ``float16_states``), the final top-k ``top_ids`` ``[N, K]`` int32 and
    ``top_logp`` ``[N, K]`` float16, and the input ``tokens`` ``[N]`` int32, on the CPU."""

    def __init__(self, model, cfg: TrainConfig) -> None:
        self.model, self.cfg = model, cfg
        self.prefill = cfg.teacher_precision == "bfloat16"

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        model, cfg = self.model, self.cfg
        states, final, _ = layer_pass(model, seqs, cfg.layers, prefill=self.prefill)  # final: [N, H]
        ids, logp = [], []
        for a in range(0, final.shape[0], cfg.logits_chunk):
            logits = model.final_logits(final[a:a + cfg.logits_chunk])  # [n, V]
            top_logp, top_ids = torch.log_softmax(logits.float(), dim=-1).topk(cfg.topk, dim=-1)
            ids.append(top_ids.to(torch.int32))
            logp.append(top_logp.to(torch.float16))
        out = {f"h.{L}": float16_states(states[L]) for L in cfg.layers}
        out.update(top_ids=torch.cat(ids), top_logp=torch.cat(logp))
        out = {k: v.cpu() for k, v in out.items()}
        out["tokens"] = torch.tensor([t for ids in seqs for t in ids], dtype=torch.int32)
        return out


F16_ROW_MAX = 2.0 ** 15  # a stored state row's largest magnitude (float16 reaches 65,504)


def float16_states(h: torch.Tensor) -> torch.Tensor:
    """Hidden states ``h [N, H]`` in float16, each row scaled down by a power of two where its
    largest value would not fit (Gemma 3's residual stream reaches ~1e5 by its middle layers:
    float16 overflowed to inf and training gave NaN). Exact (a power of two), and no reader sees
    it: exits read their states through an RMSNorm (the exit's own, the block's, the least-squares
    start's normalisation), which scaling does not change beyond its eps."""
    h = h.float()
    peak = h.abs().amax(dim=-1, keepdim=True)  # [N, 1]
    shift = torch.clamp(torch.ceil(torch.log2(peak / F16_ROW_MAX)), min=0)  # [N, 1]: 0 for most models
    return torch.ldexp(h, -shift).to(torch.float16)


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
