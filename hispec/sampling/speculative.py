"""Speculative accept/reject, vectorised over a round (one host sync per call).

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
"""
from __future__ import annotations

import torch


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
    if num < k:
        residual = (target_probs[num] - draft_probs[num]).clamp_min(0.0)  # [V]
        mass = residual.sum()
        row = residual / mass if float(mass) > 0 else target_probs[num]
    elif target_probs.shape[0] > k:
        row = target_probs[k]
    else:
        return num, None
    return num, int(torch.multinomial(row, 1, generator=generator))
