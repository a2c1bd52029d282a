# Probe (GPU machine): can cuBLASLt's DRELU epilogue serve as a masked-output GEMM for gemm_mn's
# dense fallback, replacing cuBLAS + the zero pass? DRELU zeroes every output element whose bit
# in an auxiliary bit mask is clear; one bit a (token, channel), here built from a random group
# mask (50% of the groups off). Times torch's linear, cuBLASLt without an epilogue and cuBLASLt
# with DRELU, cold (a 256 MiB write before each run) and warm, median of 15 CUDA-event-timed
# runs, and checks the outputs. Result: benchmarks/RESULTS.md, "Routed kernels", fifth session
# of 2026-12-01 (the epilogue variant runs at 0.58-0.96x of cuBLAS).
#   python3 benchmarks/probes/cublaslt_drelu.py      (writes $OUT/probe_lt.json, else ./)
import ctypes, glob, os, sys, json, statistics
import torch
import torch.nn.functional as F
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
dev = torch.device("cuda")
torch.zeros(1, device=dev) @ torch.zeros(1, 1, device=dev)  # init cublas
libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu13", "lib", "libcublasLt.so.*"))
print("lt libs", libs)
lt = ctypes.CDLL(libs[0] if libs else "libcublasLt.so.13")
c_void_p, c_int, c_uint64, c_int64, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
def ck(st, what):
    if st != 0: raise RuntimeError(f"{what}: status {st}")
h = c_void_p(); ck(lt.cublasLtCreate(ctypes.byref(h)), "create")
class Heur(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("ws", c_size_t), ("state", c_int), ("waves", ctypes.c_float), ("res", c_int * 4)]
assert ctypes.sizeof(Heur) == 96
WS = 32 << 20
ws = torch.empty(WS, dtype=torch.uint8, device=dev)
def setattr_(desc, attr, val, ctype):
    v = ctype(val); ck(lt.cublasLtMatmulDescSetAttribute(desc, c_int(attr), ctypes.byref(v), c_size_t(ctypes.sizeof(v))), f"attr {attr}")
def layout(rows, cols, ld, ty=14):
    l = c_void_p(); ck(lt.cublasLtMatrixLayoutCreate(ctypes.byref(l), c_int(ty), c_uint64(rows), c_uint64(cols), c_int64(ld)), "layout"); return l
class Plan:
    def __init__(self, M, N, K, drelu):
        self.desc = c_void_p(); ck(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), c_int(68), c_int(0)), "desc")
        setattr_(self.desc, 3, 1, c_int)  # TRANSA = T
        setattr_(self.desc, 4, 0, c_int)  # TRANSB = N
        self.drelu = drelu
        if drelu:
            setattr_(self.desc, 7, 136, c_int)  # EPILOGUE = DRELU
            setattr_(self.desc, 12, N, c_int64)  # AUX_LD in bits
        self.A = layout(K, N, K); self.B = layout(K, M, K); self.D = layout(N, M, N)
        self.M, self.N, self.K = M, N, K
        self.pref = c_void_p(); ck(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "pref")
        w = c_uint64(WS); ck(lt.cublasLtMatmulPreferenceSetAttribute(self.pref, c_int(1), ctypes.byref(w), c_size_t(8)), "pref ws")
        self.heur = None
    def run(self, x, W, out, bits=None):
        if self.drelu:
            setattr_(self.desc, 11, bits.data_ptr(), c_void_p)
        if self.heur is None:
            hs = (Heur * 4)(); n = c_int()
            ck(lt.cublasLtMatmulAlgoGetHeuristic(h, self.desc, self.A, self.B, self.D, self.D, self.pref, c_int(4), hs, ctypes.byref(n)), "heur")
            if n.value == 0: raise RuntimeError("no algo")
            self.heur = hs[0]; self.nalgo = n.value
        alpha = ctypes.c_float(1.0); beta = ctypes.c_float(0.0)
        st = torch.cuda.current_stream().cuda_stream
        ck(lt.cublasLtMatmul(h, self.desc, ctypes.byref(alpha), c_void_p(W.data_ptr()), self.A, c_void_p(x.data_ptr()), self.B, ctypes.byref(beta),
                             c_void_p(out.data_ptr()), self.D, c_void_p(out.data_ptr()), self.D, ctypes.byref(self.heur.algo), c_void_p(ws.data_ptr()), c_size_t(WS), c_void_p(st)), "matmul")
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
def timeit(fn, iters=15, cold=True):
    ts = []
    for i in range(iters + 3):
        if cold: flush.zero_()
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        if i >= 3: ts.append(a.elapsed_time(b))
    return statistics.median(ts)
recs = []
for (name, N, K) in [("up", 14336, 4096), ("q", 4096, 4096)]:
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    for M in [16, 128, 512, 1024, 4096, 16384]:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        for G in ([32, 64, 128] if name == "up" else [512]):
            NG = N // G
            mask = torch.rand(M, NG, device=dev) >= 0.5
            bits = (mask.to(torch.uint8) * 255).repeat_interleave(G // 8, dim=1).contiguous()  # [M, N/8]
            ref = F.linear(x, W) * mask.repeat_interleave(G, dim=1)
            p0 = Plan(M, N, K, False); p1 = Plan(M, N, K, True)
            o0 = torch.empty(M, N, device=dev, dtype=torch.bfloat16); o1 = torch.empty_like(o0)
            try:
                p0.run(x, W, o0); p1.run(x, W, o1, bits); torch.cuda.synchronize()
            except RuntimeError as e:
                print(name, M, G, "error", e); continue
            e0 = ((o0.float() - F.linear(x, W).float()).abs().max() / F.linear(x, W).float().abs().max()).item()
            e1 = ((o1.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            zeros_ok = bool((o1[~mask.repeat_interleave(G, dim=1)] == 0).all().item())
            for cold in (True, False):
                td = timeit(lambda: F.linear(x, W), cold=cold)
                tz = timeit(lambda: F.linear(x, W).mul_(mask.repeat_interleave(G, dim=1)), cold=cold)
                t0 = timeit(lambda: p0.run(x, W, o0), cold=cold)
                t1 = timeit(lambda: p1.run(x, W, o1, bits), cold=cold)
                tb = timeit(lambda: (mask.to(torch.uint8) * 255).repeat_interleave(G // 8, dim=1), cold=cold)
                r = dict(op=name, M=M, N=N, K=K, G=G, l2="cold" if cold else "warm", dense_ms=td, lt_plain_ms=t0, lt_drelu_ms=t1, torch_bits_ms=tb, torch_mul_ms=tz,
                         drelu_x=td / t1, err_plain=e0, err_drelu=e1, zeros_ok=zeros_ok, nalgo=p1.nalgo)
                recs.append(r)
                print(f"{name} M={M:5d} G={G:3d} {r['l2']}: dense {td*1e3:8.1f} us  lt {t0*1e3:8.1f}  lt+drelu {t1*1e3:8.1f} ({td/t1:.3f}x)  torch bits {tb*1e3:6.1f}  err {e0:.1e}/{e1:.1e} zeros {zeros_ok}", flush=True)
out = os.environ.get("OUT", ".")
json.dump(recs, open(os.path.join(out, "probe_lt.json"), "w"), indent=1)
