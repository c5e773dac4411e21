"""Settings resolution lives in the library: user values over the exit heads' recommendation
over depth-based defaults, validated against the model; the CLI is only an entry point."""
import ast
from pathlib import Path

import pytest

from hispec.config import ConfigError, SpecConfig
from hispec.settings import default_spec, resolve_spec

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


def test_invalid_values_fail_with_the_field_named():
    with pytest.raises(ConfigError, match="verify layer must be above the draft layer .1. and at most 6"):
        resolve_spec("hispec", 6, verify_layer=9)
    with pytest.raises(ConfigError, match="unknown strategy"):
        resolve_spec("medusa", 6)
    with pytest.raises(ConfigError, match="unknown speculation settings: depth"):
        resolve_spec("hispec", 6, depth=3)


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
