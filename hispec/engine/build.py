"""The front door: the one place an ``Engine`` is built from settings.

Everything that runs requests builds its engine here: the ``Generator`` (one request at a time,
and so ``hispec generate``, the benchmark and the tuner), the library's ``LLM``, the server
(each Ray Serve replica too), the exit-head collector and the tensor-parallel check. A strategy
given by name becomes a strategy here, its settings resolved once (``settings.resolve_spec``:
the depth-based defaults < the exit heads' recommendation < the user's values), so no caller
resolves settings or constructs an ``Engine`` of its own (``tests/test_layers.py`` checks it).

It is a module of the engine package, not of a layer above, because it is the engine's
constructor with its inputs resolved: it needs only what the engine's layer may import (the
strategies, the settings, the config), and everything above the engine can reach it.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config import EngineConfig, SpecConfig
from ..decode import make_strategy
from ..decode.base import Strategy
from ..model.decoder import DecoderModel
from .engine import Engine


def build_strategy(strategy: str | Strategy, num_layers: int, *, spec: SpecConfig | None = None,
                   recommended: Mapping[str, SpecConfig] | None = None,
                   overrides: Mapping[str, Any] | None = None) -> Strategy:
    """``strategy`` as a strategy object: a built one as it is; a name (a ``settings.StrategyName``
    or its text) with ``spec`` if given, else with the settings the user's ``overrides``
    (``SpecConfig`` fields, None = not given) and the exit heads' ``recommended`` settings resolve to."""
    if not isinstance(strategy, str):  # built already (a Strategy, or anything that acts as one)
        return strategy
    return make_strategy(strategy, spec, num_layers, recommended, **(overrides or {}))


def build_engine(model: DecoderModel, strategy: str | Strategy, config: EngineConfig | None = None, *,
                 spec: SpecConfig | None = None, recommended: Mapping[str, SpecConfig] | None = None,
                 overrides: Mapping[str, Any] | None = None, **options) -> Engine:
    """An engine running ``strategy`` (``build_strategy``) on ``model``. ``config`` and ``options``
    are the engine's own (``Engine``: the config's fields as keywords, ``tokenizer``, ``eos_ids``,
    ``controller``, ``cache``, ``seq_tokens``, ``num_seqs``, ``suffix``)."""
    return Engine(model, build_strategy(strategy, model.num_layers, spec=spec, recommended=recommended,
                                        overrides=overrides), config, **options)
