"""What a serving benchmark reports, from per-request outcomes (vLLM's ``vllm bench serve`` metrics).

- TTFT: seconds from sending a request to its first streamed chunk with text.
- ITL (inter-token latency): the gaps between a stream's consecutive chunks with text (a chunk may
  carry several tokens: a speculative server commits several at once, and its ITL says so).
- TPOT (time per output token): per request, ``(E2E - TTFT) / (output tokens - 1)``, for requests
  with more than one output token.
- E2E latency (``e2el``): seconds from sending a request to its end.
- request, output-token and total-token throughput over the run's wall time; goodput: requests
  per second that met every SLO given (``ttft``, ``tpot``, ``e2el``, in milliseconds).

Percentiles interpolate linearly between closest ranks (numpy's default, as vLLM).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class Outcome:
    """One request as the client saw it (seconds, ``perf_counter`` clock)."""

    ok: bool
    start: float = 0.0
    ttft: float | None = None
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_tokens: int = 0
    error: str | None = None
    finish_reason: str | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: list[float]) -> float:
    if not values:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))  # population std, as numpy's default


def percentile_label(q: float) -> str:
    """``99`` -> ``p99``, ``99.9`` -> ``p99.9``."""
    return f"p{q:g}"


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` (or space-separated) -> ``[50.0, 90.0, 99.0]``; each in (0, 100]."""
    out = []
    for part in text.replace(",", " ").split():
        try:
            q = float(part)
        except ValueError:
            raise ValueError(f"not a percentile: {part!r}") from None
        if not 0 < q <= 100:
            raise ValueError(f"a percentile is in (0, 100], got {part}")
        out.append(q)
    if not out:
        raise ValueError("no percentiles given")
    return out


def parse_slo(text: str | list[str] | None) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` (or vLLM's ``--goodput ttft:500 tpot:50``) -> ``{"ttft": 500.0, "tpot": 50.0}``,
    in milliseconds; keys ``ttft``, ``tpot``, ``e2el``."""
    if text is None:
        return {}
    parts = text if isinstance(text, list) else [text]
    slo: dict[str, float] = {}
    for item in (p for t in parts for p in t.replace(",", " ").split()):
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"an SLO is ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"the SLO {key} needs milliseconds, got {value!r}") from None
        if ms <= 0:
            raise ValueError(f"the SLO {key} must be > 0 ms, got {value}")
        slo[key] = ms
    return slo


def meets_slo(o: Outcome, slo: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (milliseconds); a one-token request's TPOT is 0."""
    if not o.ok:
        return False
    values = {"ttft": o.ttft if o.ttft is not None else o.latency, "tpot": o.tpot or 0.0, "e2el": o.latency}
    return all(values[k] * 1000.0 <= limit for k, limit in slo.items())


def compute_metrics(outcomes: list[Outcome], duration: float, percentiles=DEFAULT_PERCENTILES,
                    slo: dict[str, float] | None = None) -> dict:
    """vLLM's result fields: ``completed``, ``failed``, token totals, throughputs, ``request_goodput``
    (None without an SLO) and, per metric M in ttft/tpot/itl/e2el, ``mean_M_ms``, ``median_M_ms``,
    ``std_M_ms`` and ``pQ_M_ms`` for each percentile Q."""
    ok = [o for o in outcomes if o.ok]
    samples = {
        "ttft": [o.ttft for o in ok if o.ttft is not None],
        "tpot": [t for t in (o.tpot for o in ok) if t is not None],
        "itl": [g for o in ok for g in o.itl],
        "e2el": [o.latency for o in ok],
    }
    total_in = sum(o.input_tokens for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "request_goodput": rate(sum(meets_slo(o, slo) for o in ok)) if slo else None,
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    for m in METRICS:
        ms = [v * 1000.0 for v in samples[m]]
        out[f"mean_{m}_ms"] = _mean(ms)
        out[f"median_{m}_ms"] = percentile(ms, 50)
        out[f"std_{m}_ms"] = _std(ms)
        for q in percentiles:
            out[f"{percentile_label(q)}_{m}_ms"] = percentile(ms, q)
    return out


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent: a Poisson process of
    ``request_rate`` requests/s (gaps exponential) for ``burstiness`` 1, gamma gaps of shape
    ``burstiness`` and the same mean otherwise (< 1 burstier, > 1 more even: vLLM's
    ``--burstiness``); all at 0 for an infinite rate. Deterministic for a seed."""
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("the request rate and the burstiness must be > 0")
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0] + [float(t) for t in np.cumsum(gaps)]
