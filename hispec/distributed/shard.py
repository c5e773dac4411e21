"""Which part of each tensor a rank holds, and building a rank's model from it.

A rank holds whole K/V head groups (its KV heads and the query heads that read them), an even
part of the MLP columns and of the vocabulary; norms, RoPE, biases of row-parallel layers and
exit adapters are replicated. Head counts need not divide evenly (SmolLM2-135M: 3 KV heads on 2
ranks -> 2 + 1), but every rank needs at least one KV head: ``world_size <= num_kv_heads``.

Two sources, one plan (:func:`shard_slice`): :func:`load_shard` reads only this rank's slices
from the safetensors files (``safe_open(...).get_slice``: no rank ever holds a full copy), and
:func:`shard_model` cuts a model that is already built (tests, a model built in memory).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from ..config import ConfigError, ModelConfig
from .comm import Comm, split_range
from .layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, local_subset, exit_logits


@dataclasses.dataclass(frozen=True)
class Layout:
    """This rank's ranges: query heads, KV heads, MLP columns, vocabulary rows."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    vocab: tuple[int, int]

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world_size: int) -> "Layout":
        if world_size > cfg.num_kv_heads:
            raise ConfigError(f"--tensor-parallel-size {world_size} is more than the model's {cfg.num_kv_heads} "
                              "KV heads: each rank needs at least one")
        group = cfg.num_heads // cfg.num_kv_heads
        kv = split_range(cfg.num_kv_heads, world_size, rank)
        return cls(rank, world_size, (kv[0] * group, kv[1] * group), kv,
                   split_range(cfg.intermediate_size, world_size, rank),
                   split_range(cfg.vocab_size, world_size, rank))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head and MLP counts (vocabulary and hidden size stay full)."""
        return dataclasses.replace(cfg, num_heads=self.q_heads[1] - self.q_heads[0],
                                   num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                                   intermediate_size=self.mlp[1] - self.mlp[0])


def shard_slice(cfg: ModelConfig, layout: Layout, name: str, part: str | None) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of the (unfused) tensor ``name``/``part`` that this rank holds; None = all of it."""
    hd = cfg.head_dim
    field = re.sub(r"^layers\.\d+\.", "", name)
    if field.startswith("qkv_proj."):
        heads = layout.q_heads if part == "q" else layout.kv_heads
        return 0, heads[0] * hd, heads[1] * hd
    if field == "o_proj.weight":
        return 1, layout.q_heads[0] * hd, layout.q_heads[1] * hd
    if field in ("gate_up_proj.weight", "fc1.weight", "fc1.bias"):
        return (0,) + layout.mlp
    if field in ("down_proj.weight", "fc2.weight"):
        return (1,) + layout.mlp
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return (0,) + layout.vocab
    return None


def _cut(t: torch.Tensor, how: tuple[int, int, int] | None) -> torch.Tensor:
    if how is None:
        return t
    dim, a, b = how
    return t[a:b] if dim == 0 else t[:, a:b]


def sharded_skeleton(cfg: ModelConfig, comm: Comm) -> nn.Module:
    """This rank's model on the meta device: local head/MLP counts, parallel modules in place."""
    from ..model.decoder import DecoderModel

    layout = Layout.of(cfg, comm.rank, comm.world_size)
    local = layout.local_config(cfg)
    with torch.device("meta"):
        model = DecoderModel(local)
        h = cfg.hidden_size
        for layer in model.layers:
            layer.o_proj = RowParallelLinear(local.num_heads * cfg.head_dim, h, cfg.family == "opt", comm)
            if cfg.family == "opt":
                layer.fc2 = RowParallelLinear(local.intermediate_size, h, True, comm)
            else:
                layer.down_proj = RowParallelLinear(local.intermediate_size, h, False, comm)
        emb_dim = cfg.word_embed_proj_dim or h
        model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, emb_dim, comm)
        model.lm_head = VocabParallelHead(cfg.vocab_size, emb_dim, comm)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    model.__class__ = _sharded_class(type(model))
    model.tp, model.full_cfg, model.layout = comm, cfg, layout
    return model


def _finish(model: nn.Module, state: dict[str, torch.Tensor], device, dtype) -> nn.Module:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.full_cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ConfigError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:4])}")
    for k, v in state.items():
        if tuple(v.shape) != expected[k]:
            raise ConfigError(f"rank {model.layout.rank}: shard of {k} has shape {tuple(v.shape)}, expected {expected[k]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if model.full_cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if model.full_cfg.family != "opt":
        from ..model.decoder import rope_inv_freq
        model.inv_freq = rope_inv_freq(model.full_cfg)
    return model.to(device).eval().requires_grad_(False)


def _assemble(cfg: ModelConfig, read: Callable[[str, str | None], torch.Tensor | None],
              names: list[tuple[str, str | None]]) -> dict[str, torch.Tensor]:
    """This rank's state dict from ``read(name, part)`` (already sliced), fusing q/k/v and gate/up."""
    from ..model.load.checkpoint import fuse_parts

    state, parts = {}, {}
    for name, part in names:
        t = read(name, part)
        if part:
            parts.setdefault(name, {})[part] = t
        else:
            state[name] = t
    state.update(fuse_parts(parts))
    return state


def load_shard(path: str | Path, comm: Comm, *, device="cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """This rank's model, reading only its slices of the safetensors files of a model folder."""
    from ..model.load.checkpoint import ModelLoadError, expected_shape, ignored, internal_name, read_config
    from ..model.decoder import DecoderModel

    path = Path(path)
    cfg = read_config(path)
    if cfg.family == "gemma3":
        raise ModelLoadError("tensor parallelism does not run gemma3 models yet (sandwich norms, sliding "
                             "windows); run them on one process")
    layout = Layout.of(cfg, comm.rank, comm.world_size)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no safetensors files (tensor parallelism reads safetensors only)")
    with torch.device("meta"):
        full = DecoderModel(cfg)
    full_shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    model = sharded_skeleton(cfg, comm)
    where: dict[tuple[str, str | None], tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for hf_name in sf.keys():
                mapped = internal_name(hf_name, cfg.family)
                if mapped is None or mapped[0] not in full_shapes:
                    if ignored(hf_name, cfg):
                        continue
                    raise ModelLoadError(f"unexpected tensor {hf_name!r} for a {cfg.family} model")
                name, part = mapped
                want = expected_shape(full, full_shapes, name, part)
                got = tuple(sf.get_slice(hf_name).get_shape())
                if got != want:
                    raise ModelLoadError(f"tensor {hf_name!r} has shape {got}, the config implies {want}")
                where[mapped] = (f, hf_name)

    handles: dict[Path, object] = {}

    def read(name: str, part: str | None) -> torch.Tensor:
        f, hf_name = where[(name, part)]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        sl = handles[f].get_slice(hf_name)
        how = shard_slice(cfg, layout, name, part)
        if how is None:
            return sl[:]
        dim, a, b = how
        return sl[a:b] if dim == 0 else sl[:, a:b]

    state = _assemble(cfg, read, list(where))
    handles.clear()
    return _finish(model, state, device, dtype)


def shard_model(full: nn.Module, comm: Comm) -> nn.Module:
    """This rank's model cut from a built single-process ``full`` model (same device and dtype).
    Exit heads attached to ``full`` are carried over (their adapters are replicated)."""
    from ..model.load.checkpoint import FUSED_ORDER

    cfg = full.cfg
    layout = Layout.of(cfg, comm.rank, comm.world_size)
    model = sharded_skeleton(cfg, comm)
    full_state = full.state_dict()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sizes = {"qkv_proj": {"q": q, "k": kv, "v": kv}, "gate_up_proj": {"gate": cfg.intermediate_size,
                                                                     "up": cfg.intermediate_size}}
    names = []
    for name in model.state_dict():
        fused = name.split(".")[2] if name.startswith("layers.") else None
        names += [(name, p) for p in FUSED_ORDER[fused]] if fused in FUSED_ORDER else [(name, None)]

    def read(name: str, part: str | None) -> torch.Tensor:
        t = full_state[name]
        if part:
            fused = name.split(".")[2]
            order = FUSED_ORDER[fused]
            t = t.split([sizes[fused][p] for p in order])[order.index(part)]
        return _cut(t, shard_slice(cfg, layout, name, part)).clone()

    model = _finish(model, _assemble(cfg, read, names), full.device, full.dtype)
    model.exits = {L: _rebased(head, model) for L, head in full.exits.items()}
    return model


def _rebased(head: nn.Module, model: nn.Module) -> nn.Module:
    import copy

    new = copy.copy(head)  # the adapter's parameters are shared (replicated, frozen)
    new._base = (model,)
    new.__dict__.pop("_tp_subset", None)
    return new


class ShardedModelMixin:
    """Output heads of a sharded model: the vocabulary-parallel head, all-gathered logits."""

    def final_logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return self.lm_head(h)  # [T, V], the same on every rank

    def prepare_exit(self, head: nn.Module) -> None:
        """This rank's rows of a vocabulary-restricted exit head, now rather than in the first draft
        (the head's own ``prepare`` would index the full vocabulary in this rank's part of it)."""
        if getattr(head, "vocab_ids", None) is not None:
            local_subset(head, self.lm_head)

    def exit_logits(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        head = self.exits.get(layer) if layer < self.cfg.num_layers else None
        if head is None:
            return self.final_logits(h)
        if not hasattr(head, "adapt") or not hasattr(head, "output_input"):
            from .comm import TensorParallelError
            raise TensorParallelError(f"exit heads of type {type(head).__name__} are not supported with "
                                      "tensor parallelism")
        return exit_logits(self, head, h)


_CLASSES: dict[type, type] = {}


def _sharded_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type("Sharded" + base.__name__, (ShardedModelMixin, base), {})
    return _CLASSES[base]
