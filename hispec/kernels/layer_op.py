"""The torch op (``csrc/decode_op.cpp``): a range of decoder layers, a whole decode step, or
several greedy steps in one call, on the same kernels as the per-layer path (same bits).

The op holds what it runs between calls: a ``Range`` (the layers' plans, flattened as
:class:`LayerPlans`, and their cache layers in one KV pool) and a ``Head`` (embeddings, final
norm, output head). Ranges are kept by :class:`OpRanges` (owned by the model's fast path,
``plan.py``), per pool and plans object.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import NamedTuple

import torch

from .. import envs
from . import build, fused
from .binding import enum, library

log = logging.getLogger(__name__)

# how the op runs each matmul of a plan: hs_matmul_kind in csrc/hispec_kernels.h, read from there
MATMUL_KINDS = {name.removeprefix("HS_MM_"): value for name, value in enum("hs_matmul_kind").items()}
(MM_FLOAT, MM_INT4, MM_INT8, MM_DENSE, MM_FLOAT_LINEAR, MM_Q4, MM_Q4_PANELS, MM_PANEL, MM_Q8, MM_DENSE_BF16,
 MM_Q8A4, MM_Q8A8, MM_Q8A4_PANELS, MM_Q8A4_TILES, MM_Q8A8_TILES) = (MATMUL_KINDS[k] for k in (
     "FLOAT", "INT4", "INT8", "DENSE", "FLOAT_LINEAR", "Q4", "Q4_PANELS", "PANEL", "Q8", "DENSE_BF16", "Q8A4", "Q8A8",
     "Q8A4_PANELS", "Q8A4_TILES", "Q8A8_TILES"))
MM_FLOAT_KINDS = (MM_FLOAT, MM_FLOAT_LINEAR, MM_PANEL)  # float32 weights: as matmul.small_route()


@functools.lru_cache(maxsize=1)
def layers_op():
    """``torch.ops.hispec_fused.decode_layers`` (a range of decoder layers in one call, on the
    same kernels as the per-layer path), or None: no C kernels, no C++ compiler or torch headers,
    or ``HISPEC_FUSED_LAYERS=0``. Built once per source, torch version and CPU (~15 s)."""
    if library() is None or not envs.HISPEC_FUSED_LAYERS:
        return None
    try:
        torch.ops.load_library(str(build.build_op()))
    except (OSError, RuntimeError) as e:
        log.warning("fused layer op unavailable, running the fused kernels layer by layer: %s", e)
        return None
    return torch.ops.hispec_fused.decode_layers


def prebuild(say=None) -> None:
    """Build (or load) the kernels now rather than in the first decode step, so the first
    generation's time is not a compiler's. ``say(msg)`` is told when a build is about to run."""
    if not envs.HISPEC_FUSED:
        return
    if say is not None and library() is not None and not build.op_path().exists():
        say("building hispec's CPU kernels for this CPU (once, ~15 s)")
    layers_op()


# a layer's entries in LayerPlans.norms and .flags (csrc/decode_op.cpp's Range: NORMS, FLAGS)
NORMS = ("input", "post", "q", "k", "attn_out", "mlp_out")  # RMSNorm weights; an empty tensor where none
FLAGS = ("window", "local_rope", "act")  # sliding window (0: none), local RoPE rows, gated activation
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the op's gated activations (Act in decode_op.cpp)
NO_NORM = torch.empty(0)


class LayerPlans(NamedTuple):
    """The plans of a range of layers (``plan.layer_plan``), flattened as the C++ op takes them."""

    norms: list
    weights: list
    kinds: list
    groups: list
    flags: list

    @classmethod
    def of(cls, plans: list) -> "LayerPlans":
        flat = cls([], [], [], [], [])
        for p in plans:
            for part, values in zip(flat, p):
                part += values
        return flat


class OpRanges:
    """``torch.classes.hispec_fused.Range`` handles: a range's plans and a pool's cache layers
    ``[start, end)`` as the op holds them between calls. Kept per pool, weakly (they go with the
    pool), and per plans object: plans made anew (new weights) get a new one (the entry holds its
    plans, so their id stays theirs)."""

    PER_POOL = 16  # ranges a pool keeps (layer ranges x prompt/decode/batched plans); more: made anew

    def __init__(self) -> None:
        self._by_pool: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def get(self, plans: LayerPlans, pool, start: int, end: int, cfg, bf16_acts: bool):
        held = self._by_pool.setdefault(pool, {})
        key = (id(plans), start, end, bf16_acts)
        hit = held.get(key)
        if hit is None:
            if len(held) >= self.PER_POOL:
                held.clear()
            made = torch.classes.hispec_fused.Range(pool.k[start:end], pool.v[start:end], plans.norms, plans.weights,
                                                    plans.kinds, plans.groups, plans.flags, cfg.num_heads,
                                                    cfg.num_kv_heads, cfg.norm_eps, cfg.attn_scale or 0.0, bf16_acts)
            hit = held[key] = (plans, made)
        return hit[1]


def decode_layers(h: torch.Tensor, op_range, rope, batch, cfg, local_rope=None) -> torch.Tensor:
    """Run the layers of ``op_range`` (``OpRanges.get``) on ``h [T, H]`` float32 in one call
    (writing their K/V into its pool); bit-identical to running them one by one on the kernels.
    ``batch``: the call's ``AttentionBatch`` (a prefill's: its attention may take the prompt path,
    ``fused.paged_attention``); ``local_rope``: the RoPE rows of the layers that rotate
    by the local base (None: ``rope``)."""
    meta = batch.kernel()
    cos, ssin = (r.view(r.shape[0], r.shape[-1]).contiguous() for r in rope)  # [T, D]
    cos_l, ssin_l = (cos, ssin) if local_rope is None or local_rope is rope else (
        r.view(r.shape[0], r.shape[-1]).contiguous() for r in local_rope)
    parallel = meta.keys * cfg.num_heads * cfg.head_dim >= fused.PARALLEL_MIN_WORK
    return layers_op()(h.contiguous(), cos, ssin, cos_l, ssin_l, batch.write_slots, meta.tables, meta.seq,
                       meta.lengths, meta.tail_start, meta.tail, meta.block_size, parallel, op_range, batch.prefill)


def op_head(embed: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, params: torch.Tensor, kind: int,
            group: int, eps: float, embed_scale: float = 1.0, embed_type: int = 0):
    """``torch.classes.hispec_fused.Head``: what ``decode_step`` runs besides the layers, the token
    embeddings (a float32 table ``[V, H]``, ``embed_type`` 0; or a GGUF tensor's rows ``[V, row
    bytes]`` uint8 of that GGML type id: ``GGUFEmbedding.rows``), times ``embed_scale`` rounded to
    float32, as ``DecoderModel.embed``, the final RMSNorm weight ``[H]`` (float32) and the output head
    (a matmul of ``kind`` on ``weight`` and ``params``, as in a layer plan)."""
    return torch.classes.hispec_fused.Head(embed, int(embed_type), norm, weight, params, kind, group, eps,
                                           float(embed_scale))


def _direct(name: str):
    """The op ``torch.ops.hispec_fused.<name>`` as its C++ callable: calling the op's packet walks
    every element of its list arguments in Python first (a check for export's fake script
    objects, which these calls never carry: ~0.15 ms for a decode run's ~700-token text)."""
    packet = getattr(torch.ops.hispec_fused, name)
    return getattr(packet, "_op", packet)


def _flat_tables(tables: list[list[int]]) -> list[int]:
    """Block tables as one row-major list, each padded with block 0 to the longest."""
    width = max(len(t) for t in tables)
    return [b for t in tables for b in (t + [0] * (width - len(t)) if len(t) < width else t)]


def parallel_min_keys(cfg) -> int:
    """Keys (the sequences' positions + 1, summed) from which a decode step's attention shares the
    threads: ``keys * num_heads * head_dim >= fused.PARALLEL_MIN_WORK``, as ``decode_layers`` decides it."""
    return -(-fused.PARALLEL_MIN_WORK // (cfg.num_heads * cfg.head_dim))


def decode_step(tokens: list[int], positions: list[int], tables: list[list[int]], rope_table, op_range, head,
                block_size: int, cfg, local_table=None) -> torch.Tensor:
    """One decoding step of B sequences in one call: ``tokens[b]`` at ``positions[b]`` (sequence b's
    block table ``tables[b]``) through every layer (``op_range`` of all layers), the final norm and
    the output head (``head = op_head(...)``) -> logits ``[B, V]`` float32. ``rope_table``:
    ``(cos, signed sin)`` ``[P, D]`` float32 with ``P > max(positions)``; ``local_table``: the local
    RoPE base's (None: ``rope_table``). The same bits as the step taken call by call (embedding,
    ``decode_layers``, the norm and the head's kernel)."""
    local_table = local_table or rope_table
    return _direct("decode_step")(tokens, positions, _flat_tables(tables), block_size, rope_table[0], rope_table[1],
                                  local_table[0], local_table[1], parallel_min_keys(cfg), op_range, head)


class RowSampling(NamedTuple):
    """How ``decode_steps`` chooses each row's tokens: ``temperature[b] > 0`` samples (with ``top_k[b]``, 0 =
    off, and ``top_p[b]``, 1 = off, as ``sampler.logits_to_probs``) by ``sampler.pick`` with ``uniforms[b, s]``
    at step ``s`` (``[B, steps]`` float64: its positions' numbers, ``DecodeContext.uniforms``); temperature 0
    takes the argmax."""
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    uniforms: torch.Tensor


def decode_steps(tokens: list[int], positions: list[int], tables: list[list[int]], rope_table, op_range, head,
                 block_size: int, cfg, steps: int, eos: list[int],
                 stops: list[tuple[list[int], int]] | None = None, sampling: RowSampling | None = None,
                 local_table=None) -> torch.Tensor:
    """Up to ``steps`` steps in one call: ``decode_step``, each row's token (the argmax, as
    ``torch.argmax``, or sampled where ``sampling`` says: the token ``sampler.choose`` gives), those
    tokens at the next positions, ... -> the chosen tokens ``[B, s]`` int64, ``s <= steps`` (it stops
    once every row has chosen one of ``eos``). The same tokens as ``s`` calls of ``decode_step`` with a
    choice between them. ``tables[b]`` and ``rope_table`` must cover ``positions[b] + steps - 1``.
    ``stops[b] = (text, n)``: row b's tokens up to its pending one, and ``n > 0`` to stop after a step
    where the row ends on an n-gram that occurred earlier in its text with a token after it (where
    prompt lookup has drafts; 0: never)."""
    history, ends, ngram = [], [], []
    if stops is not None and any(n > 0 for _, n in stops):
        for text, n in stops:
            history += text
            ends.append(len(history))
            ngram.append(n)
    temperature, top_k, top_p, uniforms = sampling if sampling is not None else ([], [], [], None)
    local_table = local_table or rope_table
    return _direct("decode_steps")(tokens, positions, _flat_tables(tables), block_size, rope_table[0], rope_table[1],
                                   local_table[0], local_table[1], steps, eos, history, ends, ngram, temperature, top_k, top_p, uniforms,
                                   parallel_min_keys(cfg), op_range, head)


PROFILE_PARTS = ("matmul", "attention", "rope_cache", "norm", "silu_mul", "residual", "setup")  # silu_mul: GeGLU too


def profile(on: bool) -> dict[str, tuple[float, int]]:
    """Time the C++ op's calls per part (wall clock around each call) while ``on``; returns each
    part's ``(seconds, calls)`` summed since the previous call and starts again from zero. The
    parts (PROFILE_PARTS): the matmuls (decoder linears, output head), paged attention, RoPE with
    the cache write, the RMSNorms (with their residual adds), the gated activation, the residual add
    after the MLP, and a decode step's setup (embeddings, RoPE rows, block tables). Empty when the
    op is unavailable."""
    if layers_op() is None:
        return {}
    seconds, calls = torch.ops.hispec_fused.profile(on)
    return {part: (s, c) for part, s, c in zip(PROFILE_PARTS, seconds, calls)}
