//! The SM clock at a point in a stream: a one-thread kernel that counts SM cycles (`clock64`)
//! over a fixed stretch of the global nanosecond timer. Benchmarks enqueue it between timed runs
//! to see the clock a run started and ended at, at the stream's own position, where a driver
//! query (NVML refreshes its clock value about every 100 ms) cannot resolve a 40 ms run.
use crate::cuda::{CudaKernel, KernelArg, LaunchConfig};
use crate::nvrtc::KernelSource;
use anyhow::{bail, ensure, Result};
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = r#"
// out[0..4] = global timer (ns) and SM cycle count at the start and the end of a spin of at
// least `ns` nanoseconds on one thread. The cycle count is the SM clock's, so cycles / ns is the
// clock in GHz over the spin.
extern "C" __global__ void clock_probe(long long ns, unsigned long long* out) {
    unsigned long long t0, t1, c0, c1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    c0 = clock64();
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    } while (t1 - t0 < (unsigned long long)ns);
    c1 = clock64();
    out[0] = t0;
    out[1] = t1;
    out[2] = c0;
    out[3] = c1;
}
"#;

pub fn kernel_variants() -> Vec<KernelSource> {
    vec![KernelSource::new("probe", SOURCE)]
}

fn kernel(device: usize) -> Result<CudaKernel> {
    static K: OnceLock<Mutex<Vec<(usize, CudaKernel)>>> = OnceLock::new();
    let m = K.get_or_init(Default::default);
    if let Some((_, k)) = m.lock().unwrap().iter().find(|(d, _)| *d == device) {
        return Ok(*k);
    }
    let k = CudaKernel::get(&kernel_variants()[0], "clock_probe", device)?;
    m.lock().unwrap().push((device, k));
    Ok(k)
}

/// MHz from one probe's record (global timer ns and SM cycles at its start and end); `None`
/// for a slot never written (all zero) or a record that cannot be a clock (no time passed,
/// cycles going backwards).
pub fn probe_mhz(rec: [i64; 4]) -> Option<f64> {
    let [t0, t1, c0, c1] = rec.map(|x| x as u64);
    let (dt, dc) = (t1.checked_sub(t0)?, c1.checked_sub(c0)?);
    (dt > 0 && dc > 0).then(|| dc as f64 / dt as f64 * 1e3)
}

/// Slots for clock probes on one CUDA device: [`ClockProbe::record`] enqueues a probe on
/// libtorch's current stream, [`ClockProbe::mhz`] reads every slot back (one device-to-host
/// copy; call it after the work is done).
pub struct ClockProbe {
    buf: Tensor,
    device: usize,
    micros: u32,
}

impl ClockProbe {
    /// `slots` probes of `micros` microseconds each (the global timer ticks in about 1 us or
    /// less, so 200 us reads the clock to about 0.5%).
    pub fn new(device: Device, slots: usize, micros: u32) -> Result<Self> {
        let Device::Cuda(d) = device else { bail!("clock probes need a CUDA device, got {device:?}") };
        ensure!(slots > 0, "a clock probe needs at least one slot");
        ensure!((10..=100_000).contains(&micros), "a clock probe spins 10 to 100000 us, got {micros}");
        Ok(Self { buf: Tensor::zeros([slots as i64, 4], (Kind::Int64, device)), device: d, micros })
    }

    pub fn slots(&self) -> usize {
        self.buf.size()[0] as usize
    }

    /// Enqueues a probe writing slot `slot`.
    pub fn record(&self, slot: usize) -> Result<()> {
        ensure!(slot < self.slots(), "clock probe slot {slot} out of {}", self.slots());
        let k = kernel(self.device)?;
        let dst = self.buf.get(slot as i64);
        unsafe { k.launch(LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 }, &[KernelArg::I64(self.micros as i64 * 1000), KernelArg::tensor(&dst)?]) }
    }

    /// The clock of every slot, in MHz (`None` where no probe wrote).
    pub fn mhz(&self) -> Result<Vec<Option<f64>>> {
        let host = Vec::<i64>::try_from(self.buf.to_device(Device::Cpu).reshape([-1]))?;
        Ok(host.chunks_exact(4).map(|c| probe_mhz([c[0], c[1], c[2], c[3]])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mhz_is_cycles_over_nanoseconds() {
        // 400,000 cycles in 200,000 ns: 2 GHz.
        assert_eq!(probe_mhz([1_000, 201_000, 5, 400_005]), Some(2000.0));
        assert_eq!(probe_mhz([0; 4]), None, "an unwritten slot");
        assert_eq!(probe_mhz([10, 10, 0, 5]), None, "no time passed");
        assert_eq!(probe_mhz([10, 20, 9, 5]), None, "cycles went backwards");
    }

    #[test]
    fn needs_a_cuda_device() {
        let e = ClockProbe::new(Device::Cpu, 4, 200).err().unwrap();
        assert!(e.to_string().contains("CUDA"), "{e}");
    }
}
