"""What ``--strategies`` names, and the runners that time one generation of each.

Syntax: a comma-separated list of ``NAME[:OPTION[:OPTION...]]``.

- ``ar``: autoregressive decoding (the reference).
- ``selfspec`` / ``hispec``: options are a draft policy (``fixed``, ``svip``, ``confidence``,
  ``heuristic``) and ``KEY=VALUE`` overrides of the speculation settings: ``d`` (draft exit L_d),
  ``i`` (intermediate exit L_i), ``k`` (tokens per draft round N_d), ``w`` (window N_i), ``t`` (svip
  threshold, nats), ``c`` (confidence threshold, top-1 probability), ``m`` (token tree width: the
  exit's top-m at each draft position), ``b`` (prompt-lookup branches per tree), ``l`` (free
  drafts per round at most). ``lookup`` takes ``b=`` and ``l=`` too.
  Unset values come from the command line's speculation options, then the exit heads'
  recommendation, then the depth-based defaults. Examples: ``hispec:svip``,
  ``selfspec:heuristic``, ``selfspec:d=4:k=6``, ``hispec:d=2:i=8:w=8``, ``hispec:m=3:b=2``.
- ``hf``: transformers ``generate`` on the same model folder (greedy, or sampling with the same
  temperature / top-k / top-p).
- ``hf-early-exit[:L]``: transformers' LayerSkip-style self-speculation,
  ``generate(..., assistant_early_exit=L)``. Without ``L``, one run per ``--hf-exit-layers``
  layer (default: the draft layer), each reported as ``hf-early-exit:L``.
- ``hf-lookup[:K]``: transformers' prompt lookup decoding, ``generate(...,
  prompt_lookup_num_tokens=K, max_matching_ngram_size=3)`` (bare: K = 4); its speed is also
  reported against ``hf`` (``speedup_vs_plain``) when ``hf`` runs too.

A label may appear once. A strategy that cannot run is kept, with the reason.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field

import torch

from ..config import DRAFT_POLICIES, ConfigError, SamplingParams, SpecConfig
from ..settings import SPECULATIVE, STRATEGIES

OWN_KINDS = STRATEGIES
KINDS = OWN_KINDS + ("hf", "hf-early-exit", "hf-lookup")
HF_LOOKUP_TOKENS, HF_LOOKUP_NGRAM = 4, 3
SPEC_KEYS = {"d": "draft_layer", "i": "verify_layer", "k": "num_draft", "w": "window", "t": "svip_threshold",
             "c": "confidence_threshold", "m": "tree_width", "p": "tree_min_prob",
             "b": "lookup_branches", "l": "lookup_max_draft"}


@dataclass
class StrategySpec:
    label: str
    kind: str
    draft_policy: str | None = None
    overrides: dict = field(default_factory=dict)  # SpecConfig field -> value
    exit_layer: int | None = None  # hf-early-exit
    lookup_tokens: int | None = None  # hf-lookup


def parse_strategies(text: str) -> list[StrategySpec]:
    """Parse ``--strategies`` (see the module docstring); raises ConfigError naming the bad part."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ConfigError("--strategies is empty")
    specs, labels = [], set()
    for item in items:
        spec = _parse_one(item)
        if spec.label in labels:
            raise ConfigError(f"--strategies names {spec.label!r} twice")
        labels.add(spec.label)
        specs.append(spec)
    return specs


def _parse_one(item: str) -> StrategySpec:
    name, *options = item.split(":")
    if name not in KINDS:
        raise ConfigError(f"unknown strategy {name!r} in --strategies; choose from {', '.join(KINDS)} "
                          "(with options, e.g. hispec:svip, selfspec:d=4:k=6, hf-early-exit:8)")
    spec = StrategySpec(item, name)
    if name == "hf-early-exit":
        if len(options) > 1 or (options and not options[0].isdigit()):
            raise ConfigError(f"hf-early-exit takes one option, the exit layer (e.g. hf-early-exit:8), got {item!r}")
        spec.exit_layer = int(options[0]) if options else None
        return spec
    if name == "hf-lookup":
        if len(options) > 1 or (options and not (options[0].isdigit() and int(options[0]) > 0)):
            raise ConfigError(f"hf-lookup takes one option, the tokens drafted per round (e.g. hf-lookup:4), "
                              f"got {item!r}")
        spec.lookup_tokens = int(options[0]) if options else HF_LOOKUP_TOKENS
        return spec
    if name not in SPECULATIVE:  # ar, hf
        if options:
            raise ConfigError(f"strategy {name!r} takes no options, got {item!r}")
        return spec
    for opt in options:
        if opt in DRAFT_POLICIES:
            spec.draft_policy = opt
        elif "=" in opt and opt.split("=", 1)[0] in SPEC_KEYS:
            key, value = opt.split("=", 1)
            try:
                spec.overrides[SPEC_KEYS[key]] = float(value) if key in ("t", "c", "p") else int(value)
            except ValueError:
                raise ConfigError(f"strategy {item!r}: {key}= needs a number, got {value!r}") from None
        else:
            raise ConfigError(f"strategy {item!r}: unknown option {opt!r}; use a draft policy "
                              f"({', '.join(DRAFT_POLICIES)}) or {', '.join(k + '=N' for k in SPEC_KEYS)}")
    return spec


def expand_early_exit(specs: list[StrategySpec], layers: list[int]) -> list[StrategySpec]:
    """Replace a bare ``hf-early-exit`` by one ``hf-early-exit:L`` per layer."""
    out = []
    for s in specs:
        if s.kind == "hf-early-exit" and s.exit_layer is None:
            out.extend(StrategySpec(f"hf-early-exit:{L}", s.kind, exit_layer=L) for L in layers
                       if f"hf-early-exit:{L}" not in {t.label for t in specs})
        else:
            out.append(s)
    return out


def spec_for(strategy: StrategySpec, args: argparse.Namespace, generator) -> SpecConfig | None:
    """The speculation settings of an own strategy (None for ``ar``): its options over the
    command line's over the exit heads' recommendation over the defaults (``resolve_spec``)."""
    if strategy.kind not in SPECULATIVE:
        return None
    from ..options import spec_overrides

    overrides = spec_overrides(args)
    if strategy.draft_policy:
        overrides["draft_policy"] = strategy.draft_policy
    overrides.update(strategy.overrides)
    try:
        return generator.resolve_spec(strategy.kind, **overrides)
    except ConfigError as e:
        raise ConfigError(f"strategy {strategy.label!r}: {e}") from None


# ---- runners -------------------------------------------------------------------------------
@dataclass
class Sample:
    """One timed generation."""

    token_ids: list[int]
    seconds: float
    stats: object | None = None  # DecodeStats for own strategies
    kv_cache_bytes: int | None = None


class Runner:
    """Times one strategy; ``unavailable`` holds the reason it cannot run (or None)."""

    label: str
    kind: str
    unavailable: str | None = None

    def describe(self) -> dict:
        return {"kind": self.kind}

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        raise NotImplementedError


class OwnRunner(Runner):
    """``ar``, ``selfspec``, ``hispec`` and ``lookup`` through ``Generator.generate`` (``adaptive``: as
    ``hispec generate`` decodes, plain steps where measured speculation does not pay)."""

    def __init__(self, strategy: StrategySpec, generator, spec: SpecConfig | None, adaptive: bool = False) -> None:
        self.label, self.kind = strategy.label, strategy.kind
        self.gen, self.spec, self.adaptive = generator, spec, adaptive

    def describe(self) -> dict:
        return {"kind": self.kind, "spec": None if self.spec is None else
                {k: v for k, v in asdict(self.spec).items() if k != "num_layers"}}

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        with KVPeak(self.gen.model) as kv:
            out = self.gen.generate(list(prompt_ids), params, self.kind, spec=self.spec, adaptive=self.adaptive)
        return Sample(out.token_ids, out.seconds, out.stats, kv.bytes)


class KVPeak:
    """Peak KV-cache bytes of a generation: the most blocks in use at once, times the bytes of a
    block (all layers, K and V). Speculative strategies hold the K/V of tentative tokens until
    they are rejected, so this is where their cache overhead over ``ar`` shows.

    It watches ``BlockManager.ensure_capacity`` (the only way blocks are handed out) while the
    block is active, whatever object owns the block manager.
    """

    def __init__(self, model) -> None:
        cfg = model.cfg
        self.token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.kv_dtype.itemsize
        self.peak_tokens = 0
        self.bytes: int | None = None

    def __enter__(self) -> "KVPeak":
        from ..cache.block_manager import BlockManager

        self._original = original = BlockManager.ensure_capacity
        peak = self

        def ensure_capacity(blocks, seq_id: int, num_tokens: int) -> None:
            original(blocks, seq_id, num_tokens)
            peak.peak_tokens = max(peak.peak_tokens, blocks.num_used_blocks * blocks.block_size)

        BlockManager.ensure_capacity = ensure_capacity
        return self

    def __exit__(self, *exc) -> None:
        from ..cache.block_manager import BlockManager

        BlockManager.ensure_capacity = self._original
        self.bytes = self.peak_tokens * self.token_bytes if self.peak_tokens else None


class HFModel:
    """One transformers model on the generator's folder, loaded on first use, shared by peers."""

    def __init__(self, generator) -> None:
        self.gen = generator
        self._model = None
        self.error: str | None = None

    def get(self):
        if self._model is None and self.error is None:
            self._model, self.error = _load_hf(self.gen)
        if self._model is None:
            raise RuntimeError(self.error)
        return self._model


def _load_hf(gen):
    folder = gen.model_path
    if folder is None:
        return None, "the model was not loaded from a folder, so transformers has nothing to load"
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        return None, f"transformers is not importable: {e}"
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()  # its generate() warns about its own early-exit internals
        hf_logging.disable_progress_bar()  # the bench has its own
        if gen.gguf_path is not None:  # a model run on its file's blocks: its folder lacks the float32 weights
            from ..model.load.gguf_convert import convert_gguf

            folder = convert_gguf(gen.gguf_path, folder, progress=False)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=gen.model.dtype)
    except Exception as e:  # noqa: BLE001 - any failure makes the peer unavailable, with the reason
        return None, f"transformers cannot load {folder}: {type(e).__name__}: {e}"
    return model.to(gen.model.device).eval(), None


class HFRunner(Runner):
    """transformers ``generate``: plain (``hf``), with ``assistant_early_exit`` (``hf-early-exit:L``) or
    with prompt lookup (``hf-lookup:K``)."""

    def __init__(self, strategy: StrategySpec, generator, hf: HFModel) -> None:
        self.label, self.kind, self.exit_layer = strategy.label, strategy.kind, strategy.exit_layer
        self.lookup_tokens = strategy.lookup_tokens
        self.gen, self.hf = generator, hf
        self.unavailable = self._check()

    def describe(self) -> dict:
        d = {"kind": self.kind}
        if self.exit_layer is not None:
            d["assistant_early_exit"] = self.exit_layer
        if self.lookup_tokens is not None:
            d.update(prompt_lookup_num_tokens=self.lookup_tokens, max_matching_ngram_size=HF_LOOKUP_NGRAM,
                     plain_label="hf")
        try:
            import transformers
            d["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover
            pass
        return d

    def _check(self) -> str | None:
        if self.kind != "hf-early-exit":
            return None
        n = self.gen.model.num_layers
        if not 1 <= self.exit_layer < n:
            return f"exit layer {self.exit_layer} is outside 1..{n - 1} (the model has {n} layers)"
        try:
            from transformers import GenerationConfig
        except ImportError as e:  # pragma: no cover
            return f"transformers is not importable: {e}"
        if not hasattr(GenerationConfig(), "assistant_early_exit"):
            return "this transformers version has no assistant_early_exit (LayerSkip) support"
        return None

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        model = self.hf.get()
        device = self.gen.model.device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        kwargs = dict(max_new_tokens=params.max_new_tokens, return_dict_in_generate=True,
                      attention_mask=torch.ones_like(ids), pad_token_id=_pad_id(self.gen))
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            # top_k=0 and top_p=1.0 switch those filters off (None would mean transformers' default top_k=50)
            kwargs.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if params.ignore_eos:
            kwargs["min_new_tokens"] = params.max_new_tokens
        else:
            kwargs["eos_token_id"] = sorted(self.gen.eos_ids) or None
        if params.stop and self.gen.tokenizer is not None:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self.gen.tokenizer)
        if self.exit_layer is not None:
            kwargs["assistant_early_exit"] = self.exit_layer
        if self.lookup_tokens is not None:
            kwargs.update(prompt_lookup_num_tokens=self.lookup_tokens, max_matching_ngram_size=HF_LOOKUP_NGRAM)
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - t0
        new = out.sequences[0, len(prompt_ids):].tolist()
        cache = out.get("cache") if "cache" in out else out.get("past_key_values")  # "cache" since transformers 5
        return Sample(new, seconds, None, cache_bytes(cache))


def _pad_id(gen) -> int | None:
    tok = gen.tokenizer
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    return min(gen.eos_ids) if gen.eos_ids else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(cache) -> int | None:
    """Bytes of the K/V tensors of a transformers cache (DynamicCache or legacy tuples)."""
    if cache is None:
        return None
    total, seen = 0, set()

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            add(getattr(layer, "keys", None))
            add(getattr(layer, "values", None))
    else:
        try:
            for entry in cache:
                for t in entry:
                    add(t)
        except TypeError:
            return None
    return total


def build_runners(strategies: list[StrategySpec], args: argparse.Namespace, generator) -> list[Runner]:
    """One runner per strategy; own strategies' settings are validated here (ConfigError)."""
    hf = HFModel(generator)
    runners: list[Runner] = []
    for s in strategies:
        if s.kind in OWN_KINDS:
            runners.append(OwnRunner(s, generator, spec_for(s, args, generator), getattr(args, "adaptive", False)))
        else:
            runners.append(HFRunner(s, generator, hf))
    return runners
