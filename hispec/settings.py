"""Speculation settings for a model: defaults, the exit heads' recommendation, user overrides.

``resolve_spec`` is the one place where these meet (the CLI, the benchmark and the server all
call it): a value the user gives wins; else the exit heads' recommendation for the strategy
(the hispec one stands in for selfspec); else depth-based defaults. The result is validated
against the model's depth.
"""
from __future__ import annotations

from typing import Mapping

from .config import ConfigError, SpecConfig

SPEC_FIELDS = ("draft_layer", "verify_layer", "num_draft", "window", "draft_policy", "svip_threshold",
               "confidence_threshold", "max_draft", "lookup_max_draft", "lookup_ngram")
STRATEGIES = ("ar", "selfspec", "hispec", "lookup")


def default_spec(num_layers: int) -> SpecConfig:
    """Exits at about 1/8 and 1/4 of the depth (docs/design.md), unless exit heads declare others."""
    draft = max(1, round(num_layers / 8))
    verify = max(draft + 1, round(num_layers / 4))
    return SpecConfig(draft_layer=draft, verify_layer=min(verify, num_layers - 1) if num_layers > 2 else num_layers,
                      num_layers=num_layers)


def resolve_spec(strategy: str, num_layers: int, recommended: Mapping[str, SpecConfig] | None = None,
                 **overrides) -> SpecConfig:
    """The settings ``strategy`` runs with on a ``num_layers``-deep model.

    ``recommended``: the exit heads' settings per strategy (``ExitSet.specs``); ``overrides``:
    ``SpecConfig`` fields the user set (None = not set). A selfspec run without a recommendation
    of its own verifies with the full model unless ``verify_layer`` is given.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    unknown = set(overrides) - set(SPEC_FIELDS)
    if unknown:
        raise ConfigError(f"unknown speculation settings: {', '.join(sorted(unknown))}")
    recommended = recommended or {}
    base = recommended.get(strategy) or recommended.get("hispec") or default_spec(num_layers)
    fields = {k: getattr(base, k) for k in SPEC_FIELDS}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if strategy == "selfspec" and overrides.get("verify_layer") is None and "selfspec" not in recommended:
        fields["verify_layer"] = num_layers
    return SpecConfig(**fields, num_layers=num_layers)
