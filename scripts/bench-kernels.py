"""One decode step's matmuls (decoder linears + output head) per kernel, at 1, 2, 4, 8 and 16 rows.

    python scripts/bench-kernels.py [--model default] [--rows 1,2,4,8,16] [--repeats 15] [--threads 2]
                                    [--kernels q4,int4,q8act] [--driver c|python]

Shapes from the cached model's config (``$HISPEC_HOME/models/<model>/config.json``; the default
model: 30 layers x (qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576) and the
head 576 -> 49152). Random weights in each kernel's format: the decoder's 4-bit blocks (Q4_1-like
``d``, ``m``) and the head's Q8_0 blocks, one weight per layer so the stream is the model's size.
Kernels:

- ``q4``: hispec's 16-bit-activation kernels (``fused.q4_matmul`` decoder, ``fused.q8_matmul`` head);
- ``int4``: PyTorch's int4 kernel with bfloat16 activations (decoder; head as two int4 halves, ``int4x2``);
- ``q8act``: the 8-bit-activation integer kernels (``kernels.q8act``) on the best path this CPU
  has; ``q8act-<path>``: on another path (``avx2``, ``vnni256``, ``avx512vnni``, ``scalar``).

Drivers: ``c`` (the default) times the step in C (``scripts/bench-kernels-step.c``, built here
against hispec's kernel library): the calls back to back as the decode op makes them, so a row's
figure is the kernels' alone (``int4``, PyTorch's, is not callable from C: skipped there).
``python`` calls each matmul from Python (torch tensors, ~25 us per call: ~3 ms of a one-row step
of the default model, which the decode op does not pay, so its ratios to one row look better than
the kernels' are).

Run from the repository root with ``PYTHONPATH=.`` to time that copy. On a machine busier than its
cores, OpenMP's spinning threads wait out each other's time slices (steps ~10x slower for every
kernel alike); ``OMP_WAIT_POLICY=passive`` avoids that, but on a quiet machine it doubles every
step (threads put to sleep between the calls: q4 12.1 ms instead of 5.5 on a Zen 4), so time quiet.
The weights are random bytes, so their layout (``q8a``'s tiles) does not matter to the timing.
The C driver keeps the weights in transparent huge pages, as the decode op finds a loaded model's
(``kernels/hugepages.py``; ``HUGE=0`` in the environment: where ``malloc`` puts them). On a Zen 4 with
2 threads a one-row step took ~2.6 ms there and ~3.0 on 4 KiB pages.

Prints, per kernel and row count, the median ms of one step's matmuls (the kernels and rows are
interleaved within each repeat, so a busy machine slows all alike) and the ratio to one row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def shapes(model: str) -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
    """(layers, the per-layer (K, N) of qkv, o, gate_up, down, the head's (K, N)) from the model's config."""
    from hispec import envs
    from hispec.model.load.registry import ALIASES

    name = ALIASES.get(model, model)
    folders = [p for p in (envs.HISPEC_HOME / "models").glob("*") if p.name.lower() == name.lower()]
    cfg_path = folders[0] / "config.json" if folders else None
    if cfg_path is None or not cfg_path.exists():
        raise SystemExit(f"no cached config for {model!r} under {envs.HISPEC_HOME / 'models'}: run hispec once first")
    c = json.loads(cfg_path.read_text())
    h, i, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // heads
    per_layer = [(h, (heads + 2 * kv) * hd), (heads * hd, h), (h, 2 * i), (i, h)]
    return c["num_hidden_layers"], per_layer, (h, c["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default="q4,int4,q8act")
    ap.add_argument("--driver", choices=("c", "python"), default="c",
                    help="c: the step's calls back to back in C (default); python: each call from Python")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before any OpenMP runtime starts

    import torch

    torch.set_num_threads(args.threads)
    from hispec.kernels import q8act
    from hispec.kernels import fused
    from hispec.kernels.quant import QuantLinear, pack_nibbles

    layers, per_layer, (hk, hn) = shapes(args.model)
    rows = [int(r) for r in args.rows.split(",")]
    if args.driver == "c":
        return c_driver(args, layers, per_layer, (hk, hn), rows)
    gen = torch.Generator().manual_seed(0)
    print(f"{layers} layers x {per_layer} (K, N) + head ({hk}, {hn}); {args.threads} threads; "
          f"q8act paths on this CPU: {', '.join(q8act.supported_isas())}", flush=True)

    def four_bit(k: int, n: int):
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        d = (torch.rand((n, k // 32), generator=gen) * 0.02 + 1e-3).half().float()
        m = (-torch.rand((n, k // 32), generator=gen) * 0.1).half().float()
        return q, d, m

    decoder = [four_bit(k, n) for _ in range(layers) for k, n in per_layer]
    head_q = torch.randint(-127, 128, (hn, hk), generator=gen, dtype=torch.int8)
    head_d = (torch.rand((hn, hk // 32), generator=gen) * 0.01).half().float()

    steps: dict[str, list] = {}  # kernel -> [(fn, K)] of one step's matmuls
    kernels = args.kernels.split(",")
    for name in kernels:
        if name == "q4":
            ws = [(pack_nibbles(q), torch.stack([d, m]).contiguous()) for q, d, m in decoder]
            steps[name] = [(lambda x, w=w: fused.q4_matmul(x, *w), w[0].shape[1] * 2) for w in ws]
            steps[name].append((lambda x: fused.q8_matmul(x, head_q, head_d), hk))
        elif name == "int4":
            mods = [QuantLinear.from_int4(q, d, m, 32, kernel="int4") for q, d, m in decoder]
            head = QuantLinear.from_q8_blocks(head_q, head_d.half(), kernel="int4x2")
            steps[name] = [(lambda x, mod=mod: mod.mm(x), mod.in_features) for mod in mods + [head]]
        elif name.startswith("q8act"):
            isa = name.partition("-")[2] or None
            if isa is not None and isa not in q8act.supported_isas():
                print(f"skipping {name}: this CPU cannot run it")
                continue
            ws = [q8act.tile4(pack_nibbles(q), torch.stack([d, m])) for q, d, m in decoder]
            head = q8act.tile8(head_q, head_d)
            steps[name] = [(lambda x, w=w, isa=isa: q8act.q4_matmul(x, *w, isa=isa), w[0].shape[1] * 2) for w in ws]
            steps[name].append((lambda x, isa=isa: q8act.q8_matmul(x, *head, isa=isa), hk))
        else:
            raise SystemExit(f"unknown kernel {name!r}")

    inputs = {(t, k, dt): torch.randn((t, k), generator=gen).to(dt) for t in rows
              for k in {k for k, _ in per_layer} | {hk} for dt in (torch.float32, torch.bfloat16)}

    def step(name: str, t: int) -> float:
        dt = torch.bfloat16 if name == "int4" else torch.float32
        t0 = time.perf_counter()
        for fn, k in steps[name]:
            fn(inputs[(t, k, dt)])
        return time.perf_counter() - t0

    times = {(name, t): [] for name in steps for t in rows}
    for name in steps:  # warm-up: builds, first touches
        for t in rows:
            step(name, t)
    for _ in range(args.repeats):
        for name in steps:
            for t in rows:
                times[(name, t)].append(step(name, t))
    print(f"ms per step (median of {args.repeats}); ratio to one row", flush=True)
    print(f"{'kernel':<18}" + "".join(f"{t:>8} rows " for t in rows))
    for name in steps:
        ms = [1e3 * statistics.median(times[(name, t)]) for t in rows]
        print(f"{name:<18}" + "".join(f"{v:8.2f} ms  " for v in ms))
        print(f"{'':<18}" + "".join(f"{v / ms[0]:8.2f} x   " for v in ms))


def c_driver(args, layers: int, per_layer: list[tuple[int, int]], head: tuple[int, int], rows: list[int]) -> None:
    """Build ``bench-kernels-step.c`` against the kernel library and run it: the same table."""
    import subprocess
    import tempfile
    from pathlib import Path

    from hispec.kernels import build, q8act

    lib = build.build_library()
    names = {"q4": "q4", "q8act": "q8a:0"}  # 0: HS_Q8A_AUTO, the best path this CPU has
    ids = q8act._isa_ids()  # path name -> the header's hs_q8a_isa value
    kernels = {}
    for name in args.kernels.split(","):
        isa = name.partition("-")[2] if name.startswith("q8act-") else None
        if name in names:
            kernels[name] = names[name]
        elif isa is not None and isa in q8act.supported_isas():
            kernels[name] = f"q8a:{ids[isa]}"
        elif name == "int4":
            print("skipping int4: PyTorch's kernel is not callable from C (--driver python times it)")
        elif isa is not None:
            print(f"skipping {name}: this CPU cannot run it")
        else:
            raise SystemExit(f"unknown kernel {name!r}")
    src = Path(__file__).with_name("bench-kernels-step.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "bench-kernels-step"
        subprocess.run(["cc", "-O2", "-I", str(build.CSRC), str(src), str(lib), f"-Wl,-rpath,{lib.parent}", "-o",
                        str(exe)], check=True)
        shape_args = [str(v) for k, n in per_layer for v in (k, n)]
        out = subprocess.run([str(exe), str(layers), *shape_args, *map(str, head), ",".join(map(str, rows)),
                              str(args.repeats), *kernels.values()], check=True, capture_output=True, text=True).stdout
    ms = {}
    for line in out.split("\n"):
        if line.strip():
            kernel, t, step_ms, head_ms = line.split()
            ms[(kernel, int(t))] = (float(step_ms), float(head_ms))
    print(f"ms per step, in C (median of {args.repeats}; the output head's share in brackets); ratio to one row",
          flush=True)
    print(f"{'kernel':<18}" + "".join(f"{t:>14} rows " for t in rows))
    for name, kernel in kernels.items():
        row = [ms[(kernel, t)] for t in rows]
        print(f"{name:<18}" + "".join(f"{a:8.2f} ({b:5.2f}) " for a, b in row))
        print(f"{'':<18}" + "".join(f"{a / row[0][0]:13.2f} x   " for a, _ in row))


if __name__ == "__main__":
    main()
