#!/usr/bin/env python3
"""A GGUF file with random weights and the real shapes of a published model, for benchmarks at
sizes whose real weights are not at hand (the tokens mean nothing: only the arithmetic counts).

    python scripts/synthetic-gguf.py --shape llama-3.2-1b --type Q8_0 --out l1b-q8_0.gguf
    python scripts/synthetic-gguf.py --shape llama-3.1-8b --type Q4_K_M --out l8b.gguf   # llama-quantize
    python scripts/synthetic-gguf.py --shape qwen2.5-1.5b --type F16 --out q15.gguf --layers 2 --vocab 512

Shapes (from each model's published config.json; ``SHAPES`` below):

| shape        | arch  | hidden | layers | heads | KV heads | head_dim | FFN   | vocab  | tied | RoPE base | RMS eps | context |
|--------------|-------|--------|--------|-------|----------|----------|-------|--------|------|-----------|---------|---------|
| llama-3.2-1b | llama | 2048   | 16     | 32    | 8        | 64       | 8192  | 128256 | yes  | 500000    | 1e-5    | 131072  |
| qwen2.5-1.5b | qwen2 | 1536   | 28     | 12    | 2        | 128      | 8960  | 151936 | yes  | 1000000   | 1e-6    | 32768   |
| llama-3.1-8b | llama | 4096   | 32     | 32    | 8        | 128      | 14336 | 128256 | no   | 500000    | 1e-5    | 131072  |

(qwen2: biases on Q, K and V, as the real model. The Llama 3.x "llama3" RoPE scaling of long
contexts, a ``rope_freqs`` tensor in llama.cpp's files, is left out: hispec does not read it, and
at benchmark lengths (under 8192 positions) it does not change the cost.)

Weights: normal with standard deviation 0.02 (the models' ``initializer_range``) for matrices and
biases, 1 for RMSNorm weights (F32, as llama.cpp keeps 1-D tensors), from a seeded generator per
tensor (``--seed``). They are written streaming, tensor by tensor and a block of rows at a time,
so no more than one block of floats is in memory (an 8B file needs well under 1 GB of RAM).
F16, Q8_0 and Q4_0 (every matrix, the embedding and output too) are written by the ``gguf``
package; Q4_K_M is an F16 file (written next to ``--out``, removed afterwards) quantized by
llama.cpp's own ``llama-quantize`` (``--llama-quantize PATH``; default
``$HISPEC_PEERS/llamacpp-tools/bin/llama-quantize``, which ``scripts/install-peers.sh
llama.cpp-tools`` builds).

Vocabulary: a byte-level BPE (``gpt2`` model, ``default`` pre-tokenizer) of the 256 byte tokens
and a few merges, BOS and EOS control tokens (at the real model's ids with the full vocabulary,
else the last two ids), the rest ``[PADn]`` (type UNUSED), padded to the vocabulary size
(``--vocab N``: a smaller one, for tests). llama.cpp and transformers' GGUF tokenizer loading (so
hispec) both accept it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_base: float
    rms_eps: float
    context: int
    bos: int | None  # the real tokenizer's ids (with the full vocabulary)
    eos: int
    add_bos: bool
    qkv_bias: bool = False


SHAPES = {
    # meta-llama/Llama-3.2-1B: <|begin_of_text|> 128000, <|end_of_text|> 128001
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 1e-5, 131072,
                          128000, 128001, True),
    # Qwen/Qwen2.5-1.5B: <|endoftext|> 151643 (no BOS added)
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True, 1000000.0, 1e-6, 32768,
                          None, 151643, False, qkv_bias=True),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 1e-5, 131072,
                          128000, 128001, True),
}
TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K_M")
STD = 0.02
BLOCK_ELEMENTS = 1 << 24  # floats generated (and quantized) at a time: 64 MB
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "Ġ a", "o n", "r e", "Ġ s"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def vocabulary(shape: Shape, vocab: int) -> tuple[list[str], list[int], list[str], int | None, int]:
    """(tokens, token types, merges, BOS id, EOS id) for a vocabulary of ``vocab`` tokens."""
    import gguf

    T = gguf.TokenType
    regular = list(bytes_to_unicode().values()) + ["".join(m.split()) for m in MERGES]
    if vocab < len(regular) + 2:
        raise SystemExit(f"--vocab must be at least {len(regular) + 2} (the byte tokens, merges, BOS and EOS)")
    tokens = regular + [f"[PAD{i}]" for i in range(len(regular), vocab)]
    types = [T.NORMAL] * len(regular) + [T.UNUSED] * (vocab - len(regular))
    full = vocab == shape.vocab
    bos = (shape.bos if full else vocab - 2) if shape.bos is not None else None
    eos = shape.eos if full else vocab - 1
    for i, name in ((bos, "<|begin_of_text|>"), (eos, "<|end_of_text|>" if shape.arch == "llama" else "<|endoftext|>")):
        if i is not None:
            tokens[i], types[i] = name, T.CONTROL
    return tokens, [int(t) for t in types], MERGES, bos, eos


def tensor_list(shape: Shape, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape: [out, in] for a matrix) of every tensor, in llama.cpp's order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (vocab, h))]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)), (b + "attn_k.weight", (kv, h)),
                (b + "attn_v.weight", (kv, h))]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        out += [(b + "attn_output.weight", (h, q)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (shape.ffn, h)), (b + "ffn_up.weight", (shape.ffn, h)),
                (b + "ffn_down.weight", (h, shape.ffn))]
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


class StreamedTensor:
    """One tensor for ``GGUFWriter.write_tensor_data``: ``nbytes`` and ``tofile`` (blocks of rows,
    generated, converted and written one at a time)."""

    def __init__(self, name: str, np_shape: tuple[int, ...], qtype, seed: int) -> None:
        import gguf

        self.name, self.np_shape, self.qtype, self.seed = name, np_shape, qtype, seed
        self.norm = len(np_shape) == 1 and name.endswith("norm.weight")
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(np_shape))
        self.nbytes = n // block * size
        self.cols = np_shape[-1]
        self.rows = n // self.cols

    def tofile(self, fout) -> None:
        import gguf

        Q = gguf.GGMLQuantizationType
        rng = np.random.default_rng(self.seed)
        step = max(1, BLOCK_ELEMENTS // self.cols)
        for start in range(0, self.rows, step):
            rows = min(step, self.rows - start)
            if self.norm:
                x = np.ones((rows, self.cols), dtype=np.float32)
            else:
                x = rng.standard_normal((rows, self.cols), dtype=np.float32)
                x *= np.float32(STD)
            if self.qtype == Q.F32:
                data = x
            elif self.qtype == Q.F16:
                data = x.astype(np.float16)
            else:
                data = gguf.quants.quantize(x, self.qtype)
            data.tofile(fout)


def write_gguf(path: Path, shape_name: str, gguf_type: str, layers: int, vocab: int, seed: int) -> None:
    """A GGUF of type F16, Q8_0 or Q4_0 (every matrix of that type, 1-D tensors F32)."""
    import gguf

    Q, FT = gguf.GGMLQuantizationType, gguf.LlamaFileType
    shape = SHAPES[shape_name]
    matrix_type = {"F16": Q.F16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0}[gguf_type]
    file_type = {"F16": FT.MOSTLY_F16, "Q8_0": FT.MOSTLY_Q8_0, "Q4_0": FT.MOSTLY_Q4_0}[gguf_type]
    tokens, types, merges, bos, eos = vocabulary(shape, vocab)

    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"synthetic {shape_name} ({layers} layers, vocabulary {vocab}, random weights)")
    w.add_file_type(int(file_type))
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(shape.add_bos and bos is not None)
    w.add_add_eos_token(False)

    streamed = []
    for i, (name, np_shape) in enumerate(tensor_list(shape, layers, vocab)):
        t = StreamedTensor(name, np_shape, Q.F32 if len(np_shape) == 1 else matrix_type, seed * 100_003 + i)
        w.add_tensor_info(name, np_shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        streamed.append(t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, done, tty = sum(t.nbytes for t in streamed), 0, sys.stderr.isatty()
    for t in streamed:
        w.write_tensor_data(t)  # duck-typed: nbytes and tofile
        done += t.nbytes
        if tty:
            print(f"\r{path.name}: {done / 2**20:,.0f} / {total / 2**20:,.0f} MiB", end="", file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    w.close()


def default_llama_quantize() -> Path:
    home = Path(os.environ.get("HISPEC_HOME") or Path.home() / ".cache" / "hispec")
    peers = Path(os.environ.get("HISPEC_PEERS") or home / "peers")
    return peers / "llamacpp-tools" / "bin" / "llama-quantize"


def find_llama_quantize(given: str | None) -> Path:
    path = Path(given).expanduser() if given else default_llama_quantize()
    if not path.is_file() or not os.access(path, os.X_OK):
        where = "the --llama-quantize given" if given else "$HISPEC_PEERS/llamacpp-tools/bin/llama-quantize"
        raise SystemExit(f"synthetic-gguf: K-quant types need llama.cpp's llama-quantize, and {where} ({path}) "
                         "does not exist: build it with `scripts/install-peers.sh llama.cpp-tools`, or pass "
                         "--llama-quantize PATH")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--type", required=True, choices=TYPES, dest="gguf_type")
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument("--layers", type=int, help="fewer layers than the model's (default: all)")
    p.add_argument("--vocab", type=int, help="a smaller vocabulary than the model's (tests; default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-quantize", metavar="PATH",
                   help="llama.cpp's llama-quantize for K-quant types (default "
                        "$HISPEC_PEERS/llamacpp-tools/bin/llama-quantize, $HISPEC_PEERS defaulting to "
                        "$HISPEC_HOME/peers)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-quantize's threads")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    vocab = args.vocab or shape.vocab
    if not 1 <= layers <= shape.layers:
        p.error(f"--layers must be between 1 and {shape.layers}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        if args.gguf_type == "Q4_K_M":
            quantize = find_llama_quantize(args.llama_quantize)
            f16 = out.with_name(out.name + f".f16.tmp{os.getpid()}")
            try:
                write_gguf(f16, args.shape, "F16", layers, vocab, args.seed)
                r = subprocess.run([str(quantize), str(f16), str(tmp), "Q4_K_M", str(args.threads)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                if r.returncode != 0:
                    tail = "\n".join(r.stdout.strip().splitlines()[-15:])
                    raise SystemExit(f"synthetic-gguf: llama-quantize failed (status {r.returncode}):\n{tail}")
            finally:
                f16.unlink(missing_ok=True)
        else:
            write_gguf(tmp, args.shape, args.gguf_type, layers, vocab, args.seed)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"synthetic-gguf: wrote {out} ({args.shape}, {args.gguf_type}, {layers} layers, vocabulary {vocab}, "
          f"{out.stat().st_size / 2**20:,.0f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
