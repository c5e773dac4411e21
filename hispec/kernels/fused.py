"""The C kernels called one at a time from Python: checked tensors in, tensors out.

Eager PyTorch spends ~10 ms per token of the default model outside its matmuls: ~40 small ops
per layer at a few microseconds each (dispatch, allocation, dtype casts), and attention that
gathers each sequence's context out of the paged pool. The kernels (``csrc/``) do each run of
that work in one call: ``rms_norm`` / ``add_rms_norm`` (residual add + norm + cast to the matmul
input dtype; ``norm_add_rms_norm`` / ``norm_add``: the added output normed first, Gemma 3's
sandwich norms), ``rope_write`` (QK-norm where the family has it, rotate q and k, write K/V to
their slots), ``paged_attention`` (each query over its own context read through the block table,
no gather; a sliding window where the layer has one), ``silu_mul`` / ``gelu_tanh_mul``; and
matmuls whose every output row is computed alone: ``panel_matmul`` (float32 products on weights
packed in panels, which ``matmul.Linear`` takes where it times faster than MKL / oneDNN), and
``q4_matmul`` / ``q8_matmul`` on GGUF blocks as stored (``quant.py``).

The library is compiled on first use for this CPU (``build.py``) and bound from its header
(``binding.py``). Without a compiler (or with ``HISPEC_FUSED=0``) the model runs its eager
PyTorch path, with the same results up to float rounding.

Exactness: each function computes every row with the same code whatever the number of rows in
the call (per query, attention reads exactly its own context), so a token's hidden states do
not depend on how many tokens share a forward pass: one-token decoding, speculative
verification and batches give bit-identical values, which is what keeps every strategy's output
identical to ``ar``'s. A prompt's tokens may take another arithmetic (``paged_attention``'s
``prompt``), the same for every strategy and every chunking of the prompt.
"""
from __future__ import annotations

import functools

import torch

from .binding import available, library

# query-key multiply-adds of a call from which the threads share it (SmolLM2, one token: ~57 keys)
PARALLEL_MIN_WORK = 1 << 15


def _bf(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def _check(t: torch.Tensor, *dtypes: torch.dtype) -> torch.Tensor:
    """``t`` as the kernels read it (contiguous, on the CPU, one of ``dtypes``): a wrong tensor
    raises here instead of being read out of bounds."""
    if t.device.type != "cpu" or t.dtype not in dtypes:
        raise TypeError(f"fused kernel: expected a CPU tensor of {dtypes}, got {t.dtype} on {t.device}")
    return t.contiguous()


F32, BF16 = torch.float32, torch.bfloat16
KV_DTYPES = (F32, BF16)  # what a KV pool may hold for the kernels


def _check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V pools as the kernels read them: ``[Hkv, S, D]``, contiguous, on the CPU, one
    dtype of KV_DTYPES."""
    if k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise TypeError(f"fused kernel: K and V pools [Hkv, S, D], got {tuple(k_pool.shape)} "
                        f"and {tuple(v_pool.shape)}")
    if k_pool.dtype != v_pool.dtype:
        raise TypeError(f"fused kernel: K and V pools of one dtype, got {k_pool.dtype} and {v_pool.dtype}")
    return _check(k_pool, *KV_DTYPES), _check(v_pool, *KV_DTYPES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``x [T, D]`` float32 -> normalised and scaled ``[T, D]`` in ``out_dtype`` (float32/bfloat16)."""
    x, weight = _check(x, F32), _check(weight, F32)
    out = torch.empty(x.shape, dtype=out_dtype)
    library().hs_rms_norm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr(),
                          int(out_dtype == BF16))
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``h + delta`` (float32 ``[T, D]``; ``delta`` float32 or bfloat16) and its norm in ``out_dtype``."""
    h, delta, weight = _check(h, F32), _check(delta, F32, BF16), _check(weight, F32)
    h_out = torch.empty_like(h)
    out = torch.empty(h.shape, dtype=out_dtype)
    library().hs_add_rms_norm(h.data_ptr(), delta.data_ptr(), _bf(delta), weight.data_ptr(), h.shape[0], h.shape[1],
                              eps, h_out.data_ptr(), out.data_ptr(), int(out_dtype == BF16))
    return h_out, out


def norm_add_rms_norm(h: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor, weight: torch.Tensor,
                      eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` with ``delta`` normed first: ``h + rms_norm(delta) * delta_weight`` (``delta``
    widened to float32 first; Gemma 3's norm of the attention's output) and its norm in ``out_dtype``."""
    h, delta = _check(h, F32), _check(delta, F32, BF16)
    delta_weight, weight = _check(delta_weight, F32), _check(weight, F32)
    h_out = torch.empty_like(h)
    out = torch.empty(h.shape, dtype=out_dtype)
    library().hs_norm_add_rms_norm(h.data_ptr(), delta.data_ptr(), _bf(delta), delta_weight.data_ptr(),
                                   weight.data_ptr(), h.shape[0], h.shape[1], eps, h_out.data_ptr(), out.data_ptr(),
                                   int(out_dtype == BF16))
    return h_out, out


def norm_add(h: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h + rms_norm(delta) * delta_weight`` float32 ``[T, D]`` (Gemma 3's norm of the MLP's output
    before its residual add), as a new tensor."""
    h_out = _check(h, F32).clone()
    delta, delta_weight = _check(delta, F32, BF16), _check(delta_weight, F32)
    library().hs_norm_add_into(h_out.data_ptr(), delta.data_ptr(), _bf(delta), delta_weight.data_ptr(), h.shape[0],
                               h.shape[1], eps)
    return h_out


def _gated(kernel: str, gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up [T, 2I] = [gate | up]`` -> ``[T, I]`` by the C kernel ``kernel``."""
    gate_up = _check(gate_up, F32, BF16)
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=out_dtype)
    getattr(library(), kernel)(gate_up.data_ptr(), _bf(gate_up), t, i, out.data_ptr(), int(out_dtype == BF16))
    return out


def gelu_tanh_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (GeGLU), see :func:`_gated`."""
    return _gated("hs_gelu_tanh_mul", gate_up, out_dtype)


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU), see :func:`_gated`."""
    return _gated("hs_silu_mul", gate_up, out_dtype)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor, slots: torch.Tensor, num_heads: int,
               num_kv_heads: int, k_pool: torch.Tensor, v_pool: torch.Tensor, queries: bool = True,
               q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor | None:
    """Rotate q and k of ``qkv [T, (Hq + 2 Hkv) D]`` (``cos, ssin [T, D]`` float32), write K/V at
    ``slots [T]`` of the pools ``[Hkv, S, D]`` (float32, or bfloat16: rounded as ``.to()`` rounds);
    return the rotated queries ``[T, Hq, D]`` float32 (None when ``queries`` is False). ``q_norm``,
    ``k_norm`` ``[D]`` float32 (QK-norm: Qwen3, Gemma 3): each query / key head RMSNormed (``eps``)
    before it is rotated."""
    qkv, cos, ssin, slots = _check(qkv, F32, BF16), _check(cos, F32), _check(ssin, F32), _check(slots, torch.int64)
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise TypeError("fused kernel: the pools must be contiguous (they are written in place)")
    _check_pools(k_pool, v_pool)
    t, s, d = qkv.shape[0], k_pool.shape[1], k_pool.shape[-1]
    q = torch.empty((t, num_heads, d), dtype=F32) if queries else None
    if q_norm is None and k_norm is None:
        library().hs_rope_write(qkv.data_ptr(), _bf(qkv), cos.data_ptr(), ssin.data_ptr(), slots.data_ptr(), t,
                                num_heads, num_kv_heads, d, s, k_pool.data_ptr(), v_pool.data_ptr(), _bf(k_pool),
                                q.data_ptr() if queries else None)
        return q
    norms = [None if w is None else _check(w, F32) for w in (q_norm, k_norm)]
    if any(w is not None and w.numel() != d for w in norms):
        raise TypeError(f"fused kernel: QK-norm weights of [{d}]")
    library().hs_rope_write_qk(qkv.data_ptr(), _bf(qkv), cos.data_ptr(), ssin.data_ptr(), slots.data_ptr(), t,
                               num_heads, num_kv_heads, d, s, k_pool.data_ptr(), v_pool.data_ptr(), _bf(k_pool),
                               q.data_ptr() if queries else None, *(None if w is None else w.data_ptr() for w in norms),
                               eps)
    return q


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: "KernelBatch",
                    out_dtype: torch.dtype, window: int = 0, scale: float | None = None,
                    prompt: bool = False) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` (float32) over the pools ``[Hkv, S, D]`` (float32 or bfloat16):
    query ``t`` attends to the first ``meta.lengths[t]`` positions of its sequence, read through
    that sequence's block table (a tree node: the prefix, then its path, ``KernelBatch``). Returns
    ``[T, Hq * D]`` in ``out_dtype``. Over a bfloat16 pool the products are bfloat16 pairs where
    ``bf16_attention_products(d)`` (queries as two bfloat16 each, softmax weights rounded:
    ``csrc/attention.c``), else float32 products on the values it holds. ``window`` > 0: a sliding
    window, query ``t`` sees only the keys at positions ``> p - window`` (``p = lengths[t] - 1``, its
    own); ``scale``: the logits' (None: ``D ** -0.5``). ``prompt``: the queries are a prompt's (a
    prefill): where ``prompt_attention_on_tiles()``, over a bfloat16 pool with D 64 or 128 and no
    window, they take the tile unit's arithmetic, the same for every prompt token whatever its chunk
    (other bits than a decoded token's); the other queries there (decode steps, verification
    windows, tree nodes) take their products on the tiles too, one arithmetic for all of them."""
    q, (k_pool, v_pool) = _check(q, F32), _check_pools(k_pool, v_pool)
    t, hq, d = q.shape
    out = torch.empty((t, hq * d), dtype=out_dtype)
    args = (q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), _bf(k_pool), meta.tables.data_ptr(),
            meta.tables.shape[1], meta.seq.data_ptr(), meta.lengths.data_ptr(),
            None if meta.tail is None else meta.tail_start.data_ptr(), None if meta.tail is None else meta.tail.data_ptr(),
            0 if meta.tail is None else meta.tail.shape[1], t, hq, k_pool.shape[0], k_pool.shape[1], d, meta.block_size,
            d ** -0.5 if scale is None else scale, out.data_ptr(), int(out_dtype == BF16),
            int(meta.keys * hq * d >= PARALLEL_MIN_WORK))
    if window or prompt:
        library().hs_paged_attention_window(*args, window, int(prompt))
    else:
        library().hs_paged_attention(*args)
    return out


def q8_matmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` (float32 or bfloat16) times the transpose of the GGUF Q8_0 weight
    ``W = d * q`` (``q [N, K]`` int8, ``d [N, K / 32]`` float32, or ``[N, K / 16]``: a scale per 16
    values, GGUF Q6_K's) -> ``[T, N]`` float32, each output computed alone (the same for any T); the
    threads share W's rows."""
    x, q, d = _check(x, F32, BF16), _check(q, torch.int8), _check(d, F32)
    t, k = x.shape
    out = torch.empty((t, q.shape[0]), dtype=F32)
    group = k // d.shape[1]
    if group not in (16, 32) or d.shape[0] != q.shape[0] or q.shape[1] != k:
        raise ValueError(f"q8_matmul: d {tuple(d.shape)} must be [N, K / 32] or [N, K / 16] for q {tuple(q.shape)}")
    library().hs_q8_group_matmul(q.data_ptr(), d.data_ptr(), group, x.data_ptr(), _bf(x), t, q.shape[0], k,
                                 out.data_ptr(), 1)
    return out


def q4_matmul(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, panels: bool = False) -> torch.Tensor:
    """``x [T, K]`` float32 times the transpose of a GGUF 4-bit weight ``W = d * q + m`` given as
    the file's nibbles ``qs [N, K / 2]`` uint8 (each block's 16 bytes as stored) and
    ``dm [2, N, K / 32]`` float32 (``d``, ``m``) -> ``[T, N]`` float32; each output computed alone
    (the same for any T); the threads share W's rows. ``panels``: on the panel kernel (W rebuilt
    in float32 panels, float32 products: prompt chunks), else 16-bit activations (decode steps)."""
    x, qs, dm = _check(x, F32), _check(qs, torch.uint8), _check(dm, F32)
    t, k = x.shape
    n = qs.shape[0]
    out = torch.empty((t, n), dtype=F32)
    fn = library().hs_q4_panel_matmul if panels else library().hs_q4_matmul
    fn(qs.data_ptr(), dm[0].data_ptr(), dm[1].data_ptr(), x.data_ptr(), t, n, k, out.data_ptr(), 1)
    return out


@functools.lru_cache(maxsize=1)
def prompt_attention_on_tiles() -> bool:
    """Whether attention over a bfloat16 pool (head size 64 or 128, no sliding window) runs on AMX
    tiles here: a prompt's wholly, a step's queries' products (``csrc/attention.c``,
    ``attend_tile_amx``, ``attend_tile_steps``); a build with AMX-BF16 (Sapphire Rapids and later)
    where Linux lets the process use the tiles."""
    return bool(library().hs_attention_amx())


def bf16_attention_products(head_dim: int) -> bool:
    """Whether attention over a bfloat16 pool multiplies in bfloat16 pairs on this build: with
    AVX512_BF16 (Zen 4, Sapphire Rapids), for head sizes 64 and 128; elsewhere it widens the cached
    values and takes float32 products (emulating the pairs was 3-4x slower)."""
    return bool(library().hs_attention_bf16_products()) and head_dim in (64, 128)


def panel_width() -> int:
    """Output columns per panel of ``panel_pack``'s layout on this build: 48 with AVX-512, 16 with
    AVX2 (a tile of 6 rows x 16 columns fills its 16 registers)."""
    return library().hs_panel_width()


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` float32 in ``panel_matmul``'s layout: ``[ceil(N / P), K, P]`` for the panel
    width ``P = panel_width()``, zero-padded."""
    w = _check(weight, F32)
    n, k = w.shape
    p = panel_width()
    out = torch.empty((-(-n // p), k, p), dtype=F32)
    library().hs_panel_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


def panel_matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``x [T, K] @ W.T`` -> ``[T, N]`` float32 for ``packed = panel_pack(W)``: each output one
    fused multiply-add chain over K in order, so a row's values do not depend on T (the threads
    share the panels)."""
    x = _check(x, F32)
    t, k = x.shape
    out = torch.empty((t, n), dtype=F32)
    library().hs_panel_matmul(x.data_ptr(), t, k, packed.data_ptr(), n, out.data_ptr(), 1)
    return out


class KernelBatch:
    """A forward call's attention metadata in the kernels' form (built once, read by every layer):
    ``tables [B, max_blocks]`` int32 block tables, and per query token ``seq [T]`` (its row in
    ``tables``) and ``lengths [T]`` (how many positions it sees, itself included). Token trees:
    ``tail_start [T]`` int32 (-1 for a chain's token) and ``tail [T, W]`` int64, the slots of a
    node's keys from its tree's root on (its path); both None without a tree. ``chunks``: the
    call's ``cache.kv_cache.SeqChunk``s, one per table."""

    def __init__(self, tables: list[list[int]], chunks: list, block_size: int) -> None:
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        seq, lengths, tails = [], [], []
        for i, (table, c) in enumerate(zip(tables, chunks)):
            seq += [i] * c.num_tokens
            if c.tree is None:
                lengths += range(c.start + 1, c.start + c.num_tokens + 1)
                tails += [None] * c.num_tokens
                continue
            root = c.tree.root
            for node in c.nodes():
                path = [root + a for a in c.tree.path(node)]  # the positions it sees after the prefix
                lengths.append(root + len(path))
                tails.append((root, [table[p // block_size] * block_size + p % block_size for p in path]))
        self.seq = torch.tensor(seq, dtype=torch.int32)
        self.lengths = torch.tensor(lengths, dtype=torch.int32)
        self.tail_start = self.tail = None
        if any(tails):
            w = max(len(t[1]) for t in tails if t)
            self.tail_start = torch.tensor([t[0] if t else -1 for t in tails], dtype=torch.int32)
            self.tail = torch.tensor([t[1] + [0] * (w - len(t[1])) if t else [0] * w for t in tails],
                                     dtype=torch.int64)
        self.keys = sum(lengths)  # query-key pairs of the call
        self.block_size = block_size


def sampling_probs(logits: torch.Tensor, temperature: list[float], top_k: list[int],
                   top_p: list[float]) -> torch.Tensor:
    """``logits [T, V]`` float32 -> each row's sampling distribution ``[T, V]`` after its temperature
    (> 0), top-k (0 or >= V: off) and top-p (>= 1: off): ``sampler.logits_to_probs`` on a CPU."""
    logits = _check(logits, F32)
    t, v = logits.shape
    temperature_ = torch.tensor(temperature, dtype=F32)
    top_k_ = torch.tensor(top_k, dtype=torch.int64)
    top_p_ = torch.tensor(top_p, dtype=F32)
    if not (temperature_.shape == top_k_.shape == top_p_.shape == (t,)):
        raise ValueError(f"sampling_probs: one temperature, top-k and top-p per row of {t}")
    probs = torch.empty_like(logits)
    library().hs_sampling_probs(logits.data_ptr(), probs.data_ptr(), t, v, temperature_.data_ptr(),
                                top_k_.data_ptr(), top_p_.data_ptr())
    return probs


def sample_pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [T, V]`` (float32, unnormalised) -> ``[T]`` (long), drawn with ``u [T]``
    (float64 in [0, 1)) as ``sampler.pick`` defines it: a race where at most 1,024 tokens have p > 0,
    else the first token whose cumulative probability exceeds ``u`` times the row's mass."""
    probs, u = _check(probs, F32), _check(u, torch.float64)
    if u.shape != probs.shape[:1]:
        raise ValueError(f"sample_pick: one u per row of {probs.shape[0]}, got {tuple(u.shape)}")
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    library().hs_sample_pick(probs.data_ptr(), probs.shape[0], probs.shape[1], u.data_ptr(), out.data_ptr())
    return out
