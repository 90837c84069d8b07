#!/usr/bin/env bash
# The test suite, as CI runs it (CPU only; tests/gpu skip without CUDA). Arguments go to pytest; given
# test paths (`bash scripts/test.sh tests/test_engine.py -x`) run those alone instead of the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then targets=(); break; fi
done
exec ${PYTHON:-python3} -m pytest "${targets[@]}" -q -ra --durations=15 "$@"
