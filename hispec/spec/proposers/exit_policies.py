"""Exit draft-length policies: how many tokens an early exit drafts in a round (``proposers.exit``).

- ``fixed``: always ``num_draft``.
- ``svip`` (SVIP, arXiv 2411.18462): keep drafting while the draft distribution is confident;
  stop as soon as its entropy exceeds a threshold, since acceptance is then unlikely.
- ``confidence`` (Kangaroo's early stop): stop as soon as the draft's top-1 probability falls
  below a threshold.
- ``heuristic`` (Hugging Face's schedule): +2 after a round whose drafts were all accepted,
  -1 otherwise, between 1 and ``max_draft``.

Every policy drafts at least one token per round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import DraftPolicyName, SpecConfig
from ...sampling.sampler import entropy, per_row, scale


@dataclass(frozen=True)
class DraftConfidence:
    """How sure the draft exit is of a position: its distribution's entropy and top-1 probability."""

    entropy: float  # nats
    top1: float


class DraftPolicy:
    name = DraftPolicyName.FIXED

    def __init__(self, spec: SpecConfig) -> None:
        self.num_draft = spec.num_draft

    def max_drafts(self) -> int:
        return self.num_draft

    def wants_confidence(self) -> bool:
        return False

    def stop_before(self, confidence: DraftConfidence) -> bool:
        """Called before each draft after the first, with the confidence of its distribution."""
        return False

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Called after verification of a round."""


class SvipPolicy(DraftPolicy):
    name = DraftPolicyName.SVIP

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self.threshold = spec.svip_threshold

    def wants_confidence(self) -> bool:
        return True

    def stop_before(self, confidence: DraftConfidence) -> bool:
        return confidence.entropy > self.threshold


class ConfidencePolicy(DraftPolicy):
    name = DraftPolicyName.CONFIDENCE

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self.threshold = spec.confidence_threshold

    def wants_confidence(self) -> bool:
        return True

    def stop_before(self, confidence: DraftConfidence) -> bool:
        return confidence.top1 < self.threshold


class HeuristicPolicy(DraftPolicy):
    name = DraftPolicyName.HEURISTIC

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self.max_draft = max(spec.max_draft, spec.num_draft)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_accepted == num_drafted:
            self.num_draft = min(self.num_draft + 2, self.max_draft)
        else:
            self.num_draft = max(self.num_draft - 1, 1)


POLICIES = {p.name: p for p in (DraftPolicy, SvipPolicy, ConfidencePolicy, HeuristicPolicy)}


def make_policy(spec: SpecConfig) -> DraftPolicy:
    return POLICIES[spec.draft_policy](spec)


def draft_confidence(logits: torch.Tensor, temperatures: list[float]) -> list[DraftConfidence]:
    """Entropy (nats) and top-1 probability of each row's draft distribution ``softmax(logits / T)``
    for ``logits [R, V]``, row ``r`` at ``temperatures[r]`` (T=1 when greedy, i.e. 0); one host sync."""
    p = torch.softmax(scale(logits, per_row([t or 1.0 for t in temperatures], logits.device)), dim=-1)  # [R, V]
    return [DraftConfidence(e, top1) for e, top1 in torch.stack([entropy(p), p.max(-1).values], 1).tolist()]
