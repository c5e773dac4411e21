"""From per-prompt records to the numbers of results.json (vocabulary: docs/design.md).

Per strategy, overall and per category:

- ``tokens_per_second``: total new tokens / total generation seconds (prefill included);
  ``tokens_per_second_median``: the median of the per-prompt rates;
- ``speedup_vs_ar``: ``tokens_per_second`` / ``ar``'s, on the same prompts in the same run;
- ``decode_tokens_per_second``: new tokens / the seconds after the prompt's prefill (hispec's own
  strategies, whose phases are timed; null for peers), and ``decode_speedup_vs_ar``: the same
  against ``ar``'s. Speculation changes only this part: with short outputs and long prompts the
  prefill, the same for every strategy, dilutes ``speedup_vs_ar`` towards 1;
- ``speedup_vs_plain``: a speculative method against its own plain decoding in the same run:
  hispec's strategies against ``ar``, transformers' (``hf-lookup``, ``hf-early-exit``) against
  ``hf``, a peer's speculative mode (``llama.cpp:q4_1:lookup``, ``vllm:float32:ngram``) against the
  same peer decoding plainly;
- ``identical_to_ar``: every prompt's token ids equal ``ar``'s (sampled runs too: each prompt has one
  seed for every strategy);
  ``agreement_with_ar``: prompts whose whole output / first N tokens equal ``ar``'s, and the mean
  common prefix (for peers, whose kernels differ, agreement is measured, not expected);
- ``mean_accepted_length``: committed tokens / full-model passes;
- ``acceptance``: per level (``draft->intermediate``, ``intermediate->final``, or
  ``draft->final`` for selfspec): rounds, draft tokens, accepted tokens, acceptance rate and
  acceptance per position;
- ``phase_seconds`` (summed over prompts) and ``verification_wall`` (full-verify seconds per
  committed token / draft seconds per drafted token);
- ``peak_memory_bytes`` (see ``memory``), ``memory_added_bytes`` (the peak minus the memory in
  use when the generation started) and ``kv_cache_bytes``: the largest over the prompts; and
  the overhead against ``ar``: ``memory_overhead_vs_ar_bytes`` (difference of
  ``memory_added_bytes``: the same weights and pool are resident for both, so this is the cost
  of speculation's extra state) and ``kv_overhead_vs_ar_bytes``.

Fields a strategy cannot report (acceptance of transformers' peers) are null.
"""
from __future__ import annotations

import statistics

from ..decode.stats import DecodeStats
from ..settings import StrategyName
from .runner import BenchRun, Record

AR = StrategyName.AR  # the reference: plain decoding, hispec's own

FIELDS = ("tokens_per_second", "tokens_per_second_median", "speedup_vs_ar", "decode_tokens_per_second",
          "decode_speedup_vs_ar", "identical_to_ar", "agreement_with_ar",
          "mean_accepted_length", "acceptance", "phase_seconds", "verification_wall", "peak_memory_bytes",
          "kv_cache_bytes")


def summarize(run: BenchRun, reference: str = AR) -> dict:
    """``strategies`` of results.json: label -> fields (+ ``per_category``)."""
    categories = list(dict.fromkeys(p.category or "default" for p in run.prompts))
    ref = run.records.get(reference)
    out = {}
    for r in run.runners:
        entry = {"kind": r.kind, "available": r.unavailable is None, "reason": r.unavailable}
        entry.update(r.describe())
        recs = run.records.get(r.label)
        if recs is None:
            entry.update(dict.fromkeys(FIELDS + ("memory_added_bytes",)))
            entry["per_category"] = {}
            out[r.label] = entry
            continue
        entry.update(_fields(run, recs, ref))
        entry["per_category"] = {c: _fields(run, [x for x in recs if _cat(run, x) == c],
                                            [x for x in ref if _cat(run, x) == c] if ref else None)
                                 for c in categories}
        out[r.label] = entry
    _overheads(out, reference)
    _against_plain(out)
    return out


# kind -> its plain label
PLAIN_OF = {StrategyName.SELFSPEC: AR, StrategyName.HISPEC: AR, StrategyName.LOOKUP: AR, "hf-early-exit": "hf"}


def _against_plain(out: dict) -> None:
    """``speedup_vs_plain`` of every speculative entry, overall and per category (null elsewhere)."""
    for label, entry in out.items():
        plain = entry.get("plain_label") or PLAIN_OF.get(entry["kind"])
        base = out.get(plain) if plain else None
        scopes = [(entry, base)] + [(scope, (base or {}).get("per_category", {}).get(c))
                                    for c, scope in entry["per_category"].items()]
        for scope, base_scope in scopes:
            mine, theirs = scope.get("tokens_per_second"), (base_scope or {}).get("tokens_per_second")
            scope["speedup_vs_plain"] = round(mine / theirs, 4) if mine and theirs else None


def _cat(run: BenchRun, rec: Record) -> str:
    return run.prompts[rec.prompt_index].category or "default"


def _fields(run: BenchRun, recs: list[Record], ref: list[Record] | None) -> dict:
    tokens = sum(x.new_tokens for x in recs)
    seconds = sum(x.seconds for x in recs)
    tps = tokens / seconds if seconds > 0 else 0.0
    ref_tps = None
    if ref:
        ref_seconds = sum(x.seconds for x in ref)
        ref_tps = sum(x.new_tokens for x in ref) / ref_seconds if ref_seconds > 0 else None
    stats = _merged_stats(recs)
    d = stats.to_dict() if stats is not None else None
    decode, ref_decode = decode_rate(recs), decode_rate(ref) if ref else None
    return {
        "num_prompts": len(recs),
        "new_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(tps, 3),
        "tokens_per_second_median": round(statistics.median(
            [x.new_tokens / x.seconds if x.seconds > 0 else 0.0 for x in recs]), 3) if recs else 0.0,
        "speedup_vs_ar": round(tps / ref_tps, 4) if ref_tps else None,
        "decode_tokens_per_second": round(decode, 3) if decode else None,
        "decode_speedup_vs_ar": round(decode / ref_decode, 4) if decode and ref_decode else None,
        "identical_to_ar": _identical(run, recs, ref),
        "agreement_with_ar": _agreement(run, recs, ref),
        "mean_accepted_length": d["mean_accepted_length"] if d else None,
        "full_passes": d["full_passes"] if d else None,
        "acceptance": d["levels"] if d else None,
        "phase_seconds": d["phase_seconds"] if d else None,
        "verification_wall": d["verification_wall"] if d else None,
        "peak_memory_bytes": _max(x.peak_memory_bytes for x in recs),
        "memory_added_bytes": _max(x.memory_added_bytes for x in recs),
        "kv_cache_bytes": _max(x.sample.kv_cache_bytes for x in recs),
    }


def decode_rate(recs: list[Record]) -> float | None:
    """New tokens per second of decoding alone: each prompt's seconds less its prefill phase (the
    prompt but its last token; the first new token is a decode step's). None unless every record
    has hispec's phase timings (peers are timed end to end)."""
    if not recs or any(x.sample.stats is None for x in recs):
        return None
    seconds = sum(x.seconds - x.sample.stats.phase_seconds.get("prefill", 0.0) for x in recs)
    return sum(x.new_tokens for x in recs) / seconds if seconds > 0 else None


def _merged_stats(recs: list[Record]) -> DecodeStats | None:
    own = [x.sample.stats for x in recs if x.sample.stats is not None]
    if not own:
        return None
    total = DecodeStats(own[0].strategy)
    for s in own:
        total.merge(s)
    return total


def _identical(run: BenchRun, recs: list[Record], ref: list[Record] | None) -> bool | None:
    """Same token ids as the reference on every prompt (sampled runs too: every strategy has the
    prompt's seed, so hispec's give ``ar``'s tokens); null without ``ar``."""
    if ref is None:
        return None
    ref_ids = {x.prompt_index: x.sample.token_ids for x in ref}
    return all(ref_ids.get(x.prompt_index) == x.sample.token_ids for x in recs)


def _agreement(run: BenchRun, recs: list[Record], ref: list[Record] | None) -> dict | None:
    """How many prompts give the reference's token ids: whole outputs, and the first ``run.agree_first``
    tokens (outputs shorter than that compare whole); the mean length of the common prefix."""
    if ref is None or not recs:
        return None
    ref_ids = {x.prompt_index: x.sample.token_ids for x in ref}
    n = run.agree_first
    pairs = [(ref_ids[x.prompt_index], x.sample.token_ids) for x in recs if x.prompt_index in ref_ids]
    prefixes = [_common_prefix(a, b) for a, b in pairs]
    return {"prompts": len(pairs), "identical": sum(a == b for a, b in pairs), "first_n": n,
            "first_n_identical": sum(a[:n] == b[:n] for a, b in pairs),
            "mean_common_prefix": round(statistics.fmean(prefixes), 2) if prefixes else None}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatches(run: BenchRun, label: str, reference: str = AR) -> list[dict]:
    """Prompts whose token ids differ from the reference: id and first differing position."""
    ref = {x.prompt_index: x.sample.token_ids for x in run.records.get(reference, [])}
    out = []
    for x in run.records.get(label, []):
        theirs, mine = ref.get(x.prompt_index), x.sample.token_ids
        if theirs is not None and theirs != mine:
            out.append({"prompt": run.prompts[x.prompt_index].id, "first_difference_at": _common_prefix(theirs, mine)})
    return out


def _max(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _overheads(out: dict, reference: str) -> None:
    """Memory of each strategy beyond ``ar``'s: the cost of speculation's extra state."""
    ref = out.get(reference) or {}
    for entry in out.values():
        pairs = [(entry, ref)] + [(scope, ref.get("per_category", {}).get(c) or {})
                                  for c, scope in entry["per_category"].items()]
        for scope, ref_scope in pairs:
            for name, key in (("memory_overhead_vs_ar_bytes", "memory_added_bytes"),
                              ("kv_overhead_vs_ar_bytes", "kv_cache_bytes")):
                mine, theirs = scope.get(key), ref_scope.get(key)
                scope[name] = mine - theirs if mine is not None and theirs is not None else None
