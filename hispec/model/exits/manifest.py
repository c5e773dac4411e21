"""``manifest.json``: what a set of exit heads is, for which model, how it was made, how good it
is and the settings it recommends."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ...config import SPEC_FIELDS, ConfigError, SpecConfig
from ...settings import StrategyName
from .errors import ExitHeadError

FORMAT = "hispec-exit-heads"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DESIGNS = ("linear", "block", "block-final")  # ExitHead (head.py), ExitBlock (model/exits/block.py)


@dataclasses.dataclass
class Manifest:
    """``manifest.json``: what the heads are, for which model, how made, how good, how to use."""

    base_model: dict[str, Any]  # model_identity()
    layers: list[int]
    design: dict[str, Any]  # {"kind": "linear" | "block" | "mixed", "kinds": {layer: kind} (mixed), "vocab": {layer: K or None}}
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    training: dict[str, Any] = dataclasses.field(default_factory=dict)  # command, steps, seed, seconds
    agreement: dict[str, Any] = dataclasses.field(default_factory=dict)  # per layer: before/after top-1/top-5
    recommended: dict[str, Any] = dataclasses.field(default_factory=dict)  # SpecConfig fields (hispec)
    recommended_selfspec: dict[str, Any] = dataclasses.field(default_factory=dict)
    tuning: dict[str, Any] = dataclasses.field(default_factory=dict)
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> "Manifest":
        if raw.get("format") != FORMAT:
            raise ExitHeadError(f"{where} is not an exit-head manifest (format {raw.get('format')!r})")
        if raw.get("version", 0) > FORMAT_VERSION:
            raise ExitHeadError(f"{where} has format version {raw['version']}; this hispec reads "
                                f"version {FORMAT_VERSION}: upgrade hispec")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            m = cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as e:
            raise ExitHeadError(f"{where} is incomplete: {e}") from None
        m.layers = [int(x) for x in m.layers]
        for L in m.layers:
            if m.kind_of(L) not in DESIGNS:
                raise ExitHeadError(f"{where}: unknown head design {m.kind_of(L)!r} at layer {L} "
                                    f"(known: {', '.join(DESIGNS)})")
        return m

    def kind_of(self, layer: int) -> str:
        """The design of the exit at ``layer`` (a mixed set names each layer's in ``design.kinds``)."""
        return (self.design.get("kinds") or {}).get(str(layer), self.design.get("kind"))

    def vocab_size_of(self, layer: int) -> int | None:
        v = (self.design.get("vocab") or {}).get(str(layer))
        return int(v) if v else None

    def spec(self, num_layers: int, which: str = StrategyName.HISPEC) -> SpecConfig | None:
        """The recommended settings for ``which`` (hispec: ``recommended``; selfspec:
        ``recommended_selfspec``), validated against the depth; None: none recommended."""
        rec = self.recommended if which == StrategyName.HISPEC else self.recommended_selfspec
        if not rec:
            return None
        try:
            return SpecConfig(**{k: rec[k] for k in SPEC_FIELDS if k in rec}, num_layers=num_layers)
        except (ConfigError, TypeError) as e:
            raise ExitHeadError(f"the manifest's recommended settings are invalid: {e}") from None


def read_manifest(folder: Path) -> Manifest:
    folder = Path(folder)
    f = folder / MANIFEST_FILE if folder.is_dir() else folder
    if not f.is_file():
        raise ExitHeadError(f"no exit heads at {folder}: {MANIFEST_FILE} is missing")
    try:
        raw = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExitHeadError(f"cannot read {f}: {e}") from None
    return Manifest.from_dict(raw, str(f))


def write_manifest(folder: Path, manifest: Manifest) -> None:
    tmp = Path(folder) / (MANIFEST_FILE + ".tmp")
    tmp.write_text(manifest.to_json())
    tmp.replace(Path(folder) / MANIFEST_FILE)


def describe(manifest: Manifest) -> str:
    rec = manifest.recommended
    vocab = manifest.design.get("vocab") or {}
    layers = ", ".join(f"{L}" + (f" (vocab {vocab.get(str(L))})" if vocab.get(str(L)) else "")
                       for L in manifest.layers)
    parts = [f"exit heads at layers {layers}"]
    if rec:
        parts.append("recommended " + " ".join(f"{k}={rec[k]}" for k in SPEC_FIELDS if k in rec))
    return "; ".join(parts)
