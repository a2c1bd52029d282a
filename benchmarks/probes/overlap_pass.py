# Probe (GPU machine): can gemm_mn's dense fallback hide its zero pass behind its own product?
# The fallback is cuBLAS's y = x w^T, then a pass that writes zeros over the groups each token
# skips (s M N x 2 bytes), in order on one stream: the pass is exposed in full (NOTES v54 measured
# cuBLAS + a plain fill of those bytes at 0.956-0.959x of cuBLAS for up at 1024 tokens, s = 0.5).
# Here the product runs as k row blocks on the main stream, and each block's zeros are written on
# a second stream as soon as that block is done, while the next block computes; only the last
# block's share stays exposed. Against cuBLAS alone (one product into a preallocated output), in
# one process, every iteration all variants in a rotated order, medians of 15:
#   seq_fill / seq_groups  the product, then the zeros (in order, as the fallback does now)
#   rows{k}                the product as k row blocks, no zeros: what splitting costs
#   ovl_fill{k} / ovl_groups{k}  the k blocks with each block's zeros on the second stream
# The zeros: `fill` zeroes a separate buffer of the same bytes (a plain fill's best), `groups`
# zeroes one group in 1 / s of the output in place (runs of G x 2 bytes, the pass's placement;
# torch's strided kernel, slower than the pass). Up's shape (N 14336, K 4096, G 64) and Q's
# (N 4096, K 4096, G 512) at 1024, 4096 and 16384 tokens, s 0.25 / 0.5, cold (a dirty write of
# twice the L2 before each timed run, as `wide bench kernels --l2 cold`) and warm, each run behind
# ~1 ms of device spin so that the host has queued every launch before the first event.
#   python3 benchmarks/probes/overlap_pass.py [--shape up|q]
# (writes $OUT/probe_overlap_pass.json, else ./probe_overlap_pass.json).
import json, os, statistics, sys
import torch

K = 4096
SHAPES = {"up": (14336, 64), "q": (4096, 512)}
dev = flush = side = None  # set by main(), on the GPU


def timed(fn, cold):
    if cold:
        flush.fill_(1)
    torch.cuda._sleep(2_000_000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3  # us


def case(shape, M, s, cold, iters=15):
    N, G = SHAPES[shape]
    x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.05
    wt = w.t()
    y = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    cut = int(round(s * N / 8)) * 8
    z = torch.empty(M, cut, dtype=torch.bfloat16, device=dev)
    per = int(round(1 / s))
    gv = y.view(M, N // G // per, per, G)[:, :, 0, :]
    zero = {"fill": lambda r0, r1: z[r0:r1].zero_(), "groups": lambda r0, r1: gv[r0:r1].zero_()}
    main = torch.cuda.current_stream()

    def blocks(k, what):
        rows = M // k
        for i in range(k):
            r0, r1 = i * rows, (i + 1) * rows
            torch.matmul(x[r0:r1], wt, out=y[r0:r1])
            if what is not None:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    zero[what](r0, r1)
        if what is not None:
            main.wait_stream(side)

    variants = {
        "cublas": lambda: torch.matmul(x, wt, out=y),
        "seq_fill": lambda: (torch.matmul(x, wt, out=y), zero["fill"](0, M)),
        "seq_groups": lambda: (torch.matmul(x, wt, out=y), zero["groups"](0, M)),
    }
    for k in (2, 4, 8):
        if M // k < 128:
            continue
        variants[f"rows{k}"] = lambda k=k: blocks(k, None)
        variants[f"ovl_fill{k}"] = lambda k=k: blocks(k, "fill")
        variants[f"ovl_groups{k}"] = lambda k=k: blocks(k, "groups")
    names = list(variants)
    for n in names:  # warm-up
        timed(variants[n], cold)
    # The split products must give the same output as the whole one.
    ref = torch.matmul(x, wt)
    blocks(4 if M >= 512 else 1, None)
    torch.cuda.synchronize()
    diff = (ref.float() - y.float()).abs().max().item()
    if diff != 0:
        print(f"note: at {shape} M={M} the row blocks' product differs from the whole one by up to {diff} (another cuBLAS kernel)")
    t = {n: [] for n in names}
    for i in range(iters):
        for j in range(len(names)):
            n = names[(i + j) % len(names)]
            t[n].append(timed(variants[n], cold))
    med = {n: statistics.median(v) for n, v in t.items()}
    c = med["cublas"]
    return {"op": shape, "M": M, "N": N, "K": K, "G": G, "sparsity": s, "l2": "cold" if cold else "warm",
            "zero_bytes": M * cut * 2, "blocks_max_abs_diff": diff, "median_us": med, "spread_us": {n: [min(v), max(v)] for n, v in t.items()},
            "speedup_vs_cublas": {n: c / med[n] for n in names if n != "cublas"}}


def main(shapes):
    global dev, flush, side
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    flush = torch.empty(2 * l2, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    out = os.environ.get("OUT", ".")
    recs = []
    print(f"{torch.cuda.get_device_name(dev)}, L2 {l2 >> 20} MiB; cuBLAS / variant (1.0 = cuBLAS alone)")
    for shape in shapes:
        for M in (1024, 4096, 16384):
            for s in (0.25, 0.5):
                for cold in (True, False):
                    r = case(shape, M, s, cold)
                    recs.append(r)
                    sp = r["speedup_vs_cublas"]
                    cols = "  ".join(f"{n} {v:.3f}" for n, v in sp.items())
                    print(f"{shape:>3} {M:>6} s{s} {r['l2']:>5} cuBLAS {r['median_us']['cublas']:8.1f} us  {cols}", flush=True)
    doc = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "records": recs}
    path = os.path.join(out, "probe_overlap_pass.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
    print("wrote", path)


if __name__ == "__main__":
    args = sys.argv[1:]
    shapes = list(SHAPES)
    if args:
        if len(args) != 2 or args[0] != "--shape" or args[1] not in SHAPES:
            sys.exit(f"usage: overlap_pass.py [--shape {'|'.join(SHAPES)}]; got {' '.join(args)}")
        shapes = [args[1]]
    if not torch.cuda.is_available():
        sys.exit("overlap_pass.py runs on a CUDA GPU (the GPU machine); none is visible here")
    main(shapes)
