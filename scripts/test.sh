#!/usr/bin/env bash
# Every test, on CPU: set up (idempotent), then the whole workspace's unit and end-to-end
# tests, the oracle tests against Python transformers included. GPU tests are behind the
# `cuda-tests` feature and run on the GPU machine (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
# Assigned first: a failing set-up stops here (an exit status inside eval's argument is lost).
setup_env=$(bash scripts/setup.sh --print-env)
eval "$setup_env"
exec cargo test --release --workspace "$@"
