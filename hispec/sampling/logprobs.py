"""Log-probabilities of chosen tokens, as OpenAI's ``logprobs`` report them.

They are the target model's *raw* log-probabilities: ``log_softmax`` of the final layer's
logits, before temperature, top-k/top-p, penalties or biases (vLLM's default
``logprobs_mode``). Every strategy commits each token from a final-layer row, so speculation
never changes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; what vLLM reports for impossible tokens


@dataclass(slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor,  # [T, V] the final layer's raw logits at T positions
                   tokens: list[int],  # [T] the token that followed each position
                   num_top: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[t]`` under row ``t`` and the ``num_top`` best tokens of each row."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_min(LOGPROB_FLOOR)  # [T, V]
    ids = torch.tensor(tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()  # [T]
    if num_top <= 0:
        return [TokenLogprob(t, c, []) for t, c in zip(tokens, chosen)]
    top_lp, top_ids = lp.topk(min(num_top, lp.shape[-1]), dim=-1)  # [T, k]
    return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in
            zip(tokens, chosen, top_ids.tolist(), top_lp.tolist())]
