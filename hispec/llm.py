"""``LLM``: many prompts at once through the batched engine (continuous batching)."""
from __future__ import annotations

import time
from typing import Callable

import torch

from .config import DEFAULT_PREFILL_CHUNK, DEFAULT_SUFFIX_ENTRIES, ConfigError, EngineConfig, SamplingParams, SpecConfig
from .engine.build import build_engine
from .engine.outputs import GenerationOutput
from .generate import Generator
from .kernels.threads import check_thread
from .settings import DEFAULT_STRATEGY, strategy_kind


class LLM:
    """``LLM("default").generate(prompts, SamplingParams(...))`` -> one ``GenerationOutput`` per prompt, in order
    (a failed prompt has finish reason ``error`` and the reason in ``error``; the others are unaffected).

    Sequences run together in ragged batches of up to ``max_batch_size``; each one's greedy
    output equals its own batch-of-one ``ar`` output. With ``adaptive=True`` the engine decides
    per step whether speculation pays at the current batch size (see ``spec/policy.py``).

    The outputs of finished prompts draft for later greedy prompts of the same ``draft_scope``
    (``generate``'s; by default one scope per ``LLM``), in a cache of ``suffix_cache_entries``
    n-grams per scope (0 = off): see ``spec.proposers.suffix.SuffixStore``.
    """

    def __init__(self, model: str | Generator = "default", strategy: str = DEFAULT_STRATEGY, *,
                 spec: SpecConfig | None = None, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_batch_size: int = 16, kv_blocks: int | None = None, kv_memory_fraction: float | None = None,
                 block_size: int = 16, adaptive: bool = True, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 kv_cache_dtype: str = "auto", suffix_cache_entries: int = DEFAULT_SUFFIX_ENTRIES,
                 prefix_caching: bool = True) -> None:
        config = EngineConfig(block_size=block_size, max_batch_size=max_batch_size, kv_blocks=kv_blocks,
                              kv_memory_fraction=kv_memory_fraction, adaptive=adaptive, prefill_chunk=prefill_chunk,
                              suffix_cache_entries=suffix_cache_entries, prefix_caching=prefix_caching)
        strategy_kind(strategy)  # an unknown name fails before a model is loaded
        if isinstance(model, Generator):
            if kv_cache_dtype != "auto":
                raise ConfigError("kv_cache_dtype belongs to the model: pass it to Generator.from_pretrained")
            self.generator = model
        else:
            self.generator = Generator.from_pretrained(model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        # the pool is sized by each generate() call for its requests
        self.engine = build_engine(self.generator.model, strategy, config, spec=spec,
                                   recommended=self.generator.recommended_specs, tokenizer=self.generator.tokenizer,
                                   eos_ids=self.generator.eos_ids, seq_tokens=1, num_seqs=1)
        self.strategy = self.engine.strategy

    def _size_pool(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """Blocks from the options, or by default enough for a full batch of the longest request."""
        e, m = self.engine, self.generator.model
        longest = max(min(len(p) + sp.max_new_tokens, m.cfg.max_position_embeddings) for p, sp in zip(prompts, params))
        e.fit_pool(longest, min(e.max_batch_size, len(prompts)))

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 *, chat: bool | None = None, on_output: Callable | None = None,
                 draft_scope: str | None = None) -> list[GenerationOutput]:
        check_thread(self.generator.loaded_in)
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [p if isinstance(p, list) else self.generator.encode_prompt(p, chat) for p in prompts]
        self._size_pool(ids, plist)
        start = time.perf_counter()
        request_ids = [self.engine.add_request(p, sp, draft_scope=draft_scope) for p, sp in zip(ids, plist)]
        done = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if on_output is not None:
                    on_output(out)
                if out.finished:
                    done[out.request_id] = out
        self.seconds = time.perf_counter() - start
        return [GenerationOutput.of(done[r]) for r in request_ids]
