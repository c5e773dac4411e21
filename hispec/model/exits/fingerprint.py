"""Which base model a set of exit heads belongs to: architecture numbers and a weight fingerprint."""
from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

ARCH_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "tie_word_embeddings")
_SAMPLES_PER_TENSOR = 1024
_GROUPS = 16


def _fingerprint_tensors(model: nn.Module) -> list:
    """The tensors sampled (an embedding kept in its GGUF file: the module, which samples its rows)."""
    n = model.cfg.num_layers
    layers = model.layers
    embed = model.embed_tokens
    return [embed if hasattr(embed, "flat_sample") else embed.weight, model.norm.weight, layers[0].qkv_proj.weight,
            layers[n // 2].o_proj.weight, layers[n - 1].input_norm.weight, layers[n - 1].qkv_proj.weight]


def _samples(model: nn.Module) -> torch.Tensor:
    """A fixed, strided sample of the base weights ``[S]`` in float32 (cheap: ~6k values)."""
    out = []
    for t in _fingerprint_tensors(model):
        if isinstance(t, nn.Module):  # GGUFEmbedding
            step = max(1, t.num_embeddings * t.embedding_dim // _SAMPLES_PER_TENSOR)
            out.append(t.flat_sample(step, _SAMPLES_PER_TENSOR))
            continue
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
