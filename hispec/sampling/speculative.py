"""The accept rule, vectorised over a round (one host sync per call), for one sequence or,
batched, for a ragged batch of sequences in one pass.

Vocabulary (as in vLLM's rejection sampler): *draft tokens* ``x_1..x_k`` were proposed by a cheaper
level; the verifier *chooses* a token at each of the ``k + 1`` positions after the start (the
argmax, or a sample drawn with that position's uniform number, ``sampler.choose``); a draft is
*accepted* while it equals the token chosen before it, and the round ends with the first chosen
token that differs (*recovered*) or the one after the last draft (*bonus*).

For sampling this is exact because the chosen token at each position is a sample of the target
distribution drawn with a number that nothing else decided (``sampler.position_uniforms``): the
drafts only decide how many of those tokens one pass yields. A fixed draft ``x`` is accepted with
probability ``p(x)``, as the rejection rule of Leviathan et al. (2023) accepts a draft whose ``q``
is one-hot; an exit's draft, drawn from ``q`` with the same number, with the probability that both
draws land on the same token (at most ``1 - TV(p, q)``, the rejection rule's).

The batched rule takes the sequences' target rows laid flat, as vLLM's rejection sampler does:
sequence ``b`` with ``k_b`` drafts owns ``k_b + 1`` consecutive target rows (its bonus row last).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_chosen(draft_tokens: torch.Tensor,  # [k]
                  chosen: torch.Tensor,  # [k] or [k + 1] (with a bonus row): the verifier's token per row
                  ) -> tuple[int, int | None]:
    """Number of accepted drafts and the next token (None if all accepted and no bonus row)."""
    k = draft_tokens.shape[0]
    accepted = (draft_tokens == chosen[:k]).long().cumprod(0).sum()
    if chosen.shape[0] == k:
        num = int(accepted)
        return num, (int(chosen[num]) if num < k else None)
    num, token = torch.stack([accepted, chosen[accepted]]).tolist()
    return num, token


class RaggedRounds:
    """Where each sequence's drafts and target rows are in the flat layout (built from the
    draft counts, which the host knows): ``drafts [B, K]`` padded with -1 (never a token),
    ``target_rows [B, K + 1]`` index the flat rows (padding clamped to the sequence's bonus row)."""

    def __init__(self, draft_tokens: Sequence[torch.Tensor]) -> None:
        device = draft_tokens[0].device
        counts = [t.shape[0] for t in draft_tokens]
        self.num_drafts = torch.tensor(counts, device=device)  # [B]
        self.drafts = torch.nn.utils.rnn.pad_sequence(list(draft_tokens), batch_first=True, padding_value=-1)  # [B, K]
        j = torch.arange(self.drafts.shape[1] + 1, device=device)  # [K + 1]
        self.target_start = (self.num_drafts + 1).cumsum(0) - (self.num_drafts + 1)  # [B]
        self.target_rows = self.target_start[:, None] + torch.minimum(j, self.num_drafts[:, None])  # [B, K + 1]


def accept_chosen_batch(draft_tokens: Sequence[torch.Tensor],  # B x [k_b]
                        chosen: torch.Tensor,  # [sum (k_b + 1)]: each sequence's rows, bonus row last
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_chosen`` for a ragged batch in one pass: accepted drafts ``[B]`` and next tokens
    ``[B]`` (device tensors; nothing is synced)."""
    r = RaggedRounds(draft_tokens)
    per_seq = chosen[r.target_rows]  # [B, K + 1]: row k_b (the bonus) repeated past the drafts
    num = (r.drafts == per_seq[:, :-1]).long().cumprod(1).sum(1)  # [B]; padding never matches
    return num, per_seq.gather(1, num[:, None]).squeeze(1)
