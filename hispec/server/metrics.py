"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Counters and histograms are updated from the engine thread and the event loop under one
lock; the engine's gauges (KV blocks, waiting, running) are read at scrape time through the
``refresh`` hook (set by the engine's owner), so they are right even in the middle of a step.
"""
from __future__ import annotations

import bisect
import threading
from typing import Callable

from .vllm_metrics import VllmMetrics

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

PREFIX = "hispec"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_num(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self, model_name: str = "", strategy: str = "", max_model_len: int = 2048) -> None:
        self.lock = threading.Lock()
        self.vllm = VllmMetrics(model_name, max_model_len)  # the same measurements under vLLM's names
        self.model_name, self.strategy = model_name, strategy
        self.http: dict[tuple[str, int], int] = {}  # (endpoint, status code) -> requests
        self.finished: dict[str, int] = {}  # finish reason (stop, length, abort, error) -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.draft_tokens: dict[str, int] = {}  # per verification level
        self.accepted_tokens: dict[str, int] = {}
        self.full_passes = 0
        self.spec_tokens = 0  # tokens of the requests whose full passes are counted
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first committed token.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Per request: seconds per output token after the first.", TPOT_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}_request_latency_seconds",
                             "Seconds from a request's arrival to its end.", E2E_BUCKETS)
        self.engine: dict = {}  # the engine's gauges, as of the last refresh
        self.refresh: Callable[[], None] | None = None  # updates ``engine`` (via set_engine) before a render

    # ---- updates ------------------------------------------------------------------------------
    def count_http(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.http[(endpoint, status)] = self.http.get((endpoint, status), 0) + 1

    def add_prompt(self, num_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += num_tokens

    def add_generated(self, num_tokens: int) -> None:
        with self.lock:
            self.generation_tokens += num_tokens

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def finish(self, reason: str, stats: dict | None, num_tokens: int, seconds: float,
               ttft: float | None, prompt_tokens: int = 0, queue: float | None = None) -> None:
        with self.lock:
            self.vllm.finish(reason, stats, prompt_tokens, num_tokens, seconds, ttft, queue)
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(seconds)
            if ttft is not None and num_tokens > 1:
                self.tpot.observe((seconds - ttft) / (num_tokens - 1))
            if stats:
                for name, lv in stats.get("levels", {}).items():
                    self.draft_tokens[name] = self.draft_tokens.get(name, 0) + lv["draft_tokens"]
                    self.accepted_tokens[name] = self.accepted_tokens.get(name, 0) + lv["accepted_tokens"]
                if stats.get("full_passes"):
                    self.full_passes += stats["full_passes"]
                    self.spec_tokens += num_tokens

    def set_engine(self, snapshot: dict) -> None:
        with self.lock:
            self.engine = snapshot

    # ---- reading ------------------------------------------------------------------------------
    def engine_snapshot(self) -> dict:
        with self.lock:
            return dict(self.engine)

    def render(self) -> str:
        if self.refresh is not None:
            self.refresh()
        with self.lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        p = PREFIX
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {p}_{name} {help}")
            out.append(f"# TYPE {p}_{name} {kind}")
            for labels, value in samples:
                out.append(f"{p}_{name}{labels} {_num(value)}")

        info = f'{{model="{_label(self.model_name)}",strategy="{_label(self.strategy)}"}}'
        metric("info", "gauge", "The served model and decoding strategy.", [(info, 1)])
        metric("requests_total", "counter", "HTTP requests to the API by endpoint and status code.",
               [(f'{{endpoint="{_label(e)}",status="{s}"}}', n) for (e, s), n in sorted(self.http.items())])
        metric("requests_finished_total", "counter",
               "Generation requests that ended, by reason (stop, length, abort = cancelled, error).",
               [(f'{{reason="{_label(r)}"}}', n) for r, n in sorted(self.finished.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Committed (output) tokens.", [("", self.generation_tokens)])
        levels = sorted(self.draft_tokens)
        metric("spec_draft_tokens_total", "counter", "Draft tokens proposed, per verification level.",
               [(f'{{level="{_label(lv)}"}}', self.draft_tokens[lv]) for lv in levels])
        metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted, per verification level.",
               [(f'{{level="{_label(lv)}"}}', self.accepted_tokens.get(lv, 0)) for lv in levels])
        metric("spec_acceptance_rate", "gauge", "Accepted / drafted tokens, per verification level.",
               [(f'{{level="{_label(lv)}"}}',
                 self.accepted_tokens.get(lv, 0) / self.draft_tokens[lv] if self.draft_tokens[lv] else 0.0)
                for lv in levels])
        metric("spec_full_passes_total", "counter", "Forward passes through the full model.", [("", self.full_passes)])
        metric("spec_mean_accepted_length", "gauge",
               "Output tokens per full-model pass over the ended requests (1.0 = no speculation gain).",
               [("", self.spec_tokens / self.full_passes if self.full_passes else 0.0)])
        e = self.engine
        metric("kv_blocks_total", "gauge", "KV-cache blocks in the pool.", [("", e.get("kv_blocks_total", 0))])
        metric("kv_blocks_in_use", "gauge", "KV-cache blocks held by sequences.", [("", e.get("kv_blocks_in_use", 0))])
        metric("kv_blocks_free", "gauge", "KV-cache blocks free.", [("", e.get("kv_blocks_free", 0))])
        metric("requests_waiting", "gauge", "Requests queued for the batch (not yet running).",
               [("", e.get("waiting", 0))])
        metric("requests_running", "gauge", "Requests in the running batch.", [("", e.get("running", 0))])
        metric("preemptions_total", "counter", "Sequences preempted for KV blocks (recomputed later).",
               [("", e.get("preemptions", 0))])
        metric("engine_steps_total", "counter", "Engine steps run.", [("", e.get("steps", 0))])
        for h in (self.ttft, self.tpot, self.e2e):
            out.extend(h.render())
        out.extend(self.vllm.lines(e, self.prompt_tokens, self.generation_tokens))
        return out


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` from Prometheus text (for tests and tools; no escaping subtleties)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
