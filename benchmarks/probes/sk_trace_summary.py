"""Summarise the stream-K wgmma kernel's clock stamps (`WIDE_WGMMA_SK_TRACE=FILE`).

A trace file holds `M N blocks` on its first line, then blocks x 64 items x 8 clock64 stamps
(0 where unused): 0 the consumers' item start, 1 their first stage, 2 their k loop's end,
3 barrier A, 4 barrier C (tiles that are written), 5 the producer's item start, 6 its last
copies issued. Prints medians (and 10th / 90th percentiles) in multiprocessor cycles.

    python3 benchmarks/probes/sk_trace_summary.py FILE [FILE ...]   (.txt or .txt.xz)
"""
import lzma
import statistics
import sys


def load(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        head = f.readline().split()
        vals = [int(v) for v in f.readline().split()]
    blocks = int(head[2])
    if len(vals) != blocks * 64 * 8:
        raise SystemExit(f"{path}: {len(vals)} stamps, expected {blocks} x 64 x 8")
    return head, [[vals[(b * 64 + i) * 8:(b * 64 + i + 1) * 8] for i in range(64)] for b in range(blocks)]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for path in sys.argv[1:]:
        head, blocks = load(path)
        kloop, first, epi, period, whole_k, whole_p, spans = [], [], [], [], [], [], []
        for items in blocks:
            used = [t for t in items if t[0] > 0]
            if not used:
                continue
            for k, t in enumerate(used):
                kl = t[2] - t[1]
                kloop.append(kl)
                first.append(t[1] - t[0])
                if t[4] > 0:
                    epi.append(t[4] - t[3])
                if k + 1 < len(used):
                    period.append(used[k + 1][0] - t[0])
                    if 60000 < kl < 90000:
                        whole_p.append(used[k + 1][0] - t[0])
                if 60000 < kl < 90000:
                    whole_k.append(kl)
            spans.append(max(max(t[3], t[4]) for t in used) - used[0][5])
        print(f"== {path}: M {head[0]} N {head[1]}, {len(blocks)} blocks, {len(kloop)} items")
        for name, xs in [("k loop", kloop), ("first-stage wait", first), ("epilogue", epi), ("item period", period),
                         ("k loop, items of 60-90 K", whole_k), ("period, items of 60-90 K", whole_p)]:
            if xs:
                print(f"  {name:26s} median {statistics.median(xs):9.0f}  p10 {pct(xs, 0.1):9.0f}  p90 {pct(xs, 0.9):9.0f}")
        print(f"  blocks' last item ends after  min {min(spans)}  median {statistics.median(spans):.0f}  max {max(spans)}")


if __name__ == "__main__":
    main()
