#!/usr/bin/env bash
# Set everything up, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test ray gemma  # ray: the Ray Serve replica test (skip it with -m "not ray"); gemma: the second real model
exec "${PYTHON:-python3}" -m pytest -q "$@"
