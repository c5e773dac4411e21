"""Self-speculative decoding on one set of weights: single-exit (``selfspec``) and
hierarchical (``hispec``).

Positions in a round (``base`` is the position of the pending committed token):

    draft     layers [0, L_d)  : u, d_1 .. d_k        positions q .. q + k   (q = base + m)
    verify    layers [L_d, L_i): the same k + 1 positions, from the cached draft-exit states
    window    accepted d_1..d_a plus one recovered/bonus token, tentatively (hispec only)
    full      layers [L_i, L_f): base .. base + m, from the cached intermediate states

Nothing is computed twice: each phase starts from the hidden states where the previous
phase stopped, and the K/V of rejected tokens are cut by shortening lengths.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..config import ConfigError, SpecConfig
from ..sampling.sampler import logits_to_probs, sample
from ..sampling.speculative import greedy_accept, sample_accept
from .base import DecodeContext
from .policies import DraftPolicy, draft_entropy, make_policy
from .stats import phase_timer


@dataclass
class Proposal:
    """Tokens proposed by a cheaper level, to be verified by a deeper one."""

    tokens: torch.Tensor  # [k] proposed token ids
    probs: torch.Tensor | None  # [k, V] distribution each was drawn from (None when greedy)
    hidden: torch.Tensor  # [k + 1, H] states at the proposing exit for positions start .. start + k


@dataclass
class Verdict:
    num_accepted: int
    next_token: int  # recovered or bonus token
    hidden: torch.Tensor  # [k + 1, H] states at the verifying exit
    probs: torch.Tensor | None  # [k + 1, V] verifying distributions (None when greedy)


def draft(ctx: DecodeContext, token: int, pos: int, layer: int, policy: DraftPolicy, limit: int) -> Proposal:
    """Draft up to ``min(policy, limit)`` tokens at exit ``layer``, starting from ``token`` at ``pos``.

    The last drafted token is also run through layers ``[0, layer)`` (without the exit head),
    so the verifier can score the position after it (the bonus position).
    """
    model, params = ctx.model, ctx.params
    k_max = max(1, min(policy.max_drafts(), limit))
    x = ctx.token_tensor([token])
    hidden, tokens, probs = [], [], []
    for j in range(k_max + 1):
        h = ctx.runner.forward(ctx.seq_id, pos + j, x, 0, layer)  # [1, H]
        hidden.append(h)
        if j == k_max:
            break
        logits = model.exit_logits(h, layer)  # [1, V]
        if j > 0 and policy.wants_entropy() and policy.stop_before(draft_entropy(logits, params.temperature)):
            break
        if params.greedy:
            x = logits.argmax(-1)
        else:
            q = logits_to_probs(logits, params)
            x = sample(q, ctx.generator)
            probs.append(q)
        tokens.append(x)
    ctx.stats.draft_forward_tokens += len(hidden)
    return Proposal(torch.cat(tokens), torch.cat(probs) if probs else None, torch.cat(hidden))


def verify(ctx: DecodeContext, prop: Proposal, pos: int, from_layer: int, to_layer: int, level: str) -> Verdict:
    """Run layers ``[from_layer, to_layer)`` over the proposal's positions and accept/reject it.

    Afterwards the cache keeps ``pos .. pos + num_accepted`` (the start token and the accepted
    drafts) in every layer below ``to_layer``; the next token is pending.
    """
    h = ctx.runner.forward(ctx.seq_id, pos, prop.hidden, from_layer, to_layer)  # [k + 1, H]
    logits = ctx.model.exit_logits(h, to_layer)  # [k + 1, V]
    if ctx.params.greedy:
        probs = None
        num, token = greedy_accept(prop.tokens, logits.argmax(-1))
    else:
        probs = logits_to_probs(logits, ctx.params)
        num, token = sample_accept(prop.tokens, prop.probs, probs, ctx.generator)
    ctx.runner.truncate(ctx.seq_id, pos + num + 1)
    ctx.stats.level(level).record(prop.tokens.shape[0], num)
    return Verdict(num, token, h, probs)


def _check_layers(spec: SpecConfig, num_layers: int, hierarchical: bool) -> None:
    dataclasses.replace(spec, num_layers=num_layers)  # validates the layers against this model
    if hierarchical and spec.verify_layer >= num_layers:
        raise ConfigError(f"hispec needs a verify layer below the last layer ({num_layers}), got "
                          f"{spec.verify_layer}; use the selfspec strategy for a single exit")


class SelfSpec:
    """Single-exit self-speculation (LayerSkip-style): draft at L_d, verify with the full model."""

    name = "selfspec"

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec

    def steps(self, ctx: DecodeContext) -> Iterator[list[int]]:
        num_layers, d = ctx.model.num_layers, self.spec.draft_layer
        _check_layers(self.spec, num_layers, hierarchical=False)
        policy, device = make_policy(self.spec), ctx.model.device
        while ctx.remaining > 0:
            pos = len(ctx.tokens) - 1
            with phase_timer(ctx.stats, "draft", device):
                prop = draft(ctx, ctx.tokens[-1], pos, d, policy, ctx.remaining)
            with phase_timer(ctx.stats, "full_verify", device):
                verdict = verify(ctx, prop, pos, d, num_layers, "draft->final")
            policy.update(prop.tokens.shape[0], verdict.num_accepted)
            ctx.stats.full_passes += 1
            yield prop.tokens[:verdict.num_accepted].tolist() + [verdict.next_token]


@dataclass
class Window:
    """Tokens tentatively accepted at the intermediate exit, waiting for full verification."""

    tokens: list[int] = field(default_factory=list)  # w_1 .. w_m
    hidden: list[torch.Tensor] = field(default_factory=list)  # rows [*, H]: inputs of positions base .. base+m-1
    probs: list[torch.Tensor] = field(default_factory=list)  # rows [*, V]: p_i(. | prefix) of each w_j

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, prop: Proposal, verdict: Verdict) -> None:
        a = verdict.num_accepted
        self.tokens += prop.tokens[:a].tolist() + [verdict.next_token]
        self.hidden.append(verdict.hidden[:a + 1])
        if verdict.probs is not None:
            self.probs.append(verdict.probs[:a + 1])

    def cut_after(self, length: int) -> None:
        """Keep ``w_1 .. w_length`` (e.g. up to an end-of-sequence token)."""
        self.tokens = self.tokens[:length]
        self.hidden = [torch.cat(self.hidden)[:length]] if self.hidden else []
        self.probs = [torch.cat(self.probs)[:length]] if self.probs else []


class HiSpec:
    """Hierarchical self-speculation: draft at L_d, filter at L_i, verify a window at L_f."""

    name = "hispec"

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec

    def steps(self, ctx: DecodeContext) -> Iterator[list[int]]:
        _check_layers(self.spec, ctx.model.num_layers, hierarchical=True)
        policy = make_policy(self.spec)
        while ctx.remaining > 0:
            window = self._fill_window(ctx, policy)
            with phase_timer(ctx.stats, "full_verify", ctx.model.device):
                committed = self._verify_window(ctx, window)
            yield committed

    def _fill_window(self, ctx: DecodeContext, policy: DraftPolicy) -> Window:
        d, i, device = self.spec.draft_layer, self.spec.verify_layer, ctx.model.device
        base, window = len(ctx.tokens) - 1, Window()
        while len(window) < self.spec.window:
            room = ctx.remaining - len(window) - 1  # keeps every position below the token limit
            if room < 1:
                break
            pos = base + len(window)
            last = window.tokens[-1] if window.tokens else ctx.tokens[-1]
            with phase_timer(ctx.stats, "draft", device):
                prop = draft(ctx, last, pos, d, policy, room)
            with phase_timer(ctx.stats, "intermediate_verify", device):
                verdict = verify(ctx, prop, pos, d, i, "draft->intermediate")
            policy.update(prop.tokens.shape[0], verdict.num_accepted)
            start = len(window)
            window.add(prop, verdict)
            eos = next((j for j, t in enumerate(window.tokens[start:], start) if t in ctx.eos_ids), None)
            if eos is not None:
                window.cut_after(eos + 1)
                ctx.runner.truncate(ctx.seq_id, base + eos + 1)
                break
        return window

    def _verify_window(self, ctx: DecodeContext, window: Window) -> list[int]:
        """Full verification of ``w_1..w_m``: speculative sampling with draft ``p_i``, target ``p_f``."""
        i, num_layers = self.spec.verify_layer, ctx.model.num_layers
        base, m = len(ctx.tokens) - 1, len(window)
        last = window.tokens[-1] if m else ctx.tokens[-1]
        h_last = ctx.runner.forward(ctx.seq_id, base + m, ctx.token_tensor([last]), 0, i)  # [1, H]
        h_in = torch.cat(window.hidden + [h_last])  # [m + 1, H] at positions base .. base + m
        h = ctx.runner.forward(ctx.seq_id, base, h_in, i, num_layers)
        logits = ctx.model.exit_logits(h, num_layers)  # [m + 1, V]
        proposed = ctx.token_tensor(window.tokens)
        if ctx.params.greedy:
            num, token = greedy_accept(proposed, logits.argmax(-1))
        else:
            p_i = torch.cat(window.probs) if m else logits.new_zeros((0, logits.shape[-1]))
            num, token = sample_accept(proposed, p_i, logits_to_probs(logits, ctx.params), ctx.generator)
        ctx.runner.truncate(ctx.seq_id, base + num + 1)
        if m:
            ctx.stats.level("intermediate->final").record(m, num)
        ctx.stats.full_passes += 1
        return window.tokens[:num] + [token]
