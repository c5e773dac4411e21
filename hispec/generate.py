"""The library entry point for one request at a time: prompt in, committed tokens out.

``Generator`` owns the model, its tokenizer and a paged KV pool; a decoding strategy
(``ar``, ``selfspec``, ``hispec``) decides which layers run when. End conditions (EOS,
stop strings, the token limit, the context limit) are applied here, to committed tokens
only, so every strategy ends exactly where autoregressive decoding would.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .cache.block_manager import BlockManager
from .cache.kv_cache import KVPool
from .config import ConfigError, SamplingParams, SpecConfig
from .decode.autoregressive import Autoregressive
from .decode.base import DecodeContext, LayerRunner, Strategy
from .decode.speculative import HiSpec, SelfSpec
from .decode.stats import DecodeStats, phase_timer
from .model.llama import DecoderModel

STRATEGIES = ("ar", "selfspec", "hispec")


class PromptTooLongError(ValueError):
    """The prompt does not fit the model's context."""


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # new tokens only (an end-of-sequence token included, as transformers does)
    text: str
    finish_reason: str  # "eos", "stop", "length" (max_new_tokens) or "context"
    seconds: float
    stats: DecodeStats = field(repr=False)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def default_spec(num_layers: int) -> SpecConfig:
    """Exits at about 1/8 and 1/4 of the depth (DESIGN.md), unless exit heads declare others."""
    draft = max(1, round(num_layers / 8))
    verify = max(draft + 1, round(num_layers / 4))
    return SpecConfig(draft_layer=draft, verify_layer=min(verify, num_layers - 1) if num_layers > 2 else num_layers,
                      num_layers=num_layers)


def make_strategy(name: str, spec: SpecConfig | None = None, num_layers: int | None = None) -> Strategy:
    if name == "ar":
        return Autoregressive()
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    spec = spec or default_spec(num_layers)
    return SelfSpec(spec) if name == "selfspec" else HiSpec(spec)


class Generator:
    """Generate with any strategy over a paged KV cache, one request at a time."""

    def __init__(self, model: DecoderModel, tokenizer=None, *, block_size: int = 16) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.blocks: BlockManager | None = None
        self.pool: KVPool | None = None
        self._seq_ids = itertools.count()
        self.eos_ids = frozenset(self._eos_ids())

    @classmethod
    def from_pretrained(cls, name_or_path: str = "default", *, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, allow_pickle: bool = False,
                        progress: bool = True) -> "Generator":
        from .model.loader import load_model
        from .model.registry import resolve_model

        folder = resolve_model(name_or_path, progress=progress)
        model = load_model(folder, device=device, dtype=dtype, allow_pickle=allow_pickle)
        gen = cls(model, load_tokenizer(folder))
        gen.model_path = folder
        return gen

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

    # ---- the KV pool ---------------------------------------------------------------------
    def _ensure_pool(self, num_tokens: int) -> None:
        """A pool that holds ``num_tokens`` positions (re-made bigger only while idle)."""
        cfg = self.model.cfg
        need = -(-num_tokens // self.block_size) + 1
        if self.blocks is not None and self.blocks.num_blocks >= need:
            return
        self.blocks = BlockManager(need, self.block_size, cfg.num_layers)
        self.pool = KVPool(cfg.num_layers, need, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                           self.model.dtype, self.model.device)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, strategy: str | Strategy = "ar",
                 *, chat: bool | None = None, spec: SpecConfig | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationOutput:
        """Generate a continuation of ``prompt`` (text, or token ids). ``on_text`` receives the
        committed text as it grows (deltas; never tentative tokens)."""
        params = params or SamplingParams()
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.encode_prompt(prompt, chat)
        if isinstance(strategy, str):
            strategy = make_strategy(strategy, spec, self.model.num_layers)
        stream = _TextStream(self, params.stop, on_text)
        out = self._run(prompt_ids, params, strategy, stream)
        stream.flush(out.text)
        return out

    def _run(self, prompt_ids: list[int], params: SamplingParams, strategy: Strategy,
             stream: "_TextStream") -> GenerationOutput:
        max_pos = self.model.cfg.max_position_embeddings
        if not prompt_ids:
            raise ConfigError("the prompt is empty")
        if len(prompt_ids) >= max_pos:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                     f"{max_pos} tokens, so at most {max_pos - 1} fit with one new token")
        max_tokens = min(len(prompt_ids) + params.max_new_tokens, max_pos)
        self._ensure_pool(max_tokens + 1)
        seq_id = next(self._seq_ids)
        self.blocks.add_sequence(seq_id)
        device = self.model.device
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.seed() % 2**63)
            generator = torch.Generator(device=device).manual_seed(seed)
        stats = DecodeStats(strategy.name)
        ctx = DecodeContext(LayerRunner(self.model, self.blocks, self.pool), seq_id, list(prompt_ids), params,
                            generator, stats, max_tokens, self.eos_ids)
        t0 = time.perf_counter()
        try:
            with phase_timer(stats, "prefill", device):
                if len(prompt_ids) > 1:
                    ctx.runner.forward(seq_id, 0, ctx.token_tensor(prompt_ids[:-1]), 0, self.model.num_layers)
            finish, new = "length", []
            for chunk in strategy.steps(ctx):
                finish, chunk = self._apply_end(chunk, params, len(new), max_pos - len(prompt_ids))
                ctx.tokens.extend(chunk)
                new.extend(chunk)
                finish = stream.update(new, finish)
                if finish == "stop":
                    new = stream.tokens_through_stop(new)
                if finish is not None:
                    break
            else:
                finish = "length" if len(new) >= params.max_new_tokens else "context"
        finally:
            self.blocks.free(seq_id)
        stats.new_tokens = len(new)
        return GenerationOutput(list(prompt_ids), new, stream.final_text(new), finish,
                               time.perf_counter() - t0, stats)

    def _apply_end(self, chunk: list[int], params: SamplingParams, done: int, context_room: int
                   ) -> tuple[str | None, list[int]]:
        """Cut a committed chunk at EOS or the token limits; the reason, or None to go on."""
        limit = min(params.max_new_tokens, context_room) - done
        if not params.ignore_eos:
            for j, t in enumerate(chunk[:limit]):
                if t in self.eos_ids:
                    return "eos", chunk[:j + 1]
        if len(chunk) >= limit:
            return ("length" if params.max_new_tokens <= context_room else "context"), chunk[:limit]
        return None, chunk


class _TextStream:
    """Incremental detokenisation of committed tokens, with stop strings."""

    def __init__(self, gen: Generator, stops: tuple[str, ...], on_text: Callable[[str], None] | None) -> None:
        self.gen, self.stops, self.on_text = gen, stops, on_text
        self.sent = 0
        self.text = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def update(self, tokens: list[int], finish: str | None) -> str | None:
        if not self.stops and self.on_text is None:
            return finish
        self.text = self.gen.decode(tokens)
        for s in self.stops:
            cut = self.text.find(s)
            if cut >= 0:
                self.text = self.text[:cut]
                self._send(len(self.text))
                return "stop"
        if finish is None:
            safe = len(self.text) - self.hold
            if self.text.endswith("\ufffd"):
                safe = min(safe, len(self.text.rstrip("\ufffd")))
            self._send(safe)
        return finish

    def tokens_through_stop(self, tokens: list[int]) -> list[int]:
        """The shortest prefix of ``tokens`` whose text reaches a stop string."""
        for n in range(1, len(tokens) + 1):
            text = self.gen.decode(tokens[:n])
            if any(s in text for s in self.stops):
                return tokens[:n]
        return tokens

    def final_text(self, tokens: list[int]) -> str:
        text = self.gen.decode(tokens)
        for s in self.stops:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text

    def flush(self, text: str) -> None:
        self.text = text
        self._send(len(text))

    def _send(self, upto: int) -> None:
        if self.on_text is not None and upto > self.sent:
            self.on_text(self.text[self.sent:upto])
            self.sent = upto


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None if it has none (tiny test models)."""
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
