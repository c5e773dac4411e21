#!/usr/bin/env bash
# BENCHMARKS.md's peer table: hispec (ar in float32 and on other weights, selfspec, hispec) against
# llama.cpp (Q4_1 / F16 / F32 GGUFs of the same weights) and vLLM CPU (float32), on held-out
# Spec-Bench prompts, greedy, interleaved per prompt, at batch 1 and batch 16 (--threads threads).
# Needs the peers (scripts/install-peers.sh; venvs in $HISPEC_PEERS) and a quiet machine.
#
#   scripts/bench-peers.sh [SPEC_BENCH_QUESTION_JSONL] [OUT]
# Environment: PROMPTS (30), NEW_TOKENS (64), THREADS (2),
#   AR_PEERS: hispec ar on other weights, each in its own process (default, when hispec has --quantize:
#     ar:quantize=native,ar:quantize=int8; the strategies themselves then run float32 with --quantize none)
#   PEERS: the other engines at batch 1 (default llama.cpp,vllm); BATCH_PEERS at batch 16 (default vllm)
set -euo pipefail

DATA=${1:-../shared/data/spec_bench/question.jsonl}
OUT=${2:-bench-peers}
PROMPTS=${PROMPTS:-30}
NEW_TOKENS=${NEW_TOKENS:-64}
THREADS=${THREADS:-2}
if hispec bench --help | grep -q -- "--quantize"; then
    MAIN=(--quantize none)  # ar / selfspec / hispec on float32 weights, the reference of the agreement columns
    AR_PEERS=${AR_PEERS-ar:quantize=native,ar:quantize=int8}
else
    MAIN=()
    AR_PEERS=${AR_PEERS-}
fi
PEERS=${PEERS:-llama.cpp,vllm}
BATCH_PEERS=${BATCH_PEERS:-vllm}
join() { local IFS=,; echo "$*"; }  # join A B: "A,B" (empty words dropped)

mkdir -p "$OUT"
# held out: Spec-Bench is not in the exit heads' training data, and lines 3, 19, 35, ... are disjoint
# from the tuner's calibration prompts (NR % 24 == 13) and the heads' evaluation prompts (NR % 10 == 6)
awk 'NR % 16 == 3' "$DATA" > "$OUT/heldout.jsonl"
common=(--data "$OUT/heldout.jsonl" --limit "$PROMPTS" --max-new-tokens "$NEW_TOKENS" --threads "$THREADS" --no-progress
        ${MAIN[@]+"${MAIN[@]}"})

hispec bench "${common[@]}" --strategies ar,selfspec,hispec --peers "$(join $AR_PEERS $PEERS)" --out "$OUT/batch1"
hispec bench "${common[@]}" --strategies ar --peers "$(join $AR_PEERS $BATCH_PEERS)" --batch-sizes 1,16 \
    --out "$OUT/batch16"
python -m hispec.bench.report "$OUT/batch1/results.json" --peer-table --batch "$OUT/batch16/batch_results.json" \
    | tee "$OUT/peer-table.md"
