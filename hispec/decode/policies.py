"""Draft-length policies: how many tokens to draft in a round.

- ``fixed``: always ``num_draft``.
- ``svip`` (SVIP, arXiv 2411.18462): keep drafting while the draft distribution is confident;
  stop as soon as its entropy exceeds a threshold, since acceptance is then unlikely.
- ``heuristic`` (Hugging Face's schedule): +2 after a round whose drafts were all accepted,
  -1 otherwise, between 1 and ``max_draft``.

Every policy drafts at least one token per round.
"""
from __future__ import annotations

import torch

from ..config import SpecConfig
from ..sampling.sampler import entropy, scale


class DraftPolicy:
    name = "fixed"

    def __init__(self, spec: SpecConfig) -> None:
        self.num_draft = spec.num_draft

    def max_drafts(self) -> int:
        return self.num_draft

    def wants_entropy(self) -> bool:
        return False

    def stop_before(self, draft_entropy: torch.Tensor | None) -> bool:
        """Called before each draft after the first, with the entropy of its distribution."""
        return False

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Called after verification of a round."""


class SvipPolicy(DraftPolicy):
    name = "svip"

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self.threshold = spec.svip_threshold

    def wants_entropy(self) -> bool:
        return True

    def stop_before(self, draft_entropy: torch.Tensor | None) -> bool:
        return draft_entropy is not None and float(draft_entropy) > self.threshold


class HeuristicPolicy(DraftPolicy):
    name = "heuristic"

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self.max_draft = max(spec.max_draft, spec.num_draft)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_accepted == num_drafted:
            self.num_draft = min(self.num_draft + 2, self.max_draft)
        else:
            self.num_draft = max(self.num_draft - 1, 1)


POLICIES = {p.name: p for p in (DraftPolicy, SvipPolicy, HeuristicPolicy)}


def make_policy(spec: SpecConfig) -> DraftPolicy:
    return POLICIES[spec.draft_policy](spec)


def draft_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy (nats) of the draft distribution ``softmax(logits / T)`` for ``logits [1, V]``; T=1 when greedy."""
    return entropy(torch.softmax(scale(logits, temperature or 1.0), dim=-1))[0]
