#!/usr/bin/env bash
# Install Tandem and its test tools into the current Python environment.
# torch comes first and explicitly: a bare `torch` requirement would pull several GB of CUDA wheels,
# so on a machine without torch we install the 2.13.0 CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0 || $PY -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
$PY -m pip install -q -e ".[dev]"
$PY -m router.proto  # gRPC stubs from router/proto/inference.proto, made by the grpc just installed
$PY -c "import torch, transformers, ray, engine, tandem; print(f'tandem ready: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}')"
