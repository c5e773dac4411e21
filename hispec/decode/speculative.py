"""Self-speculative decoding on one set of weights: single-exit (``selfspec``) and
hierarchical (``hispec``), for a ragged batch of sequences (one request = a batch of one).

Positions in a round (``base`` is the position of the pending committed token):

    draft     layers [0, L_d)  : u, d_1 .. d_k        positions q .. q + k   (q = base + m)
    verify    layers [L_d, L_i): the same k + 1 positions, from the cached draft-exit states
    window    accepted d_1..d_a plus one recovered/bonus token, tentatively (hispec only)
    full      layers [L_i, L_f): base .. base + m, from the cached intermediate states

Nothing is computed twice: each phase starts from the hidden states where the previous
phase stopped, and the K/V of rejected tokens are cut by shortening lengths. Sequences of a
batch draft, verify and accept independently (different lengths), in shared passes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, SpecConfig
from ..sampling.sampler import logits_to_probs, sample
from ..sampling.speculative import greedy_accept, sample_accept
from .base import DecodeContext, Strategy, split_rows
from .policies import DraftPolicy, draft_confidence, make_policy
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


def draft(batch: list[DecodeContext], starts: list[tuple[int, int]], layer: int, limits: list[int],
          prefixes: list[list[int]]) -> list[Proposal]:
    """Draft at exit ``layer`` for each sequence, from its ``(token, position)``: up to
    ``min(policy, limit)`` tokens (at least one), fewer if its policy stops early.
    ``prefixes[b]``: the speculative tokens (not yet committed) up to and including the start token.

    Each sequence's last drafted token is also run through layers ``[0, layer)`` (without the
    exit head), so the verifier can score the position after it (the bonus position).
    """
    model, runner = batch[0].model, batch[0].runner
    k_max = [max(1, min(c.policy.max_drafts(), lim)) for c, lim in zip(batch, limits)]
    x = [c.token_tensor([tok]) for c, (tok, _) in zip(batch, starts)]
    hidden, tokens, probs = [[] for _ in batch], [[] for _ in batch], [[] for _ in batch]
    active, j = list(range(len(batch))), 0
    while active:
        hs = runner.forward_many([(batch[b].seq_id, starts[b][1] + j, x[b]) for b in active], 0, layer)
        for b, h in zip(active, hs):
            hidden[b].append(h)
        rows = [r for r, b in enumerate(active) if j < k_max[b]]
        logits = runner.exit_logits([(batch[active[r]].seq_id, starts[active[r]][1] + j, hs[r]) for r in rows],
                                    layer) if rows else None  # [len(rows), V]
        still = []
        for i, r in enumerate(rows):
            b, c = active[r], batch[active[r]]
            lg = logits[i:i + 1]
            if c.processor is not None:
                lg = c.process(lg, prefixes[b] + torch.cat(tokens[b]).tolist() if tokens[b] else prefixes[b])
            if j > 0 and c.policy.wants_confidence() and c.policy.stop_before(
                    draft_confidence(lg, 0.0 if c.params.greedy else c.params.temperature)):
                continue
            if c.params.greedy:
                x[b] = lg.argmax(-1)
            else:
                q = logits_to_probs(lg, c.params)
                x[b] = sample(q, c.generator)
                probs[b].append(q)
            tokens[b].append(x[b])
            still.append(b)
        active, j = still, j + 1
    for c, h in zip(batch, hidden):
        c.stats.draft_forward_tokens += len(h)
    return [Proposal(torch.cat(t), torch.cat(p) if p else None, torch.cat(h))
            for t, p, h in zip(tokens, probs, hidden)]


def verify(batch: list[DecodeContext], props: list[Proposal], positions: list[int], from_layer: int,
           to_layer: int, level: str, prefixes: list[list[int]]) -> list[Verdict]:
    """Run layers ``[from_layer, to_layer)`` over each proposal's positions and accept/reject it
    (``prefixes`` as in ``draft``). At the last layer the rows that chose the committed tokens
    become ``ctx.target_logits``.

    Afterwards each sequence's cache keeps ``pos .. pos + num_accepted`` (the start token and
    the accepted drafts) in every layer below ``to_layer``; its next token is pending.
    """
    model, runner = batch[0].model, batch[0].runner
    hs = runner.forward_many([(c.seq_id, pos, p.hidden) for c, p, pos in zip(batch, props, positions)],
                             from_layer, to_layer)  # B x [k_b + 1, H]
    logits = split_rows(runner.exit_logits([(c.seq_id, pos, h) for c, pos, h in zip(batch, positions, hs)], to_layer),
                        [h.shape[0] for h in hs])
    verdicts = []
    for c, p, pos, h, lg, pre in zip(batch, props, positions, hs, logits, prefixes):
        spec = pre + p.tokens.tolist() if c.processor is not None else ()
        probs, (num, token) = accept(c, p.tokens, p.probs, lg, spec)
        if to_layer == model.num_layers:
            c.target_logits = lg[:num + 1]
        c.runner.truncate(c.seq_id, pos + num + 1)
        c.stats.level(level).record(p.tokens.shape[0], num)
        verdicts.append(Verdict(num, token, h, probs))
    return verdicts


def accept(ctx: DecodeContext, proposed: torch.Tensor, proposed_probs: torch.Tensor | None,
           target_logits: torch.Tensor, spec: list[int] | tuple = ()) -> tuple[torch.Tensor | None, tuple[int, int]]:
    """Accept/reject ``proposed [k]`` against ``target_logits [k + 1, V]`` (last row: bonus),
    after the request's logits processing (``spec``: the speculative tokens, ``proposed`` last).
    Returns the target probabilities (None when greedy) and (number accepted, next token)."""
    target_logits = ctx.process(target_logits, spec)
    if ctx.params.greedy:
        return None, greedy_accept(proposed, target_logits.argmax(-1))
    probs = logits_to_probs(target_logits, ctx.params)
    return probs, sample_accept(proposed, proposed_probs, probs, ctx.generator)


def _check_layers(spec: SpecConfig, num_layers: int, hierarchical: bool) -> None:
    dataclasses.replace(spec, num_layers=num_layers)  # validates the layers against this model
    if hierarchical and spec.verify_layer >= num_layers:
        raise ConfigError(f"hispec needs a verify layer below the last layer ({num_layers}), got "
                          f"{spec.verify_layer}; use the selfspec strategy for a single exit")


def _ensure_policies(batch: list[DecodeContext], spec: SpecConfig) -> None:
    for c in batch:
        if c.policy is None:
            c.policy = make_policy(spec)


class SelfSpec(Strategy):
    """Single-exit self-speculation (LayerSkip-style): draft at L_d, verify with the full model."""

    name = "selfspec"

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.lookahead = spec.lookahead

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        model, d = batch[0].model, self.spec.draft_layer
        _check_layers(self.spec, model.num_layers, hierarchical=False)
        _ensure_policies(batch, self.spec)
        stats = [c.stats for c in batch]
        positions = [len(c.tokens) - 1 for c in batch]
        with phase_timer(stats, "draft", model.device):
            props = draft(batch, [(c.tokens[-1], p) for c, p in zip(batch, positions)], d,
                          [c.remaining for c in batch], [[] for _ in batch])
        with phase_timer(stats, "full_verify", model.device):
            verdicts = verify(batch, props, positions, d, model.num_layers, "draft->final", [[] for _ in batch])
        commits = []
        for c, p, v in zip(batch, props, verdicts):
            c.policy.update(p.tokens.shape[0], v.num_accepted)
            c.stats.full_passes += 1
            commits.append(p.tokens[:v.num_accepted].tolist() + [v.next_token])
        return commits


@dataclass
class Window:
    """Tokens tentatively accepted at the intermediate exit, waiting for full verification."""

    base: int  # position of the pending committed token
    tokens: list[int] = field(default_factory=list)  # w_1 .. w_m
    hidden: list[torch.Tensor] = field(default_factory=list)  # rows [*, H]: inputs of positions base .. base+m-1
    probs: list[torch.Tensor] = field(default_factory=list)  # rows [*, V]: p_i(. | prefix) of each w_j
    closed: bool = False  # an end-of-sequence token is in the window

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


class HiSpec(Strategy):
    """Hierarchical self-speculation: draft at L_d, filter at L_i, verify a window at L_f."""

    name = "hispec"

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.lookahead = spec.lookahead

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        model = batch[0].model
        _check_layers(self.spec, model.num_layers, hierarchical=True)
        _ensure_policies(batch, self.spec)
        windows = [Window(len(c.tokens) - 1) for c in batch]
        self._fill_windows(batch, windows)
        with phase_timer([c.stats for c in batch], "full_verify", model.device):
            return self._verify_windows(batch, windows)

    def _room(self, ctx: DecodeContext, window: Window) -> int:
        """Drafts the window may still take, keeping every position below the token limit."""
        return 0 if window.closed or len(window) >= self.spec.window else ctx.remaining - len(window) - 1

    def _fill_windows(self, batch: list[DecodeContext], windows: list[Window]) -> None:
        d, i, device = self.spec.draft_layer, self.spec.verify_layer, batch[0].model.device
        while True:
            open_ = [b for b, (c, w) in enumerate(zip(batch, windows)) if self._room(c, w) >= 1]
            if not open_:
                return
            ctxs, wins = [batch[b] for b in open_], [windows[b] for b in open_]
            positions = [w.base + len(w) for w in wins]
            starts = [(w.tokens[-1] if w.tokens else c.tokens[-1], p) for c, w, p in zip(ctxs, wins, positions)]
            with phase_timer([c.stats for c in ctxs], "draft", device):
                props = draft(ctxs, starts, d, [self._room(c, w) for c, w in zip(ctxs, wins)],
                              [list(w.tokens) for w in wins])
            with phase_timer([c.stats for c in ctxs], "intermediate_verify", device):
                verdicts = verify(ctxs, props, positions, d, i, "draft->intermediate", [list(w.tokens) for w in wins])
            for c, w, p, v in zip(ctxs, wins, props, verdicts):
                c.policy.update(p.tokens.shape[0], v.num_accepted)
                self._add_to_window(c, w, p, v)

    @staticmethod
    def _add_to_window(ctx: DecodeContext, window: Window, prop: Proposal, verdict: Verdict) -> None:
        start = len(window)
        window.add(prop, verdict)
        eos = next((j for j, t in enumerate(window.tokens[start:], start) if t in ctx.eos_ids), None)
        if eos is not None:
            window.cut_after(eos + 1)
            ctx.runner.truncate(ctx.seq_id, window.base + eos + 1)
            window.closed = True

    def _verify_windows(self, batch: list[DecodeContext], windows: list[Window]) -> list[list[int]]:
        """Full verification of each ``w_1..w_m``: speculative sampling, draft ``p_i``, target ``p_f``."""
        model, runner, i = batch[0].model, batch[0].runner, self.spec.verify_layer
        last = [c.token_tensor([w.tokens[-1] if w.tokens else c.tokens[-1]]) for c, w in zip(batch, windows)]
        h_last = runner.forward_many([(c.seq_id, w.base + len(w), x) for c, w, x in zip(batch, windows, last)], 0, i)
        h_in = [torch.cat(w.hidden + [h]) for w, h in zip(windows, h_last)]  # [m + 1, H] at base .. base + m
        hs = runner.forward_many([(c.seq_id, w.base, h) for c, w, h in zip(batch, windows, h_in)], i,
                                 model.num_layers)
        logits = split_rows(model.exit_logits(torch.cat(hs) if len(hs) > 1 else hs[0], model.num_layers),
                            [h.shape[0] for h in hs])
        commits = []
        for c, w, lg in zip(batch, windows, logits):
            p_i = torch.cat(w.probs) if w.probs else lg.new_zeros((0, lg.shape[-1]))
            _, (num, token) = accept(c, c.token_tensor(w.tokens), p_i, lg, w.tokens)
            c.target_logits = lg[:num + 1]
            c.runner.truncate(c.seq_id, w.base + num + 1)
            if len(w):
                c.stats.level("intermediate->final").record(len(w), num)
            c.stats.full_passes += 1
            commits.append(w.tokens[:num] + [token])
        return commits
