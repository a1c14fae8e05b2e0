#!/usr/bin/env bash
# install_eval_deps.sh DIR: install .gpu-eval/ (tests/fetch_eval_deps.sh) into DIR without network.
# Then PYTHONPATH=DIR for `qflash eval` only (tests/test_eval_gpu.py reads QFLASH_EVAL_SITE=DIR), so the
# server's own imports never see these packages.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: tests/install_eval_deps.sh DIR}
python3 -m pip install -q --no-index --no-deps --target "$DEST" .gpu-eval/*.whl
tar xzf .gpu-eval/lm_eval-0.4.13-trimmed.tar.gz -C "$DEST"
echo "installed lm-eval and its deps into $DEST"
