#!/usr/bin/env bash
# The test suite, as CI runs it (CPU only; tests/gpu skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
exec ${PYTHON:-python3} -m pytest tests -q -ra --durations=15 "$@"
