#!/usr/bin/env bash
# Runs on the GPU machine, from the checkout, after scripts/device/stage.sh --tests --kernels:
# an A/B of environment settings on the batch-1 decode step. ROUNDS rounds; in each, one
# `wide bench e2e --sparsity 0.5 --prefill-tokens 128 --decode-batches 1 --warmup 1 --iters 3`
# process per setting, in the order given (so each setting's processes interleave with the
# others'), each timing dense and wide in turn. A setting is NAME=VAR=VALUE[,VAR=VALUE...], or
# NAME= for the defaults; extra arguments for every process go in $E2E_ARGS (e.g. --kept-width).
# Results (JSON and logs, NAME-rR.json / .log) are packed into $OUT/env-ab.tar (without $OUT:
# ./env-ab-results.tar; common.sh) after each process, so a run cut off by a time limit still
# returns what it finished; the last lines print each process's decode rows. Exit status 1 if any
# failed. With $AB_ARGS set, each process runs `wide $AB_ARGS --out NAME-rR.json` instead of the
# decode bench (e.g. AB_ARGS="bench kernels --ops up,q --m 16,128").
#   bash scripts/device/env-ab.sh ROUNDS NAME=[VAR=VALUE[,VAR=VALUE...]]...
#   e.g. bash scripts/device/env-ab.sh 2 ffn= both=WIDE_ROUTER_FOLD=both
usage="usage: env-ab.sh ROUNDS NAME=[VAR=VALUE[,VAR=VALUE...]]..."
rounds=${1:-}
case "$rounds" in
    [1-9]) ;;
    *) echo "env-ab.sh: ROUNDS must be 1 to 9, not '$rounds'; $usage" >&2; exit 2 ;;
esac
shift
[ $# -ge 1 ] || { echo "env-ab.sh: no settings; $usage" >&2; exit 2; }
for s in "$@"; do
    name=${s%%=*}
    spec=${s#*=}
    if [ "$name" = "$s" ] || ! [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]]; then
        echo "env-ab.sh: '$s' is not NAME=[VAR=VALUE,...] (NAME of letters, digits, '_', '.', '-'); $usage" >&2
        exit 2
    fi
    if [ -n "$spec" ]; then
        IFS=, read -ra kvs <<< "$spec"
        for kv in "${kvs[@]}"; do
            [[ "$kv" =~ ^[A-Z_][A-Z0-9_]*=.*$ ]] || { echo "env-ab.sh: '$kv' in '$s' is not VAR=VALUE" >&2; exit 2; }
        done
    fi
done
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
device_setup env-ab.sh env-ab env-ab-results.tar || exit 1
set -u
failed=""
for r in $(seq 1 "$rounds"); do
    for s in "$@"; do
        name=${s%%=*}
        spec=${s#*=}
        kvs=()
        [ -n "$spec" ] && IFS=, read -ra kvs <<< "$spec"
        out=$name-r$r
        if [ -n "${AB_ARGS:-}" ]; then
            # shellcheck disable=SC2086  # AB_ARGS is a list of arguments
            env "${kvs[@]}" .device/wide $AB_ARGS --out "$R/$out.json" > "$R/$out.log" 2>&1
        else
            # shellcheck disable=SC2086  # E2E_ARGS is a list of arguments
            env "${kvs[@]}" .device/wide bench e2e --sparsity 0.5 --prefill-tokens 128 --decode-batches 1 --warmup 1 --iters 3 \
                ${E2E_ARGS:-} --out "$R/$out.json" > "$R/$out.log" 2>&1
        fi
        rc=$?
        echo "$spec" > "$R/$out.env"
        pack
        echo "env-ab.sh: $out ($spec) exit $rc $(date -u +%T)"
        [ "$rc" -eq 0 ] || failed="$failed $out"
    done
done
for f in "$R"/*.log; do
    echo "== $(basename "$f" .log) ($(cat "${f%.log}.env"))"
    grep -E "^\| (dense|wide|kept-width).*decode" "$f"
done
if [ -n "$failed" ]; then echo "env-ab.sh: failed:$failed" >&2; exit 1; fi
