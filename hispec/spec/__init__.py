"""Speculation's room (in the shape of vLLM v1's ``spec_decode/``): whether and what to speculate.

- ``proposers/``: what proposes draft tokens -- prompt lookup (``ngram``), the suffix cache of
  earlier outputs (``suffix``), the free drafts of a round from both (``lookup``), and an early exit
  (``exit``, with its draft-length policies ``exit_policies``). Trees over any of them are built
  and verified in ``decode/tree.py``.
- ``cost.py``: the one cost model -- what a verification row costs (``RowCost``), how likely a free
  draft is to be accepted (``DraftLength``, priors), how many drafts of a pass pay (``choose_drafts``).
- ``policy.py``: the one object the engine asks "a plain step, or which proposals at which
  lengths?" (``SpecPolicy``: the adaptive controller, the free-round gate, the suffix store).

The strategies that verify proposals, and the one accept rule, stay in ``decode/speculative.py``.
The engine imports ``spec.policy`` alone; the proposers never import the engine or the policy.
"""
