#!/usr/bin/env bash
# Builds the release binary (and the GPU test binaries, tests/cuda*.rs, with --tests) here, strips them and
# stages them in .device/ (git-ignored) with env.sh, for the device tool to carry; --kernels
# also compiles every CUDA kernel for the H200 (sm_90 machine code, `wide kernels precompile`)
# into .device/kernels, which env.sh then names as the kernel cache (no compiling there):
#   scripts/device/stage.sh [--tests] [--kernels] [extra files...]
#   device run, carry [".device"], command ". .device/env.sh && .device/wide ..."
# The tool returns at most 8 files from $OUT: a run script writes its results elsewhere and packs
# them into one archive there (after every stage, so a timed-out run still returns what it did).
# WIDE_STAGE_DIR=.device-x stages into another ignored folder (two stagings side by side);
# CARGO_TARGET_DIR is honoured.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
# Assigned first: a failing set-up stops here (an exit status inside eval's argument is lost).
setup_env=$(bash scripts/setup.sh --print-env)
eval "$setup_env"
tests=0
kernels=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests=1; shift ;;
    --kernels) kernels=1; shift ;;
    *) break ;;
  esac
done
S=${WIDE_STAGE_DIR:-.device}
# The folder is wiped below: only a .device* folder of the checkout that git does not track.
case "$S" in
  .device*) ;;
  *) echo "stage.sh: WIDE_STAGE_DIR must name a .device* folder of the checkout, not '$S'" >&2; exit 2 ;;
esac
if [[ "$S" == */* ]] || [ -n "$(git ls-files -- "$S")" ]; then
  echo "stage.sh: '$S' is nested or holds tracked files; choose another .device* name" >&2; exit 2
fi
grep -qx "/$S/" .git/info/exclude 2>/dev/null || echo "/$S/" >> .git/info/exclude
rm -rf "$S" && mkdir -p "$S"
cargo build --release --bin wide >&2
strip -o "$S/wide" "${CARGO_TARGET_DIR:-target}/release/wide"
if [ $tests -eq 1 ]; then
  cargo test --release --features cuda-tests --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"] \
            and m["target"]["name"].startswith("cuda"):
        print(m["target"]["name"], m["executable"])' \
    | while read -r name exe; do strip -o "$S/test-$name" "$exe"; done
fi
if [ $kernels -eq 1 ]; then
  "${CARGO_TARGET_DIR:-target}/release/wide" kernels precompile --arch sm_90 --out "$S/kernels" >&2
fi
# The device tool carries at most 64 MiB, the tracked tree (testbed weights, ~55 MiB) included:
# the binaries and the kernel images travel xz-compressed (about a quarter of their size) and
# env.sh unpacks them there, with Python's lzma (the GPU machine may have no xz).
for f in "$S"/wide "$S"/test-*; do if [ -f "$f" ]; then xz -6 -T0 -f "$f"; fi; done
if [ -d "$S/kernels" ]; then tar -C "$S" -cf - kernels | xz -6 -T0 > "$S/kernels.tar.xz" && rm -rf "$S/kernels"; fi
for f in "$@"; do cp -r "$f" "$S/"; done
cat > "$S/env.sh" <<'ENV'
# Source on the GPU machine: use its own libtorch (PyTorch 2.11.0+cu130) for the tch binary,
# its NVRTC for our kernels, and PyTorch's NCCL (one NCCL per process).
# First the staged files stage.sh compressed (binaries *.xz, kernel images kernels.tar.xz).
python3 - "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" <<'PY' || return 1
import lzma, os, sys, tarfile
d = sys.argv[1]
for n in sorted(os.listdir(d)):
    p = os.path.join(d, n)
    if n.endswith(".tar.xz"):
        with tarfile.open(p) as t:
            t.extractall(d)
    elif n.endswith(".xz"):
        with lzma.open(p) as f, open(p[:-3] + ".part", "wb") as g:
            g.write(f.read())
        os.chmod(p[:-3] + ".part", 0o755)
        os.replace(p[:-3] + ".part", p[:-3])
    else:
        continue
    os.remove(p)
PY
TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__) + "/lib")')
CUDA_PY=$(python3 -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
NCCL_DIR=$(python3 -c 'import os, nvidia.nccl as n; print(list(n.__path__)[0] + "/lib")')
NCCL_LINK_DIR=$(mktemp -d) && ln -sf "$NCCL_DIR/libnccl.so.2" "$NCCL_LINK_DIR/libnccl.so"
export LD_LIBRARY_PATH="$NCCL_LINK_DIR:$TORCH_LIB:$CUDA_PY/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f "$CUDA_PY/include/cuda_bf16.h" ] && export WIDE_CUDA_INCLUDE="$CUDA_PY/include"
# Precompiled kernels staged beside this file (stage.sh --kernels), else a cache in /tmp.
STAGED=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/kernels
if [ -d "$STAGED" ]; then export WIDE_KERNEL_CACHE="$STAGED"; else export WIDE_KERNEL_CACHE=/tmp/wide-kernels; fi
# No system fonts there: plots use the DejaVu Sans that matplotlib ships.
WIDE_FONT=$(python3 -c 'import os, matplotlib; print(os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data/fonts/ttf/DejaVuSans.ttf"))' 2>/dev/null) && export WIDE_FONT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ENV
du -sh "$S" | awk '{print "staged .device: " $1 " (carry limit 64 MiB)"}' >&2
ls "$S" >&2
