"""Exit heads: small trained heads that turn the hidden state after ``L`` decoder layers into
next-token logits for a model not trained for early exit (see ``head.py`` for the design).

One job per module: ``head`` (the module), ``fingerprint`` (which base model), ``manifest``
(``manifest.json``), ``files`` (save/load), ``attached`` (the ``ExitSet`` a ``Generator``
holds). This file finds heads for a model (``find_heads``) and attaches them
(``attach_exits``).
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from .attached import ExitSet
from .errors import ExitHeadError
from .fingerprint import ARCH_FIELDS, identity_mismatch, model_identity
from .files import WEIGHTS_FILE, load_heads, new_heads, save_heads
from .head import ExitHead
from .manifest import (DESIGNS, FORMAT, FORMAT_VERSION, MANIFEST_FILE, SPEC_FIELDS, Manifest, describe,
                       read_manifest, write_manifest)

__all__ = ["ARCH_FIELDS", "DESIGNS", "FORMAT", "FORMAT_VERSION", "MANIFEST_FILE", "SHIPPED_DIR", "SPEC_FIELDS",
           "WEIGHTS_FILE", "ExitHead", "ExitHeadError", "ExitSet", "Manifest", "attach", "attach_exits",
           "describe", "find_heads", "identity_mismatch", "load_heads", "model_identity", "new_heads",
           "read_manifest", "save_heads", "shipped_heads", "write_manifest"]

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "exits"  # package data: hispec/exits/<name>/


def shipped_heads() -> list[Path]:
    """Folders of heads shipped with hispec (package data), sorted by name."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.parent for p in SHIPPED_DIR.glob(f"*/{MANIFEST_FILE}"))


def find_heads(model: nn.Module, model_path: Path | None = None) -> Path | None:
    """Heads for this model: an ``exits/`` folder inside the model folder, else shipped heads
    whose manifest matches the model; None if there are none."""
    if model_path is not None and (Path(model_path) / "exits" / MANIFEST_FILE).is_file():
        return Path(model_path) / "exits"
    for folder in shipped_heads():
        try:
            manifest = read_manifest(folder)
        except ExitHeadError:
            continue
        if identity_mismatch(model, manifest.base_model) is None:
            return folder
    return None


def attach(gen, heads: dict[int, ExitHead], manifest: Manifest | None, path: Path | None = None) -> ExitSet:
    """Give ``gen`` (a ``Generator``) these heads and the manifest's recommended settings."""
    offline = sorted(L for L, h in heads.items() if getattr(h, "reads_final", False))
    if offline:
        raise ExitHeadError(f"the exits at layer(s) {', '.join(map(str, offline))} are of design block-final, which "
                            "the decoding engine does not run yet (it would have to feed them the final states); "
                            "they are measured offline by `hispec distill-exits`")
    exits = ExitSet.from_manifest(heads, manifest, path, gen.model.num_layers)
    gen.use_exits(exits)
    return exits


def attach_exits(gen, path: str | Path | None = None) -> Manifest | None:
    """Attach exit heads to a ``Generator``: those at ``path``, or (None) the model's own.

    With ``path=None`` the heads are discovered (``find_heads``); if none are found the
    generator is left unchanged (exits through the shared head). A manifest for another
    model raises ExitHeadError.
    """
    model = gen.model
    if path is None:
        path = find_heads(model, gen.model_path)
        if path is None:
            return None
    path = Path(path)
    if not path.exists():
        raise ExitHeadError(f"--exits {path}: no such folder")
    heads, manifest = load_heads(path, model)
    attach(gen, heads, manifest, path)
    return manifest
