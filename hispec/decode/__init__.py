"""Decoding strategies: which layers run when, for a batch of sequences.

The strategies themselves are listed once, in ``hispec/settings.py`` (``STRATEGY_KINDS``);
``make_strategy`` builds one by name from that list, with the settings ``settings.resolve_spec``
gives it unless they are given.
"""
from __future__ import annotations

import importlib
from typing import Mapping

from ..config import SpecConfig
from ..settings import resolve_spec, strategy_kind


def make_strategy(name: str, spec: SpecConfig | None = None, num_layers: int | None = None,
                  recommended: Mapping[str, SpecConfig] | None = None, **overrides):
    """The strategy called ``name`` (a ``decode.base.Strategy``); a speculative one runs with
    ``spec``, else with ``resolve_spec``'s settings for a ``num_layers``-deep model: ``overrides``
    (``SpecConfig`` fields, None = not given) over ``recommended`` (the exit heads') over the
    depth-based defaults."""
    kind = strategy_kind(name)
    module, cls = kind.impl.split(":")
    strategy_class = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if not kind.speculative:
        return strategy_class()
    return strategy_class(spec or resolve_spec(kind.name, num_layers, recommended, **overrides))
