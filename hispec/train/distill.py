"""Exit-head distillation with the base model frozen.

Recipe (measured on a 2-core CPU, see hispec/exits/README.md):

1. ``collect_cache``: run the model once over the training text -- its own greedy
   continuations of the prompts and/or teacher-forced reference responses -- and keep the
   hidden states at the candidate exit layers plus the final layer's top-k log-probs.
2. ``least_squares_init``: the linear adapter has a closed-form start: regress the
   normalised final hidden state on the normalised exit state (ridge least squares over
   every cached token; seconds, whatever the data size).
3. ``train_heads``: minimise the cross-entropy to the final layer's top-k distribution
   (= the KL divergence up to a constant) with Adam, over the shared output head (or its
   restricted-vocabulary rows). The base model never runs again.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..model.exits import ExitHead
from . import collect as C
from .sources import TextRecord, has_response


# ---- encoding ---------------------------------------------------------------------------------
def encode_record(gen, rec: TextRecord, max_prompt_tokens: int, max_response_tokens: int
                  ) -> tuple[list[int] | None, list[int] | None]:
    """(prompt ids, response ids) in the model's chat format; prompt None if it is too long."""
    if rec.prompt_ids is not None:
        prompt = list(rec.prompt_ids)
        response = list(rec.response_ids)[:max_response_tokens] if rec.response_ids else None
        return (prompt if len(prompt) <= max_prompt_tokens else None), response
    prompt = gen.encode_prompt(rec.prompt)
    if len(prompt) > max_prompt_tokens:
        return None, None
    if rec.response is None:
        return prompt, None
    tok = gen.tokenizer
    if gen.has_chat_template():
        full = tok.apply_chat_template([{"role": "user", "content": rec.prompt},
                                        {"role": "assistant", "content": rec.response}], tokenize=False)
        ids = tok(full, add_special_tokens=False)["input_ids"]
        response = ids[len(prompt):] if ids[:len(prompt)] == prompt else tok(rec.response, add_special_tokens=False)["input_ids"]
    else:
        response = tok(rec.response, add_special_tokens=False)["input_ids"]
    return prompt, response[:max_response_tokens] or None


# ---- step 1: the cache ------------------------------------------------------------------------
@dataclass
class CollectConfig:
    layers: tuple[int, ...]
    mode: str = "both"  # self | teacher | both
    topk: int = 32
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128  # per self-generated continuation
    max_response_tokens: int = 384  # per teacher-forced response
    self_tokens: int | None = None  # budget per kind (None: all records)
    teacher_tokens: int | None = None
    batch_size: int = 16  # prompts generated together
    teacher_batch_tokens: int = 2048  # tokens per teacher-forced forward pass
    shard_tokens: int = 4096


def collect_cache(gen, records: list[TextRecord], folder: Path, cfg: CollectConfig, data_summary: dict,
                  progress: bool = True) -> dict:
    """Fill (or resume) the cache in ``folder``; returns its meta."""
    from tqdm import tqdm

    model = gen.model
    meta = {"layers": list(cfg.layers), "topk": cfg.topk, "model": _model_key(gen), "data": data_summary,
            "config": {k: v for k, v in cfg.__dict__.items() if k != "layers"}}
    writer = C.CacheWriter(Path(folder), meta)
    layers = tuple(writer.meta["layers"])  # an existing cache may hold more layers than asked for
    phases = [p for p in ("teacher", "self") if cfg.mode in (p, "both")]
    for phase in phases:
        pool = [(i, r) for i, r in enumerate(records) if phase == "self" or has_response(r)]
        budget = cfg.self_tokens if phase == "self" else cfg.teacher_tokens
        key = "self" if phase == "self" else "teacher"
        have = writer.meta["tokens"][key]
        start = writer.done(phase)
        if start >= len(pool) or (budget is not None and have >= budget):
            continue
        bar = tqdm(total=budget or None, initial=have, unit="tok", desc=f"collect {phase}", file=sys.stderr,
                   disable=not progress, dynamic_ncols=True)
        cap = C.Capture(layers, cfg.topk)
        i, t0 = start, time.perf_counter()
        while i < len(pool) and (budget is None or have + cap.num_tokens < budget):
            batch, i = _next_batch(gen, pool, i, cfg, phase)
            before = cap.num_tokens
            if batch and phase == "self":
                C.self_generate(model, batch, layers, cap, cfg.max_new_tokens, gen.eos_ids)
            elif batch:
                C.teacher_forced(model, batch, layers, cap)
            bar.update(cap.num_tokens - before)
            if cap.num_tokens >= cfg.shard_tokens or i >= len(pool):
                n = cap.num_tokens
                if n:
                    writer.write(cap.take(), phase, i, time.perf_counter() - t0)
                    have += n
                else:
                    writer.meta["done"][phase] = i
                t0 = time.perf_counter()
        if cap.num_tokens:
            have += cap.num_tokens
            writer.write(cap.take(), phase, i, time.perf_counter() - t0)
        bar.close()
    return writer.meta


def _model_key(gen) -> str:
    from ..model.exits import model_identity

    return model_identity(gen.model)["weights_sha256"]


def _next_batch(gen, pool, i, cfg: CollectConfig, phase: str):
    """The next batch of encoded records from ``pool[i:]`` and the new index."""
    batch, tokens = [], 0
    while i < len(pool):
        rec_idx, rec = pool[i]
        prompt, response = encode_record(gen, rec, cfg.max_prompt_tokens, cfg.max_response_tokens)
        if phase == "self":
            if prompt is not None:
                batch.append((rec_idx, prompt))
            i += 1
            if len(batch) >= cfg.batch_size:
                break
        else:
            if prompt is not None and response:
                seq = prompt + response
                if batch and tokens + len(seq) > cfg.teacher_batch_tokens:
                    break
                batch.append((rec_idx, seq, len(prompt) - 1))
                tokens += len(seq)
            i += 1
    return batch, i


# ---- the cached data as tensors --------------------------------------------------------------
@dataclass
class TokenData:
    """Cached rows for training/evaluation (hidden states stay float16 until used)."""

    hidden: dict[int, torch.Tensor]  # layer -> [N, H] float16
    final: torch.Tensor | None  # [N, H] float16, the last layer's output
    top_ids: torch.Tensor  # [N, K] int64
    top_logp: torch.Tensor  # [N, K] float32
    kind: torch.Tensor  # [N] uint8
    seq: torch.Tensor  # [N] int32

    @property
    def num_tokens(self) -> int:
        return int(self.top_ids.shape[0])

    def select(self, mask: torch.Tensor) -> "TokenData":
        idx = mask.nonzero().squeeze(1)
        return TokenData({L: h[idx] for L, h in self.hidden.items()}, None if self.final is None else self.final[idx],
                         self.top_ids[idx], self.top_logp[idx], self.kind[idx], self.seq[idx])

    def limit(self, kind_budget: dict[int, int | None]) -> "TokenData":
        """Keep the first ``kind_budget[k]`` tokens of each kind (None: all)."""
        keep = torch.zeros(self.num_tokens, dtype=torch.bool)
        for k, budget in kind_budget.items():
            idx = (self.kind == k).nonzero().squeeze(1)
            keep[idx[:budget] if budget is not None else idx] = True
        return self.select(keep)

    def summary(self) -> dict:
        return {"tokens": self.num_tokens, "self_generated": int((self.kind == C.SELF).sum()),
                "teacher_forced": int((self.kind == C.TEACHER).sum()), "sequences": int(self.seq.unique().numel())}


def load_token_data(folder: Path, layers: list[int], with_final: bool = True) -> TokenData:
    meta = C.read_meta(folder)
    missing = [L for L in layers if L not in meta["layers"]]
    if missing:
        raise ValueError(f"cache {folder} has no states for layer(s) {missing} (it has {meta['layers']}); "
                         "collect a new cache with those layers")
    keys = [f"h.{L}" for L in layers] + ["top_ids", "top_logp", "kind", "seq"] + (["h.final"] if with_final else [])
    t = C.load_cache(Path(folder), keys)
    return TokenData({L: t[f"h.{L}"] for L in layers}, t.get("h.final"), t["top_ids"].long(),
                     t["top_logp"].float(), t["kind"], t["seq"])


def heldout_mask(data: TokenData, fraction: float, seed: int) -> torch.Tensor:
    """True for the tokens of a random ``fraction`` of the sequences (split by record, not token)."""
    seqs = sorted(data.seq.unique().tolist())
    rng = random.Random(seed)
    held = set(rng.sample(seqs, max(1, round(len(seqs) * fraction)))) if fraction > 0 else set()
    return torch.tensor([s in held for s in data.seq.tolist()], dtype=torch.bool)


# ---- vocabulary subset -----------------------------------------------------------------------
def frequent_vocab(data: TokenData, size: int, vocab_size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` tokens the final layer chooses most often on ``data`` (plus ``always``),
    sorted by id -> ``[size]``."""
    counts = torch.bincount(data.top_ids[:, 0], minlength=vocab_size).double()
    # a small prior from the rest of the top-k, so ties among unseen tokens favour likely ones
    counts += 1e-3 * torch.bincount(data.top_ids[:, 1:].reshape(-1), minlength=vocab_size).double()
    for t in always:
        counts[t] = float("inf")
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values


def vocab_coverage(data: TokenData, ids: torch.Tensor, vocab_size: int) -> float:
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    return float(inside[data.top_ids[:, 0]].float().mean())


# ---- step 2: closed-form start ---------------------------------------------------------------
def _normalised(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@torch.no_grad()
def least_squares_init(head: ExitHead, hidden: torch.Tensor, final: torch.Tensor, ridge: float = 1e-3,
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


# ---- step 3: distillation --------------------------------------------------------------------
def head_logits(head: ExitHead, h: torch.Tensor) -> torch.Tensor:
    """Trainable logits ``[B, V or K]``: over the subset for restricted heads (cheaper), else full."""
    if head.restricted:
        return head.subset_logits(h)
    return head.base.lm_head(head.output_input(head.adapt(h)))


def targets_for(head: ExitHead, top_ids: torch.Tensor, top_logp: torch.Tensor, remap: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher probabilities over the top-k (renormalised), and their column in the head's logits.
    For restricted heads, targets outside the subset get weight 0."""
    p = torch.softmax(top_logp, dim=-1)  # [B, K]
    if remap is None:
        return p, top_ids
    cols = remap[top_ids]  # -1 outside the subset
    p = p * (cols >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return p, cols.clamp_min(0)


def distill_loss(head: ExitHead, h: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
                 remap: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy to the final layer's top-k distribution (KL up to a constant)."""
    logp = torch.log_softmax(head_logits(head, h).float(), dim=-1)
    p, cols = targets_for(head, top_ids, top_logp, remap)
    return -(p * logp.gather(1, cols)).sum(-1).mean()


def subset_remap(head: ExitHead) -> torch.Tensor | None:
    if not head.restricted:
        return None
    remap = torch.full((head.vocab_size,), -1, dtype=torch.long)
    remap[head.vocab_ids.cpu()] = torch.arange(head.vocab_ids.numel())
    return remap


@torch.no_grad()
def agreement(head: ExitHead | None, model, hidden: torch.Tensor, top_ids: torch.Tensor, chunk: int = 1024
              ) -> dict[str, float]:
    """Top-1 / top-5 agreement of an exit with the final layer's greedy token on ``hidden [N, H]``.

    top1: the exit's argmax is the final argmax; top5: the final argmax is in the exit's top 5.
    ``head=None`` is the shared final norm + output head.
    """
    hits1 = hits5 = 0
    for a in range(0, hidden.shape[0], chunk):
        h = hidden[a:a + chunk].to(model.device, model.dtype)
        logits = head(h) if head is not None else model.final_logits(h)
        want = top_ids[a:a + chunk, 0].to(model.device)
        top5 = logits.topk(5, dim=-1).indices
        hits1 += int((top5[:, 0] == want).sum())
        hits5 += int((top5 == want[:, None]).any(-1).sum())
    n = max(1, hidden.shape[0])
    return {"top1": hits1 / n, "top5": hits5 / n}


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_tokens: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = 200
    eval_every: int = 500
    ls_init: bool = True
    ridge: float = 1e-3


@dataclass
class TrainState:
    step: int = 0
    losses: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _batch_indices(n: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """Batch ``step`` of an epoch-wise shuffle: the same sequence whether or not training resumed."""
    per_epoch = max(1, n // batch)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[k * batch:(k + 1) * batch]


def save_checkpoint(folder: Path, heads: dict[int, ExitHead], opt: torch.optim.Optimizer, state: TrainState) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"head.{L}.{k}": v.detach().float().contiguous()
               for L, h in heads.items() for k, v in h.state_dict().items() if v is not None and v.is_floating_point()}
    names = {id(p): f"{L}.{k}" for L, h in heads.items() for k, p in h.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    tensors[f"opt.{names[id(p)]}.{k}"] = v.detach().float().reshape(v.shape).contiguous()
    save_file(tensors, str(folder / "checkpoint.safetensors.tmp"))
    (folder / "checkpoint.safetensors.tmp").replace(folder / "checkpoint.safetensors")
    (folder / "checkpoint.json").write_text(json.dumps(state.__dict__))


def load_checkpoint(folder: Path, heads: dict[int, ExitHead], opt: torch.optim.Optimizer, state_cls=None):
    """Weights, optimizer state and progress (a ``state_cls``, default ``TrainState``) saved by
    ``save_checkpoint``; None if ``folder`` holds no checkpoint."""
    if not (folder / "checkpoint.json").is_file():
        return None
    tensors = load_file(str(folder / "checkpoint.safetensors"))
    with torch.no_grad():
        for L, h in heads.items():
            for k, v in h.state_dict().items():
                key = f"head.{L}.{k}"
                if key in tensors:
                    v.copy_(tensors[key].to(v.dtype))
    for L, h in heads.items():
        for k, p in h.named_parameters():
            st = {}
            for name in ("step", "exp_avg", "exp_avg_sq"):
                key = f"opt.{L}.{k}.{name}"
                if key in tensors:
                    st[name] = tensors[key] if name != "step" else tensors[key].reshape(())
            if st:
                opt.state[p] = st
    return (state_cls or TrainState)(**json.loads((folder / "checkpoint.json").read_text()))


def train_heads(heads: dict[int, ExitHead], train: TokenData, cfg: TrainConfig, checkpoint_dir: Path | None = None,
                resume: bool = False, heldout: TokenData | None = None, progress: bool = True,
                log=None) -> TrainState:
    """Distil every head on ``train`` (least-squares start unless resuming), with checkpoints."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    params = [p for h in heads.values() for p in h.parameters()]
    for h in heads.values():
        h.train().requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = load_checkpoint(checkpoint_dir, heads, opt) if (resume and checkpoint_dir) else None
    if state is None:
        state = TrainState(losses={str(L): [] for L in heads})
        if cfg.ls_init and train.final is not None:
            for L, h in heads.items():
                least_squares_init(h, train.hidden[L], train.final, cfg.ridge)
    device = next(iter(heads.values())).proj.weight.device
    remaps = {L: subset_remap(h) for L, h in heads.items()}
    remaps = {L: None if r is None else r.to(device) for L, r in remaps.items()}
    n = train.num_tokens
    bar = tqdm(total=cfg.steps, initial=state.step, desc="train exits", unit="step", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    running = {L: None for L in heads}
    while state.step < cfg.steps:
        idx = _batch_indices(n, state.step, cfg.batch_tokens, cfg.seed)
        for group in opt.param_groups:
            group["lr"] = _lr_at(state.step, cfg)
        opt.zero_grad(set_to_none=True)
        top_ids, top_logp = train.top_ids[idx].to(device), train.top_logp[idx].to(device)
        for L, h in heads.items():
            loss = distill_loss(h, train.hidden[L][idx].to(device, torch.float32), top_ids, top_logp, remaps[L])
            loss.backward()
            v = float(loss.detach())
            running[L] = v if running[L] is None else 0.98 * running[L] + 0.02 * v
        opt.step()
        state.step += 1
        bar.update(1)
        bar.set_postfix({f"L{L}": f"{v:.3f}" for L, v in running.items()})
        if state.step % 50 == 0 or state.step == cfg.steps:
            for L in heads:
                state.losses[str(L)].append(round(running[L], 5))
        if heldout is not None and cfg.eval_every and (state.step % cfg.eval_every == 0) and log is not None:
            with torch.no_grad():
                msg = " ".join(f"L{L} {agreement(h, h.base, heldout.hidden[L], heldout.top_ids)['top1']:.3f}"
                               for L, h in heads.items())
            log(f"step {state.step}: held-out top-1 {msg}")
        if checkpoint_dir is not None and cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
            state.seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            save_checkpoint(checkpoint_dir, heads, opt, state)
    bar.close()
    state.seconds += time.perf_counter() - t0
    if checkpoint_dir is not None:
        save_checkpoint(checkpoint_dir, heads, opt, state)
    for h in heads.values():
        h.eval().requires_grad_(False)
    return state
