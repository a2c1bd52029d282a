#!/usr/bin/env bash
# Runs on the GPU machine, from the checkout, after scripts/device/stage.sh --tests --kernels:
# the batch-1 decode step's ceilings (README: `WIDE_STEP_READS`, `--kept-width`). Processes of
# `wide bench e2e` at s = 0.5 alternate the model (WIDE_STEP_READS=0, with the kept-width row:
# dense on a model of only the kept width) with the step-read measurement at 2 and 4 blocks a
# multiprocessor, ROUNDS rounds (default 2), each process timing dense and wide in turn; then
# one process at the prefill targets' lengths (2048 and 8192 tokens) with the kept-width rows.
# Results (JSON and logs) are packed into $OUT/step-ceiling.tar (without $OUT:
# ./step-ceiling-results.tar) as each process ends, so a run cut off by a time limit
# still returns what it finished; the last lines print each process's decode rows. Exit status
# 1 if any process failed.
#   bash scripts/device/step-ceiling.sh [ROUNDS]
rounds=${1:-2}
case "$rounds" in
    [1-9]) ;;
    *) echo "step-ceiling.sh: ROUNDS must be 1 to 9, not '$rounds'" >&2; exit 2 ;;
esac
# Everything in one tar, rewritten after each process (common.sh).
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
device_setup step-ceiling.sh step-ceiling step-ceiling-results.tar || exit 1
set -u
failed=""
for r in $(seq 1 "$rounds"); do
    for b in 0 2 4; do
        name=e2e-reads$b-r$r
        kw=""
        [ "$b" = 0 ] && kw=--kept-width
        WIDE_STEP_READS=$b .device/wide bench e2e --sparsity 0.5 --prefill-tokens 128 --decode-batches 1 --warmup 1 --iters 3 \
            $kw --out "$R/$name.json" > "$R/$name.log" 2>&1
        rc=$?
        pack
        echo "step-ceiling.sh: $name exit $rc $(date -u +%T)"
        [ "$rc" -eq 0 ] || failed="$failed $name"
    done
done
# The prefill targets' lengths with the kept-width rows (the routed prefill's ceiling).
name=e2e-kept-prefill
.device/wide bench e2e --sparsity 0.5 --prefill-tokens 2048,8192 --decode-batches 1 --warmup 1 --iters 3 --kept-width \
    --out "$R/$name.json" > "$R/$name.log" 2>&1
rc=$?
pack
echo "step-ceiling.sh: $name exit $rc $(date -u +%T)"
[ "$rc" -eq 0 ] || failed="$failed $name"
grep -E "^\| (dense|wide|kept-width).*(prefill|decode)" "$R/$name.log"
for f in "$R"/e2e-reads*.log; do
    echo "== $(basename "$f" .log)"
    grep -E "^\| (dense|wide|kept-width).*decode" "$f"
done
if [ -n "$failed" ]; then echo "step-ceiling.sh: failed:$failed" >&2; exit 1; fi
