"""The one distiller: exits (``linear``, ``block``, ``block-final``) trained on the collector's
shards (``collect.py``), the base model frozen.

Loss per position (teacher = the final layer's top-k log-probs, renormalised; for a restricted
exit the teacher mass outside the subset is dropped)::

    loss = KL(p_teacher || p_exit) + ce_weight * CE(p_exit, argmax of the teacher)

(the KL is computed as the cross-entropy minus the teacher's entropy, so it is 0 for a perfect
exit). Acceptance is greedy, hence the small extra weight on the argmax (``ce_weight = 0`` is
the cross-entropy to the top-k distribution alone).

Batches (``TrainConfig.batches``): whole sequences (a block attends over every earlier
position), right-padded, drawn from a per-epoch permutation that depends only on ``(seed,
epoch)``; or, for per-token exits, reply rows drawn from such a permutation. With the optimizer
state in the checkpoint, a run stopped and resumed gives bit-identical weights. A linear head may
start from ridge least squares of the final state on its exit state (``ls_init``).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import load_file, save_file

from . import collect as C
from .config import PRECISIONS, TrainConfig, resolve_precision  # noqa: F401 (re-exported)


# ---- data ----------------------------------------------------------------------------------------
@dataclass
class SeqData:
    """Sequences of one exit layer's states, concatenated: sequence ``s`` is rows ``offsets[s]:offsets[s+1]``."""

    hidden: torch.Tensor  # [N, H] float16
    top_ids: torch.Tensor  # [N, K] int64
    top_logp: torch.Tensor  # [N, K] float32
    offsets: torch.Tensor  # [S + 1] int64
    first: torch.Tensor  # [S] int64: first reply row of each sequence
    record: torch.Tensor  # [S] int64
    final: torch.Tensor | None = None  # [N, H] float16: the final state at each row (for block-final exits)

    @property
    def num_sequences(self) -> int:
        return int(self.first.shape[0])

    @property
    def num_positions(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def subset(self, seqs: torch.Tensor) -> "SeqData":
        """The sequences ``seqs`` (indices), in that order."""
        rows = torch.cat([torch.arange(int(self.offsets[s]), int(self.offsets[s + 1])) for s in seqs.tolist()])
        lengths = self.lengths()[seqs]
        return SeqData(self.hidden[rows], self.top_ids[rows], self.top_logp[rows],
                       torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), self.first[seqs],
                       self.record[seqs], None if self.final is None else self.final[rows])

    def reply_rows(self) -> torch.Tensor:
        """Indices of the rows whose next token is reply text ``[R]``."""
        lengths = self.lengths()
        seq = torch.repeat_interleave(torch.arange(self.num_sequences), lengths)  # [N]: each row's sequence
        within = torch.arange(self.num_positions) - self.offsets[:-1][seq]
        return (within >= self.first[seq]).nonzero().squeeze(1)

    def leading(self, positions: int) -> "SeqData":
        """The leading sequences that fit in ``positions`` rows (at least one)."""
        n = max(1, int((self.offsets[1:] <= positions).sum()))
        return self.subset(torch.arange(min(n, self.num_sequences)))

    def split(self, every: int) -> tuple["SeqData", "SeqData"]:
        """(train, held out): records whose index is a multiple of ``every`` are held out."""
        held = (self.record % every) == 0
        return self.subset((~held).nonzero().squeeze(1)), self.subset(held.nonzero().squeeze(1))


def load_sequences(folder: Path, layer: int, max_positions: int | None = None, final_layer: int | None = None
                   ) -> SeqData:
    """One layer's states from the shards of ``folder`` (in order, up to ``max_positions``), and
    with ``final_layer`` (the model's layer count) the final states too."""
    meta = C.read_meta(folder)
    for L in (layer, final_layer):
        if L is not None and L not in meta["config"]["layers"]:
            what = "the final states" if L == final_layer else f"the states of layer {L}"
            raise ValueError(f"{folder} holds the states of layers {meta['config']['layers']}, not {what}; "
                             f"collect them with collect-exits --layers ...,{L}")
    keys = [f"h.{layer}", "top_ids", "top_logp"] + ([f"h.{final_layer}"] if final_layer is not None else [])
    parts: dict[str, list[torch.Tensor]] = {}
    total = 0
    for path in C.shard_paths(folder):
        if max_positions is not None and total >= max_positions:
            break
        s = C.read_shard(path, keys + ["offsets", "first", "record"])
        offsets = s.pop("offsets")
        n_seq = s["first"].shape[0]
        if max_positions is not None and total + int(offsets[-1]) > max_positions:
            n_seq = max(1, int((offsets[1:] <= max_positions - total).sum()))
        rows = int(offsets[n_seq])
        for k in keys:
            parts.setdefault(k, []).append(s[k][:rows])
        for k in ("first", "record"):
            parts.setdefault(k, []).append(s[k][:n_seq].long())
        parts.setdefault("lengths", []).append(offsets[1:n_seq + 1] - offsets[:n_seq])
        total += rows
    if not parts:
        raise ValueError(f"{folder} holds no shards yet")
    lengths = torch.cat(parts["lengths"])
    return SeqData(torch.cat(parts[f"h.{layer}"]), torch.cat(parts["top_ids"]).long(),
                   torch.cat(parts["top_logp"]).float(), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                   torch.cat(parts["first"]), torch.cat(parts["record"]),
                   torch.cat(parts[f"h.{final_layer}"]) if final_layer is not None else None)


def load_folders(folders: list[Path], layer: int, final_layer: int | None = None) -> SeqData:
    """``load_sequences`` of each folder, their sequences one after the other (a record index
    is kept as its folder numbered it, so a held-out split by record takes from every folder)."""
    parts = [load_sequences(Path(f), layer, final_layer=final_layer) for f in folders]
    if len(parts) == 1:
        return parts[0]
    lengths = torch.cat([p.lengths() for p in parts])
    return SeqData(torch.cat([p.hidden for p in parts]), torch.cat([p.top_ids for p in parts]),
                   torch.cat([p.top_logp for p in parts]), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                   torch.cat([p.first for p in parts]), torch.cat([p.record for p in parts]),
                   None if final_layer is None else torch.cat([p.final for p in parts]))


def frequent_vocab(data: SeqData, size: int, vocab_size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` tokens the final layer chooses most often on ``data`` (plus ``always``),
    sorted by id -> ``[size]``."""
    counts = torch.bincount(data.top_ids[:, 0], minlength=vocab_size).double()
    # a small prior from the rest of the top-k, so ties among unseen tokens favour likely ones
    counts += 1e-3 * torch.bincount(data.top_ids[:, 1:].reshape(-1), minlength=vocab_size).double()
    for t in always:
        counts[t] = float("inf")
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


def vocab_coverage(data: SeqData, ids: torch.Tensor, vocab_size: int) -> float:
    """How often the final layer's argmax (at reply rows) is in ``ids``."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    return float(inside[data.top_ids[data.reply_rows(), 0]].float().mean())



# ---- batches -------------------------------------------------------------------------------------
def epoch_batches(data: SeqData, batch_tokens: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """Sequence indices per batch for ``epoch``: a permutation fixed by ``(seed, epoch)``, sorted
    by length within groups of 64 (less padding), cut at ``batch_tokens`` padded positions."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(data.num_sequences, generator=g)
    lengths = data.lengths()
    out = []
    for a in range(0, len(perm), 64):
        group = perm[a:a + 64]
        group = group[lengths[group].argsort(stable=True)]
        cur: list[int] = []
        for s in group.tolist():
            longest = max([int(lengths[t]) for t in cur + [s]])
            if cur and longest * (len(cur) + 1) > batch_tokens:
                out.append(torch.tensor(cur))
                cur = []
            cur.append(s)
        if cur:
            out.append(torch.tensor(cur))
    order = torch.randperm(len(out), generator=g)
    return [out[i] for i in order.tolist()]


def padded(data: SeqData, seqs: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, T, ...]`` tensors of the sequences ``seqs`` and a mask of real rows."""
    lengths = data.lengths()[seqs]
    B, Tm = len(seqs), int(lengths.max())
    K = data.top_ids.shape[1]
    h = torch.zeros(B, Tm, data.hidden.shape[1], dtype=torch.float32)
    ids = torch.zeros(B, Tm, K, dtype=torch.long)
    logp = torch.full((B, Tm, K), -1e4, dtype=torch.float32)
    mask = torch.zeros(B, Tm, dtype=torch.bool)
    reply = torch.zeros(B, Tm, dtype=torch.bool)
    d = None if data.final is None else torch.zeros(B, Tm, data.final.shape[1], dtype=torch.float32)
    for b, s in enumerate(seqs.tolist()):
        a, n = int(data.offsets[s]), int(lengths[b])
        h[b, :n] = data.hidden[a:a + n].float()
        if d is not None:  # the final state of the position before (none before position 0)
            d[b, 1:n] = data.final[a:a + n - 1].float()
        ids[b, :n] = data.top_ids[a:a + n]
        logp[b, :n] = data.top_logp[a:a + n]
        mask[b, :n] = True
        reply[b, int(data.first[s]):n] = True
    out = dict(h=h, ids=ids, logp=logp, mask=mask, reply=reply) | ({} if d is None else {"d": d})
    return {k: v.to(device) for k, v in out.items()}


def token_batches(data: SeqData, batch_tokens: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """Reply-row indices per batch for ``epoch`` (per-token exits): a permutation of the reply
    rows fixed by ``(seed, epoch)``, cut into batches of ``batch_tokens`` (the remainder is left
    to the next epoch's permutation)."""
    rows = data.reply_rows()
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = rows[torch.randperm(rows.numel(), generator=g)]
    n = max(1, rows.numel() // batch_tokens)
    return [perm[k * batch_tokens:(k + 1) * batch_tokens] for k in range(n)]


def cfg_batches(data: SeqData, cfg: TrainConfig, epoch: int) -> list[torch.Tensor]:
    """The batches of ``epoch`` as ``cfg.batches`` draws them."""
    if cfg.batches == "tokens":
        return token_batches(data, cfg.batch_tokens, cfg.seed, epoch)
    return epoch_batches(data, cfg.batch_tokens, cfg.seed, epoch)


def batch_of(data: SeqData, index: torch.Tensor, cfg: TrainConfig, device) -> dict[str, torch.Tensor]:
    """The tensors of one batch: padded sequences, or reply rows as one ``[1, R, ...]`` sequence
    of independent positions (per-token exits only)."""
    if cfg.batches == "sequences":
        return padded(data, index, device)
    ones = torch.ones(1, index.numel(), dtype=torch.bool)
    out = dict(h=data.hidden[index].float()[None], ids=data.top_ids[index][None], logp=data.top_logp[index][None],
               mask=ones, reply=ones)
    return {k: v.to(device) for k, v in out.items()}


# ---- the exit's output on dense batches ---------------------------------------------------------
def exit_state(head, h: torch.Tensor, rope, d: torch.Tensor | None = None) -> torch.Tensor:
    """The state ``[B, T, H]`` entering the shared final norm, for any design (``d``: the
    previous positions' final states, read by ``block-final`` exits)."""
    if head.has_kv:
        return head.forward_dense(h, rope, d if getattr(head, "reads_final", False) else None)
    return head.adapt(h)


def _d(head, batch: dict[str, torch.Tensor], dtype) -> torch.Tensor | None:
    if not getattr(head, "reads_final", False):
        return None
    if "d" not in batch:
        raise ValueError("a block-final exit needs the final states (load_sequences(..., final_layer=...))")
    return batch["d"].to(dtype)


def dense_rope(model, length: int, device):
    return model.rope(torch.arange(length, device=device))


def subset_remap(head) -> torch.Tensor | None:
    if not head.restricted:
        return None
    remap = torch.full((head.vocab_size,), -1, dtype=torch.long, device=head.vocab_ids.device)
    remap[head.vocab_ids] = torch.arange(head.vocab_ids.numel(), device=head.vocab_ids.device)
    return remap


def loss_terms(head, batch: dict[str, torch.Tensor], remap: torch.Tensor | None, ce_weight: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, number of rows, top-1 hits) over the real rows of a padded batch."""
    model = head.base
    rope = dense_rope(model, batch["h"].shape[1], batch["h"].device)
    z = exit_state(head, batch["h"].to(model.dtype), rope, _d(head, batch, model.dtype))[batch["mask"]]  # [R, H]
    logq = torch.log_softmax(head.train_logits(z).float(), dim=-1)  # [R, K or V]
    ids, logp = batch["ids"][batch["mask"]], batch["logp"][batch["mask"]]  # [R, K]
    p = torch.softmax(logp, dim=-1)
    cols = ids if remap is None else remap[ids]
    inside = cols >= 0
    p = p * inside
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    cols = cols.clamp_min(0)
    kl = (p * (p.clamp_min(1e-30).log() - logq.gather(1, cols))).sum(-1)  # [R]
    ce = -logq.gather(1, cols[:, :1]).squeeze(1) * inside[:, 0]
    loss = (kl + ce_weight * ce).mean()
    hits = ((logq.argmax(-1) == cols[:, 0]) & inside[:, 0]).sum()
    return loss, torch.tensor(z.shape[0]), hits


@torch.no_grad()
def agreement(head, data: SeqData, batch_tokens: int = 4096, reply_only: bool = True) -> dict[str, float]:
    """Top-1 / top-5 agreement of the exit with the final layer's argmax (reply positions by default)."""
    model = head.base
    hits1 = hits5 = n = 0
    for seqs in epoch_batches(data, batch_tokens, 0, 0):
        b = padded(data, seqs, model.device)
        rope = dense_rope(model, b["h"].shape[1], model.device)
        rows = b["reply"] if reply_only else b["mask"]
        z = exit_state(head, b["h"].to(model.dtype), rope, _d(head, b, model.dtype))[rows]
        logits = head.logits(z)  # [R, V]
        want = b["ids"][rows][:, 0]
        top5 = logits.topk(5, dim=-1).indices
        hits1 += int((top5[:, 0] == want).sum())
        hits5 += int((top5 == want[:, None]).any(-1).sum())
        n += int(want.shape[0])
    return {"top1": hits1 / max(1, n), "top5": hits5 / max(1, n), "positions": n}


def fed_back_layer(layer, x_exact: torch.Tensor, x_fed: torch.Tensor, rope) -> torch.Tensor:
    """The decoder layer's output ``[B, T, H]`` at every position ``t`` for the input ``x_fed[:, t]``,
    attending over the keys/values of ``x_exact`` at positions ``< t`` and of ``x_fed`` at ``t``
    (with ``x_fed == x_exact`` it is the layer's ordinary causal output)."""
    cfg = layer.cfg
    B, T, _ = x_fed.shape
    _, k1, v1 = layer.qkv(layer.input_norm(x_exact), rope)  # [B, T, heads, D]
    q2, k2, v2 = layer.qkv(layer.input_norm(x_fed), rope)
    rep = cfg.num_heads // cfg.num_kv_heads
    k1, v1, k2, v2 = (t.repeat_interleave(rep, dim=2).transpose(1, 2) for t in (k1, v1, k2, v2))  # [B, Hq, T, D]
    q2 = q2.transpose(1, 2) / math.sqrt(q2.shape[-1])
    s = q2 @ k1.transpose(-1, -2)  # [B, Hq, T, T]: t reads the exact keys of j < t
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(-1), float("-inf"))
    own = (q2 * k2).sum(-1, keepdim=True)  # [B, Hq, T, 1]: and its own key
    m = torch.maximum(s.amax(-1, keepdim=True), own)
    p, po = (s - m).exp(), (own - m).exp()
    a = (p @ v1 + po * v2) / (p.sum(-1, keepdim=True) + po)  # [B, Hq, T, D]
    x = x_fed + layer.o_proj(a.transpose(1, 2).reshape(B, T, layer.q_size))
    return x + layer.mlp(layer.post_norm(x))


@torch.no_grad()
def feedback_agreement(head, data: SeqData, batch_tokens: int = 2048) -> dict[str, float]:
    """Agreement of a ``block-final`` exit when it reads its *own* output of the position
    before instead of the model's final state, as a round's second and later drafts do.

    Query position ``t`` reads ``z_{t-1}`` (the exit's output there, itself computed from the
    exact final state); the keys and values of positions ``< t`` are the exact ones (those
    positions were verified), only position ``t``'s own come from the fed-back input. Returns the
    top-1 agreement over reply positions, and the same where the exit was right at ``t - 1``
    (acceptance is sequential: a later draft counts only after the earlier ones)."""
    model, layer = head.base, head.layer
    hits = n = hits_c = n_c = 0
    for seqs in epoch_batches(data, batch_tokens, 0, 0):
        b = padded(data, seqs, model.device)
        h, d = b["h"].to(model.dtype), _d(head, b, model.dtype)
        B, T, _ = h.shape
        rope = dense_rope(model, T, model.device)
        z1 = head.forward_dense(h, rope, d)  # [B, T, H]
        right1 = head.logits(z1[b["mask"]]).argmax(-1) == b["ids"][b["mask"]][:, 0]
        prev_right = torch.zeros(B, T, dtype=torch.bool, device=h.device)
        prev_right[:, 1:] = torch.zeros(B, T, dtype=torch.bool, device=h.device).masked_scatter(b["mask"], right1)[:, :-1]
        x1, x2 = head.block_input(h, d), head.block_input(h, F.pad(z1[:, :-1], (0, 0, 1, 0)))
        z2 = fed_back_layer(layer, x1, x2, rope)
        rows = b["reply"]
        right2 = head.logits(z2[rows]).argmax(-1) == b["ids"][rows][:, 0]
        cond = prev_right[rows]
        hits, n = hits + int(right2.sum()), n + int(right2.numel())
        hits_c, n_c = hits_c + int((right2 & cond).sum()), n_c + int(cond.sum())
    return {"top1_fed_back": hits / max(1, n), "top1_fed_back_given_previous": hits_c / max(1, n_c)}


# ---- linear heads: the closed-form start ---------------------------------------------------------------
def _normalised(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.no_grad()
def least_squares_init(head: nn.Module, hidden: torch.Tensor, final: torch.Tensor, ridge: float = 1e-3,
                       chunk: int = 8192) -> None:
    """Set the adapter so that ``v + W v + b`` best predicts the normalised final state
    (ridge regression on ``[v, 1]``; ``v`` = the exit state through the head's own RMSNorm)."""
    H = hidden.shape[1]
    A = torch.zeros(H + 1, H + 1, dtype=torch.float64)
    B = torch.zeros(H + 1, H, dtype=torch.float64)
    g = head.norm.weight.detach().float().cpu()
    for a in range(0, hidden.shape[0], chunk):
        v = _normalised(hidden[a:a + chunk].cpu()) * g
        x = torch.cat([v, torch.ones(v.shape[0], 1)], dim=1).double()
        A += x.T @ x
        B += x.T @ _normalised(final[a:a + chunk].cpu()).double()
    lam = ridge * float(A.diagonal()[:H].mean())
    A += lam * torch.eye(H + 1, dtype=torch.float64)
    M = torch.linalg.solve(A, B)  # [H + 1, H]: z = x @ M
    W = (M[:H] - torch.eye(H, dtype=torch.float64)).T
    head.proj.weight.copy_(W.to(head.proj.weight.dtype))
    head.proj.bias.copy_(M[H].to(head.proj.bias.dtype))


# ---- training --------------------------------------------------------------------------------------
@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)  # running loss every 10 steps
    curve: list[dict] = field(default_factory=list)  # held-out agreement vs positions seen
    positions_seen: int = 0
    seconds: float = 0.0


def save_checkpoint(folder: Path, head: nn.Module, opt: torch.optim.Optimizer, state: TrainState) -> None:
    """Weights, AdamW state and progress, written atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"head.0.{k}": v.detach().float().contiguous()
               for k, v in head.state_dict().items() if v is not None and v.is_floating_point()}
    names = {id(p): k for k, p in head.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    tensors[f"opt.0.{names[id(p)]}.{k}"] = v.detach().float().reshape(v.shape).contiguous()
    save_file(tensors, str(folder / "checkpoint.safetensors.tmp"))
    (folder / "checkpoint.safetensors.tmp").replace(folder / "checkpoint.safetensors")
    (folder / "checkpoint.json").write_text(json.dumps(state.__dict__))


def load_checkpoint(folder: Path, head: nn.Module, opt: torch.optim.Optimizer) -> TrainState | None:
    """What :func:`save_checkpoint` saved, loaded into ``head`` and ``opt``; None if ``folder``
    holds no checkpoint."""
    if not (folder / "checkpoint.json").is_file():
        return None
    tensors = load_file(str(folder / "checkpoint.safetensors"))
    with torch.no_grad():
        for k, v in head.state_dict().items():
            if f"head.0.{k}" in tensors:
                v.copy_(tensors[f"head.0.{k}"].to(v.dtype))
    for k, p in head.named_parameters():
        st = {name: tensors[f"opt.0.{k}.{name}"] for name in ("step", "exp_avg", "exp_avg_sq")
              if f"opt.0.{k}.{name}" in tensors}
        if "step" in st:
            st["step"] = st["step"].reshape(())
        if st:
            opt.state[p] = st
    return TrainState(**json.loads((folder / "checkpoint.json").read_text()))


def epoch_steps(data: SeqData, cfg: TrainConfig) -> list[int]:
    """Steps of each epoch the run touches: every epoch's permutation cuts its own number of
    batches; a fractional ``epochs`` cuts the last one short; ``steps`` (if set) runs as many
    epochs as it takes and cuts the last one there."""
    if cfg.steps is not None:
        counts: list[int] = []
        while sum(counts) < cfg.steps:
            counts.append(min(len(cfg_batches(data, cfg, len(counts))), cfg.steps - sum(counts)))
        return counts
    counts = [len(cfg_batches(data, cfg, e)) for e in range(max(1, math.ceil(cfg.epochs)))]
    frac = cfg.epochs - math.floor(cfg.epochs)
    if frac:
        counts[-1] = max(1, math.ceil(counts[-1] * frac))
    return counts


def step_position(step: int, counts: list[int]) -> tuple[int, int]:
    """(epoch, batch index within it) of a global step."""
    for epoch, n in enumerate(counts):
        if step < n:
            return epoch, step
        step -= n
    raise IndexError("step past the end of the schedule")


def lr_at(step: int, steps: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(head, data: SeqData, cfg: TrainConfig, checkpoint_dir: Path | None = None, resume: bool = False,
          heldout: SeqData | None = None, max_steps: int | None = None, log=None) -> TrainState:
    """Distil ``head`` on ``data`` (a linear head first set by least squares with ``cfg.ls_init``,
    unless resuming); with ``checkpoint_dir`` it saves (and with ``resume`` reloads) weights,
    optimizer state and progress. ``max_steps`` stops early (to continue later)."""
    if cfg.batches == "tokens" and head.has_kv:
        raise ValueError(f"a {head.kind} exit attends over earlier positions: train it on sequence batches")
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(list(head.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = load_checkpoint(Path(checkpoint_dir), head, opt) if (resume and checkpoint_dir) else None
    if state is None:
        state = TrainState()
        if cfg.ls_init and not head.has_kv:
            if data.final is None:
                raise ValueError("the least-squares start needs the final states (load_sequences(..., final_layer=...))")
            rows = data.reply_rows()
            least_squares_init(head, data.hidden[rows], data.final[rows], cfg.ridge)
    head.train().requires_grad_(True)
    counts = epoch_steps(data, cfg)
    steps = sum(counts)
    remap = subset_remap(head)
    device = head.base.device
    running, t0 = None, time.perf_counter()
    epoch_cache: dict[int, list[torch.Tensor]] = {}
    while state.step < steps and (max_steps is None or state.step < max_steps):
        epoch, k = step_position(state.step, counts)
        if epoch not in epoch_cache:
            epoch_cache = {epoch: cfg_batches(data, cfg, epoch)}
        batch = batch_of(data, epoch_cache[epoch][k], cfg, device)
        for group in opt.param_groups:
            group["lr"] = lr_at(state.step, steps, cfg)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16"):
            loss, rows, _ = loss_terms(head, batch, remap, cfg.ce_weight)
        loss.backward()
        opt.step()
        state.step += 1
        state.positions_seen += int(rows)
        v = float(loss.detach())
        running = v if running is None else 0.95 * running + 0.05 * v
        if state.step % 10 == 0:
            state.losses.append(round(running, 5))
        last = state.step == steps
        if heldout is not None and ((cfg.eval_every and state.step % cfg.eval_every == 0) or last):
            head.eval()
            a = agreement(head, heldout)
            head.train()
            state.curve.append({"step": state.step, "positions_seen": state.positions_seen,
                                "top1": round(a["top1"], 4), "top5": round(a["top5"], 4)})
            if log:
                log(f"step {state.step}/{steps}: loss {running:.4f}, held-out top-1 {a['top1']:.4f} "
                    f"top-5 {a['top5']:.4f} after {state.positions_seen} positions")
        elif log and state.step % 10 == 0:
            log(f"step {state.step}/{steps}: loss {running:.4f}")
        if checkpoint_dir is not None and (state.step % cfg.checkpoint_every == 0 or last):
            state.seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            save_checkpoint(Path(checkpoint_dir), head, opt, state)
    state.seconds += time.perf_counter() - t0
    if checkpoint_dir is not None:
        save_checkpoint(Path(checkpoint_dir), head, opt, state)
    head.eval().requires_grad_(False)
    return state


# ---- every exit command: one layer at a time -------------------------------------------------------
@dataclass
class LayerResult:
    """What a manifest records of one distilled exit."""

    positions: int  # training positions
    agreement: dict  # held-out top-1/top-5 before and after
    training: dict  # steps, positions seen, seconds, curve, last losses


def distill_layers(model, folders: list[Path], layers: list[int], cfg: TrainConfig, design: str = "block",
                   init: str = "zero", vocab: int = 0, vocab_layers: list[int] | None = None,
                   always: list[int] = (), heldout_every: int = 50, held_folders: list[Path] | None = None,
                   max_positions: int | None = None, work: Path | None = None, resume: bool = False,
                   max_steps: int | None = None, log=None) -> tuple[dict[int, nn.Module], dict[int, LayerResult]]:
    """Distil a fresh exit of ``design`` at each layer from the data folders, one layer's states
    in memory at a time. Held out: the records of ``held_folders`` if given, else every
    ``heldout_every``-th record of ``folders``. ``vocab``: restrict the exits at ``vocab_layers``
    (default all) to the tokens the final layer chooses most often in training (plus ``always``).
    ``work``: checkpoints per layer (``work/layer-L``), continued with ``resume``."""
    import gc

    from ..model.exits import new_heads

    n = model.num_layers
    final = n if design == "block-final" or (cfg.ls_init and design == "linear") else None
    exits, results = {}, {}
    for L in layers:
        data = load_folders(folders, L, final_layer=final)
        if held_folders:
            train_data, held = data, load_folders(held_folders, L, final_layer=final if design == "block-final" else None)
        else:
            train_data, held = data.split(heldout_every)
        del data
        if max_positions is not None:
            train_data = train_data.leading(max_positions)
        ids = None
        if vocab and L in (vocab_layers or layers):
            ids = {L: frequent_vocab(train_data, vocab, model.cfg.vocab_size, always)}
            if log:
                log(f"layer {L}: vocabulary restricted to {vocab} tokens: they cover "
                    f"{vocab_coverage(train_data, ids[L], model.cfg.vocab_size):.3f} of the final layer's greedy "
                    f"tokens (training), {vocab_coverage(held, ids[L], model.cfg.vocab_size):.3f} (held out)")
        exit_ = new_heads(model, [L], ids, design=design, init=init)[L]
        before = agreement(exit_, held)
        if log:
            log(f"layer {L}: {train_data.num_positions} training positions ({train_data.num_sequences} sequences), "
                f"held-out top-1 before {before['top1']:.4f}")
        state = train(exit_, train_data, cfg, None if work is None else Path(work) / f"layer-{L}", resume, held,
                      max_steps, log=log)
        after = agreement(exit_, held)
        if design == "block-final":
            after.update(feedback_agreement(exit_, held))
            if log:
                log(f"layer {L}: held-out top-1 with the exact final state {after['top1']:.4f}; feeding back its "
                    f"own state (a round's later drafts) {after['top1_fed_back']:.4f}, "
                    f"{after['top1_fed_back_given_previous']:.4f} where the draft before was right")
        exits[L] = exit_
        results[L] = LayerResult(
            train_data.num_positions,
            {"top1_before": round(before["top1"], 4), "top5_before": round(before["top5"], 4),
             "top1_after": round(after["top1"], 4), "top5_after": round(after["top5"], 4),
             "heldout_positions": after["positions"],
             **{k: round(v, 4) for k, v in after.items() if k.startswith("top1_fed")}},
            {"steps": state.step, "positions_seen": state.positions_seen, "seconds": round(state.seconds, 1),
             "curve": state.curve, "loss": state.losses[-5:]})
        del train_data, held  # one layer's states at a time: 3.7M positions of one layer hold ~7 GB
        gc.collect()
    return exits, results
