"""The batched engine: continuous batching of many requests over one paged KV pool.

Each ``step()`` admits waiting requests (prefilling them in one ragged pass), runs one round
of the strategy for every running sequence together -- sequences at different positions,
accepting different numbers of tokens, as flat tensors with offsets and block tables --
commits the tokens, and retires finished sequences at once.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time

import torch

from ..cache.paged import PagedCache
from ..config import IDLE_PREFILL_CHUNKS, ConfigError, EngineConfig, SamplingParams, check_engine_options
from ..decode.base import DecodeContext, Strategy
from ..decode.stats import DecodeStats, phase_timer
from ..model.decoder import DecoderModel
from ..model.runner import LayerRunner
from ..sampling.logprobs import TokenLogprob, token_logprobs
from ..sampling.processors import LogitsProcessor
from ..settings import SPECULATIVE
from ..spec.policy import AdaptiveController, SpecPolicy, SuffixStore, policy_key
from .outputs import RequestOutput
from .scheduler import Scheduler
from .sequence import Sequence


log = logging.getLogger("hispec.engine")
_warned_rows = False


def _warn_if_rows_interact(model: DecoderModel, strategy: Strategy, max_batch_size: int) -> None:
    """Once per process: on CUDA in a half precision the GPU's matrix kernels are chosen by a
    pass's row count, so a row's logits (and greedy tokens) can depend on how many rows it shares a
    pass with. hispec's own CPU kernels give every row the same bits alone or among others."""
    global _warned_rows
    if _warned_rows or model.device.type != "cuda" or model.dtype not in (torch.bfloat16, torch.float16):
        return
    if strategy.name in SPECULATIVE or max_batch_size > 1:
        _warned_rows = True
        log.warning("on CUDA in %s, speculative strategies and batches can give other tokens than ar one request "
                    "at a time (the GPU's matrix kernels round a row by how many rows share its pass; measured on "
                    "an H200: selfspec and hispec parted from ar on 3 of 4 prompts); --dtype float32 kept them "
                    "identical", str(model.dtype).removeprefix("torch."))


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context."""


DEFAULT_SEQ_TOKENS = 1024  # tokens per sequence a pool is sized for before any request is known


def kv_blocks_for(model: DecoderModel, block_size: int, *, kv_blocks: int | None = None,
                  memory_fraction: float | None = None, min_tokens: int = 0, num_seqs: int = 1) -> int:
    """The one KV pool sizing rule: ``kv_blocks``, or a fraction of the device's free memory, or
    enough for ``num_seqs`` sequences of ``min_tokens`` positions each (plus one spare block each)."""
    check_engine_options({"kv_blocks": kv_blocks, "kv_memory_fraction": memory_fraction})
    if kv_blocks is not None:
        return kv_blocks
    cfg = model.cfg
    block_bytes = 2 * model.kv_layers * block_size * cfg.num_kv_heads * cfg.head_dim * model.kv_dtype.itemsize
    if memory_fraction is not None:
        return max(1, int(_free_memory(model.device) * memory_fraction) // block_bytes)
    return (-(-max(min_tokens, 1) // block_size) + 1) * max(1, num_seqs)


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


class Engine:
    """Many requests, one model, one strategy (one of ``settings.STRATEGIES``), fixed for its life.

    ``config`` (or the same fields as keywords) sets the batch size, the pool size and adaptive
    speculation; whether and what to speculate each step is the speculation policy's
    (``spec.policy.SpecPolicy``): ``controller`` hands it an adaptive controller that outlives the
    engine (the ``Generator`` keeps one per strategy and settings). ``cache`` reuses a pool no request holds
    when it is big enough; else the pool is sized for ``num_seqs`` sequences (default: the batch
    size) of ``seq_tokens`` tokens (default: ``min(context, DEFAULT_SEQ_TOKENS)``).

    The scheduler is the only allocator: before each step it reserves, for every running
    sequence, the slots the step may write (the strategy's ``lookahead``); the layer runner only
    reads the block tables, and a rollback inside a step keeps the reserved blocks.

    Free drafts across requests: a strategy with free rounds (``lookup``, ``hispec``) drafts
    for greedy sequences from the outputs of the engine's finished requests of the same scope
    (``add_request``'s ``draft_scope``; ``suffix``: a ``SuffixStore`` that outlives the engine,
    else one of its own sized by the config; none with ``suffix_cache_entries=0``).

    Prefix caching (``config.prefix_caching``): the blocks a prefill fills are keyed by their
    prompt prefix, and a later request of the same ``cache_scope`` whose prompt starts the same
    way starts its prefill after them (``cache.prefix``). Requests that ask for prompt
    log-probabilities prefill their whole prompt.
    """

    def __init__(self, model: DecoderModel, strategy: Strategy, config: EngineConfig | None = None, *,
                 tokenizer=None, eos_ids=frozenset(), controller: AdaptiveController | None = None,
                 cache: PagedCache | None = None, seq_tokens: int | None = None, num_seqs: int | None = None,
                 suffix: SuffixStore | None = None, **settings) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = dataclasses.replace(config or EngineConfig(), **settings)
        self.strategy = strategy
        self.eos_ids = frozenset(eos_ids)
        self.speculation = SpecPolicy(strategy, self.config.adaptive, controller, suffix,
                                      self.config.suffix_cache_entries, self.config.suffix_cache_scopes,
                                      policy_key(model, strategy) if self.config.adaptive else None)
        _warn_if_rows_interact(model, strategy, self.config.max_batch_size)
        self._seq_ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._max_batch_size = self.config.max_batch_size
        seq_tokens = seq_tokens or min(model.cfg.max_position_embeddings, DEFAULT_SEQ_TOKENS)
        need = self.pool_blocks(seq_tokens, num_seqs or self.config.max_batch_size)
        fits = (cache is not None and cache.block_size == self.config.block_size and cache.blocks.num_used_blocks == 0
                and len(cache.pool.k) == model.kv_layers and cache.pool.k[0].dtype == model.kv_dtype
                and (cache.num_blocks == need if self.config.fixed_pool else cache.num_blocks >= need))
        self._use_cache(cache if fits else PagedCache.for_model(model, need, self.config.block_size))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    @property
    def lookahead(self) -> int:
        """Positions one step may add to a sequence: the strategy's declaration."""
        return self.strategy.lookahead

    @property
    def adaptive(self) -> AdaptiveController | None:
        """The speculation policy's adaptive controller (None: it always speculates)."""
        return self.speculation.controller

    @property
    def suffix(self) -> SuffixStore | None:
        """The suffix caches of earlier outputs, per scope (None: no free drafts across requests)."""
        return self.speculation.suffix

    # ---- the pool ------------------------------------------------------------------------
    def pool_blocks(self, seq_tokens: int, num_seqs: int) -> int:
        """Blocks for ``num_seqs`` sequences of ``seq_tokens`` tokens, unless the config fixes the size."""
        c = self.config
        return kv_blocks_for(self.model, c.block_size, kv_blocks=c.kv_blocks, memory_fraction=c.kv_memory_fraction,
                             min_tokens=seq_tokens + self.lookahead, num_seqs=num_seqs)

    def fit_pool(self, seq_tokens: int, num_seqs: int) -> None:
        """Make the pool big enough for the requests about to be added (only while none is in
        flight). A pool that is big enough is kept, as the ``Generator`` keeps its own: a new one
        is allocated and zeroed (~1 s per GB), which calls of varying sizes would pay each time."""
        if self.config.fixed_pool:  # sized once, from the options
            return
        need = self.pool_blocks(seq_tokens, num_seqs)
        if need > self.blocks.num_blocks:
            assert not self._requests, "cannot resize the KV pool with requests in flight"
            self._use_cache(PagedCache.for_model(self.model, need, self.config.block_size))

    def _use_cache(self, cache: PagedCache) -> None:
        self.cache = cache
        self.blocks, self.pool = cache.blocks, cache.pool
        self.blocks.use_prefix_salt(self._prefix_salt())
        self.runner = LayerRunner(self.model, self.blocks, self.pool, reserved=True)
        self.scheduler = Scheduler(self.blocks, self._max_batch_size, self.lookahead)

    def _prefix_salt(self) -> tuple:
        """What the pool's K/V is computed with: cached blocks made with anything else are not reused."""
        m = self.model
        return (id(m), m.weight_format, str(m.kv_dtype), tuple((L, id(e)) for L, e in m.kv_exits().items()))

    def set_max_batch_size(self, n: int) -> None:
        """Decode at most ``n`` sequences together from the next step on."""
        check_engine_options({"max_batch_size": n})
        self._max_batch_size = self.scheduler.max_batch_size = n

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    draft_scope: str | None = None, cache_scope: str = "") -> str:
        """Queue a request; its id. ``draft_scope``: whose earlier outputs may draft for it and
        take its output when it finishes (None: the engine's default scope); see ``SuffixStore``.
        ``cache_scope``: requests share cached prompt blocks only within one scope (e.g. an API key)."""
        max_pos = self.model.cfg.max_position_embeddings
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if len(prompt_ids) >= max_pos:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                     f"{max_pos} tokens, so at most {max_pos - 1} fit with one new token")
        seq_id = next(self._seq_ids)
        request_id = request_id if request_id is not None else f"req-{seq_id}"
        if request_id in self._requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        seed = None
        if not params.greedy:
            # a fresh seed from the OS (torch.seed() re-seeded the process's own generator, and every
            # device's, capturing a stack trace each time: ~1 ms a request in a server's engine thread)
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        ctx = DecodeContext(self.runner, seq_id, list(prompt_ids), params, seed, DecodeStats(self.strategy.name),
                            min(len(prompt_ids) + params.max_new_tokens, max_pos),
                            frozenset() if params.ignore_eos else self.eos_ids)
        if params.modifies_logits:
            ctx.processor = LogitsProcessor(params, self.model.cfg.vocab_size, self.model.device)
        self.speculation.attach(ctx, draft_scope)
        seq = Sequence(request_id, ctx, self._decode, max_pos)
        seq.draft_scope = draft_scope
        if self.config.prefix_caching and params.prompt_logprobs is None:
            seq.prefix_scope = cache_scope
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks; False if it is unknown or already finished."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def sequence(self, request_id: str) -> Sequence:
        """The engine's state of an unfinished request (its tokens, cache position, statistics)."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request {request_id!r}")
        return self._requests[request_id]

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One round for the running batch. A request whose round raises fails alone (finish
        reason ``error``); the others commit their tokens as if it had not been there."""
        running = self.scheduler.schedule()
        if not running:
            return []
        chunks, errors = self._rounds(running)
        outputs = []
        with phase_timer([s.ctx.stats for s in running], "other", self.model.device):
            for s in running:
                if s not in errors and chunks.get(s) is None:
                    continue  # its prefill goes on next step
                try:
                    outputs.append(self._fail(s, errors[s]) if s in errors else self._commit(s, chunks[s]))
                except Exception as e:  # e.g. the tokenizer failed on this request's tokens
                    log.exception("request %s failed", s.request_id)
                    outputs.append(self._fail(s, e))
        return outputs

    def _rounds(self, running: list[Sequence]) -> tuple[dict, dict]:
        """Each sequence's committed chunk, or the exception its round raised. A failed batched
        round is rolled back and retried one sequence at a time to find the culprit(s)."""
        try:
            return dict(zip(running, self._round(running))), {}
        except Exception as e:
            if len(running) == 1:
                log.exception("request %s failed", running[0].request_id)
                return {}, {running[0]: e}
            log.warning("a batched step failed (%s); retrying its %d requests one at a time", e, len(running))
        for s in running:
            self._roll_back(s)
        chunks, errors = {}, {}
        for s in running:
            try:
                chunks[s] = self._round([s])[0]
            except Exception as e:
                log.exception("request %s failed", s.request_id)
                errors[s] = e
        return chunks, errors

    def _round(self, running: list[Sequence]) -> list[list[int] | None]:
        """The next prefill chunks, then one round of the strategy for the sequences whose prompt
        is in the cache: each sequence's tokens (None for one whose prefill is not done)."""
        self._prefill([s for s in running if not s.prefilled], decoding=any(s.prefilled for s in running))
        ready = [s for s in running if s.prefilled]
        commits = dict(zip(ready, self._decode_round(ready))) if ready else {}
        return [commits.get(s) for s in running]

    def _decode_round(self, running: list[Sequence]) -> list[list[int]]:
        """The speculation policy's round for the sequences whose prompt is in the cache."""
        return self.speculation.round([s.ctx for s in running])

    def _roll_back(self, seq: Sequence) -> None:
        """Back to the state before a failed round: the cache holds the committed tokens but the
        pending one (or nothing, if the prefill had not finished)."""
        self.runner.truncate(seq.seq_id, len(seq.ctx.tokens) - 1 if seq.prefilled else seq.num_cached)

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a request whose round raised: finish reason ``error``, blocks freed."""
        seq.finish("error")
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)
        return self._output(seq, [], "", error=error)

    def _prefill(self, seqs: list[Sequence], decoding: bool = True) -> None:
        """Run the next chunk of each new (or preempted) sequence's tokens but the pending last one
        through all layers: at most ``config.prefill_chunk`` tokens in all, oldest sequence first
        (``IDLE_PREFILL_CHUNKS`` times as many where no sequence is ``decoding`` in this step).
        Prompt tokens run as a prefill (``forward_many``'s ``prefill``: the kernels may take their
        prompt paths); a preempted sequence's tokens from ``Sequence.prompt_end`` on run as they were
        decoded (in other chunks, on no prompt path), so that they get the bits they had before."""
        budget = (self.config.prefill_chunk * (1 if decoding else IDLE_PREFILL_CHUNKS)) or float("inf")
        parts: list[tuple[Sequence, int, int]] = []  # (sequence, start, end) of this step's chunks
        for s in seqs:
            end = min(len(s.ctx.tokens) - 1, s.num_cached + budget)
            if s.num_cached < s.prompt_end < end:  # the prompt's end ends the chunk
                end = s.prompt_end
            if end > s.num_cached:
                parts.append((s, s.num_cached, int(end)))
                budget -= end - s.num_cached
        if parts:
            started = time.perf_counter()
            for s, _, _ in parts:
                s.scheduled_time = s.scheduled_time or started  # first scheduled (vLLM's end of queue time)
            for prompt in (True, False):
                self._run_chunks([p for p in parts if (p[1] < p[0].prompt_end) == prompt], prompt)
        now = time.perf_counter()
        for s in seqs:
            if s.num_cached >= len(s.ctx.tokens) - 1:
                s.prefilled = True
                s.scheduled_time = s.scheduled_time or now
                if s.ctx.params.prompt_logprobs is not None and s.prompt_logprobs is None:
                    s.prompt_logprobs = [None] + s.prompt_logprob_rows
                    s.prompt_logprob_rows = []

    def _run_chunks(self, parts: list[tuple[Sequence, int, int]], prompt: bool) -> None:
        """Tokens ``start .. end - 1`` of each ``(sequence, start, end)`` through all layers in one pass
        (``prompt``: prompt tokens, a prefill), and the full blocks of prompt tokens into the prefix cache."""
        if not parts:
            return
        items = [(s.seq_id, a, s.ctx.token_tensor(s.ctx.tokens[a:b])) for s, a, b in parts]
        with phase_timer([s.ctx.stats for s, _, _ in parts], "prefill", self.model.device):
            hidden = self.runner.forward_many(items, 0, self.model.num_layers, prefill=prompt)  # each [b - a, H]
        for (s, a, b), h in zip(parts, hidden):
            s.num_cached = b
            self._chunk_logprobs(s, a, b, h)
            if s.prefix_scope is not None and prompt:
                self.blocks.cache_blocks(s.seq_id, s.ctx.tokens[:b], s.prefix_scope)

    def _chunk_logprobs(self, seq: Sequence, start: int, end: int, hidden: torch.Tensor) -> None:
        """Prompt log-probabilities of the tokens after positions ``start .. end - 1`` (first prefill only)."""
        num_top = seq.ctx.params.prompt_logprobs
        if num_top is None or seq.prompt_logprobs is not None:
            return
        if start == 0:
            seq.prompt_logprob_rows = []
        seq.prompt_logprob_rows += self._prompt_logprobs(hidden, seq.prompt_ids[start + 1:end + 1], num_top)

    def _prompt_logprobs(self, hidden: torch.Tensor, tokens: list[int], num_top: int,
                         rows: int = 256) -> list[TokenLogprob]:
        """Log-probabilities of the prompt's tokens 1.. from the prefill's final states ``hidden [T, H]``,
        ``rows`` positions at a time (a [T, V] logits matrix of a long prompt would be large)."""
        out: list[TokenLogprob] = []
        for i in range(0, len(tokens), rows):
            logits = self.model.exit_logits(hidden[i:i + rows], self.model.num_layers)  # [rows, V]
            out += token_logprobs(logits, tokens[i:i + rows], num_top)
        return out

    def _commit(self, seq: Sequence, chunk: list[int]) -> RequestOutput:
        kept = seq.commit(chunk)
        params, ctx = seq.ctx.params, seq.ctx
        if ctx.processor is not None:
            ctx.processor.commit(kept)
        logprobs = None
        if params.logprobs is not None:
            logprobs = token_logprobs(ctx.target_logits[:len(kept)], kept, params.logprobs)
        if seq.finished:
            self.scheduler.finish(seq)
            self._requests.pop(seq.request_id, None)
            self.speculation.finished(seq.draft_scope, seq.prompt_ids, seq.new_tokens)
        return self._output(seq, kept, seq.text.delta(), logprobs)

    @staticmethod
    def _output(seq: Sequence, new_tokens: list[int], text_delta: str, logprobs: list[TokenLogprob] | None = None,
                error: Exception | None = None) -> RequestOutput:
        now = time.perf_counter()
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.new_tokens), new_tokens, seq.text.text,
                             text_delta, seq.finished, seq.finish_reason, seq.ctx.stats, now - seq.arrival_time,
                             ttft, logprobs, seq.prompt_logprobs, seq.scheduled_time, error,
                             seq.num_cached_tokens or 0)

    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; the final output of each."""
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return final

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_in_use": self.blocks.num_used_blocks,
            "kv_blocks_free": self.blocks.num_free_blocks,
            "waiting": self.num_waiting,
            "running": self.num_running,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.blocks.prefix.queries,  # prompt tokens looked up
            "prefix_cache_hits": self.blocks.prefix.hits,  # of them, found cached
            "kv_blocks_cached": self.blocks.num_cached_blocks,
            **self.speculation.to_dict(),  # "adaptive", "suffix_cache"
        }
