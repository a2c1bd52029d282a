# Probe (GPU machine): what writing the zero pass's bytes costs after cuBLAS, whoever writes them.
# gemm_mn's dense fallback is cuBLAS's y = x w^T followed by a pass that writes zeros over the
# groups each token skips (s M N x 2 bytes). This times, in one process against cuBLAS alone
# (torch.matmul into a preallocated output), the same product followed by
#   launch  a second launch that writes 16 bytes: what any second launch costs
#   narrow  y[:, :s N].zero_(): the pass's bytes in place as one column block (torch's kernel on a
#           strided view; measured about twice the fill below, so not a floor)
#   memset  a separate buffer of s M N x 2 bytes zeroed: the bytes at a plain fill's best
#   inplace the same plain fill over the output's first s M N elements (whole rows, contiguous)
#   groups  one group in 1 / s zeroed in place (runs of G x 2 bytes, as isolated skipped groups)
# for up's shape (N 14336, K 4096; G 32 / 64 / 256) and Q's (N 4096, K 4096; G 512) at 128, 1024,
# 4096 and 16384 tokens, s 0.25 / 0.5, cold (a dirty write of twice the L2 before every timed run,
# as `wide bench kernels --l2 cold`) and warm, each run behind ~200 us of device spin (so host
# launch gaps stay out of the events). Every iteration runs all variants in a rotated order;
# medians of 15 iterations. `--shape up` or `--shape q` runs one shape only.
#   python3 benchmarks/probes/zero_pass_bytes.py [--shape up|q]
# (writes $OUT/probe_zero_pass.json, else ./probe_zero_pass.json). Result (H100, 2026-12-07,
# before `inplace` was added; that variant has not run yet): wide-kernels/NOTES.md v54.
import json, os, statistics, sys
import torch

K = 4096
SHAPES = {"up": (14336, (32, 64, 256)), "q": (4096, (512,))}
dev = l2 = flush = one = None  # set by main(), on the GPU


def timed(fn, cold):
    if cold:
        flush.fill_(1)
    # ~200 us of device spin first, so the host has queued the timed launches before the first
    # event runs and the events time device work alone (as `wide bench kernels` does).
    torch.cuda._sleep(400_000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3  # us


def case(shape, M, G, s, cold, iters=15):
    N = SHAPES[shape][0]
    x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.05
    y = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    cut = int(round(s * N / 8)) * 8
    z = torch.empty(M * cut, dtype=torch.bfloat16, device=dev)
    per = int(round(1 / s))  # one group in `per` zeroed
    ng = N // G
    gv = y.view(M, ng // per, per, G)[:, :, 0, :] if ng % per == 0 else None
    gemm = lambda: torch.matmul(x, w.t(), out=y)
    variants = {
        "cublas": gemm,
        "launch": lambda: (gemm(), one.zero_()),
        "narrow": lambda: (gemm(), y[:, :cut].zero_()),
        "memset": lambda: (gemm(), z.zero_()),
        "inplace": lambda: (gemm(), y.view(-1)[: M * cut].zero_()),
    }
    if gv is not None:
        variants["groups"] = lambda: (gemm(), gv.zero_())
    names = list(variants)
    for n in names:  # warm-up
        timed(variants[n], cold)
    t = {n: [] for n in names}
    for i in range(iters):
        for j in range(len(names)):
            n = names[(i + j) % len(names)]
            t[n].append(timed(variants[n], cold))
    med = {n: statistics.median(v) for n, v in t.items()}
    return {"op": shape, "M": M, "N": N, "K": K, "G": G, "sparsity": s, "l2": "cold" if cold else "warm", "zero_bytes": M * cut * 2,
            "median_us": med, "added_us": {n: med[n] - med["cublas"] for n in names if n != "cublas"}}


def main(shapes):
    global dev, l2, flush, one
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    flush = torch.empty(2 * l2, dtype=torch.uint8, device=dev)
    one = torch.empty(8, dtype=torch.bfloat16, device=dev)
    out = os.environ.get("OUT", ".")
    recs = []
    print(f"{torch.cuda.get_device_name(dev)}, L2 {l2 >> 20} MiB")
    print(f"{'op':>3} {'M':>6} {'G':>4} {'s':>5} {'l2':>5} {'cuBLAS us':>10} {'bytes MB':>9}  added us: launch  narrow  memset inplace  groups")
    for shape in shapes:
        for M in (128, 1024, 4096, 16384):
            for G in SHAPES[shape][1]:
                for s in (0.25, 0.5):
                    for cold in (True, False):
                        r = case(shape, M, G, s, cold)
                        recs.append(r)
                        a = r["added_us"]
                        print(f"{shape:>3} {M:>6} {G:>4} {s:>5} {r['l2']:>5} {r['median_us']['cublas']:>10.1f} {r['zero_bytes'] / 1e6:>9.1f}  "
                              f"{a['launch']:>13.1f} {a['narrow']:>7.1f} {a['memset']:>7.1f} {a['inplace']:>7.1f} {a.get('groups', float('nan')):>7.1f}", flush=True)
    doc = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "records": recs}
    path = os.path.join(out, "probe_zero_pass.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
    print("wrote", path)


if __name__ == "__main__":
    args = sys.argv[1:]
    shapes = list(SHAPES)
    if args:
        if len(args) != 2 or args[0] != "--shape" or args[1] not in SHAPES:
            sys.exit(f"usage: zero_pass_bytes.py [--shape {'|'.join(SHAPES)}]; got {' '.join(args)}")
        shapes = [args[1]]
    if not torch.cuda.is_available():
        sys.exit("zero_pass_bytes.py runs on a CUDA GPU (the GPU machine); none is visible here")
    main(shapes)
