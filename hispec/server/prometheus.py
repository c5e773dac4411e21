"""The Prometheus text exposition format (version 0.0.4), written by hand: the one writer of
``/metrics`` (hispec's series and the same measurements under vLLM's names)."""
from __future__ import annotations

import bisect
from typing import Iterable

Labels = tuple[tuple[str, str], ...]  # (name, value) pairs, in order


class Histogram:
    """Observations counted per bucket (``value <= bound``); the caller holds any lock."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Exposition:
    """Lines of metric families named ``prefix + name``; every sample carries ``labels`` first."""

    def __init__(self, prefix: str, labels: Labels = ()) -> None:
        self.prefix, self.labels = prefix, labels
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help: str, samples: Iterable[tuple[Labels, float]]) -> None:
        """One family (``kind``: counter or gauge) and its samples, each ``(extra labels, value)``."""
        name = self.prefix + name
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{self._labels(extra)} {_num(value)}" for extra, value in samples]

    def histogram(self, name: str, help: str, h: Histogram) -> None:
        name = self.prefix + name
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(h.buckets, h.counts):
            cumulative += n
            self.lines.append(f"{name}_bucket{self._labels((('le', _num(float(bound))),))} {cumulative}")
        self.lines.append(f"{name}_bucket{self._labels((('le', '+Inf'),))} {h.count}")
        self.lines.append(f"{name}_sum{self._labels()} {_num(float(h.sum))}")
        self.lines.append(f"{name}_count{self._labels()} {h.count}")

    def _labels(self, extra: Labels = ()) -> str:
        pairs = self.labels + extra
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
