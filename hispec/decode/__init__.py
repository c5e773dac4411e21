"""Decoding strategies: which layers run when, for a batch of sequences.

The strategies themselves are listed once, in ``hispec/settings.py`` (``STRATEGY_KINDS``);
``make_strategy`` builds one by name from that list.
"""
from __future__ import annotations

import importlib

from ..config import SpecConfig
from ..settings import default_spec, strategy_kind


def make_strategy(name: str, spec: SpecConfig | None = None, num_layers: int | None = None):
    """The strategy called ``name`` (a ``decode.base.Strategy``); a speculative one runs with
    ``spec``, or the depth-based defaults for ``num_layers``."""
    kind = strategy_kind(name)
    module, cls = kind.impl.split(":")
    strategy_class = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if not kind.speculative:
        return strategy_class()
    return strategy_class(spec or default_spec(num_layers))
