"""Speculative accept/reject, vectorised over a round (one host sync per call), for one
sequence or, batched, for a ragged batch of sequences in one pass.

Vocabulary (as in vLLM's rejection sampler):

- *draft tokens* ``x_1..x_k`` were proposed from a cheaper distribution ``q``;
- a draft token is *accepted* if it survives ``u < p(x) / q(x)`` (``u ~ U[0, 1)``), and only
  while every earlier draft token was accepted;
- at the first rejection a *recovered* token is drawn from ``norm(max(0, p - q))`` at that
  position and the round ends;
- if all ``k`` are accepted and the target has a row past the last draft, a *bonus* token
  is drawn from that row of ``p``.

The result is an exact sample from ``p`` (Leviathan et al. 2023; Chen et al. 2023). With
greedy decoding both distributions are one-hot at their argmax, which reduces the rule to
"accept while the draft equals the target's argmax, then emit the target's argmax".

The batched rules take the sequences' target rows laid flat, as vLLM's rejection sampler
does: sequence ``b`` with ``k_b`` drafts owns ``k_b + 1`` consecutive target rows (its bonus
row last) and ``k_b`` consecutive draft rows. Each sequence draws its random numbers from its
own generator in the order the one-sequence rule draws them (``u_1..u_k``, then the
recovered/bonus token), so a sequence gets the same tokens alone or in any batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampler import sample_residual


def greedy_accept(draft_tokens: torch.Tensor,  # [k]
                  target_argmax: torch.Tensor,  # [k] or [k + 1] (with a bonus row)
                  ) -> tuple[int, int | None]:
    """Number of accepted drafts and the next token (None if all accepted and no bonus row)."""
    k = draft_tokens.shape[0]
    accepted = (draft_tokens == target_argmax[:k]).long().cumprod(0).sum()
    if target_argmax.shape[0] == k:
        num = int(accepted)
        return num, (int(target_argmax[num]) if num < k else None)
    num, token = torch.stack([accepted, target_argmax[accepted]]).tolist()
    return num, token


def sample_accept(draft_tokens: torch.Tensor,  # [k]
                  draft_probs: torch.Tensor,  # [k, V]: q, the distribution each draft was drawn from
                  target_probs: torch.Tensor,  # [k, V] or [k + 1, V] (with a bonus row): p
                  generator: torch.Generator | None,
                  ) -> tuple[int, int | None]:
    """Speculative sampling: number of accepted drafts and the recovered/bonus token (None if
    all were accepted and ``target_probs`` has no bonus row)."""
    k = draft_tokens.shape[0]
    idx = draft_tokens[:, None]
    p_x = target_probs[:k].gather(1, idx).squeeze(1)  # [k]: p(x_j)
    q_x = draft_probs.gather(1, idx).squeeze(1)  # [k]: q(x_j) > 0, since x_j was drawn from q
    u = torch.rand(k, generator=generator, device=draft_probs.device)
    accept = u * q_x < p_x  # u < p/q without dividing; always true where p >= q
    num = int(accept.long().cumprod(0).sum())
    if num == k and target_probs.shape[0] == k:
        return num, None
    rejected = torch.tensor([num < k], device=target_probs.device)
    return num, int(sample_residual(target_probs[num:num + 1], draft_probs[num:num + 1] if num < k else None,
                                    rejected, generator)[0])


class RaggedRounds:
    """Where each sequence's drafts and target rows are in the flat layout (built from the
    draft counts, which the host knows): ``drafts [B, K]`` padded with -1 (never a token),
    ``valid [B, K]`` marks real drafts, ``target_rows [B, K + 1]`` / ``draft_rows [B, K]`` index the
    flat rows (padding clamped to an existing row)."""

    def __init__(self, draft_tokens: Sequence[torch.Tensor]) -> None:
        device = draft_tokens[0].device
        counts = [t.shape[0] for t in draft_tokens]
        self.num_drafts = torch.tensor(counts, device=device)  # [B]
        self.drafts = torch.nn.utils.rnn.pad_sequence(list(draft_tokens), batch_first=True, padding_value=-1)  # [B, K]
        j = torch.arange(self.drafts.shape[1] + 1, device=device)  # [K + 1]
        self.valid = j[:-1] < self.num_drafts[:, None]  # [B, K]
        self.target_start = (self.num_drafts + 1).cumsum(0) - (self.num_drafts + 1)  # [B]
        self.target_rows = self.target_start[:, None] + torch.minimum(j, self.num_drafts[:, None])  # [B, K + 1]
        self.draft_start = self.num_drafts.cumsum(0) - self.num_drafts  # [B]
        self.num_draft_rows = sum(counts)
        self.draft_rows = (self.draft_start[:, None] + j[:-1]).clamp_max(max(self.num_draft_rows - 1, 0))  # [B, K]


def greedy_accept_batch(draft_tokens: Sequence[torch.Tensor],  # B x [k_b]
                        target_argmax: torch.Tensor,  # [sum (k_b + 1)]: each sequence's rows, bonus row last
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_accept`` for a ragged batch in one pass: accepted drafts ``[B]`` and next tokens
    ``[B]`` (device tensors; nothing is synced)."""
    r = RaggedRounds(draft_tokens)
    argmax = target_argmax[r.target_rows]  # [B, K + 1]: row k_b (the bonus) repeated past the drafts
    num = (r.drafts == argmax[:, :-1]).long().cumprod(1).sum(1)  # [B]; padding never matches
    return num, argmax.gather(1, num[:, None]).squeeze(1)


def sample_accept_batch(draft_tokens: Sequence[torch.Tensor],  # B x [k_b]
                        draft_probs: torch.Tensor,  # [sum k_b, V]: q of each draft, sequence by sequence
                        target_probs: torch.Tensor,  # [sum (k_b + 1), V]: p, each sequence's bonus row last
                        generators: Sequence[torch.Generator | None],  # one per sequence
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_accept`` for a ragged batch in one pass (every sequence has its bonus row):
    accepted drafts ``[B]`` and recovered/bonus tokens ``[B]`` (device tensors; nothing is
    synced). Sequence ``b``'s tokens equal ``sample_accept``'s with the same generator state."""
    r = RaggedRounds(draft_tokens)
    device = target_probs.device
    u = torch.nn.utils.rnn.pad_sequence([torch.rand(t.shape[0], generator=g, device=device)
                                         for t, g in zip(draft_tokens, generators)], batch_first=True)  # [B, K]
    x = r.drafts.clamp_min(0)  # [B, K]
    p_x = target_probs[r.target_rows[:, :-1], x]  # [B, K]
    if r.num_draft_rows:
        q_x = draft_probs[r.draft_rows, x]  # [B, K]
        accept = r.valid & (u * q_x < p_x)  # u < p/q without dividing
    else:
        accept = r.valid  # [B, 0]
    num = accept.long().cumprod(1).sum(1)  # [B]
    target = target_probs[r.target_start + num]  # [B, V]: the row after the accepted drafts
    draft = draft_probs[(r.draft_start + num).clamp_max(r.num_draft_rows - 1)] if r.num_draft_rows else None  # [B, V]
    return num, sample_residual(target, draft, num < r.num_drafts, list(generators))  # drawn after u, as sample_accept
