"""Logits -> next-token distributions, applied identically at every exit.

Speculative sampling is exact only if the draft, intermediate and final distributions are
the *processed* ones (temperature, then top-k, then top-p), so every level goes through
``logits_to_probs`` with the same ``SamplingParams``.
"""
from __future__ import annotations

import torch

from ..config import SamplingParams


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(logits - max) / T`` for ``logits [T, V]`` (float32): the top logit becomes 0, so any
    temperature, however small, gives finite-or-``-inf`` values and a softmax without NaN."""
    logits = logits.float()
    return (logits - logits.max(-1, keepdim=True).values) / temperature


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [T, V]`` -> probabilities ``[T, V]`` (float32) after temperature, top-k and top-p.

    Greedy (temperature 0, or one too small for float32: see ``SamplingParams.greedy``) gives
    the one-hot distribution of the argmax, so that the speculative acceptance rule reduces to
    exact argmax matching. Every legal parameter gives a proper distribution: the top token
    always survives top-k and top-p, and the temperature divides logits shifted to max 0.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = scale(logits, params.temperature)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [T, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # mass strictly before each token
        drop[..., 0] = False  # the top token stays, even when top_p rounds to 0 in float32
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [T, V]`` -> ``[T]`` (long)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Choose one token per row of ``logits [T, V]`` -> ``[T]``: argmax when greedy, else a sample."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params), generator)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of each row of ``probs [T, V]`` -> ``[T]``."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)
