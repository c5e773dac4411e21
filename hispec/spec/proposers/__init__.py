"""What proposes draft tokens: prompt lookup (``ngram``), the suffix cache of earlier outputs
(``suffix``), the free drafts of a round from both (``lookup``), an early exit (``exit``, its draft
lengths by ``exit_policies``). Proposals are verified by the strategies (``decode/speculative.py``)."""
