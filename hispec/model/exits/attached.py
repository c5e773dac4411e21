"""The exit heads a ``Generator`` uses and the settings they recommend, as one object."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...config import SpecConfig
from ...settings import RECOMMENDED, recommended_for
from .head import ExitHead
from .manifest import Manifest


@dataclass(frozen=True)
class ExitSet:
    """Heads by exit layer, where they came from, and their recommended settings per strategy."""

    heads: dict[int, ExitHead]
    manifest: Manifest | None = None
    path: Path | None = None
    specs: dict[str, SpecConfig] = field(default_factory=dict)  # settings.RECOMMENDED's strategies -> settings

    @classmethod
    def from_manifest(cls, heads: dict[int, ExitHead], manifest: Manifest | None, path: Path | None,
                      num_layers: int) -> "ExitSet":
        specs = {} if manifest is None else {name: s for name in RECOMMENDED
                                             if (s := manifest.spec(num_layers, name)) is not None}
        return cls(dict(heads), manifest, None if path is None else Path(path), specs)

    def spec_for(self, strategy: str) -> SpecConfig | None:
        """The recommended settings for ``strategy`` (the default strategy's, hispec's, stand in for
        a strategy without its own)."""
        return recommended_for(strategy, self.specs)
