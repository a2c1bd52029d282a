# Probe (GPU machine): how fast is cuBLAS itself on the routed gemm_mn problem's geometry?
# The routed kernel (wgmma gemm_mn) multiplies, per weight group of G output channels, the
# group's gathered active token rows by the group's G weight rows: a GEMM whose output tile can be
# at most one group wide (G = 128: 128 channels, or 256 for the fused gate+up). This times, cold
# (a 256 MiB write before each run) and warm, median of CUDA-event-timed runs:
#   dense     F.linear(x, W) on all M rows (the benchmark's dense reference)
#   half      F.linear(x[:Ma], W): dense on Ma = (1 - s) M contiguous rows, every group at once
#             (the routed FLOPs without the one-group tile width and without the gather)
#   batched   torch.bmm over the NG groups of [Ma, K] x [K, G] (x shared by every group through a
#             stride-0 batch), i.e. the routed FLOPs in tiles at most one group wide, no gather
#   gathered  the same bmm on each group's own rows (a random active set per group, copied to a
#             contiguous buffer before timing): the gathered operand without the gather cost
# and, from the profiler, the kernel names cuBLAS picked. Result: benchmarks/RESULTS.md, "Routed
# kernels", first session of 2026-12-02.
#   python3 benchmarks/probes/cublas_group_tiles.py      (writes $OUT/probe_group_tiles.json, else ./)
import json, os, statistics
import torch
import torch.nn.functional as F

dev = torch.device("cuda")
torch.manual_seed(0)
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)


def timeit(fn, iters=20, cold=True):
    ts = []
    for i in range(iters + 3):
        if cold:
            flush.fill_(i & 0xFF)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 3:
            ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def kernels(fn):
    from torch.profiler import profile, ProfilerActivity

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    names = sorted({e.name for e in p.events() if e.device_type.name == "CUDA"})
    return [n[:120] for n in names]


# (op, M, N, K, G, fused)
CASES = [
    ("up", 2048, 14336, 4096, 128, False),
    ("up", 4096, 14336, 4096, 128, False),
    ("up", 16384, 14336, 4096, 128, False),
    ("gate_up", 2048, 14336, 4096, 128, True),
    ("gate_up", 4096, 14336, 4096, 128, True),
    ("q", 2048, 4096, 4096, 512, False),
    ("q", 4096, 4096, 4096, 512, False),
]
S = 0.5
records = []
for op, M, N, K, G, fused in CASES:
    NG = N // G
    Ma = int(M * (1 - S))
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    nw = 2 if fused else 1
    Ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(nw)]
    # Per group: its weight rows (gate and up side by side when fused: a 2G-wide tile).
    Wg = torch.cat([w.view(NG, G, K) for w in Ws], dim=1)  # [NG, nw G, K]
    WgT = Wg.transpose(1, 2)  # [NG, K, nw G]
    xa = x[:Ma]
    xs = xa.unsqueeze(0).expand(NG, Ma, K)  # stride-0 batch
    # Each group's own random active set, materialised contiguously (not timed).
    idx = torch.stack([torch.randperm(M, device=dev)[:Ma].sort().values for _ in range(NG)])
    xg = x[idx]  # [NG, Ma, K]

    def dense():
        outs = [F.linear(x, w) for w in Ws]
        if fused:
            F.silu(outs[0]).mul_(outs[1])

    def half():
        outs = [F.linear(xa, w) for w in Ws]
        if fused:
            F.silu(outs[0]).mul_(outs[1])

    def batched():
        torch.bmm(xs, WgT)

    def gathered():
        torch.bmm(xg, WgT)

    flops_dense = 2.0 * M * N * K * nw
    for l2 in ("cold", "warm"):
        t = {k: timeit(f, cold=l2 == "cold") for k, f in [("dense", dense), ("half", half), ("batched", batched), ("gathered", gathered)]}
        rec = dict(op=op, M=M, N=N, K=K, G=G, sparsity=S, l2=l2, **{f"{k}_ms": v for k, v in t.items()})
        for k in ("half", "batched", "gathered"):
            rec[f"{k}_speedup"] = t["dense"] / t[k]
        rec["dense_tflops"] = flops_dense / t["dense"] / 1e9
        rec["batched_tflops"] = flops_dense * (1 - S) / t["batched"] / 1e9
        records.append(rec)
        print(
            f"{op:8s} M={M:6d} {l2}: dense {t['dense']:.3f} ms ({rec['dense_tflops']:.0f} TF/s)  half {t['half']:.3f} ({rec['half_speedup']:.2f}x)  "
            f"batched {t['batched']:.3f} ({rec['batched_speedup']:.2f}x, {rec['batched_tflops']:.0f} TF/s)  gathered {t['gathered']:.3f} ({rec['gathered_speedup']:.2f}x)",
            flush=True,
        )
    records[-1]["kernels"] = {k: kernels(f) for k, f in [("dense", dense), ("batched", batched), ("gathered", gathered)]}
    print("  kernels:", json.dumps(records[-1]["kernels"]), flush=True)
    del x, Ws, Wg, WgT, xs, xg, idx
    torch.cuda.empty_cache()

out = os.path.join(os.environ.get("OUT", "."), "probe_group_tiles.json")
with open(out + ".tmp", "w") as f:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, records=records), f, indent=1)
os.replace(out + ".tmp", out)
print("wrote", out)
