#!/bin/bash
# Pack the Python packages the GPU hosts lack (Ray with Serve, pydantic, fastapi, grpcio-tools for the gRPC stubs...)
# into one xz archive, .whl/site.tar.xz, small enough that the carried tree stays under the device tool's 64 MiB
# (the tracked files are ~32 MB; the wheels themselves are ~48 MB). Run from the project root after
# `bash ../shared/device/wheels.sh grpcio-tools==1.84.0` (that fills .whl/ with wheels); this replaces them with the
# archive (~31 MB, ~3 min on 2 cores). Each device command then begins with:
#   mkdir -p /tmp/site && tar -xJf .whl/site.tar.xz -C /tmp/site; export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
# and carries [".whl"]. Installed with pip (not unzipped) so the Ray binaries keep their executable bits.
set -euo pipefail
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run ../shared/device/wheels.sh first" >&2; exit 1; }
site=$(mktemp -d)
python -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --target "$site" .whl/*.whl
# What Tandem never imports (Ray Data, Tune, Train, RLlib, Ray LLM), byte code, and the Ray binaries' symbols.
rm -rf "$site"/ray/{data,tune,train,rllib,llm}
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
for f in "$site"/ray/_raylet.so "$site"/ray/core/src/ray/gcs/gcs_server "$site"/ray/core/src/ray/raylet/raylet; do
  [[ -f $f ]] && strip --strip-unneeded "$f"
done
tar -cJf "$site.tar.xz" -C "$site" .
rm -rf .whl "$site" && mkdir .whl && mv "$site.tar.xz" .whl/site.tar.xz
ls -l .whl/site.tar.xz
