#!/usr/bin/env bash
# Everything the H200 checks, in one device call; results and logs land in $OUT. Steps, by variable:
#   TUNE=1                 qflash tune $TUNE_ARGS (rewrites the kernel tables; copies them to $OUT; e.g.
#                          TUNE_ARGS="--rows 16" retunes only the 16-row buckets, and "--rows 16 --gemms NAME" one
#                          W8A8 entry, so the A/B below can follow it)
#   TESTS="pytest args"    default "-m gpu tests" (all GPU tests); TESTS=0 skips. Parsed as shell words, so a
#                          quoted -k works: TESTS="tests/test_kernels_gpu.py -k 'w8a8 and not prefill'"
#   STABLE=0               the tests need no stable-choice checkpoint (conftest.stable_checkpoint): not built. The
#                          quantized-server tests (the losslessness test among them) need it: without this step its
#                          ~1.5 min build falls inside TESTS_TIMEOUT (BENCHMARKS.md, sixty-first session). The
#                          losslessness verdict in one server start, to go before an A/B or a bench in the same call:
#                          TESTS=tests/test_quantized_server_gpu.py::test_speculation_is_the_teacher_forced_argmax
#                          (test_speculation_is_greedy_lossless starts a second, eager server too: 5 min or more)
#   EVAL_DEPS=1            install lm-eval offline for tests/test_eval_gpu.py (carry .gpu-eval too:
#                          tests/fetch_eval_deps.sh makes it here, 15.3 MiB)
#   BENCH_KERNELS=1        qflash bench-kernels $BENCH_KERNELS_ARGS (e.g. --skip-gemms)
#   AB_TREE=.ab            qflash bench --systems qflash $AB_ARGS from another tree (or several: AB_TREE=.ab,.ab2),
#                          then from the checkout, on one machine (a diagnostic: no stock row). Make it with
#                          `git archive REF | tar -x -C .ab` (git-ignored) and carry it too. AB_FIRST=checkout runs
#                          the checkout first: the second server started on a lent machine has run slower
#                          (BENCHMARKS.md, 2026-12-04), so alternate. AB_CHECKOUT=0 runs only the trees: with
#                          BENCH=sglang-bf16,qflash after it, the checkout's row comes from that bench, on one machine
#   BENCH=sys1,sys2,...    qflash bench --systems ... $BENCH_ARGS (e.g. BENCH_ARGS="--profile-steps 0")
#   PROFILE="args"         qflash profile --out ... args (e.g. PROFILE="--prefill --prompt-len 64,2048 --steps 3": the steps
#                          of a fresh prompt's first token, host spans beside the GPU's); its traces come back too, each
#                          under 12 MB (a call brings back at most 8 files: keep the lengths few)
#   SWITCH_AB=sw1,sw2      tests/switch_ab.py --switches ... $SWITCH_AB_ARGS: the test plugin's run-time switches
#                          (one_cycle_per_step, plan_stream_off, ...) against the default, on one server
#   DEADLINE=560          seconds of the call the steps may take together (default 560 of the device's 600): each
#                          step's timeout is cut to what is left, so the results are packed and the Triton cache
#                          goes back even when the steps ask for more (a call the device stops returns nothing)
# Device tool: carry [".gpu"] (a copy of ../shared/device, the offline SGLang bundle, and the Triton and JIT caches an
# earlier call returned); bash tests/run_gpu.sh. With ".gpu-router" (tests/fetch_router.sh) carried too, SGLang's router is
# installed beside the bundle (the replica tests and `--replicas` in the bench need it).
set -uo pipefail
# The device tool brings back at most 8 files: everything is staged, then packed into $OUT/run.tgz, with the
# benchmark table beside it.
FINAL=${OUT:-/tmp/qflash-out}
RUN=$(mktemp -d /tmp/qflash-run.XXXX)  # this call's own: a warm machine keeps an earlier call's files
OUT=$RUN/stage
status=0  # non-zero at the end if the tests or a benchmark failed
mkdir -p "$OUT" "$FINAL"
DEADLINE=${DEADLINE:-560}
within() {  # a step's timeout in seconds: what it asks for, at most what is left before DEADLINE (at least 1)
  local left=$((DEADLINE - SECONDS))
  echo $(( $1 < left ? $1 : (left > 1 ? left : 1) ))
}
pack() {  # after each step: a call stopped at its time limit still brings back what the steps before it made
  tar czf "$FINAL/run.tgz" -C "$OUT" .
  cp "$OUT/results.md" "$FINAL/" 2>/dev/null
}
pkill -f sglang.launch_server  # a server an earlier call left on a machine still warm holds the tests' ports
bash .gpu/install.sh /tmp/site >/dev/null && export PYTHONPATH=/tmp/site
[ -f .gpu-router/sglang-router.tar.xz ] && tar -xJf .gpu-router/sglang-router.tar.xz -C /tmp/site
# A Triton cache from an earlier call (its $OUT/triton-cache.tar.xz, copied into .gpu/) spares each server start its
# kernel compiles (45 s of 111 variants on a fresh machine, BENCHMARKS.md); this machine's goes back at the end.
[ -f .gpu/triton-cache.tar.xz ] && mkdir -p ~/.triton && tar -xJf .gpu/triton-cache.tar.xz -C ~/.triton
# The same for the nvcc-built JIT kernels of SGLang (TVM-FFI) and flashinfer, under ~/.cache, if the machine builds
# any: the drafter's graphs took 22 s to capture on a fresh machine and 1.6 s on a warm one (BENCHMARKS.md,
# 2026-12-05); the sizes printed at the end say what it built. This machine's go back too.
JIT_CACHES="tvm-ffi flashinfer"
[ -f .gpu/jit-cache.tar.xz ] && mkdir -p ~/.cache && tar -xJf .gpu/jit-cache.tar.xz -C ~/.cache
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export QFLASH_CACHE=/tmp/qflash-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ "${TUNE:-0}" = 1 ]; then
  # Its hundreds of candidate compiles, most of which no server runs, go to a cache of their own: in ~/.triton they
  # grew the cache that goes back past the device's 16 MiB a file, and no call on that machine brought one back
  # (BENCHMARKS.md, sixtieth session). The tests after it compile the table's configs again.
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR=$RUN/tune-triton timeout "$(within "${TUNE_TIMEOUT:-330}")" python3 -m qflash.server.cli tune \
    ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1 || status=1
  grep -E "wrote|tuned in" "$OUT/tune.log"
  cp kernels/w8a8_gemm.py kernels/w8a16_gemm.py kernels/w8a16_argmax.py kernels/w4_draft_pick.py "$OUT/"
  pack
fi

if [ "${EVAL_DEPS:-0}" = 1 ]; then
  bash tests/install_eval_deps.sh /tmp/eval-site && export QFLASH_EVAL_SITE=/tmp/eval-site
fi

if [ "${TESTS:-}" != 0 ]; then
  if [ "${STABLE:-1}" != 0 ]; then
    # the stable-choice checkpoint the GPU tests serve (conftest.stable_checkpoint), built here to show its time
    start=$SECONDS
    (cd tests && timeout "$(within 300)" python3 -c "from conftest import stable_checkpoint; stable_checkpoint()") \
      > "$OUT/make-dummy.log" 2>&1 || status=1
    echo "make-dummy --stable: $((SECONDS - start)) s"
  fi
  eval "pytest_args=(${TESTS:--m gpu tests})"
  timeout "$(within "${TESTS_TIMEOUT:-420}")" python3 -m pytest "${pytest_args[@]}" -v -s -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "FAILED|ERROR|ready after|passed|failed|: 4[0-9][0-9] |losslessness|accept length|argmax =|stable checkpoint|drafter KV|soak:|^prompt [0-9]+:|qflash_tiny|hooks applied|refusing|deselected|no tests ran|prompts over cached" "$OUT/gpu-tests.log"
  pkill -f sglang.launch_server; sleep 3
  find /tmp/pytest-of-* "$QFLASH_CACHE/logs" \( -name '*.log' -o -name '*.out' \) -print0 2>/dev/null | tar czf "$OUT/server-logs.tgz" --null -T - 2>/dev/null
  pack
fi

if [ "${BENCH_KERNELS:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "$(within "${BENCH_KERNELS_TIMEOUT:-240}")" python3 -m qflash.server.cli bench-kernels --out $RUN/kbench ${BENCH_KERNELS_ARGS:-} > $RUN/kbench.log 2>&1 || status=1
  tail -n 20 $RUN/kbench.log
  cp $RUN/kbench/kernels.md $RUN/kbench/kernels.json "$OUT/" 2>/dev/null
fi

if [ -n "${AB_TREE:-}" ]; then
  read -ra refs <<< "${AB_TREE//,/ }"
  order=("${refs[@]}" .)
  [ "${AB_FIRST:-ref}" = checkout ] && order=(. "${refs[@]}")
  [ "${AB_CHECKOUT:-1}" = 0 ] && order=("${refs[@]}")
  for tree in "${order[@]}"; do
    side=$([ "$tree" = . ] && echo checkout || echo "ref-${tree#.}")
    python3 -m pip install -q --no-deps --no-build-isolation -e "$tree" || exit 1
    # shellcheck disable=SC2086
    timeout "$(within "${AB_TIMEOUT:-250}")" python3 -m qflash.server.cli bench --systems qflash --out "$RUN/ab-$side" ${AB_ARGS:-} \
      > "$RUN/ab-$side.log" 2>&1 || status=1
    tail -n 8 "$RUN/ab-$side/results.md"
    cp "$RUN/ab-$side/run.json" "$OUT/ab-$side.json" 2>/dev/null
    for f in $RUN/ab-"$side"/profiles/*.md; do [ -e "$f" ] && cp "$f" "$OUT/ab-$side-$(basename "$f")"; done
    tar czf "$OUT/ab-$side-logs.tgz" -C "$RUN/ab-$side" logs 2>/dev/null  # the servers' start-up (graph captures)
    pack  # each tree's results survive a call that the device's time limit stops during the next
  done
  if [ "${order[-1]}" != . ]; then  # the steps below run the checkout
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  fi
fi

if [ -n "${BENCH:-}" ]; then
  # shellcheck disable=SC2086
  timeout "$(within "${BENCH_TIMEOUT:-480}")" python3 -m qflash.server.cli bench --systems "$BENCH" --out $RUN/bench ${BENCH_ARGS:-} > $RUN/bench.log 2>&1 || status=1
  tail -n 40 $RUN/bench.log
  pkill -f sglang.launch_server
  cp $RUN/bench/results.json $RUN/bench/results.md $RUN/bench/run.json $RUN/bench/latency.png $RUN/bench/workloads.png "$OUT/" 2>/dev/null
  cp $RUN/bench/profiles/*.md $RUN/bench/profiles/*.json "$OUT/" 2>/dev/null
  for d in $RUN/bench/profiles/traces/*/; do cp "$d"*.trace.json.gz "$OUT/$(basename "$d").trace.json.gz" 2>/dev/null; done
  grep -h -A3 "^Per step" $RUN/bench/profiles/*.md 2>/dev/null | head -40
  grep -h "qflash graphs\|qflash:" $RUN/bench/logs/*.log 2>/dev/null | sort | uniq -c | head -30
  tar czf "$OUT/bench-logs.tgz" -C $RUN/bench logs 2>/dev/null
  pack
fi
if [ -n "${PROFILE:-}" ]; then
  # shellcheck disable=SC2086
  timeout "$(within "${PROFILE_TIMEOUT:-300}")" python3 -m qflash.server.cli profile --out $RUN/profile $PROFILE \
    > $RUN/profile.log 2>&1 || status=1
  tail -n 5 $RUN/profile.log
  pkill -f sglang.launch_server
  for f in $RUN/profile/*.md $RUN/profile/*.json; do [ -e "$f" ] && cp "$f" "$OUT/profile-$(basename "$f")"; done
  # each trace beside run.tgz (kernel by kernel, to read here), where it keeps under the device's 16 MB a file
  for d in $RUN/profile/traces/*/; do
    for f in "$d"*.trace.json.gz; do
      [ -e "$f" ] && [ "$(stat -c %s "$f")" -lt 12000000 ] && cp "$f" "$FINAL/profile-$(basename "$d").trace.json.gz"
    done
  done
  grep -h -A3 "^Per step" $RUN/profile/*.md 2>/dev/null | head -20
  pack
fi
if [ -n "${SWITCH_AB:-}" ]; then
  # shellcheck disable=SC2086
  timeout "$(within "${SWITCH_AB_TIMEOUT:-300}")" python3 tests/switch_ab.py --switches "$SWITCH_AB" --out $RUN/switch-ab ${SWITCH_AB_ARGS:-} \
    > $RUN/switch-ab.log 2>&1 || status=1
  tail -n 20 $RUN/switch-ab.log
  cp $RUN/switch-ab/ab.md $RUN/switch-ab/ab.json "$OUT/" 2>/dev/null
  cp $RUN/switch-ab/*.log "$OUT/" 2>/dev/null
  pkill -f sglang.launch_server
fi
pack
# Each cache is packed beside $FINAL and then moved in, so a call stopped while packing brings back no empty one.
[ -d ~/.triton/cache ] && tar -C ~/.triton -cf - cache | xz -6 -T0 > "$RUN/triton-cache.tar.xz" \
  && mv "$RUN/triton-cache.tar.xz" "$FINAL/"
jit=$(cd ~/.cache 2>/dev/null && for d in $JIT_CACHES; do [ -d "$d" ] && echo "$d"; done)
if [ -n "$jit" ]; then
  (cd ~/.cache && du -sh $jit)
  # shellcheck disable=SC2086
  tar -C ~/.cache -cf - $jit | xz -6 -T0 > "$RUN/jit-cache.tar.xz" && mv "$RUN/jit-cache.tar.xz" "$FINAL/"
fi
exit $status
