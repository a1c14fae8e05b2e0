#!/usr/bin/env bash
# Everything the H200 checks, in one device call: install, the GPU tests, the benchmark. Results to $OUT.
#   device run, carry [".gpu"]:  [BENCH=baseline,sglang-bf16,...] [TESTS=0] bash tests/run_gpu.sh
# .gpu/ is a copy of ../shared/device (the offline SGLang bundle).
set -uo pipefail
OUT=${OUT:-/tmp/qflash-out}
mkdir -p "$OUT"
bash .gpu/install.sh /tmp/site >/dev/null && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export QFLASH_CACHE=/tmp/qflash-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu tests -v -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|start-up|passed|failed|: 4[0-9][0-9] "
  pkill -f sglang.launch_server; sleep 3
  cp "$QFLASH_CACHE"/logs/server-30000.log "$OUT/" 2>/dev/null
fi

if [ -n "${BENCH:-}" ]; then
  timeout "${BENCH_TIMEOUT:-480}" python3 -m qflash.server.cli bench --systems "$BENCH" --out /tmp/bench 2>&1 | tail -n 40
  pkill -f sglang.launch_server
  cp /tmp/bench/results.json /tmp/bench/results.md /tmp/bench/run.json /tmp/bench/latency.png "$OUT/" 2>/dev/null
  tar czf "$OUT/bench-logs.tgz" -C /tmp/bench logs 2>/dev/null
fi
