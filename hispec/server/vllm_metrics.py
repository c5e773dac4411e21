"""The same server metrics under vLLM's names and labels, so vLLM's Grafana dashboards and
alerts work unchanged (every series carries ``model_name``).

- gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (0-1; also as the older ``vllm:gpu_cache_usage_perc``);
- counters: ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total{finished_reason}``, ``vllm:num_preemptions_total``,
  ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (tokens; the hit rate is
  their ratio, as vLLM's dashboards compute it);
- histograms: ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``
  (and ``vllm:inter_token_latency_seconds``), ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_{queue,prefill,decode,inference}_time_seconds``,
  ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``;
- speculative decoding, for the level whose target is the full model (vLLM's draft -> target):
  ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``.
"""
from __future__ import annotations

from .prometheus import Exposition, Histogram

TIME_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to the context length."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """Updated by ``Metrics`` (under its lock); rendered as extra lines of ``/metrics``."""

    def __init__(self, model_name: str, max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.hists = {
            "time_to_first_token_seconds": Histogram(TIME_BUCKETS),
            "time_per_output_token_seconds": Histogram(ITL_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_queue_time_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_prefill_time_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_decode_time_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_inference_time_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_prompt_tokens": Histogram(token_buckets(max_model_len)),
            "request_generation_tokens": Histogram(token_buckets(max_model_len)),
        }
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def finish(self, reason: str, stats: dict | None, prompt_tokens: int, num_tokens: int, seconds: float,
               ttft: float | None, queue: float | None) -> None:
        """One request ended: ``seconds`` since arrival, ``ttft`` to its first token, ``queue``
        until it was first scheduled (None if never)."""
        self.success[reason] = self.success.get(reason, 0) + 1
        h = self.hists
        h["e2e_request_latency_seconds"].observe(seconds)
        h["request_prompt_tokens"].observe(prompt_tokens)
        h["request_generation_tokens"].observe(num_tokens)
        if queue is not None:
            h["request_queue_time_seconds"].observe(queue)
            h["request_inference_time_seconds"].observe(seconds - queue)
            if ttft is not None:
                h["request_prefill_time_seconds"].observe(max(0.0, ttft - queue))
        if ttft is not None:
            h["request_decode_time_seconds"].observe(seconds - ttft)
            if num_tokens > 1:
                per_token = (seconds - ttft) / (num_tokens - 1)
                h["time_per_output_token_seconds"].observe(per_token)
                h["inter_token_latency_seconds"].observe(per_token)
        for name, lv in ((stats or {}).get("levels") or {}).items():
            if name.endswith("->final"):
                self.drafts += lv["rounds"]
                self.draft_tokens += lv["draft_tokens"]
                self.accepted_tokens += lv["accepted_tokens"]
                per_pos = lv["accepted_per_position"]
                self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
                for j, n in enumerate(per_pos):
                    self.accepted_per_pos[j] += n

    def lines(self, engine: dict, prompt_tokens: int, generation_tokens: int) -> list[str]:
        out = Exposition("vllm:", (("model_name", self.model_name),))

        def metric(name: str, kind: str, help: str, samples: list[tuple[tuple, float]]) -> None:
            out.family(name + ("_total" if kind == "counter" else ""), kind, help, samples)

        total = engine.get("kv_blocks_total", 0)
        usage = engine.get("kv_blocks_in_use", 0) / total if total else 0.0
        metric("num_requests_running", "gauge", "Number of requests in model execution batches.",
               [((), engine.get("running", 0))])
        metric("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [((), engine.get("waiting", 0))])
        metric("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [((), usage)])
        metric("gpu_cache_usage_perc", "gauge", "KV-cache usage (the older name). 1 means 100 percent usage.",
               [((), usage)])
        metric("num_preemptions", "counter", "Cumulative number of preemptions.", [((), engine.get("preemptions", 0))])
        metric("prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.",
               [((), engine.get("prefix_cache_queries", 0))])
        metric("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
               [((), engine.get("prefix_cache_hits", 0))])
        metric("prompt_tokens", "counter", "Number of prefill tokens processed.", [((), prompt_tokens)])
        metric("generation_tokens", "counter", "Number of generation tokens processed.", [((), generation_tokens)])
        metric("request_success", "counter", "Count of finished requests by finish reason.",
               [((("finished_reason", r),), n) for r, n in self.success.items()])
        metric("spec_decode_num_drafts", "counter", "Number of spec decoding drafts (full-model verifications).",
               [((), self.drafts)])
        metric("spec_decode_num_draft_tokens", "counter", "Number of draft tokens.", [((), self.draft_tokens)])
        metric("spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.", [((), self.accepted_tokens)])
        metric("spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
               [((("position", str(j)),), n) for j, n in enumerate(self.accepted_per_pos)])
        for name, h in self.hists.items():
            out.histogram(name, f"Histogram of {name.replace('_', ' ')}.", h)
        return out.lines
