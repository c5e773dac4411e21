"""The server's state, shared by every route: the engine bridge, the tokenizer, the served names and
limits; and what turns a parsed request into engine work (prompt ids, grammar, sampling
parameters). ``build_server_state`` makes it from a loaded ``Generator`` (``hispec serve``, each
Ray Serve replica, and tests in-process).
"""
from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field

from ..config import ConfigError, SamplingParams
from .async_engine import AsyncEngine
from .errors import APIError, bad
from .metrics import Metrics
from .schema import SEED_RANGE, ParsedRequest
from .tools import fallback_messages, forced_grammar, template_knows_tools, template_messages

MAX_CHARS_PER_TOKEN = 32  # a text this many times longer than the context is first counted on a prefix


@dataclass
class ServerState:
    """What every route shares (``app.state.hispec``)."""

    engine: AsyncEngine
    tokenizer: object  # a Hugging Face tokenizer (used under tokenizer_lock)
    model_names: tuple[str, ...]  # the first is the served name; the others are accepted aliases
    context_length: int
    vocab_size: int
    strategy: str
    api_key: str | None = None
    prefix_cache_per_key: bool = False  # requests share cached prompt blocks only under the same API key
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    created: int = field(default_factory=lambda: int(time.time()))
    _token_texts: dict[int, str] = field(default_factory=dict)
    _decoder_copy: object = None

    @property
    def metrics(self) -> Metrics:
        return self.engine.metrics

    @property
    def served_name(self) -> str:
        return self.model_names[0]

    @property
    def pool_tokens(self) -> int:
        """Positions one sequence may hold when it has the whole KV pool to itself."""
        e = self.engine.engine
        return e.blocks.num_blocks * e.block_size

    # ---- prompts ------------------------------------------------------------------------------
    def prompt_ids(self, req: ParsedRequest) -> list[list[int]]:
        """The token ids of each prompt (one for chat). Blocking (seconds for a huge prompt): run it
        in a worker thread."""
        if req.kind == "completion":
            return [p if isinstance(p, list) else self._encode(p, "prompt", True) for p in req.prompts]
        return [self._chat_ids(req)]

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Tokenize ``text``; a text far longer than the context is refused after counting a prefix
        (it cannot fit, and tokenizing megabytes would only keep a core busy)."""
        if self.tokenizer is None:
            raise bad("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        ctx, limit = self.context_length, self.context_length * MAX_CHARS_PER_TOKEN
        try:
            with self.tokenizer_lock:
                if len(text) > limit:
                    head = len(self.tokenizer(text[:limit], add_special_tokens=add_special_tokens)["input_ids"])
                    if head > ctx + 16:  # the cut can change the last few tokens, never hundreds
                        raise bad(f"This model's maximum context length is {ctx} tokens, and the prompt has "
                                  f"more than {ctx} tokens", param, "context_length_exceeded")
                return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except APIError:
            raise
        except Exception as e:  # the tokenizer refused this text
            raise bad(f"the prompt could not be tokenized: {type(e).__name__}", param) from None

    def _decoder(self):
        """The event loop's own copy of the tokenizer (for logprobs and echo): never waits behind a
        huge prompt that a worker thread tokenizes under ``tokenizer_lock``."""
        if self._decoder_copy is None:
            self._decoder_copy = copy.deepcopy(self.tokenizer)
        return self._decoder_copy

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self._decoder().decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token as text (logprobs' ``token``); ``token_id:N`` without a tokenizer, as vLLM writes it."""
        text = self._token_texts.get(token)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
            else:
                text = self._decoder().decode([token])
            self._token_texts[token] = text
        return text

    def _chat_ids(self, req: ParsedRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise bad("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        if not getattr(tok, "chat_template", None):
            raise bad("this model has no chat template: use /v1/completions", "messages")
        tools = req.tools if req.tool_choice not in (None, "none") else []
        try:
            with self.tokenizer_lock:
                if template_knows_tools(tok):
                    text = tok.apply_chat_template(template_messages(req.messages), add_generation_prompt=True,
                                                   tokenize=False, tools=[{"type": "function", "function": t}
                                                                          for t in tools] or None)
                else:
                    text = tok.apply_chat_template(fallback_messages(req.messages, tools), add_generation_prompt=True,
                                                   tokenize=False)
        except Exception as e:  # jinja's TemplateError and friends: the template refused the messages
            raise bad(f"the chat template rejected the messages: {e}", "messages") from None
        return self._encode(text, "messages", add_special_tokens=False)

    def grammar(self, req: ParsedRequest):
        """The compiled grammar of ``req.json_schema``, or of a forced tool call (call off the event
        loop: the first one builds the tokenizer's grammar tables, which takes seconds)."""
        param = "response_format" if req.json_schema is not None else "tool_choice"
        try:
            from ..sampling.grammar import Grammar, GrammarError, llguidance_tokenizer
        except ImportError:  # pragma: no cover - llguidance is in the server extra
            raise bad("structured output needs the llguidance package: pip install 'hispec[server]'",
                      param) from None
        if self.tokenizer is None:
            raise bad("structured output needs the model's tokenizer", param)
        with self.tokenizer_lock:
            tokenizer = llguidance_tokenizer(self.tokenizer, self.vocab_size)
        try:
            if req.json_schema is not None:
                return Grammar.json_schema(req.json_schema, tokenizer)
            return Grammar(forced_grammar(req.tools, req.tool_choice), tokenizer)
        except GrammarError as e:
            raise bad(str(e), "tools" if param == "tool_choice" else param) from None

    def draft_scope(self, authorization: str | None, user: str | None) -> str | None:
        """Whose earlier outputs may draft for a request, and take its output (the engine's
        suffix cache, ``spec.proposers.suffix.SuffixStore``): a hash of the API key the request was
        let in with and of its ``user`` (OpenAI's end-user id), so that one client's text never
        shapes another's drafts, nor through them its timing, and no key is kept in the clear.
        Without ``--api-key`` the bearer token is not checked, so it names no one: the scope is
        the ``user``, and requests without one share the default scope (None), as one client
        would (a server without a key serves one party: its requests gain from each other's)."""
        scheme, _, token = (authorization or "").partition(" ")
        key = token.strip() if self.api_key is not None and scheme.lower() == "bearer" else None
        if key is None and user is None:
            return None
        return hashlib.sha256(json.dumps([key, user]).encode()).hexdigest()

    def cache_scope(self, authorization: str | None, salt: str | None) -> str:
        """Which requests may share cached prompt blocks with this one (``Engine.add_request``'s
        ``cache_scope``): all of them (""), or those of the same ``cache_salt`` and, under
        ``--prefix-cache-per-key``, the same API key (hashed: no key is kept in the clear). A block
        shared across tenants would let one time the other's prompts (a cache hit answers sooner)."""
        scheme, _, token = (authorization or "").partition(" ")
        key = token.strip() if self.prefix_cache_per_key and scheme.lower() == "bearer" else None
        if key is None and salt is None:
            return ""
        return hashlib.sha256(json.dumps([key, salt]).encode()).hexdigest()

    def sampling_params(self, req: ParsedRequest, num_prompt: int, sample: int = 0, grammar=None) -> SamplingParams:
        """The engine's parameters for sample ``sample`` (0 .. best_of - 1) of a prompt: sample j
        uses seed + j, so every choice of a seeded request is reproducible."""
        ctx = self.context_length
        param = "prompt" if req.kind == "completion" else "messages"
        if num_prompt == 0:
            raise bad(f"'{param}' is empty after tokenization", param)
        if num_prompt >= ctx:
            raise bad(f"This model's maximum context length is {ctx} tokens, and the prompt has {num_prompt} "
                      f"tokens: at most {ctx - 1} fit with one new token", param, "context_length_exceeded")
        room = min(ctx, self.pool_tokens - 1) - num_prompt
        if room < 1:
            raise bad(f"the prompt has {num_prompt} tokens but the server's KV cache holds at most "
                      f"{self.pool_tokens - 1} positions per request (--kv-blocks)", param, "kv_cache_too_small")
        max_name = req.max_tokens_param
        max_tokens = req.max_tokens
        if max_tokens == 0:  # echo only (checked when parsing): one token is made and dropped
            max_tokens = 1
        if max_tokens is None:
            max_tokens = min(16, room) if req.kind == "completion" else room  # OpenAI's defaults
        elif num_prompt + max_tokens > ctx:
            raise bad(f"This model's maximum context length is {ctx} tokens. However, you requested "
                      f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                      f"completion). Reduce the prompt or '{max_name}'.", max_name, "context_length_exceeded")
        elif max_tokens > room:
            raise bad(f"the request needs {num_prompt + max_tokens + 1} positions in the KV cache but the server's "
                      f"pool holds {self.pool_tokens} (--kv-blocks); reduce '{max_name}'", max_name,
                      "kv_cache_too_small")
        seed = req.seed
        if seed is not None and sample:
            seed = seed + sample if seed + sample <= SEED_RANGE[1] else seed - sample
        logprobs = req.logprobs
        if req.best_of > req.n and logprobs is None:
            logprobs = 0  # ranking needs each token's log-probability
        try:
            return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
                                  max_new_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=req.logprobs if req.echo else None,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  logit_bias=req.logit_bias, grammar=grammar)
        except ConfigError as e:
            raise bad(str(e)) from None


def served_names(args, gen) -> tuple[str, ...]:
    """The model ids clients may send: the served name first."""
    from pathlib import Path

    from ..model.load.registry import ALIASES, KNOWN_MODELS

    key = ALIASES.get(args.model.lower(), args.model.lower())
    if args.served_model_name:
        name = args.served_model_name
    elif key in KNOWN_MODELS:
        name = KNOWN_MODELS[key].name
    else:
        name = Path(args.model).name or args.model
    return tuple(dict.fromkeys([name, args.model]))


def start_server_state(args, progress: bool = True) -> ServerState:
    """The model the options describe, loaded in a thread that ends, and its engine thread started,
    with the calling thread then kept to one thread: the engine thread holds the process's only
    OpenMP pool, whose workers spin between parallel regions instead of sleeping
    (kernels/threads.py; with two pools, steps took ~1.8x as long). The engine thread starts
    before the event loop's threads, which then take the one-thread default."""
    from ..distributed import generator_from_args
    from ..kernels.threads import in_own_thread, set_threads

    state = in_own_thread(lambda: build_server_state(args, generator_from_args(args, progress)))
    state.engine.start()
    set_threads(1)
    return state


def build_server_state(args, gen) -> ServerState:
    """Engine, bridge and app state for a loaded ``Generator``."""
    import torch

    from ..config import EngineConfig
    from ..engine.build import build_engine
    from ..options import spec_overrides

    model = gen.model
    # The engine thread detokenizes with its own copy: a Hugging Face fast tokenizer is not safe to
    # use from two threads at once, and a shared lock would stall every stream behind a huge prompt.
    tokenizer = copy.deepcopy(gen.tokenizer)
    config = EngineConfig(block_size=gen.block_size, max_batch_size=args.max_batch_size, kv_blocks=args.kv_blocks,
                          adaptive=not args.no_adaptive, prefill_chunk=args.prefill_chunk,
                          suffix_cache_entries=args.suffix_cache_entries, suffix_cache_scopes=args.suffix_cache_scopes,
                          prefix_caching=not args.no_prefix_caching)
    # default pool: a full batch of min(context, 1024)-token sequences
    engine = build_engine(model, args.strategy, config, recommended=gen.recommended_specs,
                          overrides=spec_overrides(args), tokenizer=tokenizer, eos_ids=gen.eos_ids)
    ctx = model.cfg.max_position_embeddings
    names = served_names(args, gen)
    metrics = Metrics(names[0], args.strategy, ctx)
    # the engine thread computes on the threads the model was loaded with (kernels/threads.py)
    bridge = AsyncEngine(engine, max_queue=args.max_queue, metrics=metrics, threads=torch.get_num_threads())
    return ServerState(engine=bridge, tokenizer=gen.tokenizer, model_names=names, context_length=ctx,
                       vocab_size=model.cfg.vocab_size, strategy=args.strategy, api_key=args.api_key,
                       prefix_cache_per_key=args.prefix_cache_per_key)
