"""Interleaved batch-1 A/B of strategies on a few Spec-Bench prompts per category (default model,
greedy, adaptive as `hispec generate`): decode tokens/s (prefill excluded), rounds by kind, lookup
drafts/accepted, ids equal to ar's, and the measured relative row cost.

usage: python scripts/lookup-ab.py QUESTION_JSONL CATEGORIES PER_CATEGORY NEW_TOKENS STRATEGIES THREADS
(STRATEGIES must include ar: the ratios and "same" are to it)
e.g.   python scripts/lookup-ab.py question.jsonl summarization,rag,qa,translation 2 64 ar,lookup,hispec 1
"""
import json
import sys

import torch

from hispec.config import SamplingParams
from hispec.generate import Generator
if len(sys.argv) != 7:
    sys.exit(__doc__)
torch.set_num_threads(int(sys.argv[6]))
data, cats = sys.argv[1], sys.argv[2].split(",")
per = int(sys.argv[3]); new = int(sys.argv[4]); strategies = sys.argv[5].split(",")
rows = [json.loads(l) for l in open(data)]
prompts = []
for c in cats:
    prompts += [r for r in rows if r["category"] == c][1:1 + per]
gen = Generator.from_pretrained("default", progress=False)
params = SamplingParams(max_new_tokens=new)
ids = [gen.encode_prompt(p["turns"][0]) for p in prompts]
for s in strategies:  # warm-up
    gen.generate(ids[0][:64], SamplingParams(max_new_tokens=8), s, adaptive=True)
tot = {s: [0.0, 0.0, 0] for s in strategies}  # decode seconds, total seconds, tokens
for i, (p, x) in enumerate(zip(prompts, ids)):
    ref = None
    order = strategies[i % len(strategies):] + strategies[:i % len(strategies)]
    line = {}
    for s in order:
        out = gen.generate(x, params, s, adaptive=True)
        if ref is None and s == "ar":
            ref = out.token_ids
        d = out.stats.to_dict()
        dec = out.seconds - d["phase_seconds"]["prefill"]
        tot[s][0] += dec; tot[s][1] += out.seconds; tot[s][2] += out.new_tokens
        lv = d["levels"].get("lookup->final", {})
        line[s] = (out.new_tokens, round(out.new_tokens / dec, 1), d["rounds"], lv.get("draft_tokens"), lv.get("accepted_tokens"), out.token_ids)
    same = {s: line[s][5] == line["ar"][5] for s in strategies}
    print(p["category"], len(x), {s: line[s][:5] for s in strategies}, "same:", same, flush=True)
print("decode tokens/s:", {s: round(t[2] / t[0], 1) for s, t in tot.items()})
print("with prefill tokens/s:", {s: round(t[2] / t[1], 1) for s, t in tot.items()})
print("ratio to ar (decode):", {s: round((t[2] / t[0]) / (tot['ar'][2] / tot['ar'][0]), 3) for s, t in tot.items()})
print("row cost:", {k: round(c.row_cost.relative(1), 3) for k, c in gen._controllers.items()})
