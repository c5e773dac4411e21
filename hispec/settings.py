"""The decoding strategies hispec knows, and the speculation settings each one runs with.

``StrategyName`` is the strategies' identity: a ``str`` enumeration, so a name a user or a JSON
body gives compares equal to it. Code names a strategy through it; the names are written as
text here alone. ``STRATEGY_KINDS`` is the one list of strategies with their per-method settings:
every command-line ``--strategy`` choice, the server's, the benchmark's, ``make_strategy`` and the
checks below read it. Adding a strategy is a name and a line here plus its class in
``hispec/decode/``. It holds names only (no class is imported), so building a command-line
parser does not import torch.

``resolve_spec`` is the one place where settings meet (the engine's front door
``engine.build``, the CLI, the benchmark and the server all reach it): a value the user gives
wins; else the exit heads' recommendation for the strategy (the default strategy's stands in for
a strategy without one); else depth-based defaults. The result is validated against the model's
depth, the exit layers only for a strategy that drafts with exits.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from .config import SPEC_FIELDS, ConfigError, SpecConfig


class StrategyName(enum.StrEnum):
    """A decoding strategy's name (``StrategyName("ar") is StrategyName.AR``; equal to its text)."""

    AR = "ar"
    SELFSPEC = "selfspec"
    HISPEC = "hispec"
    LOOKUP = "lookup"


@dataclass(frozen=True)
class StrategyKind:
    """A decoding strategy: its name, where its class is, what it needs, its ``--help`` line."""

    name: StrategyName
    impl: str  # "module:Class" in hispec.decode; built as Class() or, if speculative, Class(spec)
    speculative: bool  # drafts and verifies: runs with a SpecConfig, and adaptive decoding may replace its steps
    help: str
    full_verify: bool = False  # verifies with the full model only: verify_layer defaults to the model's depth
    exits: bool = False  # drafts with exit heads: draft_layer / verify_layer are its settings (and validated)


STRATEGY_KINDS = (
    StrategyKind(StrategyName.AR, "autoregressive:Autoregressive", False,
                 "one full-model pass per token (the reference)"),
    StrategyKind(StrategyName.SELFSPEC, "speculative:SelfSpec", True,
                 "drafts with an early exit, verifies with the full model", full_verify=True, exits=True),
    StrategyKind(StrategyName.HISPEC, "speculative:HiSpec", True,
                 "drafts with an early exit, verifies at an intermediate exit, then with the full model", exits=True),
    StrategyKind(StrategyName.LOOKUP, "speculative:Lookup", True,
                 "drafts by prompt lookup (no model time), verifies with the full model", full_verify=True),
)
STRATEGIES = tuple(k.name for k in STRATEGY_KINDS)
SPECULATIVE = tuple(k.name for k in STRATEGY_KINDS if k.speculative)
# the commands' default; its recommended settings stand in for a strategy's own
DEFAULT_STRATEGY = StrategyName.HISPEC
# the strategies an exit-head manifest recommends settings for (``recommended``, ``recommended_selfspec``)
RECOMMENDED = (StrategyName.HISPEC, StrategyName.SELFSPEC)
_KIND = {k.name: k for k in STRATEGY_KINDS}


def strategy_kind(name: str) -> StrategyKind:
    """The strategy called ``name``; ``ConfigError`` if there is none."""
    if name not in _KIND:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return _KIND[name]  # a plain str finds its StrategyName: they hash and compare alike


def strategies_help() -> str:
    """The strategies for a ``--strategy`` help text: ``ar`` (what it does), ..."""
    return "; ".join(f"{k.name}: {k.help}" for k in STRATEGY_KINDS)


def default_spec(num_layers: int) -> SpecConfig:
    """Exits at about 1/8 and 1/4 of the depth (docs/design.md), unless exit heads declare others."""
    draft = max(1, round(num_layers / 8))
    verify = max(draft + 1, round(num_layers / 4))
    return SpecConfig(draft_layer=draft, verify_layer=min(verify, num_layers - 1) if num_layers > 2 else num_layers,
                      num_layers=num_layers)


def recommended_for(strategy: str, recommended: Mapping[str, SpecConfig] | None) -> SpecConfig | None:
    """The exit heads' settings for ``strategy`` (the default strategy's stand in for a strategy
    without its own); None: no recommendation."""
    recommended = recommended or {}
    return recommended.get(strategy) or recommended.get(DEFAULT_STRATEGY)


def resolve_spec(strategy: str, num_layers: int, recommended: Mapping[str, SpecConfig] | None = None,
                 **overrides) -> SpecConfig | None:
    """The settings ``strategy`` runs with on a ``num_layers``-deep model (None for one that does
    not speculate, ``ar``).

    ``recommended``: the exit heads' settings per strategy (``ExitSet.specs``); ``overrides``:
    ``SpecConfig`` fields the user set (None = not set). A strategy that verifies with the full
    model only (selfspec), without a recommendation of its own, verifies with the full model
    unless ``verify_layer`` is given. For a strategy that does not draft with exits (lookup) the
    exit layers are not settings: they stay the depth-based defaults whatever is given.
    """
    kind = strategy_kind(strategy)
    unknown = set(overrides) - set(SPEC_FIELDS)
    if unknown:
        raise ConfigError(f"unknown speculation settings: {', '.join(sorted(unknown))}")
    if not kind.speculative:
        return None
    recommended = recommended or {}
    base = recommended_for(strategy, recommended) or default_spec(num_layers)
    fields = {k: getattr(base, k) for k in SPEC_FIELDS}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if kind.full_verify and overrides.get("verify_layer") is None and strategy not in recommended:
        fields["verify_layer"] = num_layers
    if not kind.exits:
        fields.update(draft_layer=default_spec(num_layers).draft_layer, verify_layer=num_layers)
    spec = SpecConfig(**fields, num_layers=num_layers)
    if kind.name is StrategyName.LOOKUP and spec.lookup_max_draft < 1:  # refused before any work (and by the strategy)
        raise ConfigError(f"the lookup strategy needs --lookup-max-draft >= 1, got {spec.lookup_max_draft}")
    return spec
