#!/usr/bin/env bash
# Download SGLang's router (the scale extra: `qflash serve --replicas`) for the offline GPU machine into
# .gpu-router/ (git-ignored); needs PyPI. Its wheel (30.7 MB) is one Rust library with symbols: stripped and in xz it
# is 16.6 MB, which with .gpu's bundle (45 MB) stays under the device's 64 MiB carry (leave .gpu's Triton cache out
# of that call). On the device: carry [".gpu", ".gpu-router"]; tests/run_gpu.sh unpacks it beside the bundle. Its
# Python needs (fastapi, uvicorn, orjson, setproctitle, aiohttp) are in the bundle or on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu-router
PY=${PYTHON:-python3}
PIN=$(grep -o 'sglang-router==[0-9.]*' pyproject.toml | head -1)  # the scale extra's
rm -rf "$OUT" && mkdir -p "$OUT"
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d "$tmp" "$PIN"
"$PY" -m zipfile -e "$tmp"/sglang_router-*.whl "$tmp/site"
strip --strip-unneeded "$tmp"/site/sglang_router/*.so
tar -C "$tmp/site" -cf - . | xz -9 -T0 > "$OUT/sglang-router.tar.xz"
rm -rf "$tmp"
echo "$OUT: $(du -b "$OUT/sglang-router.tar.xz" | cut -f1) bytes"
