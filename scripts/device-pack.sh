#!/usr/bin/env bash
# Pack, here, what scripts/device-run.sh needs on a lent GPU machine that cannot reach the internet:
#   .devpack/a  (call 1, <= 64 MiB with the checkout): the gguf wheel, the first half of the default
#               model's GGUF, the training prompts with replies (gzip JSONL)
#   .devpack/b  (call 2): the second half, its checksum, the Spec-Bench file to hold out
# The folder is listed in .git/info/exclude (never committed, never in a package).
#   bash scripts/device-pack.sh [SPEC_BENCH_QUESTIONS]   # needs: pip install 'hispec[bench]'
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
HOLDOUT=${1:-../shared/data/spec_bench/question.jsonl}
grep -qx "/.devpack/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.devpack/" >> .git/info/exclude; }
rm -rf .devpack && mkdir -p .devpack/a/whl .devpack/b
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .devpack/a/whl "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
"$PY" - .devpack/a/train.jsonl.gz <<'EOF'
"""ShareGPT's first exchanges and HumanEval, with replies, cut to what a teacher pass reads (512 tokens)."""
import gzip, json, sys
from hispec.train.sources import NAMED
with gzip.open(sys.argv[1], "wt", encoding="utf-8") as f:
    for name, limit in (("sharegpt", 12000), ("humaneval", None)):
        for r in NAMED[name](limit, 0):
            f.write(json.dumps({"prompt": r.prompt[:2000], "response": (r.response or "")[:3000]}) + "\n")
EOF
GGUF=$("$PY" -c "from hispec.model.load.gguf_convert import default_gguf_path as p; print(p())")
split -n 2 -d "$GGUF" .devpack/gguf. && mv .devpack/gguf.00 .devpack/a/ && mv .devpack/gguf.01 .devpack/b/
sha256sum "$GGUF" | cut -d' ' -f1 > .devpack/b/gguf.sha256
[ -f "$HOLDOUT" ] && cp "$HOLDOUT" .devpack/b/holdout.jsonl
du -sh .devpack/a .devpack/b
