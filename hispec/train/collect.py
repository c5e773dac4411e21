"""Collect what exit heads learn from, once: hidden states at candidate exit layers and the
final layer's next-token distribution (top-k), over the model's own greedy continuations
(self-distillation) and/or teacher-forced reference text.

Training then runs on this cache only; the 135M-parameter base model is not run again.
Costs on a 2-core CPU (SmolLM2-135M, float32): teacher forcing is one batched forward pass
per sequence; self-generation is one step per new token (batched over prompts, so the
weights are streamed once per step for the whole batch).

A cache folder holds ``meta.json`` and shards ``shard-NNNNN.safetensors`` with, per token:

- ``h.{L}``     ``[N, H]`` float16: hidden state entering layer ``L`` (the exit after ``L`` layers)
- ``h.final``   ``[N, H]`` float16: the last layer's output (before the final norm)
- ``top_ids``   ``[N, K]`` int32 and ``top_logp`` ``[N, K]`` float16: the final top-k log-probs
- ``kind``      ``[N]`` uint8: 0 = self-generated, 1 = teacher-forced
- ``seq``       ``[N]`` int32: the record index (for held-out splits by sequence)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import KVPool, SeqChunk
from ..decode.base import LayerRunner
from ..model.decoder import DecoderModel

SELF, TEACHER = 0, 1


@dataclass
class Capture:
    """Per-token training rows, built up over many calls."""

    layers: tuple[int, ...]
    topk: int

    def __post_init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}

    def add(self, hidden: dict[int, torch.Tensor], final_h: torch.Tensor, logits: torch.Tensor,
            kind: int, seq: int | torch.Tensor) -> None:
        # hidden[L]: [n, H]; final_h: [n, H]; logits: [n, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = logp.topk(self.topk, dim=-1)
        n = final_h.shape[0]
        parts = {f"h.{L}": hidden[L].to(torch.float16) for L in self.layers}
        parts.update({"h.final": final_h.to(torch.float16), "top_ids": top.indices.to(torch.int32),
                      "top_logp": top.values.to(torch.float16),
                      "kind": torch.full((n,), kind, dtype=torch.uint8),
                      "seq": (seq.to(torch.int32) if isinstance(seq, torch.Tensor)
                              else torch.full((n,), seq, dtype=torch.int32))})
        for k, v in parts.items():
            self.rows.setdefault(k, []).append(v)

    @property
    def num_tokens(self) -> int:
        return sum(t.shape[0] for t in self.rows.get("kind", []))

    def take(self) -> dict[str, torch.Tensor]:
        out = {k: torch.cat(v).contiguous() for k, v in self.rows.items()}
        self.rows = {}
        return out


class LayerTap:
    """The engine's layer runner over a private KV pool, with its capture hook on the tapped
    layers: ragged batches in, the hidden states entering each tapped layer and after the last
    layer out."""

    def __init__(self, model: DecoderModel, layers: tuple[int, ...], capacity_tokens: int, block_size: int = 16):
        self.model, self.layers = model, tuple(sorted(set(layers)))
        cfg = model.cfg
        self.num_blocks = -(-capacity_tokens // block_size) + 1
        self.blocks = BlockManager(self.num_blocks, block_size, cfg.num_layers, model.kv_layers - cfg.num_layers)
        self.pool = KVPool(model.kv_layers, self.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                           model.kv_dtype, model.device)
        self.runner = LayerRunner(model, self.blocks, self.pool)

    def forward(self, chunks: list[SeqChunk], token_ids: torch.Tensor, keep: torch.Tensor | None = None
                ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Hidden states at the tapped layers and after the last one, for the rows ``keep`` only
        (all rows if None; a long prefill keeps just what it needs, not every layer's states)."""
        items, a = [], 0
        for c in chunks:
            items.append((c.seq_id, c.start, token_ids[a:a + c.num_tokens]))
            a += c.num_tokens
        capture = {L: None for L in self.layers}
        h = torch.cat(self.runner.forward_many(items, 0, self.model.num_layers, capture))
        taps = {L: (t if keep is None else t[keep]) for L, t in capture.items()}
        return taps, (h if keep is None else h[keep])


@torch.inference_mode()
def teacher_forced(model: DecoderModel, seqs: list[tuple[int, list[int], int]], layers: tuple[int, ...],
                   capture: Capture, logits_chunk: int = 256) -> None:
    """``seqs``: (record index, token ids, first position whose *next* token is a target).
    One ragged forward pass for all of them."""
    total = sum(len(t) for _, t, _ in seqs)
    tap = LayerTap(model, layers, total + 16 * len(seqs))
    chunks = []
    for sid, (_, toks, _) in enumerate(seqs):
        tap.blocks.add_sequence(sid)
        chunks.append(SeqChunk(sid, 0, len(toks)))
    ids = torch.tensor([t for _, toks, _ in seqs for t in toks], dtype=torch.long, device=model.device)
    spans, offset, kept = [], 0, 0
    for _, toks, first in seqs:  # rows whose next token is a target (the last token's next is unknown)
        spans.append((offset + first, offset + len(toks) - 1))
        offset += len(toks)
    keep = torch.cat([torch.arange(a, b) for a, b in spans]).to(model.device)
    taps, final = tap.forward(chunks, ids, keep)
    for (rec, _, _), (a0, b0) in zip(seqs, spans):
        lo, hi = kept, kept + (b0 - a0)
        for a in range(lo, hi, logits_chunk):
            b = min(hi, a + logits_chunk)
            capture.add({L: taps[L][a:b] for L in tap.layers}, final[a:b], model.final_logits(final[a:b]),
                        TEACHER, rec)
        kept = hi


@torch.inference_mode()
def self_generate(model: DecoderModel, prompts: list[tuple[int, list[int]]], layers: tuple[int, ...],
                  capture: Capture, max_new_tokens: int, eos_ids: frozenset[int]) -> dict[int, list[int]]:
    """Greedy continuations of a batch of prompts, recording every step's states. Returns the
    new tokens per record index."""
    tap = LayerTap(model, layers, sum(len(p) + max_new_tokens + 16 for _, p in prompts))
    chunks = []
    for sid, (_, p) in enumerate(prompts):
        tap.blocks.add_sequence(sid)
        chunks.append(SeqChunk(sid, 0, len(p)))
    ids = torch.tensor([t for _, p in prompts for t in p], dtype=torch.long, device=model.device)
    last = torch.tensor([sum(len(p) for _, p in prompts[:i + 1]) - 1 for i in range(len(prompts))])
    taps, final = tap.forward(chunks, ids, last.to(model.device))
    lengths = [len(p) for _, p in prompts]
    out: dict[int, list[int]] = {rec: [] for rec, _ in prompts}
    active = list(range(len(prompts)))
    while active:
        logits = model.final_logits(final)  # [B, V]
        nxt = logits.argmax(-1)
        capture.add(taps, final, logits, SELF, torch.tensor([prompts[s][0] for s in active]))
        keep = []
        for row, sid in enumerate(active):
            new = out[prompts[sid][0]]
            new.append(int(nxt[row]))
            if new[-1] not in eos_ids and len(new) < max_new_tokens:
                keep.append(row)
        if not keep:
            break
        active = [active[r] for r in keep]
        taps, final = tap.forward([SeqChunk(s, lengths[s], 1) for s in active], nxt[keep])
        for s in active:
            lengths[s] += 1
    return out


class CacheWriter:
    """Shards on disk plus a resumable progress record."""

    def __init__(self, folder: Path, meta: dict) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        meta_file = folder / "meta.json"
        if meta_file.is_file():
            old = json.loads(meta_file.read_text())
            for key in ("topk", "model"):
                if old.get(key) != meta.get(key):
                    raise ValueError(f"cache {folder} was made with {key}={old.get(key)!r}, not "
                                     f"{meta.get(key)!r}: use another --cache folder")
            missing = sorted(set(meta["layers"]) - set(old["layers"]))
            if missing:
                raise ValueError(f"cache {folder} holds the layers {old['layers']}, not {missing}: "
                                 "use another --cache folder")
            meta = {**meta, "layers": old["layers"], "done": old.get("done", {}), "shards": old.get("shards", 0),
                    "tokens": old.get("tokens", {"self": 0, "teacher": 0}), "seconds": old.get("seconds", {})}
        else:
            meta = {**meta, "done": {}, "shards": 0, "tokens": {"self": 0, "teacher": 0}}
        self.meta = meta
        self._save_meta()

    def done(self, phase: str) -> int:
        return int(self.meta["done"].get(phase, 0))

    def write(self, tensors: dict[str, torch.Tensor], phase: str, done: int, seconds: float) -> None:
        n = self.meta["shards"]
        save_file(tensors, str(self.folder / f"shard-{n:05d}.safetensors"))
        kind = tensors["kind"]
        self.meta["tokens"]["self"] += int((kind == SELF).sum())
        self.meta["tokens"]["teacher"] += int((kind == TEACHER).sum())
        self.meta["done"][phase] = done
        self.meta["shards"] = n + 1
        self.meta.setdefault("seconds", {})
        self.meta["seconds"][phase] = round(self.meta["seconds"].get(phase, 0.0) + seconds, 1)
        self._save_meta()

    def _save_meta(self) -> None:
        tmp = self.folder / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1))
        tmp.replace(self.folder / "meta.json")


def read_meta(folder: Path) -> dict:
    f = Path(folder) / "meta.json"
    if not f.is_file():
        raise FileNotFoundError(f"{folder} is not a hidden-state cache (no meta.json)")
    return json.loads(f.read_text())


def iter_shards(folder: Path) -> Iterator[dict[str, torch.Tensor]]:
    meta = read_meta(folder)
    for n in range(meta["shards"]):
        yield load_file(str(Path(folder) / f"shard-{n:05d}.safetensors"))


def load_cache(folder: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Concatenate the chosen tensors of every shard (all of them if ``keys`` is None)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for shard in iter_shards(folder):
        for k, v in shard.items():
            if keys is None or k in keys:
                parts.setdefault(k, []).append(v)
    if not parts:
        raise ValueError(f"cache {folder} is empty")
    return {k: torch.cat(v) for k, v in parts.items()}
