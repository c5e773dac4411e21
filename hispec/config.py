"""Configuration dataclasses: the model's shape, sampling parameters, speculation settings.

Each dataclass validates itself in ``__post_init__`` so that a bad value fails where it
is given (CLI, API, server) with a message that names the field.
"""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "opt")


ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "relu", "gelu")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and why."""


@dataclass(slots=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from a Hugging Face ``config.json``."""

    family: str  # one of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2); OPT has biases everywhere
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # of the gate: silu (SwiGLU), gelu_pytorch_tanh (Gemma's GeGLU), relu/gelu (OPT)
    # Gemma 3: norms on the attention's and the MLP's outputs too, before each residual add ("sandwich")
    sandwich_norm: bool = False
    embed_scale: float = 1.0  # the embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # attention logits' scale; None: head_dim ** -0.5
    # sliding-window attention: the layers that attend only to their last ``sliding_window`` positions
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # the RoPE base of the sliding layers (Gemma 3: 10,000); None: rope_theta
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # OPT only
    learned_pos_offset: int = 0
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.sliding_layers and not self.sliding_window:
            raise ConfigError("sliding_layers given without a sliding_window")
        if self.family == "opt" and not self.do_layer_norm_before:
            raise ConfigError("OPT models with do_layer_norm_before=false (OPT-350m) are not supported")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed Hugging Face config.json (transformers 4.x or 5.x layout)."""
        model_type = cfg.get("model_type", "")
        family = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                  "gemma3_text": "gemma3", "opt": "opt"}.get(model_type)
        if family is None:
            raise ConfigError(f"unsupported model_type {model_type!r}; supported: llama (incl. CodeLlama, "
                              "LayerSkip, SmolLM, Mistral), qwen2, qwen3, gemma3_text, opt")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if family == "opt":
            return cls._from_opt(cfg, eos_ids)
        if family == "gemma3":
            return cls._from_gemma3(cfg, eos_ids)
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        num_heads = cfg["num_attention_heads"]
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            # transformers' LlamaConfig, Qwen2Config and Qwen3Config all default to untied
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def _from_gemma3(cls, cfg: dict[str, Any], eos_ids: tuple[int, ...]) -> "ModelConfig":
        """Gemma 3 (text): GeGLU, QK-norm, sandwich norms, scaled embeddings, sliding-window layers
        with their own RoPE base. ``rope_parameters`` per layer type (transformers 5) or
        ``rope_theta`` / ``rope_local_base_freq`` (4.x); ``layer_types`` or every 6th layer global."""
        n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6)
                                           else "full_attention" for i in range(n)]
        rope = cfg.get("rope_parameters") or {}
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        for kind in (full, local):
            if kind.get("rope_type", "default") not in ("default", "linear"):
                raise ConfigError(f"unsupported Gemma 3 RoPE scaling {kind.get('rope_type')!r} (supported: "
                                  "default, linear)")
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(cap):
                raise ConfigError(f"Gemma 3 configs with {cap} (Gemma 2 style) are not supported")
        scaling = full if full.get("rope_type") == "linear" else None
        if local.get("rope_type") == "linear":
            raise ConfigError("linear RoPE scaling of Gemma 3's sliding layers is not supported")
        eos = eos_ids or (1,)
        return cls(
            family="gemma3",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=n,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            sandwich_norm=True,
            embed_scale=math.sqrt(cfg["hidden_size"]),
            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            sliding_window=cfg.get("sliding_window") or None,
            sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention")
            if cfg.get("sliding_window") else (),
            rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def _from_opt(cls, cfg: dict[str, Any], eos_ids: tuple[int, ...]) -> "ModelConfig":
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        return cls(
            family="opt",
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["ffn_dim"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=1e-5,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=True,
            hidden_act=cfg.get("activation_function", "relu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            learned_pos_offset=2,
            word_embed_proj_dim=cfg.get("word_embed_proj_dim", hidden),
            do_layer_norm_before=bool(cfg.get("do_layer_norm_before", True)),
        )


DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per engine step (chunked prefill)
# A step in which no sequence decodes (nothing waits on it) prefills up to this many chunks' tokens:
# each chunk is a pass over the weights and an engine step, so a long prompt in fewer pieces is
# prefilled sooner (the default model's 290-860-token summarization and RAG prompts, alone, paired
# prompt by prompt: 0.98x the time in chunks of 1,024 as in chunks of 256), the memory of a step's
# activations still bounded.
IDLE_PREFILL_CHUNKS = 4
MIN_TEMPERATURE = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` (or below ``MIN_TEMPERATURE``) means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # per new token: its log-probability and this many alternatives (None = off)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (None = off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: Any = None  # a sampling.grammar.Grammar the output must match (structured output), or None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ConfigError(f"{name} must be None or an integer >= 0, got {v}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise ConfigError(f"{name} must be between -2 and 2, got {v}")
        self.stop = tuple(s for s in self.stop if s)
        self.logit_bias = tuple((int(t), float(b)) for t, b in self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one below float32's smallest normal number: dividing float32 logits
        by it would lose all precision (or divide by zero), and its limit is the argmax anyway."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def modifies_logits(self) -> bool:
        """Whether penalties or biases change the target's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.grammar is not None)


class DraftPolicyName(enum.StrEnum):
    """An exit draft-length policy (``--draft-policy``; ``spec.proposers.exit_policies``)."""

    FIXED = "fixed"
    SVIP = "svip"
    CONFIDENCE = "confidence"
    HEURISTIC = "heuristic"


DRAFT_POLICIES = tuple(DraftPolicyName)
MAX_LOOKUP_DRAFT, MAX_LOOKUP_NGRAM, MAX_LOOKUP_BRANCHES, MAX_TREE_WIDTH = 32, 8, 4, 8


@dataclass(slots=True)
class SpecConfig:
    """Self-speculation settings.

    ``draft_layer`` (L_d) and ``verify_layer`` (L_i) count decoder layers: an exit at layer L
    reads the hidden state after layers ``0..L-1``. ``verify_layer == num_layers`` means the
    full model (no intermediate level, i.e. single-exit self-speculation).
    """

    draft_layer: int
    verify_layer: int
    num_draft: int = 4  # N_d: tokens per draft round (the maximum, with adaptive policies)
    window: int = 4  # N_i: tentatively accepted tokens before full verification
    draft_policy: str = DraftPolicyName.FIXED  # a DraftPolicyName (or its text)
    svip_threshold: float = 2.0  # nats: stop drafting when the draft entropy exceeds it
    confidence_threshold: float = 0.4  # stop drafting when the draft's top-1 probability falls below it
    max_draft: int = 16  # upper bound for the heuristic policy
    lookup_max_draft: int = 4  # free drafts (prompt lookup) per round at most; 0 = none (hispec: exits only)
    lookup_ngram: int = 3  # the longest suffix looked up in prompt + output (tried longest first, down to 1)
    tree_width: int = 1  # exit candidates per draft position: 1 = a chain; m: the top-m, the runners-up as leaves
    # a runner-up joins the tree only where the exit gives its branch at least this probability (its
    # own times the chain's drafts' before it): rows where a branch is likely, none where the exit is
    # sure. None: a verification row's measured cost relative to a plain step (decode/speculative.py)
    tree_min_prob: float | None = None
    lookup_branches: int = 1  # prompt-lookup matches verified together as the branches of one tree
    num_layers: int = field(default=0, repr=False)  # the model's depth, for validation

    def __post_init__(self) -> None:
        n = self.num_layers
        if not 1 <= self.draft_layer < self.verify_layer:
            raise ConfigError(f"the draft layer must be >= 1 and below the verify layer, got draft layer "
                              f"{self.draft_layer} and verify layer {self.verify_layer}")
        if n and not 1 <= self.draft_layer < n:
            raise ConfigError(f"draft layer must be between 1 and {n - 1} (the model has {n} layers), "
                              f"got {self.draft_layer}")
        if n and not self.draft_layer < self.verify_layer <= n:
            raise ConfigError(f"verify layer must be above the draft layer ({self.draft_layer}) and at most "
                              f"{n}, got {self.verify_layer}")
        if self.num_draft < 1:
            raise ConfigError(f"num_draft must be >= 1, got {self.num_draft}")
        if self.window < 1:
            raise ConfigError(f"window must be >= 1, got {self.window}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ConfigError(f"unknown draft policy {self.draft_policy!r}; choose from {', '.join(DRAFT_POLICIES)}")
        self.draft_policy = DraftPolicyName(self.draft_policy)
        if self.svip_threshold <= 0:
            raise ConfigError(f"svip threshold must be > 0, got {self.svip_threshold}")
        if not 0 < self.confidence_threshold < 1:
            raise ConfigError(f"confidence threshold must be in (0, 1), got {self.confidence_threshold}")
        for name in ("lookup_max_draft", "lookup_ngram"):  # counts: 2.0 or True would fail later, far from here
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), numbers.Integral):
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer, got {getattr(self, name)!r}")
        if not 0 <= self.lookup_max_draft <= MAX_LOOKUP_DRAFT:
            raise ConfigError(f"--lookup-max-draft must be between 0 and {MAX_LOOKUP_DRAFT}, "
                              f"got {self.lookup_max_draft}")
        if not 1 <= self.lookup_ngram <= MAX_LOOKUP_NGRAM:
            raise ConfigError(f"--lookup-ngram must be between 1 and {MAX_LOOKUP_NGRAM}, got {self.lookup_ngram}")
        if not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ConfigError(f"--tree-width must be between 1 (a chain) and {MAX_TREE_WIDTH}, got {self.tree_width}")
        if self.tree_min_prob is not None and not 0 <= self.tree_min_prob < 1:
            raise ConfigError(f"--tree-min-prob must be in [0, 1), got {self.tree_min_prob}")
        if not 1 <= self.lookup_branches <= MAX_LOOKUP_BRANCHES:
            raise ConfigError(f"--lookup-branches must be between 1 and {MAX_LOOKUP_BRANCHES}, "
                              f"got {self.lookup_branches}")

    @property
    def lookahead(self) -> int:
        """An upper bound on the positions one round writes past the pending token: the window,
        the longest draft the policy may ask for, the bonus position and spare."""
        longest = max(self.num_draft, self.max_draft if self.draft_policy == DraftPolicyName.HEURISTIC else 0)
        return max(self.window + longest * self.tree_width + 3, self.lookup_max_draft * self.lookup_branches + 2)


# The speculation settings by name, in declaration order: every SpecConfig field but the model's
# depth (which only validates them). Settings resolution, the exit-head manifest, the command line
# and the tuner all read and write these.
SPEC_FIELDS = tuple(f.name for f in fields(SpecConfig) if f.name != "num_layers")


# ---- engine and load options: one set of checks --------------------------------------------
QUANTIZE = ("auto", "none", "native", "int4", "int8")  # weight formats (model/load/checkpoint.py)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")  # what the KV cache holds; auto = the model's dtype

# The suffix cache of earlier outputs (free drafts across requests, ``spec.proposers.suffix.SuffixStore``):
# n-grams kept per scope and scopes kept, each least recently used out. An n-gram holds at most
# 4 continuations of --lookup-max-draft tokens; measured (tracemalloc, 4-token continuations of
# 128-token outputs) 300-430 bytes an n-gram: the defaults hold ~2700 output tokens (3 n-grams a
# token) in about 3 MB per scope, about 50 MB when all 16 scopes are full.
DEFAULT_SUFFIX_ENTRIES, DEFAULT_SUFFIX_SCOPES = 8192, 16
MAX_SUFFIX_ENTRIES, MAX_SUFFIX_SCOPES = 1 << 22, 1 << 16

# option -> (test, what a valid value is). An option left at None is "not set" where None is allowed.
_OPTION_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "block_size": (lambda v: v >= 1, ">= 1"),
    "max_batch_size": (lambda v: v >= 1, ">= 1"),
    "kv_blocks": (lambda v: v is None or v >= 1, ">= 1"),
    "kv_memory_fraction": (lambda v: v is None or 0 < v <= 0.95, "in (0, 0.95]"),
    "prefill_chunk": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0 = whole prompts)"),
    "threads": (lambda v: v is None or v >= 1, ">= 1"),
    "tensor_parallel_size": (lambda v: v >= 1, ">= 1"),
    "suffix_cache_entries": (lambda v: isinstance(v, int) and 0 <= v <= MAX_SUFFIX_ENTRIES,
                             f"an integer between 0 (off) and {MAX_SUFFIX_ENTRIES}"),
    "suffix_cache_scopes": (lambda v: isinstance(v, int) and 1 <= v <= MAX_SUFFIX_SCOPES,
                            f"an integer between 1 and {MAX_SUFFIX_SCOPES}"),
    "quantize": (lambda v: v in QUANTIZE, "one of " + ", ".join(QUANTIZE)),
    # a name, None (= auto) or the torch dtype of a name (str(torch.bfloat16) == "torch.bfloat16")
    "kv_cache_dtype": (lambda v: v is None or str(v).removeprefix("torch.") in KV_CACHE_DTYPES,
                       "one of " + ", ".join(KV_CACHE_DTYPES)),
}
ENGINE_OPTIONS = tuple(_OPTION_RULES)


def check_engine_options(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` for the first invalid value in ``values`` (option -> value, options
    from ``ENGINE_OPTIONS``). The one set of checks for the engine's and the loader's options, used
    by ``EngineConfig``, the engine, ``Generator``/``LLM``, the command line and the server.
    ``names``: how the caller spells an option in the message (a command-line flag); default: as given."""
    for option, value in values.items():
        test, valid = _OPTION_RULES[option]
        if not test(value):
            raise ConfigError(f"{(names or {}).get(option, option)} must be {valid}, got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    """How the engine batches and sizes its KV pool (one config for ``Generator``, ``LLM`` and the server).

    Chunked prefill: each step prefills at most ``prefill_chunk`` prompt tokens (the sequences
    that wait for their prefill, oldest first, share the budget), so a long prompt is prefilled
    over several steps while the running sequences go on decoding between its chunks; a step in
    which no sequence decodes takes up to ``IDLE_PREFILL_CHUNKS`` times as many.

    The pool holds ``kv_blocks`` blocks if given, else the share ``kv_memory_fraction`` of the
    device's free memory, else enough for ``max_batch_size`` sequences of the longest request
    (or of ``min(context, DEFAULT_SEQ_TOKENS)`` tokens when no request is known yet), each
    with the strategy's look-ahead: see ``engine.engine.kv_blocks_for``.

    The suffix cache (``spec.proposers.suffix.SuffixStore``): the outputs of finished requests, for free
    drafts of later greedy requests in the same scope (``Engine.add_request``'s ``draft_scope``),
    at most ``suffix_cache_entries`` n-grams per scope and ``suffix_cache_scopes`` scopes.

    Prefix caching (``prefix_caching``, ``cache.prefix``): a request whose prompt starts with the
    prompt of an earlier one (a system prompt, a conversation so far) takes the KV blocks that
    prompt's prefill left in the pool, within its ``cache_scope`` (``Engine.add_request``).
    """

    block_size: int = 16
    max_batch_size: int = 16
    kv_blocks: int | None = None
    kv_memory_fraction: float | None = None
    adaptive: bool = True  # per step, speculate only where measured speculation pays
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens prefilled per step, all sequences together; 0 = no limit
    suffix_cache_entries: int = DEFAULT_SUFFIX_ENTRIES  # n-grams of earlier outputs kept per scope; 0 = off
    suffix_cache_scopes: int = DEFAULT_SUFFIX_SCOPES  # scopes (clients) whose outputs are kept
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes earlier requests prefilled

    def __post_init__(self) -> None:
        check_engine_options({f.name: getattr(self, f.name) for f in fields(self) if f.name in _OPTION_RULES})

    @property
    def fixed_pool(self) -> bool:
        """The pool size is set by the user, not by the requests."""
        return self.kv_blocks is not None or self.kv_memory_fraction is not None
