"""Server metrics, written in the Prometheus text format by ``prometheus.Exposition``.

Counters and histograms are updated from the engine thread and the event loop under one
lock; the engine's gauges (KV blocks, waiting, running) are read at scrape time through the
``refresh`` hook (set by the engine's owner), so they are right even in the middle of a step.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

from .prometheus import Exposition, Histogram
from .vllm_metrics import VllmMetrics

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


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
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
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
        out = Exposition("hispec_")
        metric = out.family
        metric("info", "gauge", "The served model and decoding strategy.",
               [((("model", self.model_name), ("strategy", self.strategy)), 1)])
        metric("requests_total", "counter", "HTTP requests to the API by endpoint and status code.",
               [((("endpoint", e), ("status", str(s))), n) for (e, s), n in sorted(self.http.items())])
        metric("requests_finished_total", "counter",
               "Generation requests that ended, by reason (stop, length, abort = cancelled, error).",
               [((("reason", r),), n) for r, n in sorted(self.finished.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [((), self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Committed (output) tokens.", [((), self.generation_tokens)])
        levels = sorted(self.draft_tokens)
        metric("spec_draft_tokens_total", "counter", "Draft tokens proposed, per verification level.",
               [((("level", lv),), self.draft_tokens[lv]) for lv in levels])
        metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted, per verification level.",
               [((("level", lv),), self.accepted_tokens.get(lv, 0)) for lv in levels])
        metric("spec_acceptance_rate", "gauge", "Accepted / drafted tokens, per verification level.",
               [((("level", lv),),
                 self.accepted_tokens.get(lv, 0) / self.draft_tokens[lv] if self.draft_tokens[lv] else 0.0)
                for lv in levels])
        metric("spec_full_passes_total", "counter", "Forward passes through the full model.", [((), self.full_passes)])
        metric("spec_mean_accepted_length", "gauge",
               "Output tokens per full-model pass over the ended requests (1.0 = no speculation gain).",
               [((), self.spec_tokens / self.full_passes if self.full_passes else 0.0)])
        e = self.engine
        for name, kind, key, help in ENGINE_SERIES:
            metric(name, kind, help, [((), e.get(key, 0))])
        out.histogram("time_to_first_token_seconds", "Seconds from a request's arrival to its first committed token.",
                      self.ttft)
        out.histogram("time_per_output_token_seconds", "Per request: seconds per output token after the first.",
                      self.tpot)
        out.histogram("request_latency_seconds", "Seconds from a request's arrival to its end.", self.e2e)
        return out.lines + self.vllm.lines(e, self.prompt_tokens, self.generation_tokens) + process_lines()


def process_lines() -> list[str]:
    """The standard process series (Prometheus client libraries' names, as vLLM's server has them):
    CPU seconds of every thread of this process, and its resident memory where Linux says it. A
    client turns the CPU counter into cores kept busy over a run (``hispec bench serve``)."""
    out = Exposition("process_")
    times = os.times()
    out.family("cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
               [((), times.user + times.system)])
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out.family("resident_memory_bytes", "gauge", "Resident memory size in bytes.", [((), resident)])
    except (OSError, ValueError, IndexError):
        pass
    return out.lines


ENGINE_SERIES = (  # (name, kind, key in the engine's snapshot, help)
    ("kv_blocks_total", "gauge", "kv_blocks_total", "KV-cache blocks in the pool."),
    ("kv_blocks_in_use", "gauge", "kv_blocks_in_use", "KV-cache blocks held by sequences."),
    ("kv_blocks_free", "gauge", "kv_blocks_free", "KV-cache blocks free (cached prefix blocks nobody holds included)."),
    ("kv_blocks_cached", "gauge", "kv_blocks_cached", "KV-cache blocks that hold a cached prompt prefix."),
    ("prefix_cache_queries_total", "counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits_total", "counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("requests_waiting", "gauge", "waiting", "Requests queued for the batch (not yet running)."),
    ("requests_running", "gauge", "running", "Requests in the running batch."),
    ("preemptions_total", "counter", "preemptions", "Sequences preempted for KV blocks (recomputed later)."),
    ("engine_steps_total", "counter", "steps", "Engine steps run."),
)


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` from Prometheus text (for tests and tools; no escaping subtleties)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
