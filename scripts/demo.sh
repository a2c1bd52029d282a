#!/usr/bin/env bash
# The main job on a fresh machine: set up (idempotent), build, and run `wide demo` on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# Assigned first: a failing set-up stops here (an exit status inside eval's argument is lost).
setup_env=$(bash scripts/setup.sh --print-env)
eval "$setup_env"
cargo build --release --bin wide
echo "[demo] set-up and build took $(( $(date +%s) - start )) s" >&2
exec ./target/release/wide demo "$@"
