"""Distillation data at scale: batched teacher passes over whole sequences, stored in shards.

An exit *block* attends over the exit layer's states at every earlier position, so its data
are whole sequences, not loose tokens. One teacher pass is a prefill of a ragged batch of
chat-formatted conversations (prompt + reply) packed end to end through the model's own
decoder layers (:func:`packed_forward`), taking the states entering the exit layers; the
final layer's log-probabilities are reduced to their top-k on the fly (:class:`ExactTopK`).
No per-token Python work. On CPU the linear layers run as dense bfloat16 matrices of the
model's weights (:func:`teacher_model`): a prefill is compute-bound, and that is where this
CPU is fastest.

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

import copy
import shlex

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

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
    precision: str = "bfloat16"  # matmuls of the teacher pass: see teacher_model


PRECISIONS = ("bfloat16", "model")


class DenseLinear(nn.Module):
    """A linear layer as one dense bfloat16 matrix: ``x [..., K] -> [..., N]`` in ``x``'s dtype.

    Prefill-sized inputs are compute-bound, and this CPU multiplies bfloat16 (AVX512-BF16) ~3x
    faster than float32 and far faster than the int4 decode kernel does at 2,048 rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight, self.bias)
        return out if out.dtype == x.dtype else out.to(x.dtype)


def teacher_model(model, precision: str):
    """The model the teacher pass runs. ``model``: the model itself, bit for bit what it serves
    (the default model's native 4-bit weights run on the int4 kernel, built for decode-sized
    inputs: ~130 positions/s per thread at prefill). ``bfloat16`` (on CPU): a copy whose linear
    layers (decoder and output head) are dense bfloat16 matrices of the *same* weights (quantized
    ones dequantized, as :meth:`QuantLinear.dequantize` gives what the kernel multiplies by); the
    residual stream, norms and attention stay as the model runs them. With the default model this
    copy's final-layer argmax equals the served model's at ~98% of positions (the rest are
    near-ties: only the rounding of the weights to bfloat16 and the summation order differ)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown teacher precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if precision == "model" or model.device.type != "cpu":
        return model
    from ..kernels.quant import QuantLinear

    dense = copy.copy(model)  # shallow: the copies below replace linear layers, nothing is shared mutably
    dense._modules = dict(model._modules)
    dense.layers = nn.ModuleList(_densify(copy.copy(layer)) for layer in model.layers)
    head = model.lm_head
    w = head.dequantize() if isinstance(head, QuantLinear) else head.weight
    dense.lm_head = DenseLinear(w, getattr(head, "bias", None))
    return dense


def _densify(module: nn.Module) -> nn.Module:
    """``module`` (a shallow copy) with every linear child replaced by a :class:`DenseLinear`."""
    from ..kernels.quant import QuantLinear

    module._modules = dict(module._modules)
    for name, child in list(module._modules.items()):
        if isinstance(child, QuantLinear):
            module._modules[name] = DenseLinear(child.dequantize(), child.bias)
        elif isinstance(child, nn.Linear):
            module._modules[name] = DenseLinear(child.weight, child.bias)
        elif child is not None and len(child._modules):
            module._modules[name] = _densify(copy.copy(child))
    return module


class TeacherPass:
    """Batched teacher passes: a ragged batch of whole sequences packed end to end (no padding),
    every linear layer run once over all positions, attention per sequence (causal, fused)."""

    def __init__(self, model, cfg: TeacherConfig) -> None:
        self.source, self.cfg = model, cfg
        self.model = teacher_model(model, cfg.precision)
        self.head = ExactTopK(model) if isinstance(self.model.lm_head, DenseLinear) else None

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
        """States and top-k targets for ``seqs`` (token id lists), rows in sequence order."""
        model, cfg = self.model, self.cfg
        lengths = [len(ids) for ids in seqs]
        tokens = torch.cat([torch.tensor(ids, dtype=torch.long) for ids in seqs])  # [N]
        attn = torch.bfloat16 if self.head is not None else None  # the bfloat16 teacher attends in bfloat16 too
        capture, final = packed_forward(model, tokens.to(model.device), lengths, cfg.layers, attn)  # final: [N, H]
        ids, logp = [], []
        for a in range(0, final.shape[0], cfg.logits_chunk):
            h = final[a:a + cfg.logits_chunk]
            if self.head is not None:
                top_logp, top_ids = self.head(model, h, cfg.topk)
            else:
                top_logp, top_ids = torch.log_softmax(model.final_logits(h).float(), dim=-1).topk(cfg.topk, dim=-1)
            ids.append(top_ids.to(torch.int32))
            logp.append(top_logp.to(torch.float16))
        out = {f"h.{L}": capture[L].to(torch.float16) for L in cfg.layers}
        out.update(top_ids=torch.cat(ids), top_logp=torch.cat(logp))
        out = {k: v.cpu() for k, v in out.items()}
        out["tokens"] = tokens.to(torch.int32)
        return out


def packed_forward(model, tokens: torch.Tensor, lengths: list[int], layers: tuple[int, ...],
                   attn_dtype: torch.dtype | None = None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Prefill of sequences packed end to end (``tokens [N]``, ``lengths`` summing to ``N``), each
    from position 0: the states entering each layer in ``layers`` and after the last layer,
    ``[N, H]`` (layer 0: the embeddings; ``num_layers``: the final state). The decoder layer's own norms, projections and MLP (as ``DecoderLayer.forward``),
    with no KV cache: each sequence's causal attention is one fused 4-D SDPA call (the paged
    path's 3-D call runs the unfused kernel on CPU, ~2x slower at 450 positions).
    ``attn_dtype``: the dtype attention runs in (default: the residual's, as the KV pool holds it;
    the bfloat16 teacher passes bfloat16: CPU SDPA is ~3x faster there, 0.73 vs 2.1 ms for 400
    causal positions of the default model's 9 heads)."""
    positions = torch.cat([torch.arange(n) for n in lengths]).to(tokens.device)  # [N]
    h = model.embed(tokens, positions)  # [N, H]
    rope = model.rope(positions)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    capture = {}
    gqa = model.cfg.num_kv_heads != model.cfg.num_heads
    for i, layer in enumerate(model.layers):
        if i in layers:
            capture[i] = h
        q, k, v = layer.qkv(layer.input_norm(h, layer.act_dtype), rope)  # [N, Hq | Hkv, D]
        q, k, v = (t.to(attn_dtype or h.dtype) for t in (q, k, v))
        att = torch.cat([F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
            is_causal=True, enable_gqa=gqa)[0].transpose(0, 1) for a, b in zip(bounds, bounds[1:])])  # [N, Hq, D]
        att = att.reshape(h.shape[0], layer.q_size)
        h = h + layer.o_proj(att.to(layer.act_dtype or h.dtype))
        h = h + layer.mlp(layer.post_norm(h, layer.act_dtype))
    if len(model.layers) in layers:  # the final state (entering the final norm)
        capture[len(model.layers)] = h
    return capture, h


class ExactTopK:
    """The final layer's top-k log-probabilities from bfloat16 logits, made exact where it matters.

    A bfloat16 logit of ~20 is rounded to a step of 0.125, which would reorder near-ties. So the
    bfloat16 logits only *select* ``k + margin`` candidates; their logits are recomputed in float32
    against the head's float32 weights (as the model computes them: ``x`` rounded to bfloat16 first
    when the model's head is a quantized kernel), and the log-normaliser is
    ``log(sum_exact(candidates) + sum_bf16(rest))``."""

    def __init__(self, model, margin: int = 8, rows: int = 16) -> None:
        from ..kernels.quant import QuantLinear

        head = model.lm_head
        quantized = isinstance(head, QuantLinear)
        self.rounds_input = quantized and head.input_dtype == torch.bfloat16  # the kernel reads bfloat16
        self.weight = (head.dequantize() if quantized else head.weight).float()  # [V, H']
        self.bias = None if getattr(head, "bias", None) is None else head.bias.float()
        self.margin, self.rows = margin, rows

    def __call__(self, model, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # h: [n, H] final hidden states -> (log-probs [n, k] descending, ids [n, k])
        x = model.norm(h)
        if model.project_out is not None:
            x = model.project_out(x)
        rough = model.lm_head(x.to(torch.bfloat16))  # [n, V] bfloat16: one compute-bound product
        xin = x.to(torch.bfloat16).float() if self.rounds_input else x.float()
        c = min(k + self.margin, rough.shape[1])
        logp, ids = [], []
        for a in range(0, xin.shape[0], self.rows):  # rows [r, V] in float32 that stay in the cache
            r = rough[a:a + self.rows].float()
            cand = top_columns(r, c)  # [r, C]
            exact = torch.einsum("nh,nch->nc", xin[a:a + self.rows], self.weight[cand])  # [r, C]
            if self.bias is not None:
                exact = exact + self.bias[cand]
            r.scatter_(1, cand, float("-inf"))  # the rest, bfloat16-rounded
            m = r.amax(-1, keepdim=True)
            rest = r.sub_(m).exp_().sum(-1).log_() + m[:, 0]  # logsumexp in place (3 passes, no copies)
            lse = torch.logaddexp(torch.logsumexp(exact, -1), rest)  # [r]
            top = exact.topk(k, dim=-1)
            logp.append(top.values - lse[:, None])
            ids.append(cand.gather(1, top.indices))
        return torch.cat(logp), torch.cat(ids)


def top_columns(x: torch.Tensor, k: int, group: int = 64) -> torch.Tensor:
    """The columns of the ``k`` largest values of each row of ``x [n, V]`` -> ``[n, k]`` (unordered;
    the same set as ``x.topk(k)``). Each of the ``k`` largest lies in one of the ``k`` column groups
    with the largest maxima, so the full sort runs over ``k * group`` values instead of ``V``: on
    the 49,152-token vocabulary ~7x faster than ``topk``."""
    n, v = x.shape
    if v <= k * group:
        return x.topk(k, dim=-1, sorted=False).indices
    pad = -v % group
    xp = F.pad(x, (0, pad), value=float("-inf")) if pad else x
    groups = xp.view(n, -1, group).amax(-1).topk(k, dim=-1, sorted=False).indices  # [n, k]
    cols = (groups[..., None] * group + torch.arange(group, device=x.device)).view(n, -1)  # [n, k * group]
    return cols.gather(1, xp.gather(1, cols).topk(k, dim=-1, sorted=False).indices)


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
    pool = KVPool(model.kv_layers, blocks.num_blocks, block_size, c.num_kv_heads, c.head_dim, model.kv_dtype, model.device)
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


def portable_meta(value):
    """``value`` (a meta.json tree) with no absolute path of this machine: paths and the paths in
    command lines are recorded as :func:`hispec.paths.portable` records them (relative to the
    current directory, else a file's name and hash)."""
    from ..paths import portable, portable_command

    if isinstance(value, dict):
        return {portable_meta(k): portable_meta(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_meta(v) for v in value]
    if not isinstance(value, str) or "/" not in value:
        return value
    if " " in value:  # a command line
        try:
            return portable_command(shlex.split(value))
        except ValueError:
            return value
    return portable(value) if Path(value).is_absolute() else value


class ShardWriter:
    """Shards plus ``meta.json`` (progress, totals, timings), written atomically."""

    def __init__(self, folder: Path, meta: dict) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        f = self.folder / "meta.json"
        if f.is_file():
            old = portable_meta(json.loads(f.read_text()))
            old["config"] = {"precision": "model", **old.get("config", {})}  # older folders: the model's kernels
            for key in ("format", "model", "config"):
                if old.get(key) != meta.get(key):
                    raise ValueError(f"{folder} was collected with another {key} ({old.get(key)!r}); "
                                     "use another folder to collect with these settings")
            meta = old
        else:
            meta = {**portable_meta(meta), "records_done": 0, "shards": 0, "positions": 0, "reply_positions": 0,
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
                       record=torch.tensor([r for r, _, _ in seqs], dtype=torch.int32))
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
