#!/usr/bin/env bash
# One call on a GPU machine, before anything else: the CUDA paths have never run on hardware.
#   bash scripts/gpu-check.sh            # under 8 minutes on one GPU; prints a summary at the end
# Runs, each step under its own time limit:
#   1. the CUDA-marked tests (pytest -m cuda; with >= 2 GPUs also tensor parallelism over NCCL)
#   2. hispec bench in bfloat16 on the default model (ar, selfspec, hispec, transformers)
#   3. hispec bench in bfloat16 on a random model of Llama-3-8B's shape (speed only; written once)
#   4. with >= 2 GPUs: the tensor-parallel check over NCCL on the default model, and (3) at TP=2
# GPU_CHECK_TESTS / GPU_CHECK_DEFAULT / GPU_CHECK_BIG=0 leave out (1) / (2, 4) / (3): the 8B-shaped
# weights alone take ~2 minutes to write, too long when the lease is short.
# Everything goes to $GPU_CHECK_OUT (default gpu-check-out/); the summary is also in summary.txt.
# Paste the summary into BENCHMARKS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-gpu-check-out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
source scripts/steps.sh  # HISPEC (this checkout's CLI), note, step


if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu-check: no CUDA device visible to torch; nothing to check" >&2
  exit 2
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
note "gpu-check $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "$("$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB')")"
note ""

# set up only what is missing: a lent machine may have no internet (scripts/device-run.sh sets it up offline)
if ! "$PY" -c "import hispec, gguf, pytest, transformers" 2>/dev/null; then
  bash scripts/setup.sh test > "$OUT/setup.log" 2>&1 || note "setup: FAIL (see $OUT/setup.log)"
fi

# ---- 1. CUDA-marked tests -----------------------------------------------------------------
[ "${GPU_CHECK_TESTS:-1}" = 1 ] && step cuda-tests 150 "$PY" -m pytest -q -m cuda tests/test_cuda.py -rs

# ---- 2. the default model, bfloat16 ---------------------------------------------------------
cat > "$OUT/prompts.jsonl" <<'EOF'
{"id": "capital", "prompt": "What is the capital of France, and what is it known for?"}
{"id": "code", "prompt": "Write a Python function that returns the n-th Fibonacci number."}
{"id": "story", "prompt": "Tell a short story about a robot learning to paint."}
{"id": "math", "prompt": "A train travels 120 km in 1.5 hours. What is its average speed? Explain."}
EOF
[ "${GPU_CHECK_DEFAULT:-1}" = 1 ] && step bench-default-bf16 150 "${HISPEC[@]}" bench --model default --device cuda --dtype bfloat16 --data "$OUT/prompts.jsonl" \
  --strategies ar,selfspec,hispec,hf --max-new-tokens 128 --warmup 1 --no-plots --no-progress --out "$OUT/bench-default"

# ---- 3. a random model of Llama-3-8B's shape (speed only) ----------------------------------
BIG="$OUT/llama3-8b-shape"
[ "${GPU_CHECK_BIG:-1}" = 1 ] && step make-8b-shape 120 "$PY" - "$BIG" <<'EOF'
"""Random bfloat16 weights (std 0.02) in Llama-3-8B's shape, written layer by layer from the GPU,
with the default model's tokenizer (its ids fit the larger vocabulary)."""
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from hispec.model.load.registry import resolve_model

out = Path(sys.argv[1])
if (out / "config.json").is_file():
    sys.exit(0)
out.mkdir(parents=True, exist_ok=True)
cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
           intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
           max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
           bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
g = torch.Generator(device="cuda").manual_seed(0)
rnd = lambda *shape: (torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()
H, I, V, kv = 4096, 14336, 128256, 8 * 128
save_file({"model.embed_tokens.weight": rnd(V, H), "lm_head.weight": rnd(V, H),
           "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}, str(out / "model-top.safetensors"))
for i in range(32):
    p = f"model.layers.{i}."
    save_file({p + "self_attn.q_proj.weight": rnd(H, H), p + "self_attn.k_proj.weight": rnd(kv, H),
               p + "self_attn.v_proj.weight": rnd(kv, H), p + "self_attn.o_proj.weight": rnd(H, H),
               p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
               p + "mlp.down_proj.weight": rnd(H, I),
               p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)},
              str(out / f"model-{i:02d}.safetensors"))
src = resolve_model("default")
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    if (src / name).is_file():
        shutil.copy(src / name, out / name)
(out / "config.json").write_text(json.dumps(cfg, indent=2))
EOF
BENCH_BIG=(--device cuda --dtype bfloat16 --data "$OUT/prompts.jsonl" --limit 3 --strategies ar,selfspec,hispec
           --max-new-tokens 64 --ignore-eos --no-exits --warmup 1 --no-plots --no-progress)
[ -f "$BIG/config.json" ] && step bench-8b-shape-bf16 180 "${HISPEC[@]}" bench --model "$BIG" "${BENCH_BIG[@]}" --out "$OUT/bench-8b"

# ---- 4. tensor parallelism over NCCL (two or more GPUs) ------------------------------------
if [ "$NGPU" -ge 2 ] && [ "${GPU_CHECK_DEFAULT:-1}" = 1 ]; then
  step tp2-check-default 150 "$PY" -m hispec.distributed.check default --tp 2 --device cuda --dtype bfloat16 \
    --shipped-exits --max-new-tokens 32
  [ -f "$BIG/config.json" ] && step bench-8b-shape-tp2 180 "${HISPEC[@]}" bench --model "$BIG" "${BENCH_BIG[@]}" \
    --tensor-parallel-size 2 --out "$OUT/bench-8b-tp2"
else
  note "$(printf '%-28s %s' tp2-check-default 'SKIP (one GPU: tensor parallelism needs two)')"
fi

# ---- summary ---------------------------------------------------------------------------------
{
  echo ""
  echo "total $(( $(date +%s) - START ))s"
  for b in bench-default bench-8b bench-8b-tp2; do
    log="$OUT/${b/bench-default/bench-default-bf16}.log"
    case $b in bench-8b) log="$OUT/bench-8b-shape-bf16.log";; bench-8b-tp2) log="$OUT/bench-8b-shape-tp2.log";; esac
    [ -f "$log" ] || continue
    echo ""
    echo "-- $b (tail of $log)"
    tail -n 14 "$log"
  done
  if [ -f "$OUT/tp2-check-default.log" ]; then
    echo ""
    echo "-- tp2-check-default"
    grep '^{' "$OUT/tp2-check-default.log" | tail -1
  fi
  echo ""
  echo "-- failures (last lines)"
  grep -l . "$OUT"/cuda-tests.log >/dev/null 2>&1 && tail -n 5 "$OUT/cuda-tests.log"
} | tee -a "$SUMMARY"
echo "gpu-check: summary in $SUMMARY" >&2
