"""Exit drafting: an early exit proposes tokens for a deeper level to verify (``decode.speculative``).

A round drafts at exit ``L_d`` (layers ``[0, L_d)`` and the exit's head) up to ``k`` tokens per
sequence, as many as the sequence's draft-length policy allows (``proposers.exit_policies``: fixed,
SVIP, confidence, heuristic). Each draft is chosen as a plain step would choose it (the argmax, or a
sample drawn with its position's uniform number, ``DecodeContext.uniforms``), so where the exit's
distribution is close to the verifier's both draw the same token. With ``tree_width > 1`` the exit's
runners-up beside each draft make a token tree (``decode.tree.exit_tree``), those whose branch pays
for its row (``tree_min_probs``: the engine's measured row cost, ``spec.cost``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import SpecConfig
from ...decode.base import DecodeContext, process_rows
from ...sampling.sampler import choose
from ..cost import RowCost
from .exit_policies import draft_confidence, make_policy


@dataclass
class Proposal:
    """Tokens proposed by a cheaper level, to be verified by a deeper one."""

    tokens: torch.Tensor  # [k] proposed token ids
    hidden: torch.Tensor  # [k + 1, H] states at the proposing exit for positions start .. start + k
    runners_up: list[list[int]] | None = None  # beside each draft, the exit's next candidates (token trees)



def draft(batch: list[DecodeContext], starts: list[tuple[int, int]], draft_layer: int, limits: list[int],
          prefixes: list[list[int]], width: int = 1, min_probs: list[float] | None = None) -> list[Proposal]:
    """Draft at exit ``draft_layer`` for each sequence, from its ``(token, position)``: up to
    ``min(policy, limit)`` tokens (at least one), fewer if its policy stops early.
    ``prefixes[b]``: the speculative tokens (not yet committed) up to and including the start token.

    Each sequence's last drafted token is also run through layers ``[0, draft_layer)`` (without the
    exit head), so the verifier can score the position after it (the bonus position). Each
    draft position is one pass for the batch: greedy and sampled rows are chosen together and
    the drafted tokens stay on the device (a host sync only for a confidence-based policy, once
    per position, or for a request with a logits processor). ``width > 1``: beside each draft, the
    exit's next ``width - 1`` candidates (by the processed logits) are kept as its runners-up, those
    whose branch the exit gives at least ``min_probs[b]`` (``tree_min_probs``; None: every one): a
    candidate's probability times that of the drafts before it in the round (the chance, by the
    exit's reckoning, that the row pays).
    """
    runner = batch[0].runner
    k_max = [max(1, min(c.policy.max_drafts(), lim)) for c, lim in zip(batch, limits)]
    x = list(batch[0].token_tensor([tok for tok, _ in starts]).split(1))  # B x [1]: each one's next input
    hidden, tokens = [[] for _ in batch], [[] for _ in batch]
    runners_up: list[list[list[int]]] = [[] for _ in batch]
    reach = [1.0] * len(batch)  # the exit's probability of the round's drafts so far, per sequence
    least = min_probs or [0.0] * len(batch)
    active, j = list(range(len(batch))), 0
    while active:
        hs = runner.forward_many([(batch[b].seq_id, starts[b][1] + j, x[b]) for b in active], 0, draft_layer)
        for b, h in zip(active, hs):
            hidden[b].append(h)
        rows = [(b, h) for b, h in zip(active, hs) if j < k_max[b]]
        if not rows:
            break
        ctxs = [batch[b] for b, _ in rows]
        logits = runner.exit_logits([(batch[b].seq_id, starts[b][1] + j, h) for b, h in rows], draft_layer)  # [R, V]
        logits = process_rows(ctxs, logits, [1] * len(rows),
                              [prefixes[b] + (torch.cat(tokens[b]).tolist() if tokens[b] else [])
                               if batch[b].processor is not None else () for b, _ in rows])
        if j > 0:
            keep = _keep_drafting(ctxs, logits)
            if not all(keep):
                rows, ctxs = [r for r, k in zip(rows, keep) if k], [c for c, k in zip(ctxs, keep) if k]
                logits = logits[[r for r, k in enumerate(keep) if k]]
                if not rows:
                    break
        u = torch.tensor([batch[b].uniforms(starts[b][1] + j + 1, 1)[0] for b, _ in rows], dtype=torch.float64,
                         device=logits.device)  # [R]: the numbers of the positions drafted
        chosen, _ = choose(logits, [c.params for c in ctxs], u)  # [R]
        if width > 1:
            alts, p_chosen = _runners_up(logits, chosen, width, [least[b] for b, _ in rows],
                                         [reach[b] for b, _ in rows])
            for (b, _), a, pc in zip(rows, alts, p_chosen):
                runners_up[b].append(a)
                reach[b] *= pc
        for i, (b, _) in enumerate(rows):
            x[b] = chosen[i:i + 1]
            tokens[b].append(x[b])
        active, j = [b for b, _ in rows], j + 1
    for c, h in zip(batch, hidden):
        c.stats.draft_forward_tokens += len(h)
    return [Proposal(torch.cat(t), torch.cat(h), r if width > 1 else None)
            for t, h, r in zip(tokens, hidden, runners_up)]


def _runners_up(logits: torch.Tensor, chosen: torch.Tensor, width: int, min_probs: list[float] | None = None,
                reach: list[float] | None = None) -> tuple[list[list[int]], list[float]]:
    """Per row of ``logits [R, V]``, its top ``width`` tokens but the chosen one (``chosen [R]``),
    best first, at most ``width - 1``, never a token the request's processing ruled out (-inf),
    only those with ``reach[r] * p(token) >= min_probs[r]`` (``p``: the row's softmax; None: 0);
    and each row's ``p(chosen)``."""
    probs = torch.softmax(logits.float(), dim=-1)  # [R, V]
    values, ids = probs.topk(width, dim=-1)  # [R, width]
    p_chosen = probs.gather(1, chosen.view(-1, 1).to(probs.device)).view(-1).tolist()  # [R]
    reach = reach or [1.0] * len(p_chosen)
    least = min_probs or [0.0] * len(p_chosen)
    out = []
    for vals, toks, c, r, m in zip(values.tolist(), ids.tolist(), chosen.tolist(), reach, least):
        out.append([t for v, t in zip(vals, toks) if t != c and v > 0 and r * v >= m][:width - 1])
    return out, p_chosen


def tree_min_probs(batch: list[DecodeContext], spec: SpecConfig, to_layer: int) -> list[float]:
    """Per sequence, the least branch probability for which a runner-up joins its tree:
    ``spec.tree_min_prob``, or where that is None, what a runner-up's row costs relative to a plain
    step, ``c * to_layer / L`` (it runs through ``to_layer`` of the ``L`` layers before it is
    pruned or kept; ``c``: the engine's measured cost of a full row, ``DecodeContext.row_cost``, or
    the prior ``RowCost.prior`` before any is measured)."""
    if spec.tree_min_prob is not None:
        return [spec.tree_min_prob] * len(batch)
    n = batch[0].model.num_layers
    return [branch_threshold(c.row_cost if c.row_cost is not None else RowCost.prior, to_layer, n) for c in batch]


def branch_threshold(row_cost: float, to_layer: int, num_layers: int) -> float:
    """The least branch probability a runner-up needs to pay for its row: a full row's cost
    relative to a plain step, ``row_cost``, times the share of the layers it runs through."""
    return min(0.99, row_cost * to_layer / num_layers)


def has_runners_up(props: list[Proposal]) -> bool:
    """Whether any proposal has a runner-up beside its drafts (else the round verifies chains)."""
    return any(alts for p in props for alts in (p.runners_up or []))


def _keep_drafting(batch: list[DecodeContext], logits: torch.Tensor) -> list[bool]:
    """Whether each sequence's policy lets it draft from its (processed) draft logits ``[R, V]``."""
    asks = [r for r, c in enumerate(batch) if c.policy.wants_confidence()]
    if not asks:
        return [True] * len(batch)
    confidence = draft_confidence(logits[asks] if len(asks) < len(batch) else logits,
                                  [0.0 if batch[r].params.greedy else batch[r].params.temperature for r in asks])
    keep = [True] * len(batch)
    for r, conf in zip(asks, confidence):
        keep[r] = not batch[r].policy.stop_before(conf)
    return keep


def ensure_policies(batch: list[DecodeContext], spec: SpecConfig) -> None:
    for c in batch:
        if c.policy is None:
            c.policy = make_policy(spec)
