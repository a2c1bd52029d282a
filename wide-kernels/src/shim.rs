//! Safe wrappers over the libtorch CUDA shim (`csrc/torch_cuda_shim.cpp`).
use anyhow::{bail, Result};
use std::ffi::{c_void, CStr};
use std::os::raw::{c_char, c_int};

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawMemoryStats {
    allocated_current: i64,
    allocated_peak: i64,
    reserved_current: i64,
    reserved_peak: i64,
    num_ooms: i64,
}

extern "C" {
    fn wide_shim_last_error() -> *const c_char;
    fn wide_cuda_device_count(out: *mut c_int) -> c_int;
    fn wide_cuda_current_stream(device: c_int, out: *mut *mut c_void) -> c_int;
    fn wide_cuda_synchronize(device: c_int) -> c_int;
    fn wide_cuda_set_device(device: c_int) -> c_int;
    fn wide_set_deterministic(on: c_int) -> c_int;
    fn wide_graph_new(device: c_int, out: *mut *mut c_void) -> c_int;
    fn wide_graph_capture_begin(g: *mut c_void) -> c_int;
    fn wide_graph_capture_end(g: *mut c_void) -> c_int;
    fn wide_graph_replay(g: *mut c_void) -> c_int;
    fn wide_graph_free(g: *mut c_void);
    fn wide_memory_stats(device: c_int, out: *mut RawMemoryStats) -> c_int;
    fn wide_memory_reset_peak(device: c_int) -> c_int;
    fn wide_memory_empty_cache() -> c_int;
}

fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let msg = unsafe { CStr::from_ptr(wide_shim_last_error()) }.to_string_lossy().into_owned();
    bail!("{what} failed: {msg}")
}

/// Number of CUDA devices libtorch sees (0 on a CPU-only machine).
pub fn cuda_device_count() -> usize {
    let mut n: c_int = 0;
    if unsafe { wide_cuda_device_count(&mut n) } != 0 {
        return 0;
    }
    n.max(0) as usize
}

/// The `cudaStream_t` libtorch currently uses on `device`; our kernels launch on it so they
/// order correctly with tch's own work (and are captured into CUDA graphs with it).
pub fn current_stream(device: usize) -> Result<*mut c_void> {
    let mut s = std::ptr::null_mut();
    check(unsafe { wide_cuda_current_stream(device as c_int, &mut s) }, "getting the current CUDA stream")?;
    Ok(s)
}

/// Asks libtorch for deterministic kernels where it has them (and warns where it has none):
/// `torch.use_deterministic_algorithms(on, warn_only=True)`, deterministic cuDNN, no cuDNN
/// benchmarking. cuBLAS also needs `CUBLAS_WORKSPACE_CONFIG=:4096:8` set before its first use.
pub fn set_deterministic(on: bool) -> Result<()> {
    check(unsafe { wide_set_deterministic(on as c_int) }, "setting deterministic algorithms")
}

/// Makes `device` libtorch's (and the CUDA runtime's) current device in this thread.
pub fn set_device(device: usize) -> Result<()> {
    check(unsafe { wide_cuda_set_device(device as c_int) }, "setting the CUDA device")
}

/// Waits for all work on `device`.
pub fn synchronize(device: usize) -> Result<()> {
    check(unsafe { wide_cuda_synchronize(device as c_int) }, "cuda synchronize")
}

/// Caching-allocator statistics of one device, in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryStats {
    pub allocated_current: i64,
    pub allocated_peak: i64,
    pub reserved_current: i64,
    pub reserved_peak: i64,
    pub num_ooms: i64,
}

impl MemoryStats {
    pub fn read(device: usize) -> Result<Self> {
        let mut raw = RawMemoryStats::default();
        check(unsafe { wide_memory_stats(device as c_int, &mut raw) }, "reading CUDA memory statistics")?;
        Ok(Self {
            allocated_current: raw.allocated_current,
            allocated_peak: raw.allocated_peak,
            reserved_current: raw.reserved_current,
            reserved_peak: raw.reserved_peak,
            num_ooms: raw.num_ooms,
        })
    }

    /// Starts a new peak-measurement window.
    pub fn reset_peak(device: usize) -> Result<()> {
        check(unsafe { wide_memory_reset_peak(device as c_int) }, "resetting CUDA peak memory statistics")
    }

    /// Returns cached, unused blocks to the driver.
    pub fn empty_cache() -> Result<()> {
        check(unsafe { wide_memory_empty_cache() }, "emptying the CUDA caching allocator")
    }
}

/// A CUDA graph recorded from tch work (and our kernels) and replayed as one launch.
///
/// Capture runs on a side stream. Tensors allocated during capture live in the graph's private
/// memory pool and stay valid while the graph lives; inputs are fed by copying into tensors
/// that existed before capture.
pub struct CudaGraph {
    raw: *mut c_void,
    captured: bool,
}

impl CudaGraph {
    pub fn new(device: usize) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        check(unsafe { wide_graph_new(device as c_int, &mut raw) }, "creating a CUDA graph")?;
        Ok(Self { raw, captured: false })
    }

    /// Records everything `body` queues on the device. `body`'s result is returned (typically
    /// the output tensors, which the replays overwrite in place).
    pub fn capture<T>(&mut self, body: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.captured {
            bail!("this CUDA graph was already captured; create a new one");
        }
        check(unsafe { wide_graph_capture_begin(self.raw) }, "beginning CUDA graph capture")?;
        let out = body();
        let end = check(unsafe { wide_graph_capture_end(self.raw) }, "ending CUDA graph capture");
        let out = out?;
        end?;
        self.captured = true;
        Ok(out)
    }

    /// Launches the recorded work on the current stream.
    pub fn replay(&self) -> Result<()> {
        if !self.captured {
            bail!("replay of a CUDA graph that was never captured");
        }
        check(unsafe { wide_graph_replay(self.raw) }, "replaying a CUDA graph")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        unsafe { wide_graph_free(self.raw) }
    }
}
