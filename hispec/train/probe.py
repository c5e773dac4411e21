"""Per-layer agreement with the final layer (``hispec probe``): a table and a PNG curve.

Agreement is measured over the model's own greedy continuations of the prompts (what
an exit sees when drafting): at each generated position, does the exit's top-1 token
equal the final layer's (top-1), and is the final token among the exit's top 5 (top-5)?
Every layer is probed through the shared final norm + output head; layers with trained
heads are probed through them too.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .collect import greedy_continuations
from .teacher import layer_pass


@dataclass
class LayerAgreement:
    layer: int
    shared_top1: float
    shared_top5: float
    head_top1: float | None = None
    head_top5: float | None = None
    head_vocab: int | None = None


@torch.inference_mode()
def probe(model, prompts: list[list[int]], max_new_tokens: int, eos_ids, batch_size: int = 4
          ) -> tuple[list[LayerAgreement], int]:
    """Agreement of every exit layer ``1 .. num_layers - 1``; also returns the number of positions.
    The continuations come from the engine; each is then run once through the model's layers
    (the teacher pass), every exit read as decoding reads it (a block over its own K/V)."""
    layers = tuple(range(1, model.num_layers))
    hits = {L: [0, 0, 0, 0] for L in layers}
    total = 0
    for p, y in zip(prompts, greedy_continuations(model, prompts, max_new_tokens, eos_ids, batch_size)):
        if not y:
            continue
        first = len(p) - 1
        states, _, runner = layer_pass(model, [p + y[:-1]], layers)
        want = torch.tensor(y, device=model.device)  # the final layer's greedy tokens
        total += want.shape[0]
        for L in layers:
            outs = [model.final_logits(states[L][first:])]
            if L in model.exits:
                outs.append(runner.exit_logits([(0, first, states[L][first:])], L))
            for j, logits in enumerate(outs):
                top5 = logits.topk(5, dim=-1).indices
                hits[L][2 * j] += int((top5[:, 0] == want).sum())
                hits[L][2 * j + 1] += int((top5 == want[:, None]).any(-1).sum())
    n = max(1, total)
    rows = []
    for L in layers:
        h = model.exits.get(L)
        rows.append(LayerAgreement(L, hits[L][0] / n, hits[L][1] / n,
                                   hits[L][2] / n if h is not None else None,
                                   hits[L][3] / n if h is not None else None,
                                   int(h.vocab_ids.numel()) if h is not None and h.restricted else None))
    return rows, total


def format_table(rows: list[LayerAgreement], marks: dict[int, str] | None = None) -> str:
    marks = marks or {}
    lines = [f"{'layer':>5}  {'shared top-1':>12}  {'shared top-5':>12}  {'head top-1':>10}  {'head top-5':>10}"]
    for r in rows:
        head = (f"{r.head_top1:>10.3f}  {r.head_top5:>10.3f}" if r.head_top1 is not None else f"{'-':>10}  {'-':>10}")
        lines.append(f"{r.layer:>5}  {r.shared_top1:>12.3f}  {r.shared_top5:>12.3f}  {head}  {marks.get(r.layer, '')}")
    return "\n".join(lines)


def plot(rows: list[LayerAgreement], out: Path, title: str, marks: dict[int, str] | None = None) -> Path:
    """Agreement against depth, exit layers marked. Needs matplotlib (``pip install 'hispec[plot]'``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("writing a PNG needs matplotlib: pip install 'hispec[plot]' (or pip install matplotlib)"
                          ) from None
    marks = marks or {}
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    xs = [r.layer for r in rows]
    ax.plot(xs, [r.shared_top1 for r in rows], "-o", ms=3, label="shared head, top-1")
    ax.plot(xs, [r.shared_top5 for r in rows], "--", label="shared head, top-5")
    trained = [r for r in rows if r.head_top1 is not None]
    if trained:
        ax.plot([r.layer for r in trained], [r.head_top1 for r in trained], "-s", ms=5, label="trained head, top-1")
        ax.plot([r.layer for r in trained], [r.head_top5 for r in trained], ":s", ms=4, label="trained head, top-5")
    for L, name in marks.items():
        ax.axvline(L, color="grey", lw=0.8, ls=":")
        ax.text(L, 1.01, name, ha="center", va="bottom", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set_xlabel("exit layer (decoder layers run)")
    ax.set_ylabel("agreement with the final layer")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9, pad=14)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
