"""Settings resolution lives in the library: user values over the exit heads' recommendation
over depth-based defaults, validated against the model; the CLI is only an entry point."""
import ast
from pathlib import Path

import pytest

from hispec.config import ConfigError, SpecConfig
from hispec.decode import make_strategy
from hispec.config import DraftPolicyName
from hispec.settings import SPECULATIVE, STRATEGIES, STRATEGY_KINDS, StrategyName, default_spec, resolve_spec

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_then_recommendation_then_user_values():
    assert resolve_spec("hispec", 30) == default_spec(30)
    rec = {"hispec": SpecConfig(2, 24, 1, 2, "svip", num_layers=30)}
    assert resolve_spec("hispec", 30, rec) == rec["hispec"]
    got = resolve_spec("hispec", 30, rec, window=5, draft_layer=None)
    assert (got.draft_layer, got.verify_layer, got.window, got.draft_policy) == (2, 24, 5, "svip")


def test_selfspec_verifies_with_the_full_model_unless_told():
    rec = {"hispec": SpecConfig(2, 24, num_layers=30)}
    assert resolve_spec("selfspec", 30, rec).verify_layer == 30
    assert resolve_spec("selfspec", 30, rec, verify_layer=20).verify_layer == 20
    own = {**rec, "selfspec": SpecConfig(4, 30, num_draft=2, num_layers=30)}
    assert resolve_spec("selfspec", 30, own) == own["selfspec"]


def test_names_are_enumerations_equal_to_their_text():
    """A name a user or a JSON body gives finds the enumeration's member, and a member prints, hashes
    and serializes as its text."""
    assert StrategyName("lookup") is StrategyName.LOOKUP and "ar" == StrategyName.AR
    assert {"hispec": 1}[StrategyName.HISPEC] == 1 and f"{StrategyName.SELFSPEC}-tree" == "selfspec-tree"
    assert STRATEGIES == ("ar", "selfspec", "hispec", "lookup")
    spec = resolve_spec("hispec", 30, draft_policy="svip")
    assert spec.draft_policy is DraftPolicyName.SVIP and SpecConfig(2, 4).draft_policy == "fixed"


def test_settings_per_method():
    """ar has no speculation settings; lookup drafts without exits, so exit layers are not its
    settings: any given are left aside (not validated), the depth-based ones stand."""
    assert resolve_spec("ar", 30, draft_layer=99) is None
    got = resolve_spec("lookup", 30, {"hispec": SpecConfig(2, 24, num_layers=30)}, draft_layer=99, verify_layer=0,
                       lookup_max_draft=6)
    assert (got.draft_layer, got.verify_layer, got.lookup_max_draft) == (default_spec(30).draft_layer, 30, 6)
    with pytest.raises(ConfigError, match="draft layer 99"):
        resolve_spec("selfspec", 30, draft_layer=99)


def test_invalid_values_fail_with_the_field_named():
    with pytest.raises(ConfigError, match="verify layer must be above the draft layer .1. and at most 6"):
        resolve_spec("hispec", 6, verify_layer=9)
    with pytest.raises(ConfigError, match="unknown strategy"):
        resolve_spec("medusa", 6)
    with pytest.raises(ConfigError, match="unknown speculation settings: depth"):
        resolve_spec("hispec", 6, depth=3)


def test_each_strategy_is_its_one_line_in_the_list():
    """Every listed strategy builds a class of its name, with settings where it speculates; the
    commands offer exactly the listed ones (adding a strategy is its line plus its class)."""
    for kind in STRATEGY_KINDS:
        strategy = make_strategy(kind.name, num_layers=12)
        assert strategy.name == kind.name
        assert (getattr(strategy, "spec", None) is not None) == kind.speculative == (kind.name in SPECULATIVE)
    with pytest.raises(ConfigError, match="unknown strategy 'medusa'"):
        make_strategy("medusa")
    from hispec.bench.commands import DEFAULT_STRATEGIES
    from hispec.bench.strategies import OWN_KINDS
    from hispec.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("generate", "serve"):
        choices = next(a.choices for a in sub[command]._actions if a.dest == "strategy")
        assert tuple(choices) == STRATEGIES, command
    assert OWN_KINDS == STRATEGIES and set(STRATEGIES) <= set(DEFAULT_STRATEGIES.split(","))


def test_names_written_as_text_in_the_registries_alone():
    """Code names strategies and draft policies through ``StrategyName`` / ``DraftPolicyName``; their
    text appears as a string literal only where it must ("hispec" is also the package's name, so
    it is not counted)."""
    import io
    import re
    import tokenize

    names = {"ar", "selfspec", "lookup", "fixed", "svip", "confidence", "heuristic"}
    allowed = {
        "hispec/settings.py", "hispec/config.py",  # the registries
        "hispec/bench/peer_worker.py",  # runs in a peer's own venv: the standard library only at its top
        "hispec/bench/peers.py",  # llama.cpp's own speculative mode is called "lookup"
        "hispec/spec/proposers/lookup.py",  # "lookup" the draft source (stats' rounds), not the strategy
    }
    found = set()
    for path in (ROOT / "hispec").rglob("*.py"):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
            m = tok.type == tokenize.STRING and re.fullmatch(r"""(["'])(\w+)\1""", tok.string)
            if m and m.group(2) in names:
                found.add(path.relative_to(ROOT).as_posix())
    assert found <= allowed, sorted(found - allowed)


def test_no_module_imports_the_cli():
    offenders = []
    for path in (ROOT / "hispec").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                absolute = node.module or ""
                if node.level:
                    package = path.relative_to(ROOT).parent.parts
                    base = package[:len(package) - node.level + 1]
                    absolute = ".".join([*base, node.module] if node.module else base)
                if absolute == "hispec.cli":
                    offenders.append(str(path.relative_to(ROOT)))
            elif isinstance(node, ast.Import) and any(a.name == "hispec.cli" for a in node.names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], offenders
