# Probe: how many thread-block clusters of the wgmma gemm_mn's launches are resident at once.
# Two steps. On the CPU machine (NVRTC from the set-up's CUDA runtime, no GPU), build the cubins
# of a commit's wgmma.cu for sm_90a: the plain 256-token tile, tall last tiles, the 128-token
# 7-stage tile, the multicast clusters of two, and, where the commit has it, the split of K over
# clusters of two (`1efdfe6`, reverted in `4cd1768`):
#   python3 benchmarks/probes/wgmma_cluster_occupancy.py build REV DIR
# On the GPU machine, load them through the driver and print each launch's blocks a
# multiprocessor and cuOccupancyMaxActiveClusters for clusters of 1, 2, 4 and 8 blocks (the
# cluster-free kernels as if launched with that cluster dimension, the clustered ones at theirs):
#   python3 benchmarks/probes/wgmma_cluster_occupancy.py query DIR
# Result (H100, 2026-12-07): 66 clusters of two for every variant (the split included), 30 of
# four, 15 of eight; NOTES v53.
import ctypes, os, subprocess, sys
from ctypes import byref, c_int, c_uint, c_void_p

# (name, defines over the plain tile's, dynamic shared memory: stages + 1 KiB alignment slack)
VARIANTS = [
    ("plain", {}, 4 * 49152 + 1024),
    ("tall", dict(TALL=1), 4 * 57344 + 1024),
    ("small", dict(MI=1, STAGES=7), 7 * 32768 + 1024),
    ("cluster2", dict(CLUSTER=2, TMA_B=0, ROW_TMA=0), 4 * 49152 + 1024),
    ("split", dict(SPLITK=2), 4 * 49152 + 1024),
    ("splittall", dict(SPLITK=2, TALL=1), 4 * 57344 + 1024),
    ("splitsmall", dict(SPLITK=2, MI=1, STAGES=7), 7 * 32768 + 1024),
]
BASE = dict(WIDE_F16=0, FUSED=0, MI=2, STAGES=4, ASYNC_ARRIVE=1, CLUSTER=1, TMA_B=1, L2_HINT=0, PERSIST=0, ROW_TMA=1, STREAMK=0, TALL=0)


def build(rev, out):
    try:
        import nvidia  # the set-up's CUDA runtime wheel: libnvrtc and its headers
    except ImportError:
        sys.exit('build needs the set-up\'s Python: run it after eval "$(bash scripts/setup.sh --print-env)"')
    cu13 = os.path.join(list(nvidia.__path__)[0], "cu13")
    lib = ctypes.CDLL(os.path.join(cu13, "lib", "libnvrtc.so.13"))
    root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"]).decode().strip()
    files = ["mbarrier.cuh", "wgmma_common.cuh", "cluster.cuh", "wgmma.cu"]
    try:
        src = "".join(subprocess.check_output(["git", "-C", root, "show", f"{rev}:wide-kernels/src/ops/{f}"], stderr=subprocess.DEVNULL).decode() for f in files)
    except subprocess.CalledProcessError:
        sys.exit(f"build: {rev} is not a commit of this repository with wide-kernels/src/ops/wgmma.cu")
    os.makedirs(out, exist_ok=True)
    for name, defs, _ in VARIANTS:
        if "SPLITK" in defs and "SPLITK" not in src:
            print(f"{name}: {rev} has no SPLITK, skipped")
            continue
        prog = c_void_p()
        assert lib.nvrtcCreateProgram(byref(prog), src.encode(), b"wgmma.cu", 0, None, None) == 0
        opts = [b"--gpu-architecture=sm_90a", b"--std=c++17", b"-default-device", b"--fmad=true", f"--include-path={cu13}/include".encode()]
        opts += [f"-D{k}={v}".encode() for k, v in {**BASE, **defs}.items()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc != 0:
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, byref(n))
            log = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, log)
            sys.exit(f"{name}: NVRTC failed ({rc}):\n{log.value.decode()}")
        n = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, byref(n))
        b = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, b)
        with open(os.path.join(out, name + ".cubin"), "wb") as f:
            f.write(b.raw)
        print(f"{name}: {n.value} bytes")


class Attr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value (clusterDim first)
    _fields_ = [("id", c_int), ("pad", ctypes.c_char * 4), ("x", c_uint), ("y", c_uint), ("z", c_uint), ("rest", ctypes.c_char * 52)]


class Cfg(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", c_uint), ("gy", c_uint), ("gz", c_uint), ("bx", c_uint), ("by", c_uint), ("bz", c_uint), ("smem", c_uint), ("stream", c_void_p),
                ("attrs", c_void_p), ("nattrs", c_uint)]


def query(d):
    found = [v for v in VARIANTS if os.path.exists(os.path.join(d, v[0] + ".cubin"))]
    if not found:
        sys.exit(f"query: no {', '.join(v[0] + '.cubin' for v in VARIANTS)} in {d} (make them with: build REV DIR)")
    import torch

    torch.zeros(1, device="cuda")  # a current context
    cu = ctypes.CDLL("libcuda.so.1")
    print(torch.cuda.get_device_name(0), "multiprocessors", torch.cuda.get_device_properties(0).multi_processor_count)
    for name, defs, smem in found:
        path = os.path.join(d, name + ".cubin")
        mod, fn = c_void_p(), c_void_p()
        with open(path, "rb") as f:
            assert cu.cuModuleLoadData(byref(mod), f.read()) == 0, name
        assert cu.cuModuleGetFunction(byref(fn), mod, b"gemm_mn_wgmma") == 0, name
        assert cu.cuFuncSetAttribute(fn, 8, c_int(smem)) == 0, name  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        nb = c_int()
        cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(byref(nb), fn, c_int(384), ctypes.c_size_t(smem))
        fixed = 2 if ("CLUSTER" in defs or "SPLITK" in defs) else 0
        out = [f"{name}: {smem} bytes of shared memory, {nb.value} block(s) a multiprocessor"]
        for cs in [fixed] if fixed else [1, 2, 4, 8]:
            n = c_int()
            if fixed:  # the cluster dimension is the kernel's own (__cluster_dims__)
                cfg = Cfg(128, 1, 1, 384, 1, 1, smem, None, None, 0)
            else:
                a = Attr(4, b"", cs, 1, 1, b"")  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                cfg = Cfg(cs * 64, 1, 1, 384, 1, 1, smem, None, ctypes.cast(ctypes.pointer(a), c_void_p), 1)
            rc = cu.cuOccupancyMaxActiveClusters(byref(n), fn, byref(cfg))
            out.append(f"clusters of {cs}: {n.value}" + ("" if rc == 0 else f" (error {rc})"))
        print("; ".join(out))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "query":
        query(sys.argv[2])
    else:
        sys.exit("usage: wgmma_cluster_occupancy.py build REV DIR | query DIR")
