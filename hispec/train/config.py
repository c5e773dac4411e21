"""The one configuration of the exit pipeline: what the collector keeps and how the distiller
trains. Every exit command (``train-exits``, ``collect-exits``, ``distill-exits``) fills one
:class:`TrainConfig` from its flags; the collector reads the collection fields, the distiller
the training fields."""
from __future__ import annotations

from dataclasses import dataclass

import torch

TEACHER_PRECISIONS = ("bfloat16", "model")
PRECISIONS = ("auto", "float32", "bfloat16")
BATCHES = ("sequences", "tokens")


@dataclass
class TrainConfig:
    # ---- collection (collect.py, teacher.py) ----
    layers: tuple[int, ...] = ()  # states kept: entering these layers (0: embeddings; the layer count: final)
    topk: int = 32  # the final layer's log-probs kept per position
    token_cap: int = 512  # positions per sequence (prompt + reply; --max-tokens), longer ones are cut
    max_prompt_tokens: int = 384  # longer prompts are skipped
    max_new_tokens: int = 128  # per on-policy continuation
    generate_batch: int = 16  # prompts the engine continues together
    teacher_batch_tokens: int = 4096  # positions per teacher pass
    shard_positions: int = 16384
    logits_chunk: int = 1024
    teacher_precision: str = "bfloat16"  # matmuls of the CPU teacher pass: see teacher.teacher_model
    # ---- distillation (distill.py) ----
    epochs: float = 2.0
    steps: int | None = None  # a fixed number of steps instead of epochs (epochs repeat as needed)
    batches: str = "sequences"  # sequences (right-padded, any design) | tokens (per-token designs: reply rows)
    batch_tokens: int = 4096  # (padded) positions per step
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 20
    weight_decay: float = 0.01
    ce_weight: float = 0.2  # loss = KL(teacher top-k || exit) + ce_weight * CE(teacher argmax)
    seed: int = 0
    checkpoint_every: int = 50
    eval_every: int = 0  # steps (0: only at the end)
    precision: str = "float32"  # of the forward/backward pass: float32, or bfloat16 autocast
    ls_init: bool = False  # linear heads: start from ridge least squares on the final states
    ridge: float = 1e-3

    def __post_init__(self) -> None:
        self.layers = tuple(self.layers)
        if self.teacher_precision not in TEACHER_PRECISIONS:
            raise ValueError(f"unknown teacher precision {self.teacher_precision!r}; "
                             f"choose from {', '.join(TEACHER_PRECISIONS)}")
        if self.batches not in BATCHES:
            raise ValueError(f"unknown batching {self.batches!r}; choose from {', '.join(BATCHES)}")

    def collection(self) -> dict:
        """The settings a data folder records (and must match to be resumed)."""
        return {"layers": list(self.layers), "topk": self.topk, "max_tokens": self.token_cap,
                "batch_tokens": self.teacher_batch_tokens, "shard_positions": self.shard_positions,
                "logits_chunk": self.logits_chunk, "precision": self.teacher_precision}

    def training(self) -> dict:
        """The settings a manifest records for the distillation."""
        keys = ("epochs", "steps", "batches", "batch_tokens", "lr", "min_lr_ratio", "warmup", "weight_decay",
                "ce_weight", "seed", "checkpoint_every", "eval_every", "precision", "ls_init", "ridge")
        return {k: getattr(self, k) for k in keys}


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: bfloat16 autocast where the hardware multiplies bfloat16 (a CUDA GPU that
    supports it, a CPU with AVX512-BF16 / AMX / Arm BF16: 2-3x the float32 rate for a block's
    training step, the weights and AdamW state staying float32), else float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown training precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    from ..kernels.select import cpu_has_bf16

    return "bfloat16" if device.type == "cpu" and cpu_has_bf16() else "float32"
