"""``hispec bench --batch-sizes 1,2,4,8,16``: throughput of the batched engine per strategy.

For each batch size the same prompts run through the continuous-batching engine once per
strategy and round (``--rounds``, default 3; the order rotates from round to round and between
batch sizes, after one warm-up run). A run's rate is the generated tokens of the whole run over
its wall time; the result is the median run (the per-round seconds are kept). Outputs are
checked against the first batch size's ``ar`` outputs prompt by prompt, in every round: sampled
ones too, each prompt drawing with its own seed (``--seed`` + its index, as the batch-1 bench
gives them; a random base without ``--seed``), the same for every strategy, batch size and round.
Peers (``--peers``) run in the same rotation: vLLM as one continuous-batching call of up to the largest batch size (static batches
of ``b`` below it), llama.cpp at batch size 1 only (llama-cpp-python has no batched generation).
"""
from __future__ import annotations

import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

from ..config import SamplingParams
from ..settings import StrategyName

AR = StrategyName.AR  # the reference: plain decoding, hispec's own

_RUNS = itertools.count()


def run_batch_sizes(gen, strategies: dict, prompt_ids: list[list[int]], params: SamplingParams,
                    batch_sizes: list[int], adaptive: bool = True, peers: list = (), agree_first: int = 32,
                    rounds: int = 3) -> dict:
    """``strategies``: label -> (strategy name, SpecConfig or None); ``peers``: PeerRunners (those
    without batching, llama.cpp's, run at batch size 1 only). Returns results per batch size."""
    from ..llm import LLM
    from .runner import prompt_params

    base_seed = params.seed if params.seed is not None else random.randrange(2**31)
    own_params = [prompt_params(params, i, base_seed) for i in range(len(prompt_ids))]
    llms = {label: LLM(gen, name, spec=spec, max_batch_size=max(batch_sizes), adaptive=adaptive,
                 prefix_caching=False)  # rounds repeat the prompts: each prefills them
            for label, (name, spec) in strategies.items()}
    warm = prompt_ids[:min(2, len(prompt_ids))]
    for llm in llms.values():
        llm.generate(warm, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for peer in peers:
        peer.generate(warm, SamplingParams(max_new_tokens=4, ignore_eos=True), batch_size=len(warm))
    results: dict[str, dict] = {}
    reference = None
    for round_, b in enumerate(batch_sizes):
        runs = {label: _own(llms[label], b, own_params) for label in llms}
        runs.update({p.label: _peer(p, b, params) for p in peers if p.batching or b == 1})
        timed: dict[str, list] = {label: [] for label in runs}  # label -> [(seconds, token ids)] per round
        for r in range(rounds):
            labels = list(runs)
            shift = (round_ + r) % len(labels)
            for label in labels[shift:] + labels[:shift]:
                ids, seconds = runs[label](prompt_ids)
                timed[label].append((seconds, ids))
                tokens = sum(len(x) for x in ids)
                print(f"  batch {b:>2} round {r + 1}/{rounds} {label:<16} {tokens} tokens in {seconds:.1f} s"
                      f" = {tokens / seconds:.1f} tokens/s", file=sys.stderr)
        row = {label: _median_run(timed[label]) | {
                   "adaptive": llms[label].engine.adaptive.to_dict()
                   if label in llms and llms[label].engine.adaptive else None} for label in runs}
        if reference is None and AR in row:
            reference = row[AR]["token_ids"][0]  # its first round
        ar_rate = row.get(AR, {}).get("tokens_per_second")
        ar_rounds = row.get(AR, {}).get("round_seconds")
        for label, r in row.items():
            r["speedup_vs_ar"] = round(r["tokens_per_second"] / ar_rate, 3) if ar_rate else None
            r["paired_speedup_vs_ar"] = _paired(ar_rounds, r["round_seconds"], r["tokens"], row[AR]["tokens"]) \
                if ar_rounds and label != AR else None
            every = r.pop("token_ids")  # one list per round
            r["identical_to_ar"] = all(ids == reference for ids in every) if reference else None
            r["agreement_with_ar"] = _agreement(every[-1], reference, agree_first) if reference else None
        results[str(b)] = {label: row[label] for label in runs}  # rows in a fixed order
    if AR in strategies and str(batch_sizes[0]) in results and len(batch_sizes) > 1:
        base = results[str(batch_sizes[0])][AR]["tokens_per_second"]
        for b in batch_sizes:
            results[str(b)][AR]["ar_scaling_vs_first"] = round(results[str(b)][AR]["tokens_per_second"] / base, 3)
    return results


def _median_run(runs: list[tuple[float, list[list[int]]]]) -> dict:
    """The median of a label's runs (by seconds; the upper one of an even count), with every
    round's seconds and token ids."""
    seconds = [s for s, _ in runs]
    mid = sorted(seconds)[len(seconds) // 2]
    tokens = sum(len(x) for x in runs[seconds.index(mid)][1])
    return {"tokens": tokens, "seconds": round(mid, 4), "tokens_per_second": round(tokens / mid, 3) if mid else 0.0,
            "round_seconds": [round(s, 4) for s in seconds], "token_ids": [ids for _, ids in runs]}


def _paired(ar_seconds: list[float], seconds: list[float], tokens: int, ar_tokens: int) -> float | None:
    """The median over rounds of each round's speedup against ``ar``'s run of the same round (the
    two ran one after the other). The shared machines this was measured on switch between a
    fast and a slow state for tens of seconds at a time (compute-bound kernels 1.35x apart on
    two threads, steady on one): a median over all rounds of each engine can compare one
    engine's fast rounds with another's slow ones, a round's pair rarely does."""
    ratios = sorted(a / s * tokens / ar_tokens for a, s in zip(ar_seconds, seconds) if s > 0)
    return round(statistics.median(ratios), 3) if ratios else None


def _own(llm, b: int, params: list[SamplingParams]):
    """A run of hispec's engine at batch size ``b``, each prompt with its own parameters."""
    def run(prompt_ids):
        llm.engine.set_max_batch_size(b)
        t0 = time.perf_counter()
        # a scope of its own per run: the same prompts' outputs of earlier rounds never draft for it
        outs = llm.generate(prompt_ids, params, draft_scope=f"run {next(_RUNS)}")
        return [o.token_ids for o in outs], time.perf_counter() - t0
    return run


def _peer(peer, b: int, params: SamplingParams):
    """A peer's run (one set of parameters for every prompt: a peer's sampling is its own)."""
    return lambda prompt_ids: peer.generate(prompt_ids, params, batch_size=b)


def _agreement(ids: list[list[int]], reference: list[list[int]], n: int) -> dict:
    """Prompts whose whole output / first ``n`` tokens equal the reference's."""
    pairs = list(zip(reference, ids))
    return {"prompts": len(pairs), "identical": sum(a == b for a, b in pairs), "first_n": n,
            "first_n_identical": sum(a[:n] == b[:n] for a, b in pairs)}


def batch_table(results: dict) -> list[str]:
    labels = list(dict.fromkeys(l for row in results.values() for l in row))
    lines = ["| batch size | " + " | ".join(f"{l} tokens/s (vs ar; paired: median of per-round ratios)"
                                         if l != AR else f"{l} tokens/s" for l in labels) + " | identical |",
             "|---|" + "---|" * len(labels) + "---|"]
    for b, row in results.items():
        cells = [f"{row[l]['tokens_per_second']:.1f} ({_ratio(row[l]['speedup_vs_ar'])}"
                 + (f"; paired {_ratio(row[l]['paired_speedup_vs_ar'])})" if row[l].get("paired_speedup_vs_ar")
                    else ")") if l in row else "–" for l in labels]
        same = [l for l, r in row.items() if r["identical_to_ar"] is False]
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {'yes' if not same else 'not ' + ', '.join(same)} |")
    return lines


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}x"


def write_batch_outputs(results: dict, meta: dict, out: Path, plots: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_results.json").write_text(json.dumps({**meta, "batch_sizes": results}, indent=2) + "\n")
    table = batch_table(results)
    names = []
    if plots:
        try:
            names = [_plot(results, out)]
        except ImportError as e:
            print(f"hispec bench: no plot ({e}); pip install matplotlib", file=sys.stderr)
    (out / "batch_report.md").write_text("# Throughput against batch size\n\n" + "\n".join(table) + "\n"
                                         + "".join(f"\n![{n}]({n})\n" for n in names))
    print("\n".join(table))
    print(f"\nwrote {out / 'batch_results.json'}, {out / 'batch_report.md'}" + "".join(f", {out / n}" for n in names),
          file=sys.stderr)
    peers = set(meta.get("peers") or {})
    bad = [b for b, row in results.items() for l, r in row.items() if r["identical_to_ar"] is False and l not in peers]
    if bad:
        print(f"hispec bench: error: outputs differ from ar at batch sizes {sorted(set(bad))}", file=sys.stderr)
    return int(bool(bad))


def _plot(results: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [int(b) for b in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(l for row in results.values() for l in row):
        at = [b for b in sizes if label in results[str(b)]]
        ax.plot(at, [results[str(b)][label]["tokens_per_second"] for b in at], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens / s (whole batch)")
    ax.set_title("Throughput against batch size")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)
    return "throughput.png"
