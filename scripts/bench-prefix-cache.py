"""Prefix caching on the default model, with against without (interleaved, medians, the engine
as the server runs it: adaptive hispec, chunked prefill, 2 threads unless told).

1. chat: a conversation's second turn. Turn 1 is a ~HISTORY-token user message (Spec-Bench RAG
   documents) answered with 32 tokens; turn 2 resends it all with a new question. Reported: turn 2's
   time to first token with the cache (turn 1's prompt blocks cached) and without.
2. system prompt: QUESTIONS Spec-Bench questions behind one shared ~SYSTEM-token system prompt, at
   batch 16, NEW tokens each (EOS ignored): requests per second with the cache and without.

usage: python scripts/bench-prefix-cache.py QUESTION_JSONL [--history 1000] [--system 1500]
       [--questions 64] [--new 32] [--reps 5] [--rounds 2] [--threads 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hispec.config import EngineConfig, SamplingParams
from hispec.engine import Engine
from hispec.engine.build import build_engine
from hispec.generate import Generator


def text_of(rows: list[dict], tokenizer, tokens: int) -> str:
    """RAG documents, joined until they pass ``tokens`` tokens, cut there."""
    docs, n = [], 0
    for r in rows:
        if r["category"] == "rag":
            docs.append(r["turns"][0])
            n += len(tokenizer.encode(r["turns"][0]))
            if n > tokens:
                break
    ids = tokenizer.encode("\n\n".join(docs))[:tokens]
    return tokenizer.decode(ids)


def chat_ids(gen: Generator, messages: list[dict]) -> list[int]:
    text = gen.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return gen.tokenizer(text, add_special_tokens=False)["input_ids"]


def engine(gen: Generator, prefix_caching: bool, batch: int, seq_tokens: int) -> Engine:
    return build_engine(gen.model, "hispec", EngineConfig(max_batch_size=batch, prefix_caching=prefix_caching),
                        recommended=gen.recommended_specs, tokenizer=gen.tokenizer, eos_ids=gen.eos_ids,
                        seq_tokens=seq_tokens, num_seqs=batch + 1)


def chat_turn(gen: Generator, history: str, question: str, prefix_caching: bool) -> tuple[float, list[int], int]:
    """Turn 2's time to first token, its tokens and its cached prompt tokens."""
    e = engine(gen, prefix_caching, 1, 2048)
    turn1 = [{"role": "user", "content": history}]
    ids1 = chat_ids(gen, turn1)
    e.add_request(ids1, SamplingParams(max_new_tokens=32, ignore_eos=True))
    answer = next(iter(e.run_to_completion().values())).text
    ids2 = chat_ids(gen, turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}])
    e.add_request(ids2, SamplingParams(max_new_tokens=8))
    out = next(iter(e.run_to_completion().values()))
    return out.time_to_first_token, out.token_ids, out.num_cached_tokens


def system_prompt_run(gen: Generator, prompts: list[list[int]], new: int, prefix_caching: bool) -> tuple[float, list]:
    """Seconds for all prompts at batch 16, and their tokens."""
    e = engine(gen, prefix_caching, 16, max(map(len, prompts)) + new)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    started = time.perf_counter()
    ids = [e.add_request(p, params) for p in prompts]
    final = e.run_to_completion()
    return time.perf_counter() - started, [final[i].token_ids for i in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("questions")
    p.add_argument("--history", type=int, default=1000)
    p.add_argument("--system", type=int, default=1500)
    p.add_argument("--num-questions", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(args.questions) if line.strip()]
    gen = Generator.from_pretrained("default", progress=False)
    tok = gen.tokenizer
    result = {"history_tokens": args.history, "system_tokens": args.system}

    history = text_of(rows, tok, args.history)
    chat_turn(gen, history[:400], "Summarize.", True)  # warm-up
    ttft = {True: [], False: []}
    for rep in range(args.reps):
        for cached in ((True, False) if rep % 2 == 0 else (False, True)):
            seconds, ids, hit = chat_turn(gen, history, "Which facts above matter most? One line.", cached)
            ttft[cached].append(seconds)
            result.setdefault("chat_ids", {})[str(cached)] = ids
            if cached:
                result["chat_cached_tokens"] = hit
    assert result["chat_ids"]["True"] == result["chat_ids"]["False"], "the cache changed turn 2's tokens"
    med = {k: statistics.median(v) for k, v in ttft.items()}
    result["chat"] = {"ttft_cached_s": med[True], "ttft_uncached_s": med[False], "ratio": med[True] / med[False]}
    print(f"chat turn 2 ({args.history}-token history, {result['chat_cached_tokens']} cached): TTFT "
          f"{med[True] * 1e3:.0f} ms with the cache, {med[False] * 1e3:.0f} ms without: {med[True] / med[False]:.2f}x")

    system = text_of(rows[::-1], tok, args.system)
    questions = [r["turns"][0] for r in rows if r["category"] not in ("rag", "summarization")][:args.num_questions]
    prompts = [chat_ids(gen, [{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    secs = {True: [], False: []}
    outs = {}
    for r in range(args.rounds):
        for cached in ((True, False) if r % 2 == 0 else (False, True)):
            seconds, outs[cached] = system_prompt_run(gen, prompts, args.new, cached)
            secs[cached].append(seconds)
    assert outs[True] == outs[False], "the cache changed a request's tokens"
    med = {k: statistics.median(v) for k, v in secs.items()}
    rps = {k: len(prompts) / v for k, v in med.items()}
    result["system_prompt"] = {"requests": len(prompts), "prompt_tokens": statistics.mean(map(len, prompts)),
                               "rps_cached": rps[True], "rps_uncached": rps[False], "ratio": rps[True] / rps[False]}
    print(f"shared system prompt ({len(prompts)} requests of ~{statistics.mean(map(len, prompts)):.0f} tokens, "
          f"{args.new} new each, batch 16): {rps[True]:.2f} requests/s with the cache, {rps[False]:.2f} without: "
          f"{rps[True] / rps[False]:.2f}x")
    result.pop("chat_ids")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
