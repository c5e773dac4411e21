"""The library entry point for one request at a time: prompt in, committed tokens out.

``Generator`` owns the model, its tokenizer, its exit heads (``ExitSet``) and one KV pool, and
runs each request through an engine of its own as a batch of one; a decoding strategy (one of
``settings.STRATEGIES``) decides which layers run when. With ``adaptive=True`` the engine
decodes plainly on the steps where measured speculation does not pay (greedy only; the output
is the same either way).
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from .cache.paged import PagedCache
from .config import ConfigError, EngineConfig, SamplingParams, SpecConfig, check_engine_options
from .decode import make_strategy  # noqa: F401 (re-exported)
from .decode.base import Strategy
from .engine.build import build_engine, build_strategy
from .engine.engine import Engine, PromptTooLongError  # noqa: F401 (PromptTooLongError re-exported)
from .engine.outputs import GenerationOutput
from .kernels.threads import check_thread
from .model.exits.attached import ExitSet
from .model.decoder import DecoderModel
from .settings import (DEFAULT_STRATEGY, StrategyName, default_spec,  # noqa: F401 (default_spec re-exported)
                       recommended_for, resolve_spec)
from .spec.policy import AdaptiveController, adaptive_modes
from .spec.proposers.suffix import SuffixStore


class Generator:
    """Generate with any strategy over a paged KV cache, one request at a time."""

    def __init__(self, model: DecoderModel, tokenizer=None, *, block_size: int = 16) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._cache: PagedCache | None = None  # one KV pool, reused by every request's engine
        self._controllers: dict[str, AdaptiveController] = {}  # adaptive speculation, per strategy + settings
        self.model_path: Path | None = None
        self.gguf_path: Path | None = None  # the GGUF file whose own blocks the model runs on, if it does
        self.exits: ExitSet | None = None  # trained exit heads and their recommended settings
        self.eos_ids = frozenset(self._eos_ids())
        self.loaded_in = threading.current_thread()  # where it was built (kernels/threads.check_thread)

    @classmethod
    def from_pretrained(cls, name_or_path: str = "default", *, device: str = "cpu",
                        dtype: torch.dtype | None = None, allow_pickle: bool = False,
                        exits: str | Path | bool = True, progress: bool = True,
                        quantize: str = "auto", kv_cache_dtype: str | torch.dtype = "auto") -> "Generator":
        """Load a model by name or path. ``exits``: True finds the model's trained exit heads (the
        ones shipped for the default model, or an ``exits/`` folder in the model folder), a path
        loads those, False exits through the model's own final head. ``quantize``: ``none``
        (``dtype`` weights), ``native`` (a GGUF file's own 4-bit weights), ``int4``/``int8``, or
        ``auto``: native where it runs faster on this CPU (``model/load/checkpoint.py``), unless a ``dtype``
        is given (``dtype=torch.float32`` is the float32 reference). ``dtype`` defaults to float32.
        ``kv_cache_dtype``: what the KV cache holds, ``float32``, ``bfloat16`` (half the cache memory
        and attention's reads; every strategy reads the same rounded values, so their outputs stay
        identical to ``ar``'s with the same cache) or ``auto`` (``auto_kv_cache_dtype``: bfloat16
        for quantized weights on CPU, else the model's dtype)."""
        from .model.load.checkpoint import choose_quantize, load_model
        from .model.load.gguf_convert import check_gguf_file
        from .model.load.gguf_native import load_gguf_model
        from .model.load.registry import gguf_source, resolve_model

        check_engine_options({"quantize": quantize, "kv_cache_dtype": kv_cache_dtype})
        if quantize == "auto" and dtype is not None:
            quantize = "none"
        dtype = dtype or torch.float32
        gguf = gguf_source(name_or_path) if quantize in ("auto", "native") else None
        if gguf is not None:
            check_gguf_file(gguf)  # a truncated or foreign file: one clear line, before any tensor is read
        model = None
        if dtype == torch.float32 and choose_quantize(quantize, gguf, torch.device(device).type) == "native":
            # on the file's own blocks, from the file alone: its folder holds the config and tokenizer
            folder = resolve_model(name_or_path, progress=progress, weights=False)
            model = load_gguf_model(folder, gguf, refuse=quantize == "native")
            quantize = "none" if model is None else quantize  # auto, and nothing runs natively
        if model is None:
            folder = resolve_model(name_or_path, progress=progress)
            model = load_model(folder, device=device, dtype=dtype, allow_pickle=allow_pickle, quantize=quantize,
                               gguf=gguf)
        model.kv_cache_dtype = (auto_kv_cache_dtype(model) if kv_cache_dtype == "auto"
                                else kv_cache_dtype_of(kv_cache_dtype))
        if model.device.type == "cpu":
            from .kernels import layer_op

            layer_op.prebuild(say=(lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else None)
        gen = cls(model, load_tokenizer(folder))
        gen.model_path, gen.gguf_path = folder, gguf if model.weight_format == "native" else None
        if exits is not False:
            from .model.exits import attach_exits
            attach_exits(gen, None if exits is True else exits)
        if model.device.type == "cpu":
            from .kernels import matmul

            matmul.choose_routes(gen.model)  # timed at load, not in the first prefill
        return gen

    # ---- exit heads ----------------------------------------------------------------------
    def use_exits(self, exits: ExitSet | None) -> None:
        """Exit through these heads (None: through the model's own final norm and head)."""
        self.exits = exits
        self.model.exits = dict(exits.heads) if exits is not None else {}
        for head in self.model.exits.values():  # output rows and decode kernels now, not in the first draft
            if hasattr(head, "prepare"):
                head.prepare()

    def spec_for(self, strategy: str) -> SpecConfig | None:
        """The exit heads' recommended settings for ``strategy`` (None: no recommendation)."""
        return recommended_for(strategy, self.recommended_specs)

    def resolve_spec(self, strategy: str, **overrides) -> SpecConfig | None:
        """The validated settings ``strategy`` runs with on this model (``settings.resolve_spec``:
        ``overrides``, SpecConfig fields with None = not given, over the exit heads' recommendation
        over depth-based defaults; None for ``ar``)."""
        return resolve_spec(strategy, self.model.num_layers, self.recommended_specs, **overrides)

    @property
    def recommended_spec(self) -> SpecConfig | None:
        """The exit heads' recommended settings for the default strategy (hispec)."""
        return self.exits.specs.get(DEFAULT_STRATEGY) if self.exits is not None else None

    @property
    def recommended_specs(self) -> dict[str, SpecConfig]:
        """The exit heads' recommended settings per strategy."""
        return dict(self.exits.specs) if self.exits is not None else {}

    # ---- prompts -------------------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids = set(self.model.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of ``prompt``, wrapped in the chat template if ``chat`` (default: when the model has one)."""
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer: pass token ids instead of text")
        if chat is None:
            chat = self.has_chat_template()
        if chat:
            if not self.has_chat_template():
                raise ConfigError("--chat: this model has no chat template")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- generation ----------------------------------------------------------------------
    @property
    def blocks(self):
        return self._cache.blocks if self._cache else None

    @property
    def pool(self):
        return self._cache.pool if self._cache else None

    def _engine_for(self, strategy: Strategy, num_tokens: int, adaptive: bool,
                    suffix: SuffixStore | None = None) -> Engine:
        """A single-request engine for ``strategy`` over the generator's KV pool (grown to hold
        ``num_tokens`` positions). With ``adaptive``, one controller per strategy and settings
        learns across calls whether speculation pays. ``suffix``: earlier outputs that may draft
        (none by default: a call is not shaped by the calls before it; nor by their prompts' KV
        blocks: no prefix caching)."""
        key = f"{strategy.name} {strategy.spec!r}"
        controller = self._controllers.setdefault(key, AdaptiveController(modes=adaptive_modes(strategy))) \
            if adaptive else None
        engine = build_engine(self.model, strategy, EngineConfig(block_size=self.block_size, max_batch_size=1,
                                                                 adaptive=adaptive, suffix_cache_entries=0,
                                                                 prefix_caching=False),
                              tokenizer=self.tokenizer, eos_ids=self.eos_ids, controller=controller,
                              cache=self._cache, seq_tokens=num_tokens, num_seqs=1, suffix=suffix)
        self._cache = engine.cache
        return engine

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, strategy: str | Strategy = StrategyName.AR,
                 *, chat: bool | None = None, spec: SpecConfig | None = None,
                 on_text: Callable[[str], None] | None = None, adaptive: bool = False,
                 suffix: SuffixStore | None = None, draft_scope: str | None = None) -> GenerationOutput:
        """Generate a continuation of ``prompt`` (text, or token ids). ``on_text`` receives the
        committed text as it grows (deltas; never tentative tokens). ``adaptive``: decode plainly
        on the steps where measured speculation does not pay (greedy only; same output either way).
        ``suffix``: a ``SuffixStore`` of earlier outputs kept across calls (free drafts, greedy
        only; the output goes into ``draft_scope``'s cache); None: this call alone."""
        check_thread(self.loaded_in)
        params = params or SamplingParams()
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.encode_prompt(prompt, chat)
        strategy = build_strategy(strategy, self.model.num_layers, spec=spec, recommended=self.recommended_specs)
        engine = self._engine_for(strategy, min(len(prompt_ids) + params.max_new_tokens,
                                                self.model.cfg.max_position_embeddings), adaptive, suffix)
        request_id = engine.add_request(prompt_ids, params, draft_scope=draft_scope)
        final = None
        try:
            while final is None:
                for out in engine.step():
                    if on_text is not None and out.text_delta:
                        on_text(out.text_delta)
                    if out.finished:
                        final = out
        finally:
            engine.abort(request_id)  # no-op once finished; frees the blocks after an error
        if final.error is not None:
            raise final.error
        return GenerationOutput.of(final)


def auto_kv_cache_dtype(model) -> torch.dtype | None:
    """The KV cache dtype ``auto`` means for a loaded model: bfloat16 where its decoder weights are
    quantized (4- or 8-bit kernels) on CPU, else None (the model's own dtype: float32 weights keep
    the float32 reference exact). A decode step's attention reads every cached position's K and V,
    at batch 8 and long contexts about as many bytes as the weights; halving them ran batch 8
    1.08-1.10x and batch 1 1.05x faster (BENCHMARKS.md), as llama.cpp (f16) and vLLM (the model's
    bfloat16) cache by default, and on CPUs with AVX-512 BF16 attention then multiplies in bfloat16
    pairs (1.1-1.3x faster). The values are rounded once when written, so outputs move as quantized
    weights already move them (``scripts/numerics.py --kv-bf16``)."""
    return torch.bfloat16 if model.device.type == "cpu" and model.weight_format != "none" else None


def kv_cache_dtype_of(value: str | torch.dtype | None) -> torch.dtype | None:
    """A KV cache dtype option (a name from ``config.KV_CACHE_DTYPES``, its torch dtype, or None)
    -> the dtype (None: the model's own)."""
    check_engine_options({"kv_cache_dtype": value})
    if value is None or isinstance(value, torch.dtype):
        return value
    return None if value == "auto" else getattr(torch, value)


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None if it has none (tiny test models)."""
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
