#!/usr/bin/env bash
# One idempotent set-up for everything the project needs on a CPU machine (developer or CI):
#   - a Python virtual environment outside the checkout, keyed by the pinned versions, holding
#     PyTorch (the libtorch that tch links), the test oracles (transformers, tokenizers) and
#     the CUDA runtime pieces from PyPI (NVRTC for kernel compilation checks);
#   - Debian packages the later stages read (documentation corpus, fonts for plots).
# Prints `export` lines for the build environment when called with --print-env.
# Safe to run again: every step checks what is already there first.
set -euo pipefail

TORCH_VERSION=2.11.0
TRANSFORMERS_VERSION=5.17.0
PY=${WIDE_PYTHON:-python3}
PY_TAG=$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
CACHE_ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/wide
# WIDE_VENV_DIR overrides the place; WIDE_VENV (exported by --print-env for the tests) does not,
# so a shell that evaluated an older set-up's output never installs new pins into its old venv.
VENV=${WIDE_VENV_DIR:-$CACHE_ROOT/venv-$PY_TAG-torch$TORCH_VERSION-transformers$TRANSFORMERS_VERSION}
STAMP="$VENV/.wide-setup-complete"

PIP_PACKAGES=(
  "torch==$TORCH_VERSION"
  "transformers==$TRANSFORMERS_VERSION"
  "safetensors"
  "numpy"
  # CUDA C runtime headers (crt/) that libtorch's CUDA headers include; the shim compiles
  # against them. Same CUDA release as the PyTorch build.
  "nvidia-cuda-crt==13.0.88"
  # Reads TensorBoard event files back in the tests.
  "tensorboard"
)

# Documentation the testbed corpus is built from, and fonts for the plots.
DEBIAN_PACKAGES=(linux-doc-6.1 python3.11-doc fonts-dejavu-core)

log() { echo "[setup] $*" >&2; }

print_env() {
  local torch_lib
  torch_lib=$("$VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__) + "/lib")')
  echo "export WIDE_VENV='$VENV'"
  echo "export LIBTORCH_USE_PYTORCH=1"
  echo "export LIBTORCH_BYPASS_VERSION_CHECK=0"
  echo "export PATH='$VENV/bin':\"\$PATH\""
  local cuda_root
  cuda_root=$("$VENV/bin/python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
  echo "export WIDE_CUDA_INCLUDE='$cuda_root/include'"
  # NVRTC from the PyPI CUDA runtime: kernels compile on CPU-only machines too.
  echo "export LD_LIBRARY_PATH='$torch_lib:$cuda_root/lib'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
}

install_debian() {
  local want=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || want+=("$pkg")
  done
  [ ${#want[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    log "missing Debian packages: ${want[*]} (run this script as root, or install them with apt-get)"
    exit 1
  fi
  log "installing Debian packages: ${want[*]}"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${want[@]}" >&2
}

setup_venv() {
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "${PIP_PACKAGES[*]}" ]; then
    return 0
  fi
  log "creating Python environment at $VENV (first run downloads PyTorch: a few GB)"
  mkdir -p "$CACHE_ROOT"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q "${PIP_PACKAGES[@]}" >&2
  "$VENV/bin/python" -c "import torch, transformers; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__; assert transformers.__version__ == '$TRANSFORMERS_VERSION'" >&2
  echo "${PIP_PACKAGES[*]}" > "$STAMP"
  log "Python environment ready"
}

main() {
  local print=0
  for a in "$@"; do
    case "$a" in
      --print-env) print=1 ;;
      *) echo "usage: setup.sh [--print-env]" >&2; exit 2 ;;
    esac
  done
  install_debian "${DEBIAN_PACKAGES[@]}"
  setup_venv
  if [ $print -eq 1 ]; then print_env; fi
}

main "$@"
