"""The plot of a ``hispec bench serve`` sweep: request throughput, output tokens/s, TTFT and ITL
(the highest percentile asked for) per sweep point, one line per server (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

from ..plots import _pyplot
from .metrics import percentile_label


def point_label(run: dict) -> str:
    rate = run["request_rate"]
    rate = "inf" if rate == float("inf") or rate == "inf" else f"{rate:g}/s"
    conc = run.get("max_concurrency")
    return f"c={conc}, rate {rate}" if conc else f"rate {rate}"


def write_sweep_plot(results: dict, path: Path) -> Path:
    plt = _pyplot()
    runs = results["runs"]
    q = max(results["percentiles"]) if results.get("percentiles") else 99.0
    p = percentile_label(q)
    points = list(dict.fromkeys(point_label(r) for r in runs))
    servers = list(dict.fromkeys(r["server"] for r in runs))
    panels = [("request_throughput", "requests/s"), ("output_throughput", "output tokens/s"),
              (f"{p}_ttft_ms", f"TTFT {p} (ms)"), (f"{p}_itl_ms", f"ITL {p} (ms)")]
    fig, axes = plt.subplots(2, 2, figsize=(max(7.0, 1.3 * len(points) + 5), 6.4))
    for ax, (key, title) in zip(axes.flat, panels):
        for server in servers:
            xs, ys = [], []
            for r in runs:
                if r["server"] == server and r.get(key) is not None:
                    xs.append(points.index(point_label(r)))
                    ys.append(r[key])
            ax.plot(xs, ys, marker="o", label=server)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(points)), points, rotation=25, ha="right", fontsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    ds = results.get("dataset", {})
    fig.suptitle(f"hispec bench serve: {ds.get('name', '')}, {results.get('num_prompts', '')} prompts", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
