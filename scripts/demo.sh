#!/usr/bin/env bash
# The main job on a fresh machine: set up (idempotent), build, and run `wide demo` on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
eval "$(bash scripts/setup.sh --print-env)"
cargo build --release --bin wide
echo "[demo] set-up and build took $(( $(date +%s) - start )) s" >&2
exec ./target/release/wide demo "$@"
