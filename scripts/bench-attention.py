"""Paged attention (``fused.paged_attention``) on a model's shapes: decode steps, verification
windows and a prompt chunk, ms per call and per step of all layers; optionally against another
build of the kernel library, interleaved.

    python scripts/bench-attention.py [--heads 9 --kv-heads 3 --head-dim 64 --layers 30]
                                      [--block-size 16] [--kv-dtype float32|bfloat16] [--repeats 15] [--threads 2]
                                      [--against OTHER.so] [--cases decode:16x260,verify:5x300,...]

Cases: ``decode:BxL`` (B sequences, one query each over L positions), ``verify:WxL`` (one
sequence, a window of W queries after L cached positions), ``prefill:N`` (one prompt chunk of N
tokens from position 0). The defaults are the default model's shapes (SmolLM2-135M: 9 query heads
over 3 KV heads of 64, 30 layers). Random queries and K/V in pools laid out as the engine's, float32
or bfloat16 (``--kv-dtype``; the default model's cache is bfloat16, where attention takes bfloat16
products).

``--against``: a kernel library built from other sources (e.g. ``git stash``, then ``cc -O3
-march=native -ffp-contract=off -fno-math-errno -fopenmp -fPIC -shared -I hispec/kernels/csrc -o
old.so hispec/kernels/csrc/*.c``): both run on the same inputs, alternating by repeat, and the line
gives the ratio (this tree's / the other's) and the largest difference of their outputs (0: the same
bits). Medians over ``--repeats``; time on a quiet machine.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import AttentionBatch, KVPool, SeqChunk
from hispec.kernels import binding, fused

DEFAULT_CASES = "decode:1x260,decode:1x800,decode:16x260,verify:5x300,verify:16x300,prefill:512"


def parse_case(text: str) -> tuple[list[int], list[int]]:
    """``decode:BxL`` / ``verify:WxL`` / ``prefill:N`` -> (cached positions, new queries) per sequence."""
    kind, _, size = text.partition(":")
    try:
        if kind == "prefill":
            return [0], [int(size)]
        a, b = (int(v) for v in size.split("x"))
    except ValueError:
        raise SystemExit(f"--cases: {text!r} is not decode:BxL, verify:WxL or prefill:N") from None
    if kind == "decode":
        return [b - 1] * a, [1] * a
    if kind == "verify":
        return [b], [a]
    raise SystemExit(f"--cases: unknown kind {kind!r} (decode, verify, prefill)")


def build_case(starts, counts, hq, hkv, d, bs, dtype=torch.float32):
    """The engine's block tables for the sequences (blocks handed out round-robin as they grow),
    a pool of random K/V in ``dtype`` and random queries [sum(counts), hq, d]."""
    nblocks = sum((s + n) // bs + 2 for s, n in zip(starts, counts))
    blocks = BlockManager(nblocks, bs, 1)
    chunks = [SeqChunk(i, s, n) for i, (s, n) in enumerate(zip(starts, counts))]
    for c in chunks:
        blocks.add_sequence(c.seq_id)
    for upto in range(bs, max(s + n for s, n in zip(starts, counts)) + bs, bs):
        for c in chunks:
            blocks.ensure_capacity(c.seq_id, min(upto, c.start + c.num_tokens))
    pool = KVPool(1, nblocks, bs, hkv, d, dtype, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape).to(dtype))
    pool.v[0].copy_(torch.randn(pool.v[0].shape).to(dtype))
    return AttentionBatch(chunks, blocks, "cpu").kernel(), pool, torch.randn(sum(counts), hq, d)


class _Other:
    """Another library's ``hs_paged_attention``, bound with this tree's signature."""

    def __init__(self, path: str) -> None:
        self.hs_paged_attention = ctypes.CDLL(path).hs_paged_attention
        self.hs_paged_attention.argtypes, self.hs_paged_attention.restype = binding.signatures()["hs_paged_attention"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="a step's figure: this many calls")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16"], help="the pool's dtype")
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=0, help="calls timed per repeat (0: by the case's size)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", help="another build of the kernel library (.so) to compare with")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.kv_dtype)
    cases = {c: build_case(*parse_case(c), args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
             for c in args.cases.split(",")}
    mine = fused.library
    libs = [("this tree", mine)] + ([("other", lambda o=_Other(args.against): o)] if args.against else [])
    times = {(c, name): [] for c in cases for name, _ in libs}
    outs = {}
    try:
        for r in range(args.repeats):
            for c, (meta, pool, q) in cases.items():
                calls = args.calls or max(3, 200_000 // max(1, int(meta.keys)))  # ~10 ms of work
                for name, lib in (libs if r % 2 == 0 else libs[::-1]):
                    fused.library = lib
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        out = fused.paged_attention(q, pool.k[0], pool.v[0], meta, torch.float32)
                    times[(c, name)].append((time.perf_counter() - t0) / calls)
                    outs[(c, name)] = out
    finally:
        fused.library = mine
    print(f"paged attention: {args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}, block "
          f"{args.block_size}, {args.kv_dtype} pool, {args.threads} threads; ms per call and per step of "
          f"{args.layers} layers (medians of {args.repeats})")
    for c in cases:
        ms = {name: statistics.median(times[(c, name)]) * 1e3 for name, _ in libs}
        line = f"  {c:16s} {ms['this tree']:8.3f} ms  step {ms['this tree'] * args.layers:8.2f} ms"
        if args.against:
            diff = (outs[(c, 'this tree')] - outs[(c, 'other')]).abs().max().item()
            line += (f"   other {ms['other']:8.3f} ms  this/other {ms['this tree'] / ms['other']:5.2f}"
                     f"  max |difference| {diff:.1e}")
        print(line)


if __name__ == "__main__":
    main()
