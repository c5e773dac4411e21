"""A decoder-only transformer that runs in layer ranges over a paged KV cache.

Covers the Llama family (Llama 2/3/3.x, CodeLlama, LayerSkip, SmolLM), Qwen2/2.5 (q/k/v
bias), Qwen3 (per-head q/k RMSNorm), Gemma 3 (q/k RMSNorm, GeGLU, norms on the attention's and
MLP's outputs, scaled embeddings, sliding-window layers with their own RoPE base) and OPT
(learned positions, LayerNorm, ReLU). The families differ only by ``ModelConfig`` fields.

The model only computes; it never decides what to generate. The model runner
(``model/runner.py``) calls:

- ``embed(token_ids, positions)``                      -> hidden ``[T, H]``
- ``run_layers(h, start, end, batch, pool, backend)``  -> hidden after layers ``[start, end)``,
  writing those layers' K/V for the new tokens into the pool
- ``exit_logits(h, layer)``                             -> logits ``[T, V]`` from the exit after
  ``layer`` decoder layers (``layer == num_layers`` is the model's own output)

This file is the reference PyTorch computation. Its layers are built from kernel-backed modules
(``kernels.matmul.Linear``, ``kernels.quant.QuantLinear``, ``kernels.norm.RMSNorm``), as vLLM's
model files are; running whole layers, ranges of layers or decode steps on the fused CPU kernels
is the runner's (``model/fast_path.py``, planned by ``kernels/plan.py``): this file imports neither
(``tests/test_layers.py``).
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.kv_cache import AttentionBatch, KVPool
from ..config import ConfigError, ModelConfig
from ..kernels.matmul import Linear
from ..kernels.norm import LayerNorm, RMSNorm


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_pytorch_tanh": gelu_tanh}


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.family == "opt":
        return LayerNorm(dim, eps=cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` for default, linear and llama3 RoPE (none of them scales cos/sin),
    on the CPU whatever the default device (a model built on the meta device: ``arange`` there costs a
    process ~1 s the first time, PyTorch importing its reference implementations). ``local``: those of
    the sliding-window layers (their own base, ``rope_local_theta``, unscaled)."""
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = {} if local else cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    else:
        raise ConfigError(f"unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3)")
    return inv_freq.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [..., T, H, D]``, with ``signed_sin = [-sin, sin]``
    (halves): the halves are swapped by one flip, and ``(-a) * b == a * (-b)`` exactly, so the
    values equal the rotate_half form bit for bit with fewer operations."""
    d = x.shape[-1]
    swapped = x.reshape(*x.shape[:-1], 2, d // 2).flip(-2).view(x.shape)  # [x2, x1]
    return x * cos + swapped * signed_sin


# A last-bit difference in attention can flip a greedy choice (with bfloat16 between layers, a
# rounding, and grow); batched matmuls give a query's scores last-bit differences depending on how
# many queries share the call and on the padded context. So on the CPU (and with bfloat16 between
# layers anywhere) a sequence's verification queries (up to this many) are attended one by one, each
# over exactly its own context (on a sliding layer, its window), as in one-token decoding: every
# strategy then computes each token bit for bit as ``ar`` does.
EXACT_MAX_QUERIES = 32
# eager CPU attention (attend, where the fused kernels are unavailable): a sequence's queries from which
# it takes SDPA's fused kernel (as fast as the batched matmuls there, and leaner); the fused paged
# kernel takes every chunk, so that a prompt's K/V do not depend on its chunking
SDPA_MIN_QUERIES = 256


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention of one sequence: ``q [T, Hq, D]`` over ``k, v [C, Hkv, D]`` -> ``[T, Hq, D]``,
    logits scaled by ``scale`` (None: ``D ** -0.5``).

    ``mask [T, C]`` (True = may attend) or None when every key is visible. On CUDA, and on CPU
    for prefill-sized queries (``T >= SDPA_MIN_QUERIES``), this is ``scaled_dot_product_attention``
    (a fused kernel: 1,400 queries x 1,400 keys take 97 ms instead of 135 ms per layer and never
    hold the [T, C] scores). Otherwise, on CPU, two batched matmuls with the query heads of a
    group stacked, which avoids expanding K/V and is 2-3x faster for decode-sized queries.
    """
    if q.device.type != "cpu" or q.shape[0] >= SDPA_MIN_QUERIES:
        # with a batch dimension: 3-D inputs take CPU SDPA's unfused path (1,400 x 1,400: 188 vs 71 ms)
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                              attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1],
                                              scale=scale)[0].transpose(0, 1)
    T, hq, d = q.shape
    hkv, c = k.shape[1], k.shape[0]
    g = hq // hkv
    qg = q.view(T, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * T, d)  # [Hkv, G*T, D]
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * (d ** -0.5 if scale is None else scale)  # [Hkv, G*T, C]
    if mask is not None:
        scores = scores.view(hkv, g, T, c).masked_fill(~mask, float("-inf")).view(hkv, g * T, c)
    out = torch.bmm(scores.float().softmax(-1).to(v.dtype), v.transpose(0, 1))  # [Hkv, G*T, D]
    return out.view(hkv, g, T, d).permute(2, 0, 1, 3).reshape(T, hq, d)


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ROPE_TABLE_MIN = 1024  # positions in the first RoPE table (CPU; doubled as positions grow)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP. q/k/v and gate/up projections are fused for fewer matmuls.

    ``index``: the layer's place in the model (None: a copy outside it, e.g. an exit block, which
    attends globally); it decides whether the layer attends over a sliding window (``sliding``)."""

    def __init__(self, cfg: ModelConfig, index: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.sliding = index is not None and index in cfg.sliding_layers
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.input_norm = make_norm(cfg, h)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, h, bias=cfg.family == "opt")
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.post_norm = make_norm(cfg, h)  # before the MLP
        # Gemma 3's norms of the attention's and the MLP's outputs (before their residual adds)
        self.attn_out_norm = RMSNorm(h, cfg.norm_eps) if cfg.sandwich_norm else None
        self.mlp_out_norm = RMSNorm(h, cfg.norm_eps) if cfg.sandwich_norm else None
        if cfg.family == "opt":
            self.fc1 = Linear(h, cfg.intermediate_size, bias=True)
            self.fc2 = Linear(cfg.intermediate_size, h, bias=True)
        else:
            self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = Linear(cfg.intermediate_size, h, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        # dtype of the linear layers' inputs: None = the residual stream's; bfloat16 when they
        # run on the quantized kernels (set by loader.apply_quantization), so the norms hand
        # them bfloat16 directly and their outputs stay bfloat16 into the next kernel
        self.act_dtype: torch.dtype | None = None

    def projections(self) -> tuple:
        """The four matmul modules a plan covers (None where this family has not got one: OPT's MLP)."""
        return tuple(getattr(self, name, None) for name in _PROJECTIONS)

    def forward(self, h: torch.Tensor, layer: int, rope: tuple[torch.Tensor, torch.Tensor] | None,
                batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
        """The reference computation of this layer on ``h [T, H]`` (the residual stream stays in the
        model's dtype), writing its K/V for the new positions into layer ``layer`` of ``pool``. (The
        model runner's fused CPU path, ``model/fast_path.py``, computes it on its kernels: the same values
        up to float rounding.)"""
        a = self._attention(self.input_norm(h, self.act_dtype), layer, rope, batch, pool)
        h = h + (a if self.attn_out_norm is None else self.attn_out_norm(a.to(h.dtype)))
        m = self.mlp(self.post_norm(h, self.act_dtype))
        return h + (m if self.mlp_out_norm is None else self.mlp_out_norm(m.to(h.dtype)))

    def _window(self, mask: torch.Tensor | None, positions: torch.Tensor, context: int) -> torch.Tensor | None:
        """``mask [T, C]`` (None: all visible) narrowed, on a sliding layer, to the keys within the
        window of each query at ``positions [T]``: key ``j`` is seen from position ``p`` iff
        ``p - j < sliding_window`` (the context's key ``j`` is position ``j``, a tree's nodes after it)."""
        w = self.cfg.sliding_window
        if not self.sliding or int(positions.max()) < w:
            return mask
        window = torch.arange(context, device=positions.device)[None, :] > (positions[:, None] - w)  # [T, C]
        return window if mask is None else mask & window

    def _window_keys(self, keys, position: int):
        """Which of the context's keys (``keys``: a count, the first ``keys``; or indices) a query at
        ``position`` sees on this layer, as a slice (of a count) or indices: on a sliding layer only
        those within its window. A one-token step and a verification window's query at the same
        position both attend over exactly these keys (so over the same bits)."""
        w = self.cfg.sliding_window
        first = position - w + 1 if self.sliding and position >= w else 0
        if isinstance(keys, int):
            return slice(first, keys)
        keys = torch.as_tensor(keys)
        return keys[keys >= first] if first else keys

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.family == "opt":
            return self.fc2(self.act(self.fc1(x)))
        gate, up = self.gate_up_proj(x).split(self.cfg.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, Hq, D]``, keys and values ``[T, Hkv, D]`` of the normalised input ``x [T, H]``
        (keys and queries rotated, together; ``x`` may also be ``[B, T, H]``, then ``[B, T, heads, D]``)."""
        cfg, lead = self.cfg, x.shape[:-1]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv_proj(x)  # [..., Q + 2 KV]
        if self.q_norm is not None:  # per head; as rows of [T * heads, D] (the norm kernel's rows: row-invariant)
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = q.reshape(-1, d), k.reshape(-1, d)
            qk = torch.cat([self.q_norm(q).view(*lead, hq, d), self.k_norm(k).view(*lead, hkv, d)], dim=-2)
        else:
            qk = qkv[..., :self.q_size + self.kv_size].view(*lead, hq + hkv, d)  # q and k heads
        v = qkv[..., self.q_size + self.kv_size:].view(*lead, hkv, d)
        if rope is not None:
            qk = apply_rope(qk, *rope)  # both at once
        return qk[..., :hq, :], qk[..., hq:, :], v

    def write_kv(self, h: torch.Tensor, layer: int, rope, batch: AttentionBatch, pool: KVPool) -> None:
        """Only this layer's K/V for the input ``h [T, H]`` (e.g. positions whose output nobody reads)."""
        _, k, v = self.qkv(self.input_norm(h, self.act_dtype), rope)
        pool.write(layer, batch.write_slots, k, v)

    def _attention(self, x: torch.Tensor, layer: int, rope, batch: AttentionBatch, pool: KVPool) -> torch.Tensor:
        T = x.shape[0]
        hq, d = self.cfg.num_heads, self.cfg.head_dim
        scale = self.cfg.attn_scale
        q, k, v = self.qkv(x, rope)
        pool.write(layer, batch.write_slots, k, v)
        exact = self.act_dtype is not None or x.device.type == "cpu"
        if len(batch.chunks) == 1 and T == 1:  # one token of a chain: its keys are the context's first C
            ck, cv = pool.context(layer, batch, 0, q.dtype)  # [C, Hkv, D]
            keys = self._window_keys(ck.shape[0], int(batch.positions[0]))
            out = attend(q, ck[keys], cv[keys], None, scale)
        elif len(batch.chunks) == 1 and not (exact and 1 < T <= EXACT_MAX_QUERIES):
            ck, cv = pool.context(layer, batch, 0, q.dtype)  # [C, Hkv, D]
            out = attend(q, ck, cv, self._window(batch.masks[0], batch.positions, ck.shape[0]), scale)
        else:
            out = q.new_empty((T, hq, d))
            for i, c in enumerate(batch.chunks):
                lo, hi = batch.offsets[i], batch.offsets[i + 1]
                ck, cv = pool.context(layer, batch, i, q.dtype)
                if exact and 1 < c.num_tokens <= EXACT_MAX_QUERIES:
                    for j in range(c.num_tokens):  # each query exactly as if it were decoded alone
                        keys = self._window_keys(c.keys(j), int(batch.positions[lo + j]))  # a slice, or key indices
                        out[lo + j:lo + j + 1] = attend(q[lo + j:lo + j + 1], ck[keys], cv[keys], None, scale)
                else:
                    out[lo:hi] = attend(q[lo:hi], ck, cv, self._window(batch.masks[i], batch.positions[lo:hi],
                                                                       ck.shape[0]), scale)
        out = out.reshape(T, self.q_size)
        return self.o_proj(out if self.act_dtype is None else out.to(self.act_dtype))


class LayerBackend(Protocol):
    """How a range of decoder layers runs other than by each layer's reference ``forward``: the model
    runner's fused CPU path (``model/fast_path.py``'s ``FUSED``). ``DecoderModel.run_layers`` hands it
    the range with the RoPE rows of its positions (``local_rope``: those of the sliding layers)."""

    def run_layers(self, model: "DecoderModel", h: torch.Tensor, start: int, end: int,
                   rope: tuple[torch.Tensor, torch.Tensor] | None, local_rope: tuple[torch.Tensor, torch.Tensor] | None,
                   batch: AttentionBatch, pool: KVPool) -> torch.Tensor: ...

    def layer(self, layer: DecoderLayer, h: torch.Tensor, index: int, rope: tuple[torch.Tensor, torch.Tensor] | None,
              batch: AttentionBatch, pool: KVPool) -> torch.Tensor: ...

    def write_kv(self, layer: DecoderLayer, h: torch.Tensor, index: int,
                 rope: tuple[torch.Tensor, torch.Tensor] | None, batch: AttentionBatch, pool: KVPool) -> None: ...


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; built on the meta device (a model about to be loaded) without its
    random init: ``normal_`` on a meta tensor costs a process ~1 s the first time (PyTorch imports
    its decompositions), every ``hispec generate`` paid it."""
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight) if weight.is_meta else nn.Embedding(num, dim)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        emb_dim = cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = _embedding(cfg.vocab_size, emb_dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        self.lm_head = Linear(emb_dim, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.embed_positions = None
        self.project_in = self.project_out = None
        if cfg.family == "opt":
            self.embed_positions = _embedding(cfg.max_position_embeddings + cfg.learned_pos_offset, cfg.hidden_size)
            if emb_dim != cfg.hidden_size:
                self.project_in = Linear(emb_dim, cfg.hidden_size, bias=False)
                self.project_out = Linear(cfg.hidden_size, emb_dim, bias=False)
            inv_freq = None
        else:
            inv_freq = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # the sliding-window layers' own RoPE (Gemma 3), else None: every layer rotates by inv_freq
        local = cfg.sliding_layers and cfg.rope_local_theta not in (None, cfg.rope_theta)
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=True) if local else None, persistent=False)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # see rope_table
        self._rope_table_local: tuple[torch.Tensor, torch.Tensor] | None = None  # the same, local base
        self.exits: dict[int, nn.Module] = {}  # trained exits by layer; see model/exits/, exit_block.py
        self.weight_format = "none"  # or "native" / "int4" / "int8": see loader.apply_quantization
        self.kv_cache_dtype: torch.dtype | None = None  # what KV pools for this model hold; None: the model's dtype

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def kv_exits(self) -> dict[int, nn.Module]:
        """The attached exits that keep K/V in the pool (``has_kv``: exit blocks), by exit layer;
        each gets the pool layer ``num_layers + i`` (``kv_layer``), in layer order."""
        out = {L: self.exits[L] for L in sorted(self.exits) if self.exits[L].has_kv}
        for i, e in enumerate(out.values()):
            e.kv_layer = self.cfg.num_layers + i
        return out

    @property
    def kv_layers(self) -> int:
        """Layers of K/V a pool for this model holds: its decoder layers plus its exit blocks."""
        return self.cfg.num_layers + len(self.kv_exits())

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of this model's KV pools: ``kv_cache_dtype``, or the model's own. K/V are
        rounded to it when written and every read sees the rounded values, whichever path
        (one-token steps, verification windows, prefill) wrote or reads them."""
        return self.kv_cache_dtype or self.dtype

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # token_ids, positions: [T] -> [T, H]
        h = self.embed_tokens(token_ids)
        if self.cfg.embed_scale != 1.0:  # Gemma: sqrt(hidden), a float32 scalar as transformers multiplies
            h = h * torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(h.dtype)
        if self.project_in is not None:
            h = self.project_in(h)
        if self.embed_positions is not None:
            h = h + self.embed_positions(positions + self.cfg.learned_pos_offset)
        return h

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, signed sin)`` ``[T, 1, D]`` of ``positions [T]`` (see ``apply_rope``). On the CPU,
        rows of a table of positions ``0 ..`` (grown by doubling) instead of ~8 tensor ops per
        step: the same values (each element is computed by the same element-wise kernels)."""
        if self.inv_freq is None:
            return None
        if positions.device.type != "cpu":
            cos, sin = self._rope_rows(positions)
        else:
            table = self.rope_table(int(positions.max()))
            cos, sin = table[0].index_select(0, positions), table[1].index_select(0, positions)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D]

    def local_rope(self, positions: torch.Tensor, rope):
        """The sliding-window layers' ``(cos, signed sin)`` ``[T, 1, D]`` where they have their own
        RoPE base (``inv_freq_local``), else ``rope`` (every layer's). On the CPU rows of its table
        (``rope_table(.., local=True)``), as ``rope``: the rows the fused op reads."""
        if self.inv_freq_local is None or rope is None:
            return rope
        if positions.device.type != "cpu":
            cos, sin = self._rope_rows(positions, self.inv_freq_local.to(positions.device))
        else:
            table = self.rope_table(int(positions.max()), local=True)
            cos, sin = table[0].index_select(0, positions), table[1].index_select(0, positions)
        return cos[:, None, :], sin[:, None, :]

    def rope_table(self, last: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)`` ``[P, D]`` of positions ``0 .. P - 1``, ``P > last`` (grown by doubling);
        ``local``: of the sliding layers' own base (``inv_freq_local``)."""
        table = self._rope_table_local if local else self._rope_table
        if table is None or table[0].dtype != self.dtype or table[0].shape[0] <= last:
            size = max(ROPE_TABLE_MIN, 2 * (0 if table is None else table[0].shape[0]))
            while size <= last:
                size *= 2
            table = self._rope_rows(torch.arange(size), self.inv_freq_local if local else None)
            if local:
                self._rope_table_local = table
            else:
                self._rope_table = table
        return table

    def _rope_rows(self, positions: torch.Tensor,
                   inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T, D]: sin signed for apply_rope
        return cos.to(self.dtype), sin.to(self.dtype)

    def run_layers(self, h: torch.Tensor, start: int, end: int, batch: AttentionBatch, pool: KVPool,
                   backend: LayerBackend | None = None) -> torch.Tensor:
        """Run decoder layers ``[start, end)`` on ``h [T, H]`` (the input to layer ``start``), writing
        their K/V for the new positions into ``pool``: each layer's reference ``forward``, or, with
        ``backend``, on the kernels the model runner chose (``model/fast_path.py``). The one entry
        for a range of layers (a tensor-parallel leader intercepts it: ``distributed/runtime.py``)."""
        assert 0 <= start <= end <= self.cfg.num_layers, (start, end)
        rope = self.rope(batch.positions)
        local = self.local_rope(batch.positions, rope) if any(
            self.layers[i].sliding for i in range(start, end)) else rope
        if backend is not None:
            return backend.run_layers(self, h, start, end, rope, local, batch, pool)
        for layer in range(start, end):
            h = self.layers[layer](h, layer, local if self.layers[layer].sliding else rope, batch, pool)
        return h

    def move_kv(self, pool: KVPool, layer: int, src: list[int], dst: list[int]) -> None:
        """Copy layer ``layer``'s K/V at slots ``src`` to ``dst`` (a token tree's kept path; see
        ``model.runner.LayerRunner.keep_path``); a tensor-parallel model has its followers do the same."""
        pool.move(layer, src, dst)

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The model's own output head on the last hidden state ``[T, H]`` -> ``[T, V]``."""
        h = self.norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return self.lm_head(h)

    def exit_logits(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """Logits ``[T, V]`` of the exit after ``layer`` decoder layers.

        The last layer always uses the model's own head. An earlier layer uses its trained
        exit head if one is attached, else the shared final norm + output head.
        """
        head = self.exits.get(layer) if layer < self.cfg.num_layers else None
        return head(h) if head is not None else self.final_logits(h)
