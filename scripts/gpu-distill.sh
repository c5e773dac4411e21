#!/usr/bin/env bash
# Distil exit blocks for the default model on one GPU, in the shipped format (manifest + safetensors).
#   bash scripts/gpu-distill.sh          # under 8 minutes on one GPU; prints a summary at the end
# Steps (each under its own time limit; the exit pipeline of hispec/train, the same commands as on CPU):
#   1. data, two folders: teacher passes over the records' replies ($OUT/teacher, TEACHER_SECONDS;
#      ~7,000 positions/s on an H200) and the model's own greedy continuations of their prompts
#      ($OUT/own, SELF_SECONDS; the engine continues them, then one teacher pass per batch). Both keep
#      the states entering the exit layers and the final layer's top-32 (hispec collect-exits --mode
#      teacher / self; each stops itself after its seconds, keeping what it has). On-policy data is
#      what the exits see at inference, but on a GPU the engine makes it at only ~270 positions/s
#      (measured 2026-12-04: batches of 128 at ~0.6 s a step), hence the split.
#   2. distillation of a block per exit layer, bfloat16 autocast on the GPU (hispec distill-exits),
#      written with the kept exits (KEEP, default the shipped ones) into $GPU_DISTILL_OUT/exits
#   3. the check: the written exits load with the model, and selfspec / hispec give ar's tokens
# Settings (environment; defaults for the default model on one GPU):
#   GPU_DISTILL_OUT (gpu-distill-out)  MODEL (default)  DEVICE (cuda)  LAYERS (4,16)
#   DATA ("sharegpt humaneval": pip install 'hispec[bench]'; records with replies)
#   HOLDOUT (none: the Spec-Bench file you evaluate on)
#   TEACHER_SECONDS (150)  SELF_SECONDS (60)  MAX_NEW_TOKENS (128)  BATCH_SIZE (32: prompts continued together)
#   TEACHER_BATCH_TOKENS (16384)  VOCAB (8192)  EPOCHS (4)  BATCH_TOKENS (16384)  LR (3e-3)
#   KEEP (hispec/exits/smollm2-135m-instruct; empty: none)  CHECK_TOKENS (48)
#   time limits: each collection its seconds + 45, DISTILL_SECONDS (120), CHECK_SECONDS (60): 8 minutes
#   in all. Measured on an H200 (446k teacher positions, layers 4 and 16): 4 epochs at lr 3e-3 took
#   ~35 s and reached held-out top-1 0.236 / 0.326, 1 epoch at 1e-3 0.195 / 0.249.
# The collection resumes: run the script again to collect more and train afresh on all of it.
# Then, on the CPU the exits are meant for: hispec tune --model default --exits $GPU_DISTILL_OUT/exits ...
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_DISTILL_OUT:-gpu-distill-out}
MODEL=${MODEL:-default}
DEVICE=${DEVICE:-cuda}
LAYERS=${LAYERS:-4,16}
DATA=${DATA:-sharegpt humaneval}
HOLDOUT=${HOLDOUT:-}
TEACHER_SECONDS=${TEACHER_SECONDS:-150}
SELF_SECONDS=${SELF_SECONDS:-60}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}
BATCH_SIZE=${BATCH_SIZE:-32}
TEACHER_BATCH_TOKENS=${TEACHER_BATCH_TOKENS:-16384}
VOCAB=${VOCAB:-8192}
EPOCHS=${EPOCHS:-4}
BATCH_TOKENS=${BATCH_TOKENS:-16384}
LR=${LR:-3e-3}
KEEP=${KEEP-hispec/exits/smollm2-135m-instruct}
CHECK_TOKENS=${CHECK_TOKENS:-48}
CHECK_SECONDS=${CHECK_SECONDS:-60}
DISTILL_SECONDS=${DISTILL_SECONDS:-120}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
source scripts/steps.sh  # HISPEC (this checkout's CLI), note, step


if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu-distill: no CUDA device visible to torch (DEVICE=cpu runs the same steps on the CPU, slowly)" >&2
  exit 2
fi
note "gpu-distill $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), device $DEVICE"
[ "$DEVICE" = cuda ] && note "$("$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}')")"

read -r -a DATA_ARGS <<< "$DATA"
HOLDOUT_ARGS=(); [ -n "$HOLDOUT" ] && HOLDOUT_ARGS=(--holdout $HOLDOUT)
KEEP_ARGS=(); [ -n "$KEEP" ] && KEEP_ARGS=(--keep "$KEEP")
# the final state too (layer count): free to keep, and what a block-final exit would read
N_LAYERS=$("$PY" -c "import json, sys; from hispec.model.load.registry import resolve_model; \
print(json.loads((resolve_model(sys.argv[1]) / 'config.json').read_text())['num_hidden_layers'])" "$MODEL") || exit 2

# ---- 1. data: teacher passes over the replies, then the model's own continuations ------------------
COLLECT=("${HISPEC[@]}" collect-exits --model "$MODEL" --device "$DEVICE" --quantize none --layers "$LAYERS,$N_LAYERS"
         --data "${DATA_ARGS[@]}" "${HOLDOUT_ARGS[@]}" --batch-tokens "$TEACHER_BATCH_TOKENS")
step collect-teacher $(( TEACHER_SECONDS + 45 )) "${COLLECT[@]}" --mode teacher --out "$OUT/teacher" \
  --max-seconds "$TEACHER_SECONDS" || exit 1
FOLDERS=("$OUT/teacher")
if [ "$SELF_SECONDS" -gt 0 ]; then
  step collect-self $(( SELF_SECONDS + 45 )) "${COLLECT[@]}" --mode self --out "$OUT/own" \
    --max-new-tokens "$MAX_NEW_TOKENS" --batch-size "$BATCH_SIZE" --max-seconds "$SELF_SECONDS" && FOLDERS+=("$OUT/own")
fi

# ---- 2. distillation -----------------------------------------------------------------------------
step distill "$DISTILL_SECONDS" "${HISPEC[@]}" distill-exits --model "$MODEL" --device "$DEVICE" --quantize none --data "${FOLDERS[@]}" --layers "$LAYERS" \
  --design block --init zero --vocab "$VOCAB" --epochs "$EPOCHS" --batch-tokens "$BATCH_TOKENS" --lr "$LR" \
  --precision auto --out "$OUT/exits" --work "$OUT/work" "${KEEP_ARGS[@]}" || exit 1

# ---- 3. the written exits load and decode losslessly ---------------------------------------------
step check "$CHECK_SECONDS" "$PY" - "$MODEL" "$DEVICE" "$OUT/exits" "$CHECK_TOKENS" <<'EOF' || exit 1
"""The exits load with the model (identity checked), and greedy selfspec / hispec from the new
exit layers give exactly ar's tokens."""
import sys

from hispec.config import SamplingParams, SpecConfig
from hispec.generate import Generator
from hispec.model.exits import read_manifest

model, device, exits, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
gen = Generator.from_pretrained(model, device=device, exits=exits, progress=False)
manifest = read_manifest(exits)
n = gen.model.num_layers
params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
prompts = ["What is the capital of France, and what is it known for?",
           "Write a Python function that returns the n-th Fibonacci number."]
for L in sorted(int(x) for x in manifest.training["per_layer"]):
    deeper = [d for d in sorted(gen.model.exits) if d > L] or [n - 1]
    specs = {"selfspec": SpecConfig(draft_layer=L, verify_layer=n, num_draft=3, num_layers=n),
             "hispec": SpecConfig(draft_layer=L, verify_layer=max(deeper), num_draft=3, window=3, num_layers=n)}
    for p in prompts:
        want = gen.generate(p, params, "ar").token_ids
        for name, spec in specs.items():
            got = gen.generate(p, params, name, spec=spec).token_ids
            assert got == want, f"{name} from layer {L} differs from ar on {p!r}"
    a = manifest.agreement[str(L)]
    print(f"layer {L} ({gen.model.exits[L].kind}): selfspec and hispec equal ar; held-out top-1 "
          f"{a['top1_before']:.3f} -> {a['top1_after']:.3f} on {a['heldout_positions']} positions")
EOF

# ---- summary -------------------------------------------------------------------------------------
{
  echo ""
  echo "total $(( $(date +%s) - START ))s"
  for c in teacher self; do echo "-- data ($c): $(grep -h 'positions/s' "$OUT/collect-$c.log" 2>/dev/null | tail -1)"; done
  echo "-- exits: $(grep -h '^wrote' "$OUT/distill.log" | tail -1)"
  echo "-- check:"
  cat "$OUT/check.log"
} | tee -a "$SUMMARY"
echo "gpu-distill: exits in $OUT/exits, summary in $SUMMARY" >&2
