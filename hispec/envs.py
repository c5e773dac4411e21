"""Every ``HISPEC_*`` environment variable hispec reads, with its default and meaning.

This is the only module that reads them. Each is read when it is used (``envs.HISPEC_FUSED``), not
at import, so a test's ``monkeypatch.setenv`` or a script's ``os.environ[...] = ...`` before the
first use takes effect. The README lists the same table (``markdown_table()``; a test keeps the two
equal).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, NamedTuple


class Var(NamedTuple):
    default: str | None  # the raw value when unset (None: unset means "not forced")
    parse: Callable[[str | None], Any]
    meaning: str


def _on(raw: str | None) -> bool:
    return raw != "0"


def _choice(raw: str | None) -> str | None:
    return raw or None


def _home(raw: str | None) -> Path:
    return Path(raw) if raw else Path.home() / ".cache" / "hispec"


def _path_or_none(raw: str | None) -> Path | None:
    return Path(raw) if raw else None


VARIABLES: dict[str, Var] = {
    "HISPEC_HOME": Var(None, _home, "where converted models, compiled kernels, kernel choices and peer venvs are "
                                    "kept (default `~/.cache/hispec`)"),
    "HISPEC_PEERS": Var(None, _path_or_none, "the venvs of the benchmark peers (llama.cpp, vLLM) "
                                             "(default `$HISPEC_HOME/peers`)"),
    "HISPEC_FUSED": Var("1", _on, "`0`: no compiled C kernels; the model runs its eager PyTorch path"),
    "HISPEC_FUSED_LAYERS": Var("1", _on, "`0`: no C++ layer op; decoder layers run one kernel call at a time"),
    "HISPEC_Q4_KERNEL": Var(None, _choice, "`q4`, `int4` or `q8a`: force the 4-bit weight kernel instead of "
                                           "timing them once per machine (`q8a`: q4's weights on 8-bit activations, "
                                           "a Q8_0 head too; faster on several rows, tokens may differ from q4's)"),
    "HISPEC_Q8": Var("1", _on, "`0`: 8-bit weights run on PyTorch's int4x2 path instead of hispec's `q8` kernel"),
    "HISPEC_PREFILL_DENSE": Var("1", _on, "`0`: 4-bit layers prefill on their own kernel instead of a dense "
                                          "bfloat16 copy (CPUs with bfloat16 hardware; `q8a` on CPUs with "
                                          "integer dot products always prefills on its own rows)"),
    "HISPEC_BF16_TILES": Var("1", _on, "`0`: `q8a` layers prefill on their 8-bit activations instead of "
                                       "bfloat16 AMX tiles (CPUs with AMX-BF16: Sapphire Rapids and later)"),
    "HISPEC_HUGE_PAGES": Var("1", _on, "`0`: weights and the KV cache in ordinary 4 KiB pages instead of "
                                       "transparent huge pages (Linux)"),
    "HISPEC_PREPACK": Var("1", _on, "`0`: no packed weight copies for the float32 panel kernel"),
    "HISPEC_FREE_ROUND_GATE": Var("1", _on, "`0`: adaptive decoding takes free-draft rounds wherever the cost "
                                            "model picks drafts, also at a batch size where they measured "
                                            "slower than plain steps (the tests' setting)"),
    "HISPEC_POLICY_MEMORY": Var("1", _on, "`0`: adaptive decoding measures its modes afresh in every process "
                                          "instead of starting from what it measured before on this machine "
                                          "(`$HISPEC_HOME/policy`; the tests' setting)"),
    "HISPEC_BATCH_MATMUL": Var(None, _choice, "`panel` or `onednn`: force the float32 matmul of batched rows "
                                              "instead of timing"),
    "HISPEC_SMALL_MATMUL": Var(None, _choice, "`wxt`, `linear` or `panel`: force the float32 matmul of one or "
                                              "a few rows instead of timing"),
    "HISPEC_TP_TIMEOUT": Var("120", float, "seconds a tensor-parallel collective waits before it fails"),
}


def __getattr__(name: str) -> Any:
    """``envs.<name>``: the variable's current value, parsed."""
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raw = os.environ.get(name)
    return var.parse(raw if raw is not None else var.default)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES))


def markdown_table() -> str:
    """The variables as a Markdown table (the README's)."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, var in VARIABLES.items():
        rows.append(f"| `{name}` | {'`' + var.default + '`' if var.default is not None else 'unset'} | {var.meaning} |")
    return "\n".join(rows)
