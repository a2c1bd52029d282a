# Sourced by the GPU machine's scripts (check.sh, step-ceiling.sh, env-ab.sh), run from the checkout
# after scripts/device/stage.sh --tests --kernels.
#   device_setup SCRIPT DIR LOCAL_TAR
# sources .device/env.sh (one clear error naming SCRIPT if the binaries are not staged), makes the
# results folder R (a temporary folder named DIR), sets dest, the tar the results are packed into
# ($OUT/DIR.tar, or ./LOCAL_TAR without $OUT: the device tool returns few files, so one tar), and
# writes the GPU's name and clock to R/gpu.txt. pack rewrites dest from R (a .part file, then a
# rename), so a run cut off by a time limit still returns what it had packed.
device_setup() {
    local script=$1 dir=$2 local_tar=$3
    # shellcheck disable=SC1091  # staged on the GPU machine
    . .device/env.sh || { echo "$script: .device/env.sh failed: stage the binaries first (scripts/device/stage.sh --tests --kernels)" >&2; return 1; }
    R=$(mktemp -d)/$dir
    mkdir -p "$R"
    if [ -n "${OUT:-}" ]; then dest=$OUT/$dir.tar; else dest=$PWD/$local_tar; fi
    # Recorded, not required: a machine without nvidia-smi leaves its error in gpu.txt.
    nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1 || true
}

pack() { tar -C "$(dirname "$R")" -cf "$dest.part" "$(basename "$R")" && mv "$dest.part" "$dest"; }
