"""report.md: the tables a person reads, made from results.json alone."""
from __future__ import annotations

from ..settings import STRATEGIES, StrategyName

AR = StrategyName.AR  # the reference: plain decoding, hispec's own

PHASE_ORDER = ("prefill", "draft", "intermediate_verify", "full_verify", "other")


def _mib(n: int | None) -> str:
    """Bytes as MiB (KiB below 1 MiB)."""
    if n is None:
        return "–"
    if n == 0:
        return "0"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 or n == 0 else f"{n / 2**10:.1f} KiB"


def _signed_mib(n: int | None) -> str:
    return "–" if n is None else ("+" if n > 0 else "") + _mib(n)


def _num(x, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _bool(x) -> str:
    return "–" if x is None else ("yes" if x else "**NO**")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"] + \
           ["| " + " | ".join(r) + " |" for r in rows]


def _acceptance_cell(acc: dict | None) -> str:
    if not acc:
        return "–"
    return "; ".join(f"{name} {lv['acceptance_rate']:.3f}" for name, lv in acc.items())


def overall_table(strategies: dict) -> list[str]:
    rows = []
    for label, e in strategies.items():
        if not e["available"]:
            rows.append([f"`{label}`", "unavailable"] + ["–"] * 9)
            continue
        rows.append([f"`{label}`", _num(e["tokens_per_second"]), _num(e["tokens_per_second_median"]),
                     _num(e["speedup_vs_ar"], "{:.2f}x"), _num(e.get("decode_speedup_vs_ar"), "{:.2f}x"),
                     _bool(e["identical_to_ar"]),
                     _num(e["mean_accepted_length"]), _acceptance_cell(e["acceptance"]),
                     _num(e["verification_wall"]), _mib(e["peak_memory_bytes"]), _mib(e["kv_cache_bytes"])])
    return _table(["strategy", "tokens/s", "median tokens/s", "speedup vs ar", "decode speedup vs ar",
                   "identical to ar",
                   "mean accepted length", "acceptance rate per level", "verification wall", "peak memory",
                   "KV cache"], rows)


def category_table(strategies: dict) -> list[str]:
    available = {k: e for k, e in strategies.items() if e["available"]}
    if not available:
        return ["(no strategy ran)"]
    categories = list(next(iter(available.values()))["per_category"])
    rows = []
    for c in categories + ["overall"]:
        row = [c if c != "overall" else "**overall**"]
        first = next(iter(available.values()))
        n = first["num_prompts"] if c == "overall" else first["per_category"][c]["num_prompts"]
        row.append(str(n))
        for e in available.values():
            f = e if c == "overall" else e["per_category"].get(c, {})
            sp, dsp = f.get("speedup_vs_ar"), f.get("decode_speedup_vs_ar")
            cell = _num(f.get("tokens_per_second"), "{:.1f}")
            if sp is not None and e["kind"] != AR:
                cell += f" ({sp:.2f}x" + (f"; decode {dsp:.2f}x)" if dsp is not None else ")")
            if f.get("identical_to_ar") is False:
                cell += " ≠ar"
            row.append(cell)
        rows.append(row)
    return _table(["category", "prompts"] + [f"`{k}`" for k in available], rows)


def speculation_table(strategies: dict) -> list[str]:
    """Each speculative method against its own plain decoding, per category: hispec's strategies
    against ``ar``, each peer's speculative mode against the same peer decoding plainly."""
    spec = {k: e for k, e in strategies.items() if e.get("available") and e.get("speedup_vs_plain") is not None}
    if not spec:
        return []
    categories = list(next(iter(spec.values()))["per_category"])
    rows = []
    for c in categories + ["overall"]:
        cells = [_num((e if c == "overall" else e["per_category"].get(c, {})).get("speedup_vs_plain"), "{:.2f}x")
                 for e in spec.values()]
        rows.append([f"**{c}**" if c == "overall" else c] + cells)
    names = [f"`{k}` vs `{e.get('plain_label') or 'ar'}`" for k, e in spec.items()]
    return _table(["category"] + names, rows)


def acceptance_table(strategies: dict, positions: int = 8) -> list[str]:
    rows = []
    for label, e in strategies.items():
        for level, lv in (e.get("acceptance") or {}).items():
            per = lv["acceptance_per_position"][:positions]
            rows.append([f"`{label}`", level, str(lv.get("rounds", lv.get("drafts"))), str(lv["draft_tokens"]), f"{lv['acceptance_rate']:.3f}"]
                        + [f"{a:.2f}" for a in per] + ["–"] * (positions - len(per)))
    if not rows:
        return ["(no strategy with speculation ran)"]
    return _table(["strategy", "level", "rounds", "draft tokens", "rate"] + [f"pos {j + 1}" for j in range(positions)],
                  rows)


def phase_table(strategies: dict) -> list[str]:
    rows = []
    for label, e in strategies.items():
        if not e["available"] or not e["new_tokens"]:
            continue
        per_token = 1000.0 / e["new_tokens"]
        phases = e["phase_seconds"] or {}
        known = sum(phases.values())
        cells = [_num(phases.get(p) * per_token if p in phases else None, "{:.1f}") for p in PHASE_ORDER]
        rows.append([f"`{label}`"] + cells + [f"{max(e['seconds'] - known, 0.0) * per_token:.1f}",
                                              f"{e['seconds'] * per_token:.1f}"])
    return _table(["strategy"] + list(PHASE_ORDER) + ["unattributed", "total"], rows)


def _agreement_cell(a: dict | None, first: bool = False) -> str:
    if not a:
        return "–"
    return f"{a['first_n_identical']}/{a['prompts']}" if first else f"{a['identical']}/{a['prompts']}"


def _peer_name(label: str, e: dict) -> str:
    """What ran: the engine and its weights."""
    weights = e.get("weights")
    return f"`{label}`" + (f" ({weights})" if weights else "")


def peers_table(strategies: dict, first_n: int) -> list[str]:
    """hispec's strategies and the peer engines side by side: speed against ``ar`` and agreement."""
    rows = []
    for label, e in strategies.items():
        if e["kind"] not in (*STRATEGIES, "peer"):
            continue
        name = _peer_name(label, e) if e["kind"] == "peer" else f"hispec `{label}`"
        if not e["available"]:
            rows.append([name, "did not run"] + ["–"] * 4)
            continue
        a = e.get("agreement_with_ar")
        rows.append([name, _num(e["tokens_per_second"], "{:.1f}"), _num(e["speedup_vs_ar"], "{:.2f}x"),
                     _agreement_cell(a), _agreement_cell(a, first=True), _num((a or {}).get("mean_common_prefix"),
                                                                              "{:.1f}")])
    return _table(["engine / weights", "tokens/s", "vs `ar`", "same token ids as `ar`",
                   f"same first {first_n} ids", "mean common prefix"], rows)


def peer_summary_table(results: dict, batch: dict | None = None, batch_size: str = "16") -> list[str]:
    """BENCHMARKS.md's peer table: batch-1 tokens/s against ``ar`` (from results.json) and, with a
    ``--batch-sizes`` run's batch_results.json, throughput at ``batch_size``."""
    strategies, n = results["strategies"], results["config"].get("agree_first", 32)
    ar = strategies.get(AR, {})
    row_b = (batch or {}).get("batch_sizes", {}).get(batch_size, {})
    ar_b = row_b.get(AR, {})
    header = ["engine / weights", "batch 1 tokens/s", "vs hispec `ar`", f"same ids as `ar` (whole / first {n})"]
    if batch:
        header += [f"batch {batch_size} tokens/s", f"vs `ar` at batch {batch_size}"]
    rows = []
    for label, e in strategies.items():
        if e["kind"] not in (*STRATEGIES, "peer"):
            continue
        name = _peer_name(label, e) if e["kind"] == "peer" else f"hispec `{label}`"
        a = e.get("agreement_with_ar")
        same = "reference" if label == AR else \
            (f"{_agreement_cell(a)} / {_agreement_cell(a, first=True)}" if a else "–")
        row = [name, _num(e["tokens_per_second"], "{:.1f}") if e["available"] else "did not run",
               _num(e["speedup_vs_ar"], "{:.2f}x") if e["available"] else "–", same]
        if batch:
            r = row_b.get(label)
            row += [_num(r["tokens_per_second"], "{:.1f}") if r else "–",
                    _num(r["tokens_per_second"] / ar_b["tokens_per_second"], "{:.2f}x")
                    if r and ar_b.get("tokens_per_second") else "–"]
        rows.append(row)
    note = [f"`ar` ran at {ar['tokens_per_second']:.1f} tokens/s at batch 1" + (
        f" and {ar_b['tokens_per_second']:.1f} at batch {batch_size}" if ar_b else "") + "."] if ar.get(
        "tokens_per_second") else []
    if batch and any(e.get("engine") == "llama.cpp" for e in strategies.values()):
        note.append(f"llama.cpp has no batch {batch_size} figure: llama-cpp-python's API generates one sequence "
                    "at a time.")
    return _table(header, rows) + [""] + [" ".join(note)]


def wall_memory_table(strategies: dict) -> list[str]:
    rows = []
    for label, e in strategies.items():
        if not e["available"]:
            continue
        rows.append([f"`{label}`", _num(e["verification_wall"]), _mib(e["peak_memory_bytes"]),
                     _mib(e.get("memory_added_bytes")), _signed_mib(e.get("memory_overhead_vs_ar_bytes")),
                     _mib(e["kv_cache_bytes"]), _signed_mib(e.get("kv_overhead_vs_ar_bytes"))])
    return _table(["strategy", "verification wall", "peak memory", "added by the generation", "added vs ar",
                   "KV cache peak", "KV vs ar"], rows)


def targets_table(targets: dict) -> list[str]:
    names = {"ar_vs_hf": "hispec `ar` vs transformers `generate`",
             "hispec_vs_ar": "`hispec` vs `ar`",
             "hispec_vs_best_selfspec": "`hispec` vs the best `selfspec`",
             "hispec_vs_best_hf_early_exit": "`hispec` vs `hf-early-exit` at its best layer"}
    rows = []
    for key, name in names.items():
        t = targets[key]
        met = "–" if t["met"] is None else ("met" if t["met"] else "not met")
        goal = f"> {t['goal']:.1f}x" if key == "hispec_vs_best_hf_early_exit" else f">= {t['goal']:.1f}x"
        pair = f"`{t['of']}` / `{t['against']}`" if t["of"] and t["against"] else "–"
        rows.append([name, pair, _num(t["value"], "{:.2f}x"), goal, met])
    rows.append(["every strategy identical to `ar`", "", _bool(targets["all_identical_to_ar"]), "yes",
                 "–" if targets["all_identical_to_ar"] is None else ("met" if targets["all_identical_to_ar"]
                                                                     else "not met")])
    return _table(["target", "strategies", "measured", "goal", ""], rows)


def setup_lines(results: dict) -> list[str]:
    m, model, cfg = results["machine"], results["model"], results["config"]
    heads = model.get("exit_heads")
    return [
        f"- model: `{model['name']}` ({model['family']}, {model['num_layers']} layers, {model['dtype']}"
        + (f", {model['weight_format']} weights" if model.get("weight_format", "none") != "none" else "")
        + (f", KV cache {model['kv_cache_dtype']}" if model.get("kv_cache_dtype", model["dtype"]) != model["dtype"] else "")
        + f", {model['path']}); exit heads: " + (f"layers {heads.get('layers')} from {heads.get('path')}" if heads
                                             else "none (exits through the final norm and output head)"),
        f"- machine: {m['cpu']}, {m['threads']} torch thread{'s' if m['threads'] != 1 else ''} of {m['cpu_count']} CPUs, device {m['device']}, "
        f"torch {m['torch']}" + (f", transformers {m['transformers']}" if "transformers" in m else "")
        + (f"; load average {m.get('load_average_at_start')} at start, {m.get('load_average_at_end')} at end"
           if "load_average_at_start" in m else ""),
        f"- commit: `{results['commit']}`; created {results['created']}; wall {results['wall_seconds']} s",
        f"- data: {', '.join(cfg['data'])}; {cfg['num_prompts']} prompts"
        + (f"; categories {', '.join(cfg['categories'])}" if cfg.get("categories") else "")
        + (f"; limit {cfg['limit']}{' per category' if cfg.get('per_category') else ''}" if cfg.get("limit") else ""),
        f"- generation: max {cfg['max_new_tokens']} new tokens, "
        + ("greedy" if cfg["sampling"]["temperature"] == 0 else f"sampling {cfg['sampling']}")
        + f", chat template {'on' if cfg['chat'] else 'off'}, batch size 1, warm-up {cfg['warmup']} prompt(s), "
          "prompts interleaved round-robin across strategies, "
        + ("adaptive (plain steps where measured speculation does not pay)" if cfg.get("adaptive")
           else "always speculating"),
        f"- command: `{cfg['command']}`",
    ] + _roofline_lines(m)


def _roofline_lines(m: dict) -> list[str]:
    r = m.get("memory_roofline_ar")
    if not r:
        return []
    return [f"- memory roofline (`ar`): {r['weight_bytes'] / 2**20:.0f} MiB of weights read per token at a measured "
            f"copy bandwidth of {r['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s = at least "
            f"{1000 * r['floor_seconds_per_token']:.1f} ms per token; `ar`'s decode steps took "
            f"{1000 * r['seconds_per_token']:.1f} ms = {100 * r['fraction_of_roofline']:.0f}% of the roofline, weights read "
            f"at {r['weight_bytes'] / r['seconds_per_token'] / 1e9:.1f} GB/s (a copy also writes: reads alone can go "
            "faster)"]


def body_lines(results: dict, h: str = "##") -> list[str]:
    m, strategies = results["machine"], results["strategies"]
    lines = [
        f"{h} Overall", "",
        "tokens/s = all new tokens / all generation seconds (prefill included); speedup against `ar` in "
        "the same run on the same prompts; decode speedup: the same with each prompt's prefill left out "
        "(new tokens / the seconds after it; hispec's strategies only), the part speculation changes; "
        "acceptance rate per level = accepted / drafted tokens; "
        "verification wall = full-verification seconds per committed token / drafting seconds per drafted token.",
        "",
        *overall_table(strategies), "",
        f"{h} Per category", "",
        "tokens/s (speedup vs `ar`; decode: the same with the prefill left out)", "",
        *category_table(strategies), "",
        *_speculation_section(strategies, h),
        f"{h} Acceptance per position", "",
        "Fraction of rounds with a draft at position j whose draft j was accepted.", "",
        *acceptance_table(strategies), "",
        f"{h} Time per phase", "",
        "Milliseconds per new token (summed over prompts / new tokens). transformers' peers are timed end "
        "to end only.", "",
        *phase_table(strategies), "",
        f"{h} Verification wall and memory", "",
        f"Peak memory: {m['memory_measure']}; added by the generation: the peak minus the memory in use when "
        "it started (the largest over the prompts); added vs ar: the overhead of speculation's extra state. "
        "KV cache: the most blocks a request held at once times the bytes per block (all layers, K and V); "
        "speculative strategies also hold tentative tokens' K/V until they are rejected. For transformers' "
        "peers: the final cache's tensors.", "",
        *wall_memory_table(strategies), "",
        *_peer_section(results, h),
        f"{h} Targets", "",
        *targets_table(results["targets"]), "",
    ]
    unavailable = [(k, e["reason"]) for k, e in strategies.items() if not e["available"]]
    if unavailable:
        lines += [f"{h} Strategies that did not run", ""] + [f"- `{k}`: {r}" for k, r in unavailable] + [""]
    mism = [(k, e["mismatched_prompts"]) for k, e in strategies.items() if e.get("mismatched_prompts")]
    if mism:
        lines += [f"{h} Outputs that differ from `ar`", ""]
        lines += [f"- `{k}`: " + ", ".join(f"{x['prompt']} (from token {x['first_difference_at']})" for x in v)
                  for k, v in mism] + [""]
    return lines


def _speculation_section(strategies: dict, h: str) -> list[str]:
    table = speculation_table(strategies)
    if not table:
        return []
    return [f"{h} Speculation against its own plain decoding", "",
            "tokens/s of each speculative method / tokens/s of the same engine decoding plainly, in the same run "
            "on the same prompts (hispec against `ar`; a peer's lookup/ngram mode against that peer).", "",
            *table, ""]


def _peer_section(results: dict, h: str) -> list[str]:
    strategies = results["strategies"]
    if not any(e["kind"] == "peer" for e in strategies.values()):
        return []
    n = results["config"].get("agree_first", 32)
    return [f"{h} Peer engines", "",
            "Each peer ran in its own process on the same prompt token ids, interleaved with hispec's strategies; "
            "its seconds are the engine's own wall time for the generation (prefill included). Agreement "
            "counts prompts whose token ids equal `ar`'s: whole outputs, and the first "
            f"{n} tokens (the peers' kernels differ from hispec's, so a near-tie between two tokens can flip).", "",
            *peers_table(strategies, n), ""]


def render(results: dict, plots: list[str]) -> str:
    """report.md."""
    lines = ["# hispec bench report", "", *setup_lines(results), "", *body_lines(results)]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def _ms_per_token(e: dict, phase: str | None = None) -> float | None:
    if not e.get("available") or not e.get("new_tokens"):
        return None
    seconds = e["seconds"] if phase is None else (e["phase_seconds"] or {}).get(phase)
    return None if seconds is None else 1000.0 * seconds / e["new_tokens"]


def limit_lines(strategies: dict) -> list[str]:
    """Where each strategy's time per committed token goes, against ``ar``'s: the facts that
    limit each ratio."""
    ar = strategies.get(AR)
    ar_note = (f"; `ar`: {_ms_per_token(ar):.1f} ms per new token, {_ms_per_token(ar, 'full_verify'):.1f} ms "
               "of it in full-model passes") if ar and ar.get("available") and ar.get("phase_seconds") else ""
    lines = []
    for label, e in strategies.items():
        if not e["available"] or label == AR:
            continue
        total = _ms_per_token(e)
        head = f"- `{label}` ({_num(e['speedup_vs_ar'], '{:.2f}x')} `ar`): {total:.1f} ms per new token"
        if e["phase_seconds"]:
            parts = [f"{_ms_per_token(e, p):.1f} ms {p.replace('_', ' ')}" for p in PHASE_ORDER
                     if (_ms_per_token(e, p) or 0) > 0.05]
            lines.append(f"{head} = {' + '.join(parts)}; mean accepted length {_num(e['mean_accepted_length'])}; "
                         f"acceptance {_acceptance_cell(e['acceptance'])}; verification wall "
                         f"{_num(e['verification_wall'])}{ar_note}")
        else:
            lines.append(f"{head}, timed end to end{ar_note}")
    return lines


def render_benchmarks(results: dict, notes: str | None = None) -> str:
    """A full benchmark page of one run: setup, how to reproduce, every table, and where each ratio's
    time goes. (BENCHMARKS.md itself is a summary made by ``hispec bench --summary``; the dated history is
    docs/benchmarks/history.md.)"""
    cfg = results["config"]
    lines = [
        "# Benchmarks", "",
        "Measured by `hispec bench` (greedy, batch size 1): every strategy and the transformers peers on the "
        "same prompts in one process, after a warm-up, prompts interleaved round-robin across strategies; "
        "`identical_to_ar` compares every strategy's token ids with `ar`'s, prompt by prompt.", "",
        "## Setup", "", *setup_lines(results), "",
        "Reproduce:", "", "```", cfg["command"],
        f"python -m hispec.bench.report {cfg.get('out', 'OUT')}/results.json --benchmarks > bench-page.md", "```", "",
    ]
    if notes:
        lines += ["## Notes", "", notes.strip(), ""]
    lines += body_lines(results)
    lines += ["## Where the time goes", "", *limit_lines(results["strategies"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m hispec.bench.report",
                                description="Render report.md (default) or a full benchmark page from a results.json.")
    p.add_argument("results", help="results.json written by hispec bench")
    p.add_argument("--benchmarks", action="store_true",
                   help="render a full benchmark page (setup, reproduce, tables, where the time goes) instead of "
                        "report.md; BENCHMARKS.md's summary is made by hispec bench --summary")
    p.add_argument("--notes", metavar="FILE", help="markdown to include as the Notes section (with --benchmarks)")
    p.add_argument("--peer-table", action="store_true",
                   help="print only the table of hispec against the peer engines (BENCHMARKS.md)")
    p.add_argument("--batch", metavar="BATCH_RESULTS", help="with --peer-table: a --batch-sizes run's "
                   "batch_results.json, for the throughput columns")
    p.add_argument("--batch-size", default="16", help="with --batch: the batch size shown (default 16)")
    args = p.parse_args(argv)
    results = json.loads(Path(args.results).read_text(encoding="utf-8"))
    if args.peer_table:
        batch = json.loads(Path(args.batch).read_text(encoding="utf-8")) if args.batch else None
        print("\n".join(peer_summary_table(results, batch, args.batch_size)))
    elif args.benchmarks:
        notes = Path(args.notes).read_text(encoding="utf-8") if args.notes else None
        print(render_benchmarks(results, notes))
    else:
        print(render(results, []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
