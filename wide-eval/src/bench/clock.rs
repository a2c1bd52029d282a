//! The GPU's SM clock sampled in the background while a benchmark runs (NVML, loaded at run time
//! from the driver's `libnvidia-ml.so.1`), so that each timed run can be read against the clock
//! it ran at: a full-FLOP prefill runs at the board's power limit, where the clock moves by a
//! fifth within tens of milliseconds (RESULTS, end to end, 2026-12-06). NVML refreshes the value
//! only about every 100 ms, so a shorter run needs the in-stream probe
//! (`wide_kernels::ops::probe`) to see its own clock. Absent NVML (CPU runs, a machine without
//! the driver's library) the sampler is simply not there and the figures carry no clock.
use std::ffi::{c_char, c_uint, c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type NvmlDevice = *mut c_void;
const NVML_SUCCESS: i32 = 0;
const NVML_CLOCK_SM: c_uint = 1;

struct Nvml {
    _lib: libloading::Library,
    clock: unsafe extern "C" fn(NvmlDevice, c_uint, *mut c_uint) -> i32,
    shutdown: unsafe extern "C" fn() -> i32,
    dev: NvmlDevice,
}
// The device handle is an opaque NVML token, valid from any thread.
unsafe impl Send for Nvml {}

impl Nvml {
    fn open(pci_bus_id: &str) -> Option<Self> {
        let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }.ok()?;
        unsafe {
            let init = *lib.get::<unsafe extern "C" fn() -> i32>(b"nvmlInit_v2\0").ok()?;
            let by_bus = *lib.get::<unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> i32>(b"nvmlDeviceGetHandleByPciBusId_v2\0").ok()?;
            let clock = *lib.get::<unsafe extern "C" fn(NvmlDevice, c_uint, *mut c_uint) -> i32>(b"nvmlDeviceGetClockInfo\0").ok()?;
            let shutdown = *lib.get::<unsafe extern "C" fn() -> i32>(b"nvmlShutdown\0").ok()?;
            if init() != NVML_SUCCESS {
                return None;
            }
            let bus = CString::new(pci_bus_id).ok()?;
            let mut dev: NvmlDevice = std::ptr::null_mut();
            if by_bus(bus.as_ptr(), &mut dev) != NVML_SUCCESS {
                shutdown();
                return None;
            }
            let nvml = Self { _lib: lib, clock, shutdown, dev };
            nvml.sm_mhz()?;
            Some(nvml)
        }
    }

    fn sm_mhz(&self) -> Option<u32> {
        let mut v: c_uint = 0;
        (unsafe { (self.clock)(self.dev, NVML_CLOCK_SM, &mut v) } == NVML_SUCCESS).then_some(v)
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        unsafe { (self.shutdown)() };
    }
}

/// A background thread reading the SM clock every `period`; dropped, it stops.
pub struct ClockSampler {
    samples: Arc<Mutex<Vec<(Instant, u32)>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ClockSampler {
    /// Starts sampling CUDA device `device`'s SM clock every `period`; `None` where NVML or the
    /// device cannot be opened.
    pub fn start(device: usize, period: Duration) -> Option<Self> {
        let bus = wide_kernels::cuda::pci_bus_id(device).ok()?;
        let nvml = Nvml::open(&bus)?;
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (samples.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("sm-clock".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    if let Some(mhz) = nvml.sm_mhz() {
                        s.lock().unwrap().push((Instant::now(), mhz));
                    }
                    std::thread::sleep(period);
                }
            })
            .ok()?;
        Some(Self { samples, stop, thread: Some(thread) })
    }

    /// The samples taken between `from` and `to`: (ms since `from`, MHz).
    pub fn trace(&self, from: Instant, to: Instant) -> Vec<(f64, u32)> {
        self.samples.lock().unwrap().iter().filter(|(t, _)| *t >= from && *t < to).map(|&(t, m)| ((t - from).as_secs_f64() * 1e3, m)).collect()
    }

    /// Median SM clock (MHz) of the samples taken inside the windows; `None` if there are none.
    pub fn median_mhz(&self, windows: &[(Instant, Instant)]) -> Option<f64> {
        median_in_windows(&self.samples.lock().unwrap(), windows)
    }
}

impl Drop for ClockSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The median of the values whose time lies in any of `windows` (half-open, `[from, to)`).
fn median_in_windows(samples: &[(Instant, u32)], windows: &[(Instant, Instant)]) -> Option<f64> {
    let mut v: Vec<f64> = samples.iter().filter(|(t, _)| windows.iter().any(|(a, b)| t >= a && t < b)).map(|&(_, m)| m as f64).collect();
    (!v.is_empty()).then(|| super::median(&mut v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_counts_only_samples_inside_the_windows() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let samples: Vec<(Instant, u32)> = [(0, 1980), (10, 1500), (20, 1530), (30, 1545), (40, 1980), (50, 1700), (60, 1980)]
            .iter()
            .map(|&(ms, mhz)| (at(ms), mhz))
            .collect();
        assert_eq!(median_in_windows(&samples, &[(at(10), at(40))]), Some(1530.0));
        // Two windows: 1500, 1530, 1545 and 1700; the end of a window is outside it.
        assert_eq!(median_in_windows(&samples, &[(at(10), at(40)), (at(50), at(60))]), Some(1537.5));
        assert_eq!(median_in_windows(&samples, &[(at(61), at(70))]), None);
        assert_eq!(median_in_windows(&[], &[(at(0), at(70))]), None);
    }

    #[test]
    fn no_sampler_without_a_gpu() {
        // On a machine without the CUDA driver the sampler is absent, not an error.
        if !tch::Cuda::is_available() {
            assert!(ClockSampler::start(0, Duration::from_millis(2)).is_none());
        }
    }
}
