"""PNG plots from results.json (matplotlib, headless): speedup per category and strategy,
acceptance per position per level, time per phase."""
from __future__ import annotations

from pathlib import Path

from ..settings import StrategyName
from .report import PHASE_ORDER

PLOTS = ("speedup.png", "acceptance.png", "phases.png")


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable("plots need matplotlib: pip install matplotlib (or pip install 'hispec[bench]')") \
            from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: dict, out: Path) -> list[str]:
    """Write the PNGs into ``out``; returns their file names."""
    plt = _pyplot()
    names = []
    for name, fn in zip(PLOTS, (_speedup, _acceptance, _phases)):
        fig = fn(plt, results["strategies"])
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _speedup(plt, strategies: dict):
    shown = {k: e for k, e in strategies.items() if e["available"] and e["kind"] != StrategyName.AR}
    cats = list(next(iter(strategies.values()))["per_category"]) if strategies else []
    groups = cats + ["overall"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) * max(1, len(shown)) ** 0.5 + 2), 4.2))
    width = 0.8 / max(1, len(shown))
    for j, (label, e) in enumerate(shown.items()):
        values = [(e if g == "overall" else e["per_category"].get(g, {})).get("speedup_vs_ar") or 0.0
                  for g in groups]
        ax.bar([i + (j - (len(shown) - 1) / 2) * width for i in range(len(groups))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=35, ha="right")
    ax.set_ylabel("speedup vs ar (tokens/s ratio)")
    ax.set_title("Speedup per category and strategy")
    if shown:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.text(0.5, 0.5, "no strategy besides ar ran", ha="center", transform=ax.transAxes)
    return fig


def _acceptance(plt, strategies: dict):
    levels = list(dict.fromkeys(lv for e in strategies.values() for lv in (e.get("acceptance") or {})))
    fig, axes = plt.subplots(1, max(1, len(levels)), figsize=(4.6 * max(1, len(levels)), 3.8), squeeze=False)
    for ax, level in zip(axes[0], levels):
        for label, e in strategies.items():
            lv = (e.get("acceptance") or {}).get(level)
            if lv and lv["acceptance_per_position"]:
                per = lv["acceptance_per_position"]
                ax.plot(range(1, len(per) + 1), per, marker="o", label=label)
        ax.set_title(level)
        ax.set_xlabel("draft position")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("acceptance rate")
    if not levels:
        axes[0][0].text(0.5, 0.5, "no speculative strategy ran", ha="center", transform=axes[0][0].transAxes)
    fig.suptitle("Acceptance per position, per level")
    fig.tight_layout()
    return fig


def _phases(plt, strategies: dict):
    rows = [(k, e) for k, e in strategies.items() if e["available"] and e["new_tokens"]]
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(rows) + 1.8))
    for i, (label, e) in enumerate(rows):
        per_token = 1000.0 / e["new_tokens"]
        phases = e["phase_seconds"] or {}
        left = 0.0
        for j, name in enumerate(PHASE_ORDER + ("unattributed",)):
            if name == "unattributed":
                value = max(e["seconds"] - sum(phases.values()), 0.0) * per_token
            else:
                value = phases.get(name, 0.0) * per_token
            ax.barh(i, value, left=left, color=f"C{j}", label=name if i == 0 else None)
            left += value
    ax.set_yticks(range(len(rows)), [k for k, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per new token")
    ax.set_title("Time per phase")
    if rows:
        ax.legend(fontsize=8, loc="lower right")
    return fig
