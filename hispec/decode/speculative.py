"""Self-speculative decoding on one set of weights: single-exit (``selfspec``) and
hierarchical (``hispec``), for a ragged batch of sequences (one request = a batch of one).

Positions in a round (``base`` is the position of the pending committed token; phases and
names as in docs/design.md):

    draft                layers [0, L_d)  : u, x_1 .. x_k    positions q .. q + k   (q = base + m)
    intermediate_verify  layers [L_d, L_i): the same k + 1 positions, from the cached draft-exit states
    window               accepted x_1..x_a plus one recovered/bonus token, tentatively (hispec only;
                         at most N_i = ``spec.window`` tokens)
    full_verify          layers [L_i, L_f): base .. base + m, from the cached intermediate-exit states

(selfspec has no intermediate exit: its drafts go straight to ``full_verify``, layers [L_d, L_f).)

The drafts come from speculation's proposers (an exit's: ``spec/proposers/exit.py``; free ones:
``spec/proposers/lookup.py``); this module verifies them and commits what the accept rule keeps.

Free drafts (``lookup``, and ``hispec`` where prompt lookup finds a match; ``spec/proposers/lookup.py``)
cost no model time: the pending token and its drafts x_1 .. x_k go through every layer in one
pass (positions base .. base + k), and the same acceptance rule commits the accepted prefix
and the bonus or recovered token.

Acceptance, greedy or sampled: every level chooses the token of each of its rows as a plain step
would (the argmax, or a sample drawn with that position's uniform number,
``DecodeContext.uniforms``), and a proposal is kept up to its first token that differs from the
token chosen before it, then that chosen token. An exit's drafts are drawn the same way, with the
same numbers (so where its distribution q is close to the verifier's p, both draw the same token).
The full model's token at each position is therefore a sample of p drawn with a number that
nothing else decided: the output is distributed as plain sampling and, for a seed, it is plain
decoding's, whatever drafted (a fixed draft x is kept with probability p(x), as speculative sampling
keeps it; an exit's with probability sum_x P(both draw x), at most 1 - TV(p, q)).

Nothing is computed twice: each phase starts from the hidden states where the previous
phase stopped, and the K/V of rejected tokens are cut by shortening lengths. Sequences of a
batch draft, verify and accept independently (different lengths), in shared passes.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..config import ConfigError, SpecConfig
from ..sampling.sampler import choose
from ..sampling.speculative import accept_chosen, accept_chosen_batch
from ..settings import StrategyName
from ..spec.cost import RowCost
from ..spec.proposers.exit import Proposal, draft, ensure_policies, has_runners_up, tree_min_probs
from ..spec.proposers.lookup import free_drafts
from .autoregressive import Autoregressive, row_sampling
from .base import DecodeContext, Strategy, process_rows, split_rows
from .stats import phase_timer
from .tree import DraftTree, accept_tree, exit_tree


@dataclass
class Verdict:
    tokens: list[int]  # the accepted proposals, then the recovered or bonus token
    hidden: torch.Tensor  # [k + 1, H] states at the verifying exit

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


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
    logits = runner.exit_logits([(c.seq_id, pos, h) for c, pos, h in zip(batch, positions, hs)], to_layer)
    specs = [pre + p.tokens.tolist() if c.processor is not None else () for c, p, pre in zip(batch, props, prefixes)]
    accepted = accept(batch, [p.tokens for p in props], logits, specs, positions)
    verdicts = []
    for c, p, pos, h, lg, toks in zip(batch, props, positions, hs, split_rows(logits, [h.shape[0] for h in hs]),
                                      accepted):
        num = len(toks) - 1
        if to_layer == model.num_layers:
            c.target_logits = lg[:num + 1]
        c.runner.truncate(c.seq_id, pos + num + 1)
        c.stats.level(level).record(p.tokens.shape[0], num)
        verdicts.append(Verdict(toks, h))
    return verdicts


def accept(batch: list[DecodeContext], proposed: list[torch.Tensor], target_logits: torch.Tensor,
           specs: list[list[int] | tuple], positions: list[int]) -> list[list[int]]:
    """Accept each sequence's ``proposed[b] [k_b]`` against its rows of ``target_logits``
    ``[sum (k_b + 1), V]`` (``k_b + 1`` consecutive rows per sequence, the bonus row last, after the
    token at ``positions[b]``), after the request's logits processing (``specs[b]``: its speculative
    tokens, ``proposed[b]`` last): each row's token chosen as a plain step would (the argmax, or a
    sample with its position's uniform number), the proposals kept up to the first that differs from
    it (``accept_chosen``). Returns, per sequence, the accepted proposals followed by the next chosen
    token (host ints: one host sync for the batch)."""
    sizes = [t.shape[0] + 1 for t in proposed]
    target_logits = process_rows(batch, target_logits, sizes, specs)
    rows = [c for c, k in zip(batch, sizes) for _ in range(k)]  # each row's sequence
    u = torch.tensor([x for c, pos, k in zip(batch, positions, sizes) for x in c.uniforms(pos + 1, k)],
                     dtype=torch.float64, device=target_logits.device)  # [sum (k_b + 1)]
    chosen = choose(target_logits, [c.params for c in rows], u)[0]  # [sum (k_b + 1)]
    if len(batch) == 1:
        num, token = accept_chosen(proposed[0], chosen)
        return [proposed[0][:num].tolist() + [token]]
    return _committed(*accept_chosen_batch(proposed, chosen), proposed)


def _committed(num: torch.Tensor, token: torch.Tensor, proposed: list[torch.Tensor]) -> list[list[int]]:
    """Each sequence's accepted proposals and next token as host ints, in one host sync."""
    b = num.shape[0]
    flat = torch.cat([num, token] + list(proposed)).tolist()
    out, start = [], 2 * b
    for n, t, drafts in zip(flat[:b], flat[b:2 * b], proposed):
        out.append(flat[start:start + n] + [t])
        start += drafts.shape[0]
    return out


def verify_tree(batch: list[DecodeContext], trees: list[DraftTree], roots: list[int], inputs: list[torch.Tensor],
                from_layer: int, to_layer: int, level: str, prefixes: list[list[int]]) -> list[Verdict]:
    """``verify`` for token trees (``decode/tree.py``): every node of ``trees[b]`` (its flat order
    at positions ``roots[b] ..``; ``inputs[b]``: token ids ``[N]`` from layer 0, else the states
    ``[N, H]`` entering ``from_layer``) through layers ``[from_layer, to_layer)`` in one pass, each
    node attending to the prefix and its own ancestors; the longest accepted path kept
    (``accept_tree``, ``LayerRunner.keep_path``; at the final layer a sampled sequence's tokens drawn
    with their positions' uniform numbers, as plain steps draw them). A verdict's tokens are the path's then the next
    token, its states the path's, and (sampling) its distributions one-hot rows: tree nodes are
    fixed drafts to any later level."""
    model, runner = batch[0].model, batch[0].runner
    layouts = [t.layout(r) for t, r in zip(trees, roots)]
    hs = runner.forward_many([(c.seq_id, r, x) for c, r, x in zip(batch, roots, inputs)], from_layer, to_layer,
                             trees=layouts)  # B x [N_b, H]
    logits = runner.exit_logits([(c.seq_id, r, h) for c, r, h in zip(batch, roots, hs)], to_layer, trees=layouts)
    verdicts = []
    for c, t, r, lay, h, lg, pre in zip(batch, trees, roots, layouts, hs, split_rows(logits, [len(t) for t in trees]),
                                        prefixes):
        path, nxt = accept_tree(c, t, lg, pre, c.uniforms(r + 1, t.depth + 1))
        runner.keep_path(c.seq_id, lay, path)
        toks = [t.tokens[i] for i in path[1:]] + [nxt]
        if to_layer == model.num_layers:
            c.target_logits = lg[path]
        c.stats.level(level).record(len(t) - 1, len(path) - 1, depth=t.depth)  # per position: per depth
        verdicts.append(Verdict(toks, h[path]))
    return verdicts


def tree_round(batch: list[DecodeContext], props: list[Proposal], starts: list[tuple[int, int]], draft_layer: int,
               to_layer: int, level: str, prefixes: list[list[int]]) -> list[Verdict]:
    """Verify each proposal as a token tree, its runners-up beside its drafts (``exit_tree``):
    the runners-up first go through the draft layers ``[0, draft_layer)`` (one pass, the chain's
    K/V already there), then every node through ``[draft_layer, to_layer)`` (``verify_tree``)."""
    runner = batch[0].runner
    roots = [pos for _, pos in starts]
    # at most up to the last position the sequence may hold (the scheduler reserves no slot past it)
    trees = [exit_tree(tok, p.tokens.tolist(), p.runners_up or []).first(c.token_cap + 1 - root)
             for c, (tok, root), p in zip(batch, starts, props)]
    hidden = [p.hidden for p in props]  # [k_b + 1, H]: the chain's nodes
    grow = [b for b, (t, h) in enumerate(zip(trees, hidden)) if len(t) > h.shape[0]]
    if grow:
        hs = runner.forward_many([(batch[b].seq_id, roots[b] + hidden[b].shape[0],
                                   batch[b].token_tensor(trees[b].tokens[hidden[b].shape[0]:])) for b in grow],
                                 0, draft_layer, trees=[trees[b].layout(roots[b]) for b in grow])
        for b, h in zip(grow, hs):
            batch[b].stats.draft_forward_tokens += h.shape[0]
            hidden[b] = torch.cat([hidden[b], h])
    return verify_tree(batch, trees, roots, hidden, draft_layer, to_layer, level, prefixes)


def verify_free(batch: list[DecodeContext], drafts: list[list[int]], level: str | None = None) -> list[list[int]]:
    """Verify drafts that cost no model time: each sequence's pending token and its drafts
    ``drafts[b]`` (``k_b >= 0``) through every layer in one pass (``[sum (k_b + 1), H]``). Each row
    chooses the token its position takes, as a plain step would (the argmax, or a sample with the
    position's uniform number: ``DecodeContext.uniforms``), and a sequence keeps its drafts up to the
    first that differs from the token chosen before it, then that token. For a sampled sequence this
    is speculative sampling with a one-hot draft distribution (a draft ``x`` is kept with probability
    ``p(x)``, else the token follows ``p`` without ``x``), and its tokens are plain decoding's whether
    it drafted or not. A sequence without drafts takes one plain row.
    Statistics: the level ``level``, by default that of the drafts' source (``lookup->final`` or
    ``suffix->final``, ``ctx.lookup.source``), and a round of that source.
    Afterwards each cache holds the committed tokens but the new pending one."""
    model, runner, n = batch[0].model, batch[0].runner, batch[0].model.num_layers
    positions = [len(c.tokens) - 1 for c in batch]
    chosen = _verify_free_op(batch, drafts, positions)
    if chosen is not None:  # best[i]: the token after the pending one and d[:i]
        kept = [num_kept(d, best) for d, best in zip(drafts, chosen)]
        accepted = [d[:k] + [best[k]] for d, best, k in zip(drafts, chosen, kept)]
        rows: list[torch.Tensor | None] = [None] * len(batch)
    else:
        logits = runner.rows_logits([(c.seq_id, pos, c.tokens[-1:] + d) for c, pos, d in zip(batch, positions, drafts)])
        if logits is None:  # the general path: layers, then the head
            hs = runner.forward_many([(c.seq_id, pos, c.token_tensor(c.tokens[-1:] + d))
                                      for c, pos, d in zip(batch, positions, drafts)], 0, n)  # B x [k_b + 1, H]
            logits = model.exit_logits(torch.cat(hs) if len(hs) > 1 else hs[0], n)  # [sum (k_b + 1), V]
        accepted = accept(batch, [c.token_tensor(d) for c, d in zip(batch, drafts)], logits, drafts, positions)
        rows = split_rows(logits, [len(d) + 1 for d in drafts])
    for c, d, pos, toks, lg in zip(batch, drafts, positions, accepted, rows):
        c.target_logits = None if lg is None else lg[:len(toks)]  # (only a request with logprobs reads them)
        _verified_free(c, d, pos, len(toks) - 1, level)
    return accepted


def num_kept(drafts: list[int], chosen: list[int]) -> int:
    """How many of ``drafts`` a round keeps: those before the first that differs from the token chosen
    before it (``chosen [len(drafts) + 1]``)."""
    return next((i for i, t in enumerate(drafts) if t != chosen[i]), len(drafts))


def _verify_free_op(batch: list[DecodeContext], drafts: list[list[int]],
                    positions: list[int]) -> list[list[int]] | None:
    """``verify_free``'s choices for sequences with nothing between their logits and the token (no
    logits processor, no logprobs), in one op call (``greedy_rows``: layers, final norm, head and each
    row's token in C++, the argmax or a sample with the row's number; the same bits as ``accept`` on
    the general path): ``[B][k_b + 1]``. None where it does not apply (nothing written)."""
    if any(c.processor is not None or c.params.logprobs is not None for c in batch):
        return None
    sampling = None
    if any(not c.params.greedy for c in batch):  # one entry per row: its sequence's parameters and number
        sampling = row_sampling([c for c, d in zip(batch, drafts) for _ in range(len(d) + 1)],
                                [[x] for c, pos, d in zip(batch, positions, drafts)
                                 for x in c.uniforms(pos + 1, len(d) + 1)])
    return batch[0].runner.greedy_rows([(c.seq_id, pos, c.tokens[-1:] + d)
                                        for c, pos, d in zip(batch, positions, drafts)], sampling)


def _verified_free(c: DecodeContext, drafts: list[int], pos: int, num: int, level: str | None) -> None:
    """A free-draft round's bookkeeping for one sequence: ``num`` of its ``drafts`` accepted."""
    c.runner.truncate(c.seq_id, pos + num + 1)
    c.stats.full_passes += 1
    if drafts:
        c.stats.level(level or f"{c.lookup.source}->final").record(len(drafts), num)
        c.lookup.length.record(c.lookup.last_n, len(drafts), num)
    c.stats.count_round(c.lookup.source if drafts else "plain")


def lookup_round(spec: SpecConfig, batch: list[DecodeContext], cost: RowCost | None) -> list[list[int]] | None:
    """One free-draft round (``Strategy.free_round``): the sequences with drafts verify them in one
    pass, the others ride along as plain rows (each row takes the token a plain step would); None
    when no sequence has drafts worth verifying. The pass's seconds and rows go into ``cost``."""
    if spec.lookup_max_draft < 1:
        return None
    drafts = free_drafts(batch, spec.lookup_max_draft, spec.lookup_ngram, cost)
    if not any(drafts):
        return None
    trees = _lookup_trees(batch, drafts, spec.lookup_branches)
    t0 = time.perf_counter()
    with phase_timer([c.stats for c in batch], "full_verify", batch[0].model.device):
        commits = verify_free(batch, drafts) if trees is None else verify_free_trees(batch, trees)
    if cost is not None:
        rows = len(batch) + (sum(map(len, drafts)) if trees is None else sum(len(t) - 1 for t in trees))
        cost.record(rows, time.perf_counter() - t0, len(batch))
    return commits


def _lookup_trees(batch: list[DecodeContext], drafts: list[list[int]], branches: int) -> list[DraftTree] | None:
    """Each sequence's drafts with the other continuations of its match beside them (up to
    ``branches`` in all, each as long as its drafts, merged where they share tokens), or None
    when that gives no sequence a second branch."""
    if branches < 2:
        return None
    trees = []
    for c, d in zip(batch, drafts):
        more = [b.tokens for b in c.lookup.branches(c.tokens, c.suffix, len(d))] if d else []
        tree = DraftTree.of_branches(c.tokens[-1], [d] + [b for b in more if b != d][:branches - 1])
        trees.append(tree.first(c.token_cap + 1 - (len(c.tokens) - 1)))
    return None if all(t.is_chain for t in trees) else trees


def verify_free_trees(batch: list[DecodeContext], trees: list[DraftTree]) -> list[list[int]]:
    """``verify_free`` for free drafts in several branches: each tree through every layer in one
    pass (``verify_tree``); the same bookkeeping, the first branch's length as the draft length."""
    n = batch[0].model.num_layers
    roots = [len(c.tokens) - 1 for c in batch]
    verdicts = verify_tree(batch, trees, roots, [c.token_tensor(t.tokens) for c, t in zip(batch, trees)], 0, n,
                           "tree->final", [[] for _ in batch])
    for c, t, v in zip(batch, trees, verdicts):
        c.stats.full_passes += 1
        if len(t) > 1:
            first = next((i for i in range(1, len(t)) if t.parents[i] != i - 1), len(t)) - 1  # nodes 1 .. first
            c.lookup.length.record(c.lookup.last_n, first, min(v.num_accepted, first))
        c.stats.count_round(c.lookup.source if len(t) > 1 else "plain")
    return [v.tokens for v in verdicts]


def _check_layers(spec: SpecConfig, num_layers: int, hierarchical: bool) -> None:
    dataclasses.replace(spec, num_layers=num_layers)  # validates the layers against this model
    if hierarchical and spec.verify_layer >= num_layers:
        raise ConfigError(f"hispec needs a verify layer below the last layer ({num_layers}), got "
                          f"{spec.verify_layer}; use the selfspec strategy for a single exit")


class SelfSpec(Strategy):
    """Single-exit self-speculation (LayerSkip-style): draft at L_d, verify with the full model."""

    name = StrategyName.SELFSPEC

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.lookahead = spec.lookahead

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        model, draft_layer = batch[0].model, self.spec.draft_layer
        _check_layers(self.spec, model.num_layers, hierarchical=False)
        ensure_policies(batch, self.spec)
        stats = [c.stats for c in batch]
        positions = [len(c.tokens) - 1 for c in batch]
        starts, width = [(c.tokens[-1], p) for c, p in zip(batch, positions)], self.spec.tree_width
        with phase_timer(stats, "draft", model.device):
            props = draft(batch, starts, draft_layer, [c.remaining for c in batch], [[] for _ in batch], width,
                          tree_min_probs(batch, self.spec, model.num_layers) if width > 1 else None)
        branched = has_runners_up(props)
        with phase_timer(stats, "full_verify", model.device):
            if branched:
                verdicts = tree_round(batch, props, starts, draft_layer, model.num_layers, "draft->final",
                                      [[] for _ in batch])
            else:
                verdicts = verify(batch, props, positions, draft_layer, model.num_layers, "draft->final",
                                  [[] for _ in batch])
        commits = []
        for c, p, v in zip(batch, props, verdicts):
            c.policy.update(p.tokens.shape[0], v.num_accepted)
            c.stats.full_passes += 1
            c.stats.count_round("tree" if branched else "exits")
            commits.append(v.tokens)
        return commits


@dataclass
class Window:
    """Tokens tentatively accepted at the intermediate exit, waiting for full verification."""

    base: int  # position of the pending committed token
    tokens: list[int] = field(default_factory=list)  # w_1 .. w_m
    hidden: list[torch.Tensor] = field(default_factory=list)  # rows [*, H]: inputs of positions base .. base+m-1
    closed: bool = False  # an end-of-sequence token is in the window
    branched: bool = False  # one of its draft rounds was a token tree

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, verdict: Verdict) -> None:
        a = verdict.num_accepted
        self.tokens += verdict.tokens
        self.hidden.append(verdict.hidden[:a + 1])

    def cut_after(self, length: int) -> None:
        """Keep ``w_1 .. w_length`` (e.g. up to an end-of-sequence token)."""
        self.tokens = self.tokens[:length]
        self.hidden = [torch.cat(self.hidden)[:length]] if self.hidden else []


class HiSpec(Strategy):
    """Hierarchical self-speculation: draft at L_d, filter at L_i, verify a window at L_f; where
    prompt lookup finds drafts that pay, they are verified instead (``free_round``)."""

    name = StrategyName.HISPEC

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.lookahead = spec.lookahead

    def free_round(self, batch: list[DecodeContext], cost: RowCost | None) -> list[list[int]] | None:
        return lookup_round(self.spec, batch, cost)

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        model = batch[0].model
        _check_layers(self.spec, model.num_layers, hierarchical=True)
        ensure_policies(batch, self.spec)
        windows = [Window(len(c.tokens) - 1) for c in batch]
        self._fill_windows(batch, windows)
        with phase_timer([c.stats for c in batch], "full_verify", model.device):
            return self._verify_windows(batch, windows)

    def _room(self, ctx: DecodeContext, window: Window) -> int:
        """Drafts the window may still take, keeping every position below the token limit."""
        return 0 if window.closed or len(window) >= self.spec.window else ctx.remaining - len(window) - 1

    def _fill_windows(self, batch: list[DecodeContext], windows: list[Window]) -> None:
        draft_layer, verify_layer, device = self.spec.draft_layer, self.spec.verify_layer, batch[0].model.device
        while True:
            open_ = [b for b, (c, w) in enumerate(zip(batch, windows)) if self._room(c, w) >= 1]
            if not open_:
                return
            ctxs, wins = [batch[b] for b in open_], [windows[b] for b in open_]
            positions = [w.base + len(w) for w in wins]
            starts = [(w.tokens[-1] if w.tokens else c.tokens[-1], p) for c, w, p in zip(ctxs, wins, positions)]
            width = self.spec.tree_width
            with phase_timer([c.stats for c in ctxs], "draft", device):
                props = draft(ctxs, starts, draft_layer, [self._room(c, w) for c, w in zip(ctxs, wins)],
                              [list(w.tokens) for w in wins], width,
                              tree_min_probs(ctxs, self.spec, verify_layer) if width > 1 else None)
            branched = has_runners_up(props)
            with phase_timer([c.stats for c in ctxs], "intermediate_verify", device):
                if branched:  # the intermediate exit prunes the tree: only its accepted path goes deeper
                    verdicts = tree_round(ctxs, props, starts, draft_layer, verify_layer, "draft->intermediate",
                                          [list(w.tokens) for w in wins])
                else:
                    verdicts = verify(ctxs, props, positions, draft_layer, verify_layer, "draft->intermediate",
                                      [list(w.tokens) for w in wins])
            for c, w, p, v in zip(ctxs, wins, props, verdicts):
                c.policy.update(p.tokens.shape[0], v.num_accepted)
                w.branched = w.branched or branched
                self._add_to_window(c, w, v)

    @staticmethod
    def _add_to_window(ctx: DecodeContext, window: Window, verdict: Verdict) -> None:
        start = len(window)
        window.add(verdict)
        eos = next((j for j, t in enumerate(window.tokens[start:], start) if t in ctx.eos_ids), None)
        if eos is not None:
            window.cut_after(eos + 1)
            ctx.runner.truncate(ctx.seq_id, window.base + eos + 1)
            window.closed = True

    def _verify_windows(self, batch: list[DecodeContext], windows: list[Window]) -> list[list[int]]:
        """Full verification of each window ``w_1..w_m`` (``accept``)."""
        model, runner, verify_layer = batch[0].model, batch[0].runner, self.spec.verify_layer
        last = [c.token_tensor([w.tokens[-1] if w.tokens else c.tokens[-1]]) for c, w in zip(batch, windows)]
        h_last = runner.forward_many([(c.seq_id, w.base + len(w), x) for c, w, x in zip(batch, windows, last)], 0,
                                   verify_layer)
        h_in = [torch.cat(w.hidden + [h]) for w, h in zip(windows, h_last)]  # [m + 1, H] at base .. base + m
        hs = runner.forward_many([(c.seq_id, w.base, h) for c, w, h in zip(batch, windows, h_in)], verify_layer,
                                 model.num_layers)
        logits = model.exit_logits(torch.cat(hs) if len(hs) > 1 else hs[0], model.num_layers)  # [sum (m_b + 1), V]
        drafts = [c.token_tensor(w.tokens) for c, w in zip(batch, windows)]
        accepted = accept(batch, drafts, logits, [w.tokens for w in windows], [w.base for w in windows])
        commits = []
        for c, w, lg, toks in zip(batch, windows, split_rows(logits, [h.shape[0] for h in hs]), accepted):
            num = len(toks) - 1
            c.target_logits = lg[:num + 1]
            c.runner.truncate(c.seq_id, w.base + num + 1)
            if len(w):
                c.stats.level("intermediate->final").record(len(w), num)
            c.stats.full_passes += 1
            c.stats.count_round("tree" if w.branched else "exits")
            commits.append(toks)
        return commits


class Lookup(Strategy):
    """Prompt-lookup decoding (transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram``):
    free drafts verified by the full model (``free_round``); a plain round (``ar``'s, several
    greedy tokens per op call) where there are none."""

    name = StrategyName.LOOKUP
    adaptive_steps = False  # its step is already plain: nothing for the engine to choose between

    def __init__(self, spec: SpecConfig) -> None:
        if spec.lookup_max_draft < 1:
            raise ConfigError(f"the lookup strategy needs --lookup-max-draft >= 1, got {spec.lookup_max_draft}")
        self.spec = spec
        self._ar = Autoregressive()
        self.lookahead = max(spec.lookup_max_draft * spec.lookup_branches + 2, self._ar.lookahead)

    def free_round(self, batch: list[DecodeContext], cost: RowCost | None) -> list[list[int]] | None:
        return lookup_round(self.spec, batch, cost)

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        return self._ar.step(batch)

    def steps(self, ctx: DecodeContext) -> Iterator[list[int]]:
        """Rounds of one sequence driven directly: every draft there is verified."""
        while ctx.remaining > 0:
            free = self.free_round([ctx], None)
            yield free[0] if free is not None and free[0] is not None else self.step([ctx])[0]
