"""Distillation data at scale: batched teacher passes over whole sequences, stored in shards.

An exit *block* attends over the exit layer's states at every earlier position, so its data
are whole sequences, not loose tokens. One teacher pass is a prefill of a ragged batch of
chat-formatted conversations (prompt + reply) through the engine's own ``LayerRunner``,
with its ``capture`` hook taking the states entering the exit layers; the final layer's
log-probabilities are reduced to their top-k on the fly. No per-token Python work.

A data folder holds ``meta.json`` and shards ``shard-NNNNN.safetensors``; per shard, for
``S`` sequences of ``N`` positions in all:

- ``offsets``  ``[S + 1]`` int64: sequence ``s`` is rows ``offsets[s] .. offsets[s + 1] - 1``
- ``first``    ``[S]`` int32: the first row (within its sequence) whose next token is reply text
- ``record``   ``[S]`` int32: the record index (for held-out splits by record)
- ``tokens``   ``[N]`` int32: the input token ids
- ``h.{L}``    ``[N, H]`` float16: the hidden state entering layer ``L``
- ``top_ids``  ``[N, K]`` int32, ``top_logp`` ``[N, K]`` float16: the final layer's top-k
  log-probabilities of the next token at each position (every position is a target)

``meta.json`` records how many records were consumed, so an interrupted collection resumes
where it stopped (``collect`` with the same folder); records are processed in a fixed order.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import KVPool
from ..decode.base import LayerRunner

FORMAT = "hispec-distill-sequences"
MIN_TOKENS = 16  # shorter sequences teach little and would crowd a batch


@dataclass
class TeacherConfig:
    layers: tuple[int, ...]
    topk: int = 32
    max_tokens: int = 512  # per sequence (prompt + reply), longer ones are cut
    batch_tokens: int = 4096  # positions per teacher pass
    shard_positions: int = 16384
    logits_chunk: int = 1024


class TeacherPass:
    """Batched teacher passes over a private paged pool, through the engine's layer runner."""

    def __init__(self, model, cfg: TeacherConfig, block_size: int = 16) -> None:
        self.model, self.cfg = model, cfg
        c = model.cfg
        max_seqs = cfg.batch_tokens // MIN_TOKENS  # shorter sequences are not collected
        num_blocks = -(-cfg.batch_tokens // block_size) + max_seqs + 1
        self.blocks = BlockManager(num_blocks, block_size, c.num_layers, model.kv_layers - c.num_layers)
        self.pool = KVPool(model.kv_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype,
                           model.device)
        self.runner = LayerRunner(model, self.blocks, self.pool)

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        """States and top-k targets for ``seqs`` (token id lists), rows in sequence order."""
        model, cfg = self.model, self.cfg
        items = []
        for sid, ids in enumerate(seqs):
            self.blocks.add_sequence(sid)
            items.append((sid, 0, torch.tensor(ids, dtype=torch.long, device=model.device)))
        try:
            capture = {L: None for L in cfg.layers}
            final = torch.cat(self.runner.forward_many(items, 0, model.num_layers, capture))  # [N, H]
        finally:
            for sid in range(len(seqs)):
                self.blocks.free(sid)
        ids, logp = [], []
        for a in range(0, final.shape[0], cfg.logits_chunk):
            lp = torch.log_softmax(model.final_logits(final[a:a + cfg.logits_chunk]).float(), dim=-1)
            top = lp.topk(cfg.topk, dim=-1)  # [n, K]
            ids.append(top.indices.to(torch.int32))
            logp.append(top.values.to(torch.float16))
        out = {f"h.{L}": capture[L].to(torch.float16) for L in cfg.layers}
        out.update(top_ids=torch.cat(ids), top_logp=torch.cat(logp))
        return {k: v.cpu() for k, v in out.items()}


def encode_records(gen, records, max_tokens: int, max_prompt_tokens: int = 384
                   ) -> Iterator[tuple[int, list[int], int]]:
    """``(record index, prompt + reply ids, first reply row)`` in the model's chat format,
    for the records that have a reply and a prompt of at most ``max_prompt_tokens``."""
    from .distill import encode_record

    for i, rec in enumerate(records):
        prompt, reply = encode_record(gen, rec, max_prompt_tokens, max_tokens)
        if prompt is not None and reply:
            yield i, (prompt + reply)[:max_tokens], len(prompt) - 1


@torch.inference_mode()
def exit_logits_along(model, ids: list[int], first: int, layers: list[int], block_size: int = 16
                      ) -> dict[int, torch.Tensor]:
    """Logits ``[len(ids) - first, V]`` of each exit layer at positions ``first ..`` of ``ids``, as
    decoding computes them: one pass through the engine's runner (exit blocks write their K/V as
    in decoding) with the capture hook, then each exit (``LayerRunner.exit_logits``)."""
    c = model.cfg
    blocks = BlockManager(-(-len(ids) // block_size) + 1, block_size, c.num_layers, model.kv_layers - c.num_layers)
    pool = KVPool(model.kv_layers, blocks.num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype, model.device)
    runner = LayerRunner(model, blocks, pool)
    blocks.add_sequence(0)
    capture = {L: None for L in layers if L < c.num_layers}
    x = torch.tensor(ids, dtype=torch.long, device=model.device)
    final = runner.forward_many([(0, 0, x)], 0, c.num_layers, capture)[0]
    out = {L: runner.exit_logits([(0, first, capture[L][first:])], L) for L in capture}
    if c.num_layers in layers:
        out[c.num_layers] = model.final_logits(final[first:])
    return out


def batches(seqs: Iterable[tuple[int, list[int], int]], batch_tokens: int
            ) -> Iterator[list[tuple[int, list[int], int]]]:
    """Group ``(record, ids, first)`` into batches of at most ``batch_tokens`` positions."""
    batch, n = [], 0
    for s in seqs:
        if batch and n + len(s[1]) > batch_tokens:
            yield batch
            batch, n = [], 0
        batch.append(s)
        n += len(s[1])
    if batch:
        yield batch


class ShardWriter:
    """Shards plus ``meta.json`` (progress, totals, timings), written atomically."""

    def __init__(self, folder: Path, meta: dict) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        f = self.folder / "meta.json"
        if f.is_file():
            old = json.loads(f.read_text())
            for key in ("format", "model", "config"):
                if old.get(key) != meta.get(key):
                    raise ValueError(f"{folder} was collected with another {key} ({old.get(key)!r}); "
                                     "use another folder to collect with these settings")
            meta = old
        else:
            meta = {**meta, "records_done": 0, "shards": 0, "positions": 0, "reply_positions": 0,
                    "sequences": 0, "seconds": 0.0}
        self.meta = meta
        self._pending: list[tuple[list[tuple[int, list[int], int]], dict]] = []
        self._save_meta()

    def add(self, batch: list[tuple[int, list[int], int]], rows: dict[str, torch.Tensor]) -> None:
        self._pending.append((batch, rows))

    @property
    def pending_positions(self) -> int:
        return sum(r["top_ids"].shape[0] for _, r in self._pending)

    def flush(self, records_done: int, seconds: float) -> None:
        """Write the pending batches as one shard and record the progress."""
        if not self._pending:
            return
        seqs = [s for b, _ in self._pending for s in b]
        lengths = torch.tensor([len(ids) for _, ids, _ in seqs])
        tensors = {k: torch.cat([r[k] for _, r in self._pending]).contiguous() for k in self._pending[0][1]}
        tensors.update(offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                       first=torch.tensor([f for _, _, f in seqs], dtype=torch.int32),
                       record=torch.tensor([r for r, _, _ in seqs], dtype=torch.int32),
                       tokens=torch.tensor([t for _, ids, _ in seqs for t in ids], dtype=torch.int32))
        n = self.meta["shards"]
        tmp = self.folder / f"shard-{n:05d}.safetensors.tmp"
        save_file(tensors, str(tmp))
        tmp.replace(self.folder / f"shard-{n:05d}.safetensors")
        m = self.meta
        m["shards"], m["records_done"] = n + 1, records_done
        m["positions"] += int(lengths.sum())
        m["reply_positions"] += int(sum(len(ids) - f for _, ids, f in seqs))
        m["sequences"] += len(seqs)
        m["seconds"] = round(m["seconds"] + seconds, 1)
        m["positions_per_s"] = round(m["positions"] / max(m["seconds"], 1e-9), 1)
        self._pending = []
        self._save_meta()

    def _save_meta(self) -> None:
        tmp = self.folder / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1))
        tmp.replace(self.folder / "meta.json")


def collect(model, encoded: Iterable[tuple[int, list[int], int]], folder: Path, cfg: TeacherConfig,
            meta: dict, max_positions: int | None = None, log=None) -> dict:
    """Teacher passes over ``encoded`` = ``(record index, ids, first reply row)`` in a fixed
    order, resuming after the records already in ``folder``; stops after ``max_positions``
    positions in the folder (None: all records). Returns the meta."""
    writer = ShardWriter(folder, {"format": FORMAT, **meta, "config": {**asdict(cfg), "layers": list(cfg.layers)}})
    done = writer.meta["records_done"]
    teacher = TeacherPass(model, cfg)
    todo = ((r, ids[:cfg.max_tokens], f) for r, ids, f in encoded
            if r >= done and MIN_TOKENS <= min(len(ids), cfg.max_tokens) and f < min(len(ids), cfg.max_tokens))
    t0 = time.perf_counter()
    last = done
    for batch in batches(todo, cfg.batch_tokens):
        if max_positions is not None and writer.meta["positions"] + writer.pending_positions >= max_positions:
            break
        writer.add(batch, teacher([ids for _, ids, _ in batch]))
        last = batch[-1][0] + 1
        if writer.pending_positions >= cfg.shard_positions:
            writer.flush(last, time.perf_counter() - t0)
            t0 = time.perf_counter()
            if log:
                m = writer.meta
                log(f"{m['positions']} positions ({m['reply_positions']} in replies), {m['records_done']} records, "
                    f"{m['positions_per_s']} positions/s")
    writer.flush(last, time.perf_counter() - t0)
    return writer.meta


# ---- reading ----------------------------------------------------------------------------------
def read_meta(folder: Path) -> dict:
    f = Path(folder) / "meta.json"
    if not f.is_file():
        raise FileNotFoundError(f"{folder} holds no distillation data (no meta.json)")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder} is not a sequence-distillation folder (format {meta.get('format')!r})")
    return meta


def shard_paths(folder: Path) -> list[Path]:
    return [Path(folder) / f"shard-{n:05d}.safetensors" for n in range(read_meta(folder)["shards"])]


def read_shard(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in keys}
