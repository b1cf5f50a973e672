#!/usr/bin/env bash
# Wheels that benchmarks/gpu_check.py needs on a GPU machine without network (Python 3.12, torch +
# CUDA 13, no pyzmq/msgspec/NIXL), into .whl/ (git-ignored). Keep the copied tree small (64 MiB):
# nixl-cu13 is 56 MiB: its wheel is repacked without `nixl_ep_cu13` (NIXL's
# expert-parallel kernels for three torch versions, 94 MB unpacked, never imported by kvpool) and
# UCX's perftest library, which makes it 28 MiB.
#
#   bash benchmarks/gpu_wheels.sh
#   then, on the GPU machine (with .whl/ copied there):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_check.py --out $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
NIXL=1.5.1
rm -rf .whl && mkdir -p .whl
py=${PYTHON:-python3}
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pyzmq msgspec "nixl==$NIXL" "nixl-cu13==$NIXL"
wheel=$(ls .whl/nixl_cu13-*.whl)
work=$(mktemp -d)
(cd "$work" && unzip -q "$OLDPWD/$wheel" && rm -rf nixl_ep_cu13 nixl_cu13.libs/ucx/libucx_perftest_cuda.so.* \
  && grep -v '^nixl_ep_cu13/\|libucx_perftest_cuda' nixl_cu13-$NIXL.dist-info/RECORD > RECORD.new \
  && mv RECORD.new nixl_cu13-$NIXL.dist-info/RECORD && rm "$OLDPWD/$wheel" && zip -q -r -9 "$OLDPWD/$wheel" .)
rm -rf "$work"
du -ch .whl/* | tail -1
