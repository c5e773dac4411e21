#!/usr/bin/env python3
"""What a model costs in resident memory beside its GGUF file: the process's resident set (anonymous
and file-backed pages, /proc/self/status) after the imports, with a tokenizer alone, after loading
(weights and tokenizer) and after generating, freed heap handed back before each reading, and the
peak (VmHWM) from the load on, against the file's size.

    python scripts/resident-memory.py --model gemma3-270m
    python scripts/resident-memory.py --model l8b-q4km.gguf --tokens 16 --quantize native

The tokenizer is priced in a process of its own; the weights are what loading added beside it (blocks repacked for the kernels, the
embedding rows read in place, norms); the tokenizer (Hugging Face's, in Rust: ~280 MB for a
262k-token BPE) and the runtime (Python, PyTorch) are shown apart. Linux only.
"""
from __future__ import annotations

import argparse
import json
import re
import time


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile in MiB."""
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"^{k}:\s+(\d+)", text, re.M).group(1)) // 1024
            for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def tokenizer_cost(folder) -> int:
    """MiB a tokenizer of ``folder`` adds to a fresh process that has imported transformers."""
    import subprocess
    import sys

    code = ("import re, transformers\n"
            "from hispec.generate import load_tokenizer\n"
            "rss = lambda: int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            f"a = rss(); t = load_tokenizer(__import__('pathlib').Path({str(folder)!r})); print((rss() - a) // 1024)\n")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="The history of the printing press")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch  # noqa: F401  (the runtime, counted before the model)
    import transformers  # noqa: F401

    from hispec import SamplingParams
    from hispec.generate import Generator, load_tokenizer
    from hispec.model.load.registry import gguf_source

    from hispec.kernels.hugepages import trim_heap
    from hispec.model.load.registry import resolve_model

    gguf = gguf_source(args.model)
    folder = resolve_model(args.model, progress=False, weights=False)  # config and tokenizer only
    tok = tokenizer_cost(folder)
    trim_heap()
    rows = {"imports": status()}
    t0 = time.perf_counter()
    gen = Generator.from_pretrained(args.model, progress=False, quantize=args.quantize, exits=False)
    load_s = time.perf_counter() - t0
    trim_heap()
    rows["loaded (weights + tokenizer)"] = status()
    gen.generate(args.prompt, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True), strategy="ar")
    trim_heap()
    rows[f"after {args.tokens} tokens"] = status()
    file_mib = gguf.stat().st_size / 2**20 if gguf is not None else None
    model = rows["loaded (weights + tokenizer)"]["VmRSS"] - rows["imports"]["VmRSS"] - tok
    peak = rows[f"after {args.tokens} tokens"]["VmHWM"] - rows["imports"]["VmRSS"]
    out = {"model": args.model, "file_mib": file_mib, "weight_format": gen.model.weight_format,
           "load_seconds": round(load_s, 1), "rows": rows, "tokenizer_mib": tok, "model_mib": model,
           "peak_over_runtime_mib": peak}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for name, r in rows.items():
        print(f"{name:30s} RSS {r['VmRSS']:6d} MiB (anon {r['RssAnon']:6d}, file {r['RssFile']:5d}), peak {r['VmHWM']:6d}")
    ratio = f" = {model / file_mib:.2f}x the file's {file_mib:.0f} MiB" if file_mib else ""
    print(f"loaded in {load_s:.1f} s ({gen.model.weight_format}); the weights: {model} MiB{ratio}; "
          f"the tokenizer: {tok} MiB; peak over the runtime: {peak} MiB"
          + (f" = {peak / file_mib:.2f}x the file (the tokenizer's {tok} MiB included)" if file_mib else ""))


if __name__ == "__main__":
    main()
