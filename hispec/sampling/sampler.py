"""Logits -> next-token distributions, applied identically at every exit.

Speculative sampling is exact only if the draft, intermediate and final distributions are
the *processed* ones (temperature, then top-k, then top-p), so every level goes through
``logits_to_probs`` with the same ``SamplingParams``.

A batch mixes requests: ``logits_to_probs`` and ``choose`` take one ``SamplingParams`` per row
and work on the whole ``[T, V]`` tensor at once (per-row temperature, top-k and top-p as
tensors, as nano-vllm's and vLLM's samplers do; on a CPU one compiled pass per row, or without the
kernels PyTorch ops in cache-sized blocks of rows). Each request keeps its own random stream: the
only per-row work is drawing its random number from its own generator.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..config import SamplingParams
from ..kernels import fused

Generators = torch.Generator | None | Sequence[torch.Generator | None]  # one for every row, or one per row


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


def uniforms(rows: int, generators: Generators, device: torch.device) -> torch.Tensor:
    """``U[0, 1)`` draws ``[rows]`` (float64), row ``r`` from ``generators[r]`` (or all rows from one
    generator): one number per sampled token, so a request's stream is the same in any batch."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(rows, dtype=torch.float64, generator=generators, device=device)
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=device) for g in generators])


def pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``probs [T, V]`` (``p >= 0``, need not be normalised) and ``u [T]`` in ``[0, 1)`` -> ``[T]`` (long):
    the first token whose cumulative probability exceeds ``u`` times the row's mass (the inverse of
    its distribution function: token ``i`` has probability ``p_i / sum p`` for a uniform ``u``), never a
    token with ``p = 0`` (where rounding reaches the end, the last token with ``p > 0``); 0 for a row of
    zeros. On a CPU the compiled kernel (``fused.sample_pick``), elsewhere PyTorch (no host sync)."""
    if on_kernels(probs) and u.device.type == "cpu":
        return fused.sample_pick(probs, u)
    cum = probs.double().cumsum(-1)  # [T, V]
    total = cum[:, -1:]  # [T, 1]
    token = torch.searchsorted(cum, u[:, None] * total, right=True).squeeze(1)  # [T]; V past the end
    last = (cum < total).sum(-1)  # [T]: where the cumulative mass reaches the total, the last token it can take
    return torch.minimum(token, last)


def sample(probs: torch.Tensor, generators: Generators) -> torch.Tensor:
    """One token per row of ``probs [T, V]`` -> ``[T]`` (long), row ``r`` drawn with ``generators[r]``
    (or every row with one generator): ``pick`` with one uniform number per row.

    One draw whatever the vocabulary or how many tokens top-k / top-p leave: the exponential race
    that this replaced drew one number per token a row can take (49,152 for SmolLM2 without top-p).
    A seed's stream differs from releases before it."""
    return pick(probs, uniforms(probs.shape[0], generators, probs.device))


def sample_residual(target: torch.Tensor, draft: torch.Tensor | None, rejected: torch.Tensor,
                    generators: Generators) -> torch.Tensor:
    """A recovered or bonus token per row of ``target [T, V]`` (the verifier's distribution) -> ``[T]``:
    where ``rejected [T]``, a sample of the residual ``norm(max(0, p - q))`` with ``q`` that row of
    ``draft [T, V]`` (the distribution the rejected draft came from; ``p`` itself where the residual is
    all zeros, i.e. ``p == q`` up to rounding), elsewhere of ``p``; one uniform number per row, as
    ``sample``. On a CPU the compiled kernel takes the residual and the draw in one pass per row
    (``fused.sample_residual``), without the vocabulary-wide temporaries."""
    u = uniforms(target.shape[0], generators, target.device)
    if on_kernels(target) and (draft is None or on_kernels(draft)):
        return fused.sample_residual(target, draft, rejected, u)
    if draft is not None:
        target = torch.where(rejected[:, None], residual(target, draft), target)
    return pick(target, u)


def residual(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` of rows ``[..., V]``, the distribution of a recovered token (``p``
    itself where ``p <= q`` everywhere, which happens only when ``p == q`` up to rounding)."""
    r = (target - draft).clamp_min_(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r.div_(mass), target)


def choose(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of ``logits [T, V]`` (row ``r`` with ``params[r]`` and ``generators[r]``):
    the argmax for greedy rows, a sample of ``logits_to_probs`` for the others, in one pass.
    Returns the tokens ``[T]`` and the distributions of the sampled rows ``[S, V]`` (in row
    order; None when every row is greedy)."""
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    if not sampled:
        return argmax(logits), None
    every = len(sampled) == logits.shape[0]
    probs = logits_to_probs(logits if every else logits[sampled], [params[r] for r in sampled])  # [S, V]
    picks = sample(probs, [generators[r] for r in sampled])
    if every:
        return picks, probs
    tokens = argmax(logits)
    tokens[sampled] = picks
    return tokens, probs


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Choose one token per row of ``logits [T, V]`` -> ``[T]``: argmax when greedy, else a sample."""
    if params.greedy:
        return argmax(logits)
    return sample(logits_to_probs(logits, params), generator)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each row of ``probs [T, V]`` -> ``[T]``."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)
