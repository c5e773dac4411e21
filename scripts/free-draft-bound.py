"""What prompt-lookup drafts could give at a batch size on this machine, at best.

    python scripts/free-draft-bound.py --data question.jsonl [--limit 16] [--batch-size 8] [--model default]
                                       [--max-new-tokens 256] [--ignore-eos] [--threads 2] [--repeats 31]

1. ``ar``'s greedy tokens for the prompts (up to ``--max-new-tokens``, ``--batch-size`` at a time).
2. What rows cost here: one fused decode step of B sequences (``LayerRunner.greedy_rows``, the op
   that verifies drafts), their prompts in the cache, with B rows (the pending tokens) and with
   e = 1, 2, 4, 8, 16 draft rows more (behind the first sequences' pending tokens, spread over
   them), medians of ``--repeats`` interleaved rounds: ``extra(e)``, the time such a step takes
   beyond the B-row step's, as a fraction of it; linear in between (past 16 by the last slope).
3. Each prompt's text replayed as prompt lookup sees it: at each position the longest earlier match
   of the last 1-3 tokens of prompt + output (``NgramIndex``, as ``hispec``'s lookup finds it) and
   the tokens after its most recent occurrence; a policy drafts some of them, the pass commits the
   accepted ones and one more. A sequence-step with d drafts costs ``1 / B + extra(d)`` of a B-row
   step (the others' drafts not counted: each sequence as if it drafted alone), against ``1 / B``
   a plain token: no Python, no round overhead, no plain run cut short, so each figure is an
   upper bound for its policy (at batch 1, exactly the measured step).

Prints, overall and per category, decoding's tokens per cost (prefill not counted) over plain
decoding's, for fixed policies (up to k drafts from matches of at least n tokens) and for the
oracle that drafts exactly the tokens that will be accepted: the bound of any policy over these
drafts. Run alone: the row costs are timings.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from hispec.cache.paged import PagedCache
from hispec.config import SamplingParams
from hispec.data.sets import load_prompts
from hispec.decode.base import LayerRunner
from hispec.spec.proposers.ngram import NgramIndex, continuation
from hispec.generate import Generator
from hispec.llm import LLM

POLICIES = [(3, 1), (3, 2), (3, 4), (2, 1), (2, 2), (1, 2)]  # (least match length n, drafts k)
ORACLE_DRAFTS = 16
EXTRA_ROWS = (1, 2, 4, 8, 16)


def extra_costs(gen: Generator, prompts: list[list[int]], repeats: int) -> list[tuple[int, float]]:
    """``[(e, extra(e))]`` for e = 0 and ``EXTRA_ROWS``: the seconds of a fused decode step of the
    B = len(prompts) pending tokens and e drafts more, over those of the B-row step, minus one."""
    model = gen.model
    n, bs, most = model.num_layers, 16, max(EXTRA_ROWS)
    blocks = sum(-(-(len(p) + most + 2) // bs) for p in prompts) + len(prompts)
    cache = PagedCache.for_model(model, blocks, bs)
    runner = LayerRunner(model, cache.blocks, cache.pool)
    times: dict[int, list[float]] = {e: [] for e in (0, *EXTRA_ROWS)}
    with torch.no_grad():
        for sid, p in enumerate(prompts):
            cache.blocks.add_sequence(sid)
            runner.forward_many([(sid, 0, torch.tensor(p[:-1]))], 0, n, prefill=True)
        sizes = list(times)
        for r in range(repeats + 1):  # the first round warms up; each round starts one size later
            for e in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                items = [(sid, len(p) - 1, [p[-1]] * (1 + e // len(prompts) + (sid < e % len(prompts))))
                         for sid, p in enumerate(prompts)]
                t = time.perf_counter()
                runner.greedy_rows(items)
                times[e].append(time.perf_counter() - t)
                for sid, p in enumerate(prompts):
                    runner.truncate(sid, len(p) - 1)
    med = {e: statistics.median(v[1:]) for e, v in times.items()}
    print(f"a fused step of {len(prompts)} rows: {med[0] * 1e3:.2f} ms; with e rows more, its time x "
          + ", ".join(f"{e}: {med[e] / med[0]:.3f}" for e in EXTRA_ROWS))
    return [(e, med[e] / med[0] - 1) for e in sorted(med)]


def interpolate(table: list[tuple[int, float]], d: int) -> float:
    """``extra(d)`` from the measured ``(e, extra(e))`` points, linear between them and past the last."""
    for (e0, c0), (e1, c1) in zip(table, table[1:]):
        if d <= e1:
            return c0 + (c1 - c0) * (d - e0) / (e1 - e0)
    (e0, c0), (e1, c1) = table[-2:]
    return c1 + (c1 - c0) * (d - e1) / (e1 - e0)


def accepted_prefix(drafts: list[int], truth: list[int]) -> int:
    """How many of ``drafts`` greedy verification accepts: those equal to the tokens to come, up to the first not."""
    accepted = 0
    while accepted < min(len(drafts), len(truth)) and drafts[accepted] == truth[accepted]:
        accepted += 1
    return accepted


def replay(prompt: list[int], output: list[int], drafts_for) -> list[int]:
    """How many drafts each step took, one text decoded with the drafts ``drafts_for(n, continuation,
    truth)`` picks at each position (``n``: the match length, 0 for none; ``truth``: the tokens to come)."""
    text, index, i, steps = list(prompt), NgramIndex(3), 0, []
    while i < len(output):
        n, ends = index.match(text)
        drafts = drafts_for(n, continuation(text, ends[-1], ORACLE_DRAFTS) if n else [], output[i:])
        take = min(accepted_prefix(drafts, output[i:]) + 1, len(output) - i)
        text += output[i:i + take]
        i = i + take
        steps.append(len(drafts))
    return steps


def fixed(least: int, k: int):
    """Up to ``k`` drafts from a match of at least ``least`` tokens."""
    return lambda n, cont, truth: cont[:k] if n >= least else []


def oracle(n: int, cont: list[int], truth: list[int]) -> list[int]:
    """Exactly the drafts that will be accepted."""
    return cont[:accepted_prefix(cont, truth)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="prompts: a JSONL file (Spec-Bench's question.jsonl, ...)")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true", help="every prompt to --max-new-tokens (as the batch benches)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = Generator.from_pretrained(args.model, progress=False)
    records = load_prompts([args.data], limit=args.limit)
    prompts = [gen.encode_prompt(r.prompt) for r in records]
    b = min(args.batch_size, len(prompts))
    table = extra_costs(gen, prompts[:b], args.repeats)
    outs = LLM(gen, "ar", max_batch_size=args.batch_size).generate(
        prompts, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos))
    cats = sorted({rec.category or "-" for rec in records})
    print(f"tokens per cost over plain decoding's at batch {b} (no round overhead: an upper bound per policy)")
    print(f"{'policy':<20}{'all':>7}" + "".join(f"{c[:11]:>12}" for c in cats))
    named = [(f"n >= {n}, up to {k}", fixed(n, k)) for n, k in POLICIES] + [("oracle", oracle)]
    for label, policy in named:
        tokens, cost = defaultdict(float), defaultdict(float)
        for rec, p, o in zip(records, prompts, outs):
            steps = replay(p, o.token_ids, policy)
            for key in ("all", rec.category or "-"):
                tokens[key] += len(o.token_ids)
                cost[key] += sum(1 / b + interpolate(table, d) for d in steps)
        print(f"{label:<20}" + "".join(f"{tokens[k] / b / cost[k]:>{7 if k == 'all' else 12}.3f}"
                                       for k in ["all"] + cats))


if __name__ == "__main__":
    main()
