"""Exit heads: how a hidden state after ``L`` decoder layers becomes next-token logits.

A model trained for early exit (LayerSkip) needs nothing here: its shared final norm and
output head already work at every layer. A standard model does not (SmolLM2-135M: layer 8
of 30 agrees with the final top-1 token ~2% of the time through its own head), so small
heads are trained after the fact, with the base model frozen (``hispec train-exits``).

Design ``linear`` (per exit layer ``L``)::

    v = RMSNorm_g(h)                  # own gain g, initialised to 1
    z = v + W v + b                   # residual linear adapter, W = 0, b = 0 at initialisation
    logits = lm_head(final_norm(z))   # the model's own, shared (never copied, never trained)

At initialisation the head is the identity: ``final_norm(v) == final_norm(h)`` (RMSNorm is
scale invariant), so an untrained head equals the shared-head exit. The added weights are
``H*H + 2H`` per exit (333k for H = 576, 0.25% of SmolLM2-135M).

A head may restrict its output to a subset of the vocabulary (the most frequent tokens, as
in FR-Spec, arXiv 2502.14856): the matmul covers only those rows of ``lm_head``, and the
logits are still returned full-vocabulary shaped ``[T, V]``, with ``-inf`` outside the
subset. The strategies and the lossless maths are unchanged: a draft/intermediate exit can
only propose subset tokens, and the final verification uses the model's full head.

Heads are saved as ``heads.safetensors`` + ``manifest.json`` (format below, see
``Manifest``); ``attach_exits`` finds, checks and attaches them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import ConfigError, SpecConfig
from .llama import RMSNorm
from .matmul import Linear, linear

FORMAT = "hispec-exit-heads"
FORMAT_VERSION = 1
WEIGHTS_FILE = "heads.safetensors"
MANIFEST_FILE = "manifest.json"
DESIGNS = ("linear", "block")  # ExitHead here, ExitBlock in exit_block.py
# stored precision per design: a block is a whole decoder layer (14 MB in float32 for SmolLM2)
STORED_DTYPE = {"linear": torch.float32, "block": torch.float16}
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "exits"


class ExitHeadError(ValueError):
    """Exit heads cannot be used with this model, or their files are broken; the message says why."""


class SharedOutput(nn.Module):
    """The frozen end of every exit: the model's final norm and output head, optionally over a
    vocabulary subset. Held by reference (not registered), so ``state_dict()`` holds only what
    a subclass adds."""

    def __init__(self, model: nn.Module, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self._base = (model,)  # a tuple, so nn.Module does not register (or save) the base model
        self.vocab_size = model.cfg.vocab_size
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long().clone())
        self._sub_weight: torch.Tensor | None = None

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    @property
    def restricted(self) -> bool:
        return self.vocab_ids is not None

    def output_input(self, z: torch.Tensor) -> torch.Tensor:
        """The shared final norm (and OPT's output projection) on ``z [T, H]``."""
        base = self.base
        y = base.norm(z)
        if base.project_out is not None:
            y = base.project_out(y)
        return y

    def sub_weight(self) -> torch.Tensor:
        """The rows of the shared output head for the subset, ``[K, H]``: copied once (the head
        is frozen) and shared by every exit of the model with the same subset."""
        w = self.base.lm_head.weight
        if self._sub_weight is None or self._sub_weight.device != w.device or self._sub_weight.dtype != w.dtype:
            key = (hashlib.sha1(self.vocab_ids.cpu().numpy().tobytes()).hexdigest(), w.device, w.dtype)
            shared = self.base.__dict__.setdefault("_exit_sub_weights", {})
            if key not in shared:
                rows = w.detach()[self.vocab_ids.to(w.device)].contiguous()
                shared[key] = rows
            self._sub_weight = shared[key]
        return self._sub_weight

    def train_logits(self, z: torch.Tensor) -> torch.Tensor:
        """Differentiable logits of the state ``z [..., H]``: over the subset ``[..., K]`` for
        restricted exits (cheaper), else the full vocabulary ``[..., V]``."""
        y = self.output_input(z)
        if self.restricted:
            return nn.functional.linear(y, self.sub_weight())
        return self.base.lm_head(y)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary shaped logits ``[T, V]`` of ``z [T, H]`` (``-inf`` outside a subset)."""
        y = self.output_input(z)
        if self.vocab_ids is None:
            return linear(y, self.base.lm_head.weight)
        sub = linear(y, self.sub_weight())  # [T, K]
        out = sub.new_full((z.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.vocab_ids, sub)

    def num_added_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class ExitHead(SharedOutput):
    """Design ``linear``: RMSNorm + residual linear adapter, then the shared final norm + output head."""

    kind = "linear"
    has_kv = False

    def __init__(self, model: nn.Module, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__(model, vocab_ids)
        h = model.cfg.hidden_size
        self.norm = RMSNorm(h, model.cfg.norm_eps)  # the adapter's own input normalisation
        self.proj = Linear(h, h, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def adapt(self, h: torch.Tensor) -> torch.Tensor:
        """``h [T, H]`` -> the adapted state ``z [T, H]`` that enters the shared final norm."""
        v = self.norm(h)
        return v + self.proj(v)

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the subset only ``[T, K]`` (restricted heads), e.g. for training."""
        return nn.functional.linear(self.output_input(self.adapt(h)), self.sub_weight())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [T, H] -> logits [T, V]
        return self.logits(self.adapt(h))


# ---- base-model identity -------------------------------------------------------------------
ARCH_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "tie_word_embeddings")
_SAMPLES_PER_TENSOR = 1024
_GROUPS = 16


def _fingerprint_tensors(model: nn.Module) -> list[torch.Tensor]:
    n = model.cfg.num_layers
    layers = model.layers
    return [model.embed_tokens.weight, model.norm.weight, layers[0].qkv_proj.weight,
            layers[n // 2].o_proj.weight, layers[n - 1].input_norm.weight, layers[n - 1].qkv_proj.weight]


def _samples(model: nn.Module) -> torch.Tensor:
    """A fixed, strided sample of the base weights ``[S]`` in float32 (cheap: ~6k values)."""
    out = []
    for t in _fingerprint_tensors(model):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        out.append(flat[::step][:_SAMPLES_PER_TENSOR].float().cpu())
    return torch.cat(out)


def model_identity(model: nn.Module, name: str | None = None) -> dict[str, Any]:
    """Architecture numbers plus a fingerprint of the weights, for ``manifest.json``.

    ``weights_sha256`` hashes a strided sample of the embedding, the final norm and three
    layers' weights rounded to bfloat16, so float32 and bfloat16 loads of the same
    checkpoint agree exactly; ``weights_checksums`` (group sums of the same sample) let a
    float16 load (where double rounding may flip a last bit) match within tolerance.
    """
    cfg = model.cfg
    s = _samples(model)
    digest = hashlib.sha256(s.to(torch.bfloat16).view(torch.int16).numpy().tobytes()).hexdigest()
    sums = [round(float(g.double().sum()), 6) for g in s.chunk(_GROUPS)]
    arch = {f: getattr(cfg, f) for f in ARCH_FIELDS}
    return {"name": name, "architecture": arch, "weights_sha256": digest, "weights_checksums": sums}


def identity_mismatch(model: nn.Module, identity: dict[str, Any]) -> str | None:
    """Why ``identity`` (from a manifest) is not ``model``; None if it is."""
    cfg = model.cfg
    arch = identity.get("architecture", {})
    diffs = [f"{f} {arch.get(f)!r} vs {getattr(cfg, f)!r}" for f in ARCH_FIELDS
             if f in arch and arch[f] != getattr(cfg, f)]
    if diffs:
        return "architecture differs: " + ", ".join(diffs)
    mine = model_identity(model)
    if identity.get("weights_sha256") in (None, mine["weights_sha256"]):
        return None
    s = _samples(model)
    theirs = identity.get("weights_checksums") or []
    if len(theirs) == _GROUPS:
        scale = [float(g.double().abs().sum()) for g in s.chunk(_GROUPS)]
        if all(abs(a - b) <= 4e-3 * max(c, 1e-6) for a, b, c in zip(mine["weights_checksums"], theirs, scale)):
            return None  # the same weights in another precision
    return "the weights differ (fingerprint mismatch)"


# ---- manifest --------------------------------------------------------------------------------
SPEC_FIELDS = ("draft_layer", "verify_layer", "num_draft", "window", "draft_policy", "svip_threshold")


@dataclasses.dataclass
class Manifest:
    """``manifest.json``: what the heads are, for which model, how made, how good, how to use."""

    base_model: dict[str, Any]  # model_identity()
    layers: list[int]
    design: dict[str, Any]  # {"kind": "linear", "vocab": {layer: K or None}}
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    training: dict[str, Any] = dataclasses.field(default_factory=dict)  # command, steps, seed, seconds
    agreement: dict[str, Any] = dataclasses.field(default_factory=dict)  # per layer: before/after top-1/top-5
    recommended: dict[str, Any] = dataclasses.field(default_factory=dict)  # SpecConfig fields (hispec)
    recommended_selfspec: dict[str, Any] = dataclasses.field(default_factory=dict)
    tuning: dict[str, Any] = dataclasses.field(default_factory=dict)
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> "Manifest":
        if raw.get("format") != FORMAT:
            raise ExitHeadError(f"{where} is not an exit-head manifest (format {raw.get('format')!r})")
        if raw.get("version", 0) > FORMAT_VERSION:
            raise ExitHeadError(f"{where} has format version {raw['version']}; this hispec reads "
                                f"version {FORMAT_VERSION}: upgrade hispec")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            m = cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as e:
            raise ExitHeadError(f"{where} is incomplete: {e}") from None
        if m.design.get("kind") not in DESIGNS:
            raise ExitHeadError(f"{where}: unknown head design {m.design.get('kind')!r} (known: {', '.join(DESIGNS)})")
        m.layers = [int(x) for x in m.layers]
        return m

    def vocab_size_of(self, layer: int) -> int | None:
        v = (self.design.get("vocab") or {}).get(str(layer))
        return int(v) if v else None

    def spec(self, num_layers: int, which: str = "hispec") -> SpecConfig | None:
        rec = self.recommended if which == "hispec" else self.recommended_selfspec
        if not rec:
            return None
        try:
            return SpecConfig(**{k: rec[k] for k in SPEC_FIELDS if k in rec}, num_layers=num_layers)
        except (ConfigError, TypeError) as e:
            raise ExitHeadError(f"the manifest's recommended settings are invalid: {e}") from None


def read_manifest(folder: Path) -> Manifest:
    folder = Path(folder)
    f = folder / MANIFEST_FILE if folder.is_dir() else folder
    if not f.is_file():
        raise ExitHeadError(f"no exit heads at {folder}: {MANIFEST_FILE} is missing")
    try:
        raw = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExitHeadError(f"cannot read {f}: {e}") from None
    return Manifest.from_dict(raw, str(f))


def write_manifest(folder: Path, manifest: Manifest) -> None:
    tmp = Path(folder) / (MANIFEST_FILE + ".tmp")
    tmp.write_text(manifest.to_json())
    tmp.replace(Path(folder) / MANIFEST_FILE)


# ---- save / load ---------------------------------------------------------------------------
def new_heads(model: nn.Module, layers: list[int], vocab_ids: dict[int, torch.Tensor | None] | None = None,
              design: str = "linear", init: str = "copy") -> dict[int, SharedOutput]:
    """Untrained exits of ``design`` at ``layers`` (1 .. num_layers - 1), on the model's device and
    dtype: identity-initialised ``linear`` heads, or ``block`` exits (``init`` as in ``ExitBlock``)."""
    n = model.cfg.num_layers
    bad = [L for L in layers if not 1 <= L < n]
    if bad:
        raise ExitHeadError(f"exit layers must be between 1 and {n - 1} for this {n}-layer model, got {bad}")
    if design not in DESIGNS:
        raise ExitHeadError(f"unknown exit design {design!r} (known: {', '.join(DESIGNS)})")
    vocab_ids = vocab_ids or {}

    def make(L: int) -> SharedOutput:
        if design == "block":
            from .exit_block import ExitBlock

            return ExitBlock(model, vocab_ids.get(L), init=init)
        return ExitHead(model, vocab_ids.get(L))

    return {L: make(L).to(device=model.device, dtype=model.dtype).eval().requires_grad_(False) for L in layers}


def save_heads(folder: str | Path, heads: dict[int, ExitHead], manifest: Manifest) -> Path:
    """Write ``heads.safetensors`` (float32 adapters, float16 blocks) and ``manifest.json`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {h.kind for h in heads.values()}
    if len(kinds) != 1:
        raise ExitHeadError(f"one design per set of exits, got {sorted(kinds)}")
    kind = kinds.pop()
    tensors = {}
    for L, head in sorted(heads.items()):
        for k, v in head.state_dict().items():
            if v is not None:
                tensors[f"{L}.{k}"] = v.detach().to("cpu", STORED_DTYPE[kind] if v.is_floating_point() else v.dtype
                                                   ).contiguous()
    manifest.layers = sorted(heads)
    manifest.design = {**manifest.design, "kind": kind,
                       "vocab": {str(L): (int(h.vocab_ids.numel()) if h.restricted else None)
                                 for L, h in sorted(heads.items())}}
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT})
    tmp.replace(folder / WEIGHTS_FILE)
    write_manifest(folder, manifest)
    return folder


def load_heads(folder: str | Path, model: nn.Module, check_identity: bool = True
               ) -> tuple[dict[int, ExitHead], Manifest]:
    """Heads from ``folder`` for ``model``; ExitHeadError if they belong to another model."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if check_identity:
        why = identity_mismatch(model, manifest.base_model)
        if why:
            name = manifest.base_model.get("name") or "another model"
            raise ExitHeadError(f"the exit heads in {folder} were trained for {name}, not this model ({why}); "
                                "train heads for this model with `hispec train-exits`, or pass --no-exits")
    wfile = folder / WEIGHTS_FILE
    if not wfile.is_file():
        raise ExitHeadError(f"{folder}: {WEIGHTS_FILE} is missing")
    try:
        tensors = load_file(str(wfile))
    except Exception as e:  # safetensors raises its own error types
        raise ExitHeadError(f"cannot read {wfile}: {e}") from None
    vocab = {L: tensors.get(f"{L}.vocab_ids") for L in manifest.layers}
    heads = new_heads(model, manifest.layers, vocab, design=manifest.design["kind"])
    for L, head in heads.items():
        state = {k: tensors.get(f"{L}.{k}") for k in head.state_dict()}
        missing = [k for k, v in state.items() if v is None and k != "vocab_ids"]
        if missing:
            raise ExitHeadError(f"{wfile} lacks the tensors {', '.join(f'{L}.{k}' for k in missing)}")
        for k, v in state.items():
            if v is not None and tuple(v.shape) != tuple(head.state_dict()[k].shape):
                raise ExitHeadError(f"{wfile}: {L}.{k} has shape {tuple(v.shape)}, expected "
                                    f"{tuple(head.state_dict()[k].shape)}")
        head.load_state_dict({k: v.to(head.state_dict()[k].dtype) for k, v in state.items() if v is not None},
                             strict=False)
        head.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
    return heads, manifest


# ---- discovery -------------------------------------------------------------------------------
def shipped_heads() -> list[Path]:
    """Folders of heads shipped with hispec (package data), sorted by name."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.parent for p in SHIPPED_DIR.glob(f"*/{MANIFEST_FILE}"))


def find_heads(model: nn.Module, model_path: Path | None = None) -> Path | None:
    """Heads for this model: an ``exits/`` folder inside the model folder, else shipped heads
    whose manifest matches the model; None if there are none."""
    if model_path is not None and (Path(model_path) / "exits" / MANIFEST_FILE).is_file():
        return Path(model_path) / "exits"
    for folder in shipped_heads():
        try:
            manifest = read_manifest(folder)
        except ExitHeadError:
            continue
        if identity_mismatch(model, manifest.base_model) is None:
            return folder
    return None


def attach(gen, heads: dict[int, ExitHead], manifest: Manifest | None, path: Path | None = None) -> None:
    """Attach ``heads`` to ``gen.model`` and set ``gen.recommended_spec`` from the manifest."""
    n = gen.model.num_layers
    gen.model.exits = dict(heads)  # exit blocks get their KV-pool layers from model.kv_exits()
    gen.exit_heads_path = path
    gen.exit_manifest = manifest
    gen.recommended_spec = manifest.spec(n) if manifest is not None else None
    gen.recommended_specs = {k: s for k, s in (("hispec", gen.recommended_spec),
                                               ("selfspec", manifest.spec(n, "selfspec") if manifest else None))
                             if s is not None}


def attach_exits(gen, path: str | Path | None = None) -> Manifest | None:
    """Attach exit heads to a ``Generator``: those at ``path``, or (None) the model's own.

    With ``path=None`` the heads are discovered (``find_heads``); if none are found the
    generator is left unchanged (exits through the shared head). A manifest for another
    model raises ExitHeadError.
    """
    model = gen.model
    if path is None:
        path = find_heads(model, getattr(gen, "model_path", None))
        if path is None:
            return None
    path = Path(path)
    if not path.exists():
        raise ExitHeadError(f"--exits {path}: no such folder")
    heads, manifest = load_heads(path, model)
    attach(gen, heads, manifest, path)
    return manifest


def heads_nbytes(heads: dict[int, ExitHead]) -> int:
    """Memory the heads add: adapter weights, subset ids, and the (shared) subset rows of the output head."""
    total, subsets = 0, set()
    for h in heads.values():
        total += sum(p.numel() * p.element_size() for p in h.parameters())
        if h.restricted:
            total += h.vocab_ids.numel() * h.vocab_ids.element_size()
            subsets.add((h.vocab_ids.numel(), hashlib.sha1(h.vocab_ids.cpu().numpy().tobytes()).hexdigest()))
    some = next(iter(heads.values()), None)
    if some is not None:
        w = some.base.lm_head.weight
        total += sum(k * w.shape[1] * w.element_size() for k, _ in subsets)  # the subset's rows
    return total


def describe(manifest: Manifest) -> str:
    rec = manifest.recommended
    vocab = manifest.design.get("vocab") or {}
    layers = ", ".join(f"{L}" + (f" (vocab {vocab.get(str(L))})" if vocab.get(str(L)) else "")
                       for L in manifest.layers)
    parts = [f"exit heads at layers {layers}"]
    if rec:
        parts.append("recommended " + " ".join(f"{k}={rec[k]}" for k in SPEC_FIELDS if k in rec))
    return "; ".join(parts)
