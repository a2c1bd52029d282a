#!/usr/bin/env bash
# Runs on the GPU machine, from the checkout, after scripts/device/stage.sh --tests --kernels:
# the kernel and inference GPU tests, the issue's e2e rows in two processes (with the prefills
# also timed interleaved, dense and routed in turn), the full kernel
# grid and compute-sanitizer's memcheck on small shapes of every op, each result packed into
# $OUT/res.tar (or ./check-results.tar without $OUT) as soon as it exists, so a run cut off by a
# time limit still returns what it finished. Every step runs even if one before it failed; the
# exit status is 1 if any step failed (each step's line says which).
#   bash scripts/device/check.sh [--no-grid]
grid=1
case "${1:-}" in
    "") ;;
    --no-grid) grid=0 ;;
    *) echo "check.sh: unknown argument '$1' (takes --no-grid or nothing)" >&2; exit 2 ;;
esac
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
device_setup check.sh res check-results.tar || exit 1
set -u
failed=""
# name, command...: stdout and stderr to name.log, the exit status appended. With $skip_if set,
# a failure whose log contains that text is reported as skipped (the step cannot run here).
run() {
    local name=$1 rc; shift
    "$@" > "$R/$name.log" 2>&1
    rc=$?
    echo "rc=$rc" >> "$R/$name.log"
    if [ "$rc" -eq 0 ]; then
        echo "check.sh: $name ok"
    elif [ -n "${skip_if:-}" ] && grep -qF "$skip_if" "$R/$name.log"; then
        echo "check.sh: $name skipped ($skip_if; see res/$name.log)"
    else
        echo "check.sh: $name FAILED (exit $rc; see res/$name.log)"
        failed="$failed $name"
    fi
    pack
}
# The SM clock, power and temperature every 200 ms for the whole run (clocks.csv), so that a
# figure can be read against the clock it ran at (dense's full-FLOP prefills draw the most power).
smi=""
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv -lms 200 > "$R/clocks.csv" 2>&1 &
    smi=$!
fi
date -u > "$R/start.txt"
run test-cuda_kernels .device/test-cuda_kernels --test-threads=1
run test-cuda_infer .device/test-cuda_infer --test-threads=1
for r in 1 2; do
    run "e2e-r$r" .device/wide bench e2e --sparsity 0.5 --prefill-tokens 2048,8192 --decode-batches 1,16 --interleave --out "$R/e2e-r$r.json"
done
if [ "$grid" = 1 ]; then
    run kernels .device/wide bench kernels --ops up,gate_up,down,q,o,attn_decode,attn_prefill --out "$R/kernels.json"
fi
# Memcheck on small shapes of every op and path (the issue's "compute-sanitizer memcheck clean on
# one run of each op"), last so that it costs the timings nothing. A runtime whose
# compute-sanitizer does not support the device (gVisor) is reported as skipped, not failed.
# A limit of 300 s (exit 124 from timeout when it is reached).
cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null)
if [ -n "$cs" ]; then
    skip_if="Device not supported" run memcheck timeout 300 "$cs" --tool memcheck --error-exitcode 1 .device/test-cuda_kernels sanitizer_small_all_ops --test-threads=1
else
    echo "check.sh: memcheck skipped (no compute-sanitizer on this machine)"
fi
date -u > "$R/end.txt"
if [ -n "$smi" ]; then kill "$smi" 2> /dev/null; wait "$smi" 2> /dev/null; fi
pack
if [ -n "$failed" ]; then echo "check.sh: failed:$failed" >&2; exit 1; fi
