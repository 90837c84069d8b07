#!/usr/bin/env bash
# Repack .whl/ (filled by ../shared/device/wheels.sh) into one .whl/wheels.tar.xz that fits the device call's carry.
# Ray 2.60's trimmed wheel alone is 42.5 MB deflated, and the tracked tree ~22 MB, against a 64 MiB carry; stored
# uncompressed and xz'd together the wheels take ~31 MB. On the device, begin the command with the unpack line below.
#
#     bash ../shared/device/wheels.sh grpcio-tools==1.84.0 && bash scripts/pack_device_wheels.sh
set -euo pipefail
cd .whl
ls ./*.whl >/dev/null  # nothing to pack: run wheels.sh first
tmp=$(mktemp -d)
cp ./*.whl "$tmp"/
python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
for src in glob.glob(os.path.join(sys.argv[1], "ray-*.whl")):  # deflate -> stored, so xz sees the raw binaries
    out = src + ".stored"
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            info.compress_type = zipfile.ZIP_STORED
            zo.writestr(info, zi.read(info.filename))
    os.replace(out, src)
PY
(cd "$tmp" && tar cf - ./*.whl) | xz -T0 -9 > wheels.tar.xz
rm -rf "$tmp" ./*.whl
du -sh wheels.tar.xz
echo 'On the device, begin with:'
echo 'mkdir -p /tmp/wh && tar xJf .whl/wheels.tar.xz -C /tmp/wh && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/wh/*.whl && export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH || exit 1; rm -f ~/.ray/auth_token'
