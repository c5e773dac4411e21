"""The batched engine: continuous batching of many requests over one paged KV pool.

Each ``step()`` admits waiting requests (prefilling them in one ragged pass), runs one round
of the strategy for every running sequence together -- sequences at different positions,
accepting different numbers of tokens, as flat tensors with offsets and block tables --
commits the tokens, and retires finished sequences at once.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import KVPool
from ..config import ConfigError, SamplingParams
from ..decode.autoregressive import Autoregressive
from ..decode.base import DecodeContext, LayerRunner, Strategy
from ..decode.stats import DecodeStats, phase_timer
from ..model.llama import DecoderModel
from ..sampling.logprobs import TokenLogprob, token_logprobs
from ..sampling.processors import LogitsProcessor
from .adaptive import PLAIN, SPECULATE, AdaptiveController
from .scheduler import Scheduler
from .sequence import Sequence


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context."""


@dataclass
class RequestOutput:
    """A request's state after a step: the new committed tokens/text of this step and all so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str  # committed text so far (stop strings cut)
    text_delta: str  # text that became final in this step
    finished: bool
    finish_reason: str | None
    stats: DecodeStats = field(repr=False)
    seconds: float = 0.0  # arrival to now
    time_to_first_token: float | None = None
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, if the request asked (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None), if asked


def kv_blocks_for(model: DecoderModel, block_size: int, *, kv_blocks: int | None = None,
                  memory_fraction: float | None = None, min_tokens: int = 0) -> int:
    """Pool size: ``kv_blocks``, or a fraction of the device's free memory, or enough for ``min_tokens``."""
    if kv_blocks is not None:
        if kv_blocks < 1:
            raise ConfigError(f"kv_blocks must be >= 1, got {kv_blocks}")
        return kv_blocks
    cfg = model.cfg
    block_bytes = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    if memory_fraction is not None:
        if not 0 < memory_fraction <= 0.95:
            raise ConfigError(f"memory fraction must be in (0, 0.95], got {memory_fraction}")
        return max(1, int(_free_memory(model.device) * memory_fraction) // block_bytes)
    return -(-max(min_tokens, 1) // block_size) + 1


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


class Engine:
    """Many requests, one model, one strategy (``ar``, ``selfspec`` or ``hispec``)."""

    def __init__(self, model: DecoderModel, strategy: Strategy, *, tokenizer=None, eos_ids=frozenset(),
                 kv_blocks: int = 64, block_size: int = 16, max_batch_size: int = 16, adaptive: bool = True,
                 lookahead: int | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.strategy = strategy
        self.eos_ids = frozenset(eos_ids)
        self.block_size = block_size
        self._ar = Autoregressive()
        self.adaptive = AdaptiveController() if adaptive and strategy.name != "ar" else None
        self._seq_ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self.max_batch_size = max_batch_size
        self._lookahead = lookahead
        self.resize_pool(kv_blocks)

    # ---- the pool ------------------------------------------------------------------------
    def resize_pool(self, kv_blocks: int) -> None:
        """(Re)make the KV pool; only while no request is in flight."""
        assert not self._requests, "cannot resize the KV pool with requests in flight"
        cfg = self.model.cfg
        self.blocks = BlockManager(kv_blocks, self.block_size, cfg.num_layers)
        self.pool = KVPool(cfg.num_layers, kv_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                           self.model.dtype, self.model.device)
        self.runner = LayerRunner(self.model, self.blocks, self.pool)
        self.scheduler = Scheduler(self.blocks, self.max_batch_size, self.lookahead)

    @property
    def lookahead(self) -> int:
        """Positions one step may add to a sequence (drafts, window, bonus)."""
        if self._lookahead is not None:
            return self._lookahead
        spec = getattr(self.strategy, "spec", None)
        if spec is None:
            return 2
        return spec.window + max(spec.num_draft, spec.max_draft if spec.draft_policy == "heuristic" else 0) + 3

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
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
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.seed() % 2**63)
            generator = torch.Generator(device=self.model.device).manual_seed(seed)
        ctx = DecodeContext(self.runner, seq_id, list(prompt_ids), params, generator, DecodeStats(self.strategy.name),
                            min(len(prompt_ids) + params.max_new_tokens, max_pos),
                            frozenset() if params.ignore_eos else self.eos_ids)
        if params.modifies_logits:
            ctx.processor = LogitsProcessor(params, self.model.cfg.vocab_size, self.model.device)
        seq = Sequence(request_id, ctx, self._decode, max_pos)
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
        running = self.scheduler.schedule()
        if not running:
            return []
        self._prefill([s for s in running if not s.prefilled])
        batch = [s.ctx for s in running]
        # Only greedy batches switch: a sampled sequence's random stream depends on the mode, and
        # a seeded request must give the same output whatever else shares its batch.
        adaptive = self.adaptive is not None and all(c.params.greedy for c in batch)
        mode = self.adaptive.choose(len(batch)) if adaptive else SPECULATE
        strategy = self.strategy if mode == SPECULATE else self._ar
        t0 = time.perf_counter()
        commits = strategy.step(batch)
        if strategy is not self.strategy:
            for c in batch:
                c.stats.plain_steps += 1
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        elapsed = time.perf_counter() - t0
        outputs = [self._commit(s, chunk) for s, chunk in zip(running, commits)]
        if adaptive:
            self.adaptive.record(len(batch), mode, sum(len(o.new_token_ids) for o in outputs), elapsed)
        return outputs

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Run each new (or preempted) sequence's tokens but the pending last one through all layers."""
        long = [s for s in seqs if len(s.ctx.tokens) > 1]
        items = [(s.seq_id, 0, s.ctx.token_tensor(s.ctx.tokens[:-1])) for s in long]
        if items:
            with phase_timer([s.ctx.stats for s in seqs], "prefill", self.model.device):
                hidden = self.runner.forward_many(items, 0, self.model.num_layers)  # each [T_i - 1, H]
            for s, h in zip(long, hidden):
                if s.ctx.params.prompt_logprobs is not None and s.prompt_logprobs is None:
                    s.prompt_logprobs = [None] + self._prompt_logprobs(h, s.prompt_ids[1:], s.ctx.params.prompt_logprobs)
        for s in seqs:
            s.prefilled = True
            if s.ctx.params.prompt_logprobs is not None and s.prompt_logprobs is None:
                s.prompt_logprobs = [None]  # a one-token prompt

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
        now = time.perf_counter()
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.new_tokens), kept, seq.text.text, seq.text.delta(),
                             seq.finished, seq.finish_reason, seq.ctx.stats, now - seq.arrival_time, ttft,
                             logprobs, seq.prompt_logprobs)

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
            "adaptive": self.adaptive.to_dict() if self.adaptive else None,
        }
