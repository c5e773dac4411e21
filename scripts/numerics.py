"""How far each 4-bit kernel's greedy tokens follow float32's: the first position where they part.

    python scripts/numerics.py --data question.jsonl [--limit 16] [--model default] [--max-new-tokens 64]
                               [--kernels q4,int4,q8a] [--kv-bf16] [--llama-cpp] [--threads 2] [--save JSON]

Greedy ``ar`` on each prompt (chat template, as ``hispec bench``), float32 weights (``--quantize none``)
as the reference, then the GGUF's own 4-bit weights (``--quantize native``) on each kernel named
(``HISPEC_Q4_KERNEL``: ``q4`` 16-bit activations, ``int4`` PyTorch's on bfloat16 ones, ``q8a`` 8-bit
ones), each on a float32 KV cache; ``--kv-bf16``: also each on a bfloat16 one (the default under
quantized weights); ``--llama-cpp``: also llama.cpp's own greedy tokens on the same Q4_1 GGUF and
prompt ids (``hispec bench``'s peer process, its venv under ``$HISPEC_HOME/peers/llamacpp``). Prints
per prompt the first differing position (``=``: identical), then per kernel: prompts identical,
median first divergence and mean tokens agreeing before it (an identical prompt counts its length),
against float32 and (``--llama-cpp``) against llama.cpp's.
Run from the repository root with ``PYTHONPATH=.`` to use that copy; on a machine busier than its
cores, ``OMP_WAIT_POLICY=passive`` (see ``bench-kernels.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def first_divergence(ref: list[int], ids: list[int]) -> int | None:
    """The first position where ``ids`` differs from ``ref`` (one ending before the other differs at
    the shorter's length), or None where they are identical."""
    for i, (a, b) in enumerate(zip(ref, ids)):
        if a != b:
            return i
    return None if len(ref) == len(ids) else min(len(ref), len(ids))


def summarize(refs: list[list[int]], outs: list[list[int]]) -> tuple[int, float, float]:
    """(prompts identical, median first divergence, mean tokens agreeing before it); an identical
    prompt counts its length in both."""
    agree = [len(r) if d is None else d for r, d in ((r, first_divergence(r, o)) for r, o in zip(refs, outs))]
    same = sum(first_divergence(r, o) is None for r, o in zip(refs, outs))
    return same, statistics.median(agree), statistics.mean(agree)


def _hispec_ids(model: str, prompt_ids: list[list[int]], params, *, kernel: str, kv: str) -> list[list[int]]:
    """Greedy ``ar`` ids of every prompt on the GGUF's 4-bit blocks on ``kernel`` (what the model runs
    on, ``select.describe``, to stderr)."""
    from hispec.generate import Generator
    from hispec.kernels import quant, select

    os.environ["HISPEC_Q4_KERNEL"] = kernel
    quant.four_bit_kernel.cache_clear()  # decided once per process: again for this kernel
    gen = Generator.from_pretrained(model, progress=False, exits=False, kv_cache_dtype=kv, quantize="native")
    print(f"{kernel} kv {kv}: {select.describe(gen.model)}", file=sys.stderr, flush=True)
    return [gen.generate(ids, params, "ar").token_ids for ids in prompt_ids]


def _load_saved(path: str | None, key: dict) -> dict[str, list[list[int]]]:
    """The runs ``--save`` kept from an earlier call with the same model, prompt ids and length."""
    if not path or not Path(path).exists():
        return {}
    saved = json.loads(Path(path).read_text())
    return saved["runs"] if saved.get("key") == key else {}


def _llama_cpp_ids(gen, model: str, prompt_ids: list[list[int]], params, threads: int) -> list[list[int]]:
    from hispec.bench.peers import PeerRunner, PeerSpec

    with tempfile.TemporaryDirectory() as log_dir:
        peer = PeerRunner(PeerSpec("llama.cpp:q4_1", "llama.cpp", "q4_1"), gen, model_name=model, threads=threads,
                          python_overrides={}, log_dir=Path(log_dir))
        if peer.unavailable:
            raise SystemExit(f"--llama-cpp: {peer.unavailable}")
        try:
            return peer.generate(prompt_ids, params)[0]
        finally:
            peer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--data", required=True, help="a prompt file or set, as hispec bench --data")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--kernels", default="q4,int4,q8a")
    ap.add_argument("--kv-bf16", action="store_true", help="also each kernel with a bfloat16 KV cache")
    ap.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's tokens on the same Q4_1 GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save", metavar="JSON", help="keep every run's ids here; a later call with the same "
                                                   "prompts reuses them (resume a long run)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    torch.set_num_threads(args.threads)
    from hispec.bench.runner import encode_prompts
    from hispec.config import SamplingParams
    from hispec.data import load_prompts
    from hispec.generate import Generator

    prompts = load_prompts([args.data], limit=args.limit)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    ref_gen = Generator.from_pretrained(args.model, progress=False, exits=False, quantize="none")
    prompt_ids = encode_prompts(ref_gen, prompts, chat=None)
    key = {"model": args.model, "prompt_ids": prompt_ids, "max_new_tokens": args.max_new_tokens}
    runs = _load_saved(args.save, key)
    jobs = {"float32": lambda: [ref_gen.generate(ids, params, "ar").token_ids for ids in prompt_ids]}
    if args.llama_cpp:
        jobs["llama.cpp Q4_1"] = lambda: _llama_cpp_ids(ref_gen, args.model, prompt_ids, params, args.threads)
    for kernel in filter(None, args.kernels.split(",")):
        jobs[kernel] = lambda kernel=kernel: _hispec_ids(args.model, prompt_ids, params, kernel=kernel, kv="float32")
        if args.kv_bf16:
            jobs[f"{kernel} kv-bf16"] = lambda kernel=kernel: _hispec_ids(args.model, prompt_ids, params,
                                                                          kernel=kernel, kv="bfloat16")
    for label, job in jobs.items():
        if label not in runs:
            t0 = time.perf_counter()
            runs[label] = job()
            print(f"{label}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if args.save:
                Path(args.save).write_text(json.dumps({"key": key, "runs": runs}))
        if label == ("llama.cpp Q4_1" if args.llama_cpp else "float32"):
            ref_gen = None  # the last job to use it: one model in memory at a time
    refs = runs.pop("float32")

    labels = list(runs)
    print(f"{len(prompts)} prompts from {args.data}, greedy ar, {args.max_new_tokens} new tokens; first position "
          "differing from float32 ('=': identical)")
    print(f"{'prompt':<24}{'tokens':>7}" + "".join(f"{l:>16}" for l in labels))
    for i, p in enumerate(prompts):
        cells = [first_divergence(refs[i], runs[l][i]) for l in labels]
        name = f"{p.category}/{p.id}"[:23]
        print(f"{name:<24}{len(refs[i]):>7}" + "".join(f"{'=' if c is None else c:>16}" for c in cells))
    for l in labels:
        print(f"{l} against float32: {_summary(refs, runs[l])}")
    peer = runs.get("llama.cpp Q4_1")
    for l in (["float32"] + [l for l in labels if l != "llama.cpp Q4_1"]) if peer else []:
        print(f"{l} against llama.cpp Q4_1: {_summary(peer, refs if l == 'float32' else runs[l])}")


def _summary(refs: list[list[int]], outs: list[list[int]]) -> str:
    same, med, mean = summarize(refs, outs)
    return f"identical {same}/{len(refs)}, median first divergence {med:g}, mean tokens agreeing {mean:.1f}"


if __name__ == "__main__":
    main()
