#!/usr/bin/env bash
# Download what `qflash eval` needs on the offline GPU machine (Python 3.12, x86_64) beyond what that
# machine and its SGLang bundle have, into .gpu-eval/ (git-ignored); needs PyPI. On the device:
# carry [".gpu", ".gpu-eval"], then tests/install_eval_deps.sh DIR (tests/run_gpu.sh does it with EVAL_DEPS=1).
# Found by running the tiny local task (tests/data/eval) in a venv of the machine's packages: lm-eval's
# API model path imports datasets (so pandas, multiprocess), sacrebleu and tenacity, not torch.
# huggingface-hub and fsspec come along at the versions datasets 5.2.0 asks for (the machine's may be older;
# these are seen by `qflash eval` only). sacrebleu 2.1.0 is the last without lxml (5 MB); lm-eval's 9 MB wheel is mostly task definitions, so
# only its code and the three gated tasks are kept (the tiny task comes with --include-path).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu-eval
PY=${PYTHON:-python3}
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT" \
  datasets==5.2.0 multiprocess==0.70.19 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0 \
  sacrebleu==2.1.0 portalocker==4.4.2 tabulate==0.10.0 colorama==0.4.6 tenacity==9.2.1 \
  huggingface-hub==1.33.0 fsspec==2026.9.0
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps -d "$tmp" lm-eval==0.4.13
"$PY" -m pip install -q --no-deps --target "$tmp/site" "$tmp"/lm_eval-0.4.13-*.whl
find "$tmp/site/lm_eval/tasks" -mindepth 1 -maxdepth 1 -type d ! -name mmlu_pro ! -name ifeval ! -name gpqa -exec rm -rf {} +
tar czf "$OUT/lm_eval-0.4.13-trimmed.tar.gz" -C "$tmp/site" lm_eval lm_eval-0.4.13.dist-info
rm -rf "$tmp"
echo "$OUT: $(du -cb "$OUT"/* | tail -1 | cut -f1) bytes"
