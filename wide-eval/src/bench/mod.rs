//! Benchmark programs. Timing follows the device method: warm-up first, then the median of
//! repeated runs, each bracketed by device synchronisation.
pub mod clock;
pub mod dense;
pub mod e2e;
pub mod train;
pub mod scaling;
pub mod kernels;

use anyhow::Result;
use tch::Device;

/// Waits for all queued work on `device`.
pub fn sync(device: Device) -> Result<()> {
    if let Device::Cuda(d) = device {
        wide_kernels::shim::synchronize(d)?;
    }
    Ok(())
}

/// Median wall time in seconds of `iters` runs of `f` after `warmup` runs.
pub fn time_median(device: Device, warmup: usize, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    Ok(median(&mut time_runs(device, warmup, iters, f)?.secs))
}

/// The timed runs of [`time_runs`]: wall seconds of each (issue and device work), the host's
/// seconds inside `f` (issuing the work, before the sync: when close to the total, the host sets
/// the pace or `f` waits for the device), and each run's window (to read a clock trace against).
pub struct Runs {
    pub secs: Vec<f64>,
    pub host_secs: Vec<f64>,
    pub windows: Vec<(std::time::Instant, std::time::Instant)>,
}

/// `warmup` runs of `f`, a device sync, then `iters` (at least one) runs each ended by a sync.
pub fn time_runs(device: Device, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<Runs> {
    for _ in 0..warmup {
        f()?;
    }
    sync(device)?;
    let n = iters.max(1);
    let mut r = Runs { secs: Vec::with_capacity(n), host_secs: Vec::with_capacity(n), windows: Vec::with_capacity(n) };
    for _ in 0..n {
        let t = std::time::Instant::now();
        f()?;
        r.host_secs.push(t.elapsed().as_secs_f64());
        sync(device)?;
        r.secs.push(t.elapsed().as_secs_f64());
        r.windows.push((t, std::time::Instant::now()));
    }
    Ok(r)
}

/// Checks a benchmark's counts before anything is built: at least one timed iteration, and for
/// decode at least two new tokens (a step time is the time after the first token over the
/// rest), positive lengths and batches. One error naming the flag.
pub fn check_counts(iters: usize, new_tokens: Option<i64>, lengths: &[(&str, &[i64])]) -> anyhow::Result<()> {
    anyhow::ensure!(iters >= 1, "--iters must be at least 1 (the timed repetitions), got {iters}");
    if let Some(n) = new_tokens {
        anyhow::ensure!(n >= 2, "--new-tokens must be at least 2 (steps are timed after the first new token), got {n}");
    }
    for (flag, v) in lengths {
        if let Some(bad) = v.iter().find(|&&x| x < 1) {
            anyhow::bail!("{flag} takes positive values, got {bad}");
        }
    }
    Ok(())
}

/// The median of `v` (NaN for an empty slice; [`check_counts`] keeps benchmarks from that).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Peak allocated bytes of the caching allocator since the last reset (0 on CPU).
pub fn peak_bytes(device: Device) -> Result<i64> {
    Ok(match device {
        Device::Cuda(d) => wide_kernels::MemoryStats::read(d)?.allocated_peak,
        _ => 0,
    })
}

pub fn reset_peak(device: Device) -> Result<()> {
    if let Device::Cuda(d) = device {
        wide_kernels::MemoryStats::reset_peak(d)?;
    }
    Ok(())
}

/// The large-M autotuner's records so far (one per op, shape, M bucket and sparsity eighth):
/// each path's time and what the dispatch policy takes from it, so a run's per-process choices can be read
/// back from its JSON.
pub fn autotune_json() -> serde_json::Value {
    use wide_kernels::ops::dispatch::{choose, GemmShape};
    let mut recs = wide_kernels::ops::gemm::tuned_records();
    recs.sort_by_key(|(k, _)| (format!("{:?}", k.op), k.n, k.k, k.group, k.m_bucket, k.sparsity_eighths, k.f16, k.device));
    let v: Vec<serde_json::Value> = recs
        .into_iter()
        .map(|(k, t)| {
            // The policy itself on the bucket's M (records exist for large M, and for 2-128 tokens
            // where the small-M kernels are measured against dense + mask, cold and warm).
            let shape = GemmShape { op: k.op, m: k.m_bucket, n: k.n, k: k.k, group: k.group };
            let picked = choose(&shape, k.sparsity_eighths as f64 / 8.0, Some(&t));
            serde_json::json!({"op": format!("{:?}", k.op), "N": k.n, "K": k.k, "G": k.group, "m_bucket": k.m_bucket,
                   "sparsity": k.sparsity_eighths as f64 / 8.0, "dense_ms": t.dense_ms,
                   "tiles": t.tiles.iter().map(|(c, ms)| serde_json::json!({"tile": c.label(), "ms": ms})).collect::<Vec<_>>(),
                   "wgmma_ms": t.wgmma_ms, "skinny_ms": t.skinny_ms, "skinny_wg_ms": t.skinny_wg_ms,
                   "warm": t.warm.map(|w| serde_json::json!({"dense_ms": w.dense_ms, "skinny_ms": w.skinny_ms, "skinny_wg_ms": w.skinny_wg_ms})),
                   "picked": picked.label()})
        })
        .collect();
    serde_json::Value::Array(v)
}

pub fn device_label(device: Device) -> String {
    match device {
        Device::Cuda(d) => wide_kernels::cuda::device_name(d).unwrap_or_else(|_| format!("cuda:{d}")),
        _ => "cpu".to_string(),
    }
}
