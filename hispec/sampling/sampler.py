"""Logits -> next-token distributions, applied identically at every exit.

Speculative sampling is exact only if the draft, intermediate and final distributions are
the *processed* ones (temperature, then top-k, then top-p), so every level goes through
``logits_to_probs`` with the same ``SamplingParams``.

A batch mixes requests: ``logits_to_probs`` and ``choose`` take one ``SamplingParams`` per row
and work on the whole ``[T, V]`` tensor at once (per-row temperature, top-k and top-p as
tensors, as nano-vllm's and vLLM's samplers do; on a CPU one compiled pass per row, or without the
kernels PyTorch ops in cache-sized blocks of rows).

A sampled token is drawn with one uniform number (``pick``: a race over a small support, else the
inverse of the row's distribution function), and the token a sampled sequence takes at position
``i`` of its text is drawn with the number ``position_uniforms(key, i, 1)`` (``key`` from the
request's seed), whichever level or round chooses it: a plain step, a run of steps, an exit's draft,
a verification pass (which keeps a draft when it is the token drawn there). So drafting never
changes a seeded request's tokens: they are plain decoding's, alone or in any batch, and nothing is
drawn per row but that number.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..config import SamplingParams
from ..kernels import fused

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio, SplitMix64's increment


def _mix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014; Java's SplittableRandom): a bijection
    of 64-bit integers, whose values over a counter stepped by ``_GOLDEN64`` pass BigCrush."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def sample_key(seed: int) -> int:
    """The key of a request's positional stream (``position_uniforms``) from its seed (any integer)."""
    return _mix64(seed & _MASK64)


def position_uniforms(key: int, start: int, n: int) -> list[float]:
    """``U[0, 1)`` numbers for the tokens at positions ``start .. start + n - 1`` of a sequence whose
    stream has ``key``: SplitMix64 at counter ``key + position * _GOLDEN64``, its top 53 bits. A
    function of the position alone, so the token a position gets does not depend on the round that
    chose it."""
    return [(_mix64((key + pos * _GOLDEN64) & _MASK64) >> 11) * (1.0 / (1 << 53)) for pos in range(start, start + n)]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum, ``x [..., V]`` -> ``[...]`` (long): the first one on ties,
    the first NaN where a row has one, as ``torch.argmax``. A float32 tensor on the CPU goes
    through numpy's argmax, which follows the same rules (so the same index) and vectorizes:
    PyTorch's CPU argmax over SmolLM2's 49,152 logits took ~55 us against numpy's ~3 us, 0.5% of a
    batch-1 decode step spent picking the greedy token."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and x.shape[-1] > 0:
        return torch.from_numpy(np.asarray(x.numpy().argmax(-1), dtype=np.int64))
    return x.argmax(-1)


def scale(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``(logits - max) / T`` for ``logits [T, V]`` (float32; ``temperature`` a number or ``[T, 1]``):
    the top logit becomes 0, so any temperature, however small, gives finite-or-``-inf`` values
    and a softmax without NaN."""
    logits = logits.float()
    return (logits - logits.max(-1, keepdim=True).values) / temperature


def per_row(values: list, device: torch.device) -> float | torch.Tensor:
    """One number for all rows when they agree, else a ``[T, 1]`` column."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


# On a CPU a chain of whole-tensor ops over many vocabulary-wide rows streams each
# intermediate through memory; blocks of rows that fit in a core's cache go through the chain
# at cache speed (measured on the default model's 49152-token vocabulary: the 80 target rows
# of 16 sampled sequences took about twice as long as whole tensors as in 5-row blocks).
# A GPU takes all rows in one pass.
CPU_BLOCK_BYTES = 1 << 20


def block_rows(logits: torch.Tensor) -> int:
    """How many rows of ``logits [T, V]`` one pass of a vocabulary-wide chain should take."""
    return logits.shape[0] if logits.is_cuda else max(1, CPU_BLOCK_BYTES // (4 * logits.shape[-1]))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """``logits [T, V]`` -> probabilities ``[T, V]`` (float32) after temperature, top-k and top-p;
    ``params``: one for every row, or one per row.

    Greedy (temperature 0, or one too small for float32: see ``SamplingParams.greedy``) gives
    the one-hot distribution of the argmax, so that the speculative acceptance rule reduces to
    exact argmax matching. Every legal parameter gives a proper distribution: the top token
    always survives top-k and top-p, and the temperature divides logits shifted to max 0.
    A row's result does not depend on the other rows.
    """
    rows = [params] * logits.shape[0] if isinstance(params, SamplingParams) else list(params)
    if all(p.greedy for p in rows):
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    step = block_rows(logits)
    if logits.shape[0] <= step or on_kernels(logits):
        return _probs(logits, rows)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], step):
        out[start:start + step] = _probs(logits[start:start + step], rows[start:start + step])
    return out


def on_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` is what hispec's compiled sampling kernels take (float32 on a CPU that has them)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad and fused.available()


def _probs(logits: torch.Tensor, rows: list[SamplingParams]) -> torch.Tensor:
    """``logits_to_probs`` of ``logits [T, V]`` in one pass, row ``r`` with ``rows[r]``: on a CPU the
    compiled kernel (``fused.sampling_probs``, one pass over each row, the same definition up to float
    rounding), elsewhere the PyTorch ops below."""
    greedy = [p.greedy for p in rows]
    if all(greedy):
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    vocab, device, raw = logits.shape[-1], logits.device, logits
    if on_kernels(logits):
        probs = fused.sampling_probs(logits, [1.0 if p.greedy else p.temperature for p in rows],
                                     [p.top_k if 0 < p.top_k < vocab else 0 for p in rows], [p.top_p for p in rows])
        return _one_hot_greedy(probs, raw, greedy)
    logits = scale(logits, per_row([1.0 if p.greedy else p.temperature for p in rows], device))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in rows]  # vocab = off
    if min(top_k) < vocab:
        logits = logits.masked_fill(logits < _kth_largest(logits, top_k), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = [p.top_p for p in rows]
    if min(top_p) < 1.0:
        probs = _top_p(probs, top_p)
    return _one_hot_greedy(probs, raw, greedy)


def _one_hot_greedy(probs: torch.Tensor, logits: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
    """``probs [T, V]`` with each greedy row replaced by the one-hot of its logits' argmax."""
    if any(greedy):
        idx = torch.tensor([r for r, g in enumerate(greedy) if g], device=probs.device)
        probs[idx] = torch.nn.functional.one_hot(argmax(logits[idx]), probs.shape[-1]).float()
    return probs


def _kth_largest(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Each row's ``top_k[r]``-th largest logit ``[T, 1]`` (``-inf`` where ``top_k[r]`` is the vocabulary)."""
    vocab = logits.shape[-1]
    values = torch.topk(logits, max(k for k in top_k if k < vocab), dim=-1).values  # [T, k_max]
    if all(k == top_k[0] for k in top_k):
        return values[..., -1:]
    col = torch.tensor([min(k, values.shape[-1]) - 1 for k in top_k], device=logits.device)[:, None]
    off = torch.tensor([k >= vocab for k in top_k], device=logits.device)[:, None]
    return values.gather(-1, col).masked_fill(off, float("-inf"))


# Top-p sorts only each row's largest tokens, this many at first (8x more while a row's nucleus is longer,
# up to the whole row): the nucleus is their prefix, and a prefix's running sum is the same whatever
# follows it, so the kept tokens and their values are those of a full sort. A full sort of SmolLM2's
# 49,152 probabilities took ~3.5 ms (a third of a sampled decode step on 2 Zen 4 cores), topk(128) ~0.1.
TOP_P_PREFIX = 128


def _top_p(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep the smallest prefix of each sorted row whose mass reaches ``top_p[r]`` (1 = off), renormalised."""
    on = [p < 1.0 for p in top_p]
    # rows without top-p keep every token: an infinite threshold, whatever the rounding of the sum
    threshold = per_row([p if o else float("inf") for p, o in zip(top_p, on)], probs.device)
    rows = torch.tensor(on, device=probs.device)  # [T]
    k = min(TOP_P_PREFIX, probs.shape[-1])
    while True:
        sorted_p, order = probs.topk(k, dim=-1)  # [T, k], largest first
        drop = sorted_p.cumsum(-1) - sorted_p >= threshold  # mass strictly before each token
        if k == probs.shape[-1] or bool(drop[rows, -1].all()):  # every nucleus ends inside the prefix
            break
        k = min(8 * k, probs.shape[-1])
    drop[..., 0] = False  # the top token stays, even when top_p rounds to 0 in float32
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    kept = kept / kept.sum(-1, keepdim=True)
    if all(on):
        return kept
    return torch.where(rows[:, None], kept, probs)


RACE_MAX = 1024  # a row with at most this many tokens of p > 0 is drawn by a race


def pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``probs [T, V]`` (``p >= 0``, need not be normalised) and ``u [T]`` in ``[0, 1)`` -> ``[T]`` (long): a
    sample of each row drawn with its number, never a token with ``p = 0``; 0 for a row of zeros.

    - A row with at most ``RACE_MAX`` tokens of ``p > 0`` (top-k, top-p): the race ``argmin_i E_i / p_i``
      over them (the lower token on ties), ``E_i = -log U_i`` exponential with ``U_i`` in ``(0, 1]`` from
      ``u``'s bits and ``i`` (``_race_uniforms``): token ``i`` wins with probability ``p_i / sum p``, and
      two rows drawn with one ``u`` (an exit's draft and its verifier's) give the same token as often as
      a coupling of their distributions nearly can (``1 - TV``; random close rows: 0.86 at ``1 - TV``
      0.87, where inverting both in vocabulary order gave 0.71).
    - Otherwise the inverse of its distribution function: the first token whose cumulative probability
      exceeds ``u`` times the row's mass (where rounding reaches the end, the last token with ``p > 0``).

    On a CPU the compiled kernel (``fused.sample_pick``), elsewhere the same definition in PyTorch and
    NumPy (the same tokens up to the rounding of a logarithm)."""
    if on_kernels(probs) and u.device.type == "cpu":
        return fused.sample_pick(probs, u)
    support = probs > 0  # [T, V]
    race = support.sum(-1) <= RACE_MAX  # [T]
    cum = probs.double().cumsum(-1)  # [T, V]
    total = cum[:, -1:]  # [T, 1]
    token = torch.searchsorted(cum, u[:, None] * total, right=True).squeeze(1)  # [T]; V past the end
    last = (cum < total).sum(-1)  # [T]: where the cumulative mass reaches the total, the last token it can take
    token = torch.minimum(token, last)
    for r in race.nonzero().flatten().tolist():
        ids = support[r].nonzero().flatten()  # [n]
        if ids.numel():
            e = -np.log(_race_uniforms(float(u[r]), ids.cpu().numpy()))  # [n]
            token[r] = ids[int(np.argmin(e / probs[r, ids].double().cpu().numpy()))]
        else:
            token[r] = 0
    return token


def _race_uniforms(u: float, tokens: np.ndarray) -> np.ndarray:
    """``U_i`` in ``(0, 1]`` for tokens ``i`` of a race drawn with ``u``: SplitMix64 at counter ``bits(u) +
    (i + 1) * _GOLDEN64``, its top 53 bits, plus one."""
    key = np.array([u], dtype=np.float64).view(np.uint64)[0]
    with np.errstate(over="ignore"):
        z = key + (tokens.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0 ** -53


def choose(logits: torch.Tensor, params: Sequence[SamplingParams],
           u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of ``logits [T, V]`` (row ``r`` with ``params[r]`` and the uniform number
    ``u[r]``, ``u [T]`` float64: its position's, ``position_uniforms``): the argmax for greedy rows,
    ``pick`` from ``logits_to_probs`` for the others, in one pass. Returns the tokens ``[T]`` and the
    distributions of the sampled rows ``[S, V]`` (in row order; None when every row is greedy)."""
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    if not sampled:
        return argmax(logits), None
    every = len(sampled) == logits.shape[0]
    probs = logits_to_probs(logits if every else logits[sampled], [params[r] for r in sampled])  # [S, V]
    picks = pick(probs, u if every else u[sampled])
    if every:
        return picks, probs
    tokens = argmax(logits)
    tokens[sampled] = picks
    return tokens, probs


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each row of ``probs [T, V]`` -> ``[T]``."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)
