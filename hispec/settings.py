"""The decoding strategies hispec knows, and the speculation settings each one runs with.

``STRATEGY_KINDS`` is the one list of strategies: every command-line ``--strategy`` choice, the
server's, the benchmark's, ``make_strategy`` and the checks below read it. Adding a strategy is
one line here plus its class in ``hispec/decode/``. It holds names only (no class is imported),
so building a command-line parser does not import torch.

``resolve_spec`` is the one place where settings meet (the CLI, the benchmark and the server all
call it): a value the user gives wins; else the exit heads' recommendation for the strategy
(the default strategy's stands in for a strategy without one); else depth-based defaults. The
result is validated against the model's depth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .config import SPEC_FIELDS, ConfigError, SpecConfig


@dataclass(frozen=True)
class StrategyKind:
    """A decoding strategy: its name, where its class is, what it needs, its ``--help`` line."""

    name: str
    impl: str  # "module:Class" in hispec.decode; built as Class() or, if speculative, Class(spec)
    speculative: bool  # drafts and verifies: runs with a SpecConfig, and adaptive decoding may replace its steps
    help: str
    full_verify: bool = False  # verifies with the full model only: verify_layer defaults to the model's depth


STRATEGY_KINDS = (
    StrategyKind("ar", "autoregressive:Autoregressive", False, "one full-model pass per token (the reference)"),
    StrategyKind("selfspec", "speculative:SelfSpec", True,
                 "drafts with an early exit, verifies with the full model", full_verify=True),
    StrategyKind("hispec", "speculative:HiSpec", True,
                 "drafts with an early exit, verifies at an intermediate exit, then with the full model"),
    StrategyKind("lookup", "speculative:Lookup", True,
                 "drafts by prompt lookup (no model time), verifies with the full model", full_verify=True),
)
STRATEGIES = tuple(k.name for k in STRATEGY_KINDS)
SPECULATIVE = tuple(k.name for k in STRATEGY_KINDS if k.speculative)
DEFAULT_STRATEGY = "hispec"  # the commands' default; its recommended settings stand in for a strategy's own
_KIND = {k.name: k for k in STRATEGY_KINDS}


def strategy_kind(name: str) -> StrategyKind:
    """The strategy called ``name``; ``ConfigError`` if there is none."""
    if name not in _KIND:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return _KIND[name]


def strategies_help() -> str:
    """The strategies for a ``--strategy`` help text: ``ar`` (what it does), ..."""
    return "; ".join(f"{k.name}: {k.help}" for k in STRATEGY_KINDS)


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
    ``SpecConfig`` fields the user set (None = not set). A strategy that verifies with the full
    model only (selfspec), without a recommendation of its own, verifies with the full model
    unless ``verify_layer`` is given.
    """
    kind = strategy_kind(strategy)
    unknown = set(overrides) - set(SPEC_FIELDS)
    if unknown:
        raise ConfigError(f"unknown speculation settings: {', '.join(sorted(unknown))}")
    recommended = recommended or {}
    base = recommended.get(strategy) or recommended.get(DEFAULT_STRATEGY) or default_spec(num_layers)
    fields = {k: getattr(base, k) for k in SPEC_FIELDS}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if kind.full_verify and overrides.get("verify_layer") is None and strategy not in recommended:
        fields["verify_layer"] = num_layers
    spec = SpecConfig(**fields, num_layers=num_layers)
    if strategy == "lookup" and spec.lookup_max_draft < 1:  # refused before any work (the strategy checks it too)
        raise ConfigError(f"the lookup strategy needs --lookup-max-draft >= 1, got {spec.lookup_max_draft}")
    return spec
