//! Loading NVRTC output into the device's primary context (the one libtorch uses) and
//! launching it on libtorch's current stream. Every driver result is checked.
use crate::nvrtc::{self, CompiledKernel, KernelSource};
use crate::shim;
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as drv, sys};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Mutex, OnceLock};
use tch::{Device, Tensor};

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch covering `n` elements with `threads` per block.
    pub fn for_elements(n: usize, threads: u32) -> Self {
        let blocks = n.div_ceil(threads as usize).max(1) as u32;
        Self { grid: (blocks, 1, 1), block: (threads, 1, 1), shared_mem_bytes: 0 }
    }
}

/// A kernel parameter, passed by value as the kernel's signature expects.
#[derive(Debug, Clone, Copy)]
pub enum KernelArg {
    Ptr(u64),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    /// A 128-byte `CUtensorMap`, for a `const __grid_constant__` tensor-map parameter.
    TensorMap([u64; 16]),
}

impl KernelArg {
    /// Device pointer of a CUDA tensor's data (its storage offset included).
    pub fn tensor(t: &Tensor) -> Result<Self> {
        match t.device() {
            Device::Cuda(_) => Ok(KernelArg::Ptr(t.data_ptr() as u64)),
            d => bail!("kernel argument must be a CUDA tensor, got one on {d:?}"),
        }
    }
}

/// A loaded kernel entry point on one device.
#[derive(Debug, Clone, Copy)]
pub struct CudaKernel {
    func: sys::CUfunction,
    device: usize,
}
// CUfunction handles are plain driver handles, valid from any thread of the process.
unsafe impl Send for CudaKernel {}
unsafe impl Sync for CudaKernel {}

fn driver_err(e: drv::DriverError, what: &str) -> anyhow::Error {
    anyhow!("CUDA driver error while {what}: {e:?}")
}

/// Makes the device's primary context (shared with libtorch) current on this thread.
pub fn ensure_context(device: usize) -> Result<()> {
    static CTX: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    if !unsafe { sys::is_culib_present() } {
        bail!("the CUDA driver library (libcuda.so) is not available on this machine");
    }
    let map = CTX.get_or_init(Default::default);
    let mut map = map.lock().unwrap();
    let ctx = match map.get(&device) {
        Some(c) => *c as sys::CUcontext,
        None => {
            drv::init().map_err(|e| driver_err(e, "initialising the driver"))?;
            let dev = drv::device::get(device as i32).map_err(|e| driver_err(e, "opening the device"))?;
            let ctx = unsafe { drv::primary_ctx::retain(dev) }.map_err(|e| driver_err(e, "retaining the primary context"))?;
            map.insert(device, ctx as usize);
            ctx
        }
    };
    unsafe { drv::ctx::set_current(ctx) }.map_err(|e| driver_err(e, "making the context current"))
}

/// The PCI bus id of a CUDA device (`0000:18:00.0`), which names the same GPU in NVML whatever
/// `CUDA_VISIBLE_DEVICES` renumbers.
pub fn pci_bus_id(device: usize) -> Result<String> {
    ensure_context(device)?;
    let dev = drv::device::get(device as i32).map_err(|e| driver_err(e, "opening the device"))?;
    let mut buf = [0 as std::ffi::c_char; 32];
    unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) }
        .result()
        .map_err(|e| driver_err(e, "reading the PCI bus id"))?;
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// `compute_XY` of a device, the NVRTC target for it.
pub fn compute_arch(device: usize) -> Result<String> {
    ensure_context(device)?;
    let dev = drv::device::get(device as i32).map_err(|e| driver_err(e, "opening the device"))?;
    let major = unsafe {
        drv::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    }
    .map_err(|e| driver_err(e, "reading the compute capability"))?;
    let minor = unsafe {
        drv::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    }
    .map_err(|e| driver_err(e, "reading the compute capability"))?;
    Ok(format!("compute_{major}{minor}"))
}

impl CudaKernel {
    /// Compiles (or takes from cache) `src` for `device` and loads entry point `entry`.
    pub fn get(src: &KernelSource, entry: &str, device: usize) -> Result<Self> {
        static LOADED: OnceLock<Mutex<HashMap<(u64, String, usize), usize>>> = OnceLock::new();
        let dev_arch = compute_arch(device)?;
        let arch = match src.target {
            None => dev_arch,
            // `compute_90a` code runs on compute capability 9.0 devices only.
            Some(t) if t.trim_end_matches('a') == dev_arch => t.to_string(),
            Some(t) => bail!("kernel `{}` is built for {t} only, but device {device} is {dev_arch}", src.name),
        };
        // Machine code for the device's real architecture when the cache holds it (`wide kernels
        // precompile`: loads without any compiler), else PTX, compiled by the driver as it loads.
        // `WIDE_KERNEL_IMAGE=ptx` (read once) ignores cached machine code; a cubin the driver
        // refuses falls back to PTX too.
        static PTX_ONLY: OnceLock<bool> = OnceLock::new();
        let ptx_only = *PTX_ONLY.get_or_init(|| crate::knobs::choice("WIDE_KERNEL_IMAGE", &["ptx"]).is_some());
        let real = arch.replacen("compute_", "sm_", 1);
        // Each (image, entry, device) is loaded once per process.
        let load_once = |compiled: &CompiledKernel| -> Result<Self> {
            let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap();
            let k = (compiled.key, entry.to_string(), device);
            let func = match loaded.get(&k) {
                Some(&f) => f as sys::CUfunction,
                None => {
                    let f = Self::load(compiled, entry, device)?;
                    loaded.insert(k, f as usize);
                    f
                }
            };
            Ok(Self { func, device })
        };
        if let Some(compiled) = (!ptx_only).then(|| nvrtc::cached(src, &real)).flatten() {
            match load_once(&compiled) {
                Ok(k) => return Ok(k),
                Err(e) => eprintln!("warning: kernel `{}` for {real} did not load as machine code ({e:#}); compiling its PTX instead", src.name),
            }
        }
        match load_once(&nvrtc::compile(src, &arch)?) {
            Ok(k) => Ok(k),
            // A cached PTX the driver refuses (written by a newer NVRTC sharing the cache folder):
            // compiled again here, replacing the file; a fresh image that still fails is an error.
            Err(e) => load_once(&nvrtc::recompile(src, &arch)?).with_context(|| format!("kernel `{}` for {arch} did not load ({e:#}), nor after compiling it again", src.name)),
        }
    }

    fn load(compiled: &CompiledKernel, entry: &str, device: usize) -> Result<sys::CUfunction> {
        ensure_context(device)?;
        let module = unsafe { drv::module::load_data(compiled.image.as_ptr() as *const c_void) }
            .map_err(|e| driver_err(e, "loading a compiled module"))?;
        let name = CString::new(entry).context("kernel entry name")?;
        unsafe { drv::module::get_function(module, name) }
            .map_err(|e| driver_err(e, &format!("finding kernel entry `{entry}`")))
    }

    /// Raises the dynamic shared-memory limit of this kernel (needed above 48 KiB).
    pub fn set_max_dynamic_shared_mem(&self, bytes: u32) -> Result<()> {
        unsafe {
            drv::function::set_function_attribute(
                self.func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(|e| driver_err(e, "setting the dynamic shared memory limit"))
    }

    /// Sets this kernel's preferred shared-memory carveout: `percent` of the largest shared
    /// memory a multiprocessor can have, the rest of its 256 KiB of L1 / shared storage left to
    /// L1. A hint: the driver takes a larger carveout where the kernel's blocks need one. Set
    /// once per loaded function (later calls with the same value are free).
    pub fn set_carveout(&self, percent: i32) -> Result<()> {
        static SET: OnceLock<Mutex<HashMap<usize, i32>>> = OnceLock::new();
        let mut set = SET.get_or_init(Default::default).lock().unwrap();
        if set.get(&(self.func as usize)) == Some(&percent) {
            return Ok(());
        }
        unsafe { drv::function::set_function_attribute(self.func, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent) }
            .map_err(|e| driver_err(e, "setting the shared memory carveout"))?;
        set.insert(self.func as usize, percent);
        Ok(())
    }

    /// Bytes of statically declared shared memory of this kernel (the dynamic shared memory of a
    /// launch must fit beside them).
    pub fn static_shared_mem(&self) -> Result<u32> {
        unsafe { drv::function::get_function_attribute(self.func, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) }
            .map(|v| v.max(0) as u32)
            .map_err(|e| driver_err(e, "reading the static shared memory size"))
    }

    /// Launches on libtorch's current stream of the kernel's device.
    ///
    /// # Safety
    /// The arguments must match the kernel's signature, and every pointer must be valid for
    /// the accesses the kernel makes with this launch configuration.
    pub unsafe fn launch(&self, cfg: LaunchConfig, args: &[KernelArg]) -> Result<()> {
        self.launch_with(cfg, args, false)
    }

    /// [`launch`](Self::launch) with programmatic dependent launch where the device has it
    /// (compute capability 9.0+, unless `WIDE_PDL=0`): the kernel's blocks may start while the
    /// preceding launch on the stream still runs, and overlap its tail with their own set-up.
    ///
    /// # Safety
    /// As for `launch`; in addition the kernel must execute `pdl_wait()` (`pdl.cuh`) before it
    /// reads anything the preceding launch writes, and `pdl_trigger()` only after that wait.
    pub unsafe fn launch_pdl(&self, cfg: LaunchConfig, args: &[KernelArg]) -> Result<()> {
        self.launch_with(cfg, args, pdl_enabled(self.device)?)
    }

    /// [`launch_pdl`](Self::launch_pdl) with thread-block clusters of `cluster` blocks
    /// (compute capability 9.0+; each grid dimension a multiple of the cluster's).
    ///
    /// # Safety
    /// As for `launch_pdl`.
    pub unsafe fn launch_pdl_cluster(&self, cfg: LaunchConfig, cluster: (u32, u32, u32), args: &[KernelArg]) -> Result<()> {
        self.launch_ex(cfg, args, pdl_enabled(self.device)?, Some(cluster))
    }

    unsafe fn launch_with(&self, cfg: LaunchConfig, args: &[KernelArg], pdl: bool) -> Result<()> {
        self.launch_ex(cfg, args, pdl, None)
    }

    unsafe fn launch_ex(&self, cfg: LaunchConfig, args: &[KernelArg], pdl: bool, cluster: Option<(u32, u32, u32)>) -> Result<()> {
        ensure_context(self.device)?;
        let stream = shim::current_stream(self.device)? as sys::CUstream;
        // One 128-byte slot an argument (the driver copies each parameter's own size).
        let mut storage: Vec<[u64; 16]> = args
            .iter()
            .map(|a| {
                let mut slot = [0u64; 16];
                let b = &mut bytemuck_bytes(&mut slot)[..];
                match *a {
                    KernelArg::Ptr(p) => b[..8].copy_from_slice(&p.to_ne_bytes()),
                    KernelArg::I64(v) => b[..8].copy_from_slice(&v.to_ne_bytes()),
                    KernelArg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                    KernelArg::U32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                    KernelArg::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                    KernelArg::TensorMap(m) => slot = m,
                }
                slot
            })
            .collect();
        let mut params: Vec<*mut c_void> = storage.iter_mut().map(|b| b.as_mut_ptr() as *mut c_void).collect();
        if pdl || cluster.is_some() {
            let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
            let mut n = 0;
            if pdl {
                attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[n].value.programmaticStreamSerializationAllowed = 1;
                n += 1;
            }
            if let Some((x, y, z)) = cluster {
                attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                attrs[n].value.clusterDim.x = x;
                attrs[n].value.clusterDim.y = y;
                attrs[n].value.clusterDim.z = z;
                n += 1;
            }
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid.0,
                gridDimY: cfg.grid.1,
                gridDimZ: cfg.grid.2,
                blockDimX: cfg.block.0,
                blockDimY: cfg.block.1,
                blockDimZ: cfg.block.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: stream,
                attrs: attrs.as_mut_ptr(),
                numAttrs: n as u32,
            };
            let r = sys::cuLaunchKernelEx(&config, self.func, params.as_mut_ptr(), std::ptr::null_mut());
            if r != sys::CUresult::CUDA_SUCCESS {
                match cluster {
                    Some(c) => bail!("CUDA driver error while launching a kernel in clusters of {c:?} blocks (programmatic dependent launch {}): {r:?}", if pdl { "on" } else { "off" }),
                    None => bail!("CUDA driver error while launching a kernel with programmatic dependent launch: {r:?} (WIDE_PDL=0 turns it off)"),
                }
            }
        } else {
            drv::launch_kernel(self.func, cfg.grid, cfg.block, cfg.shared_mem_bytes, stream, &mut params)
                .map_err(|e| driver_err(e, "launching a kernel"))?;
        }
        // Launch-configuration errors are returned above; faults inside the kernel surface at
        // the next synchronising call.
        Ok(())
    }
}

fn bytemuck_bytes(slot: &mut [u64; 16]) -> &mut [u8; 128] {
    // SAFETY: [u64; 16] and [u8; 128] have the same size, and u8 has no alignment or validity
    // requirement.
    unsafe { &mut *(slot as *mut [u64; 16] as *mut [u8; 128]) }
}

/// Whether [`CudaKernel::launch_pdl`] uses programmatic dependent launch on `device`: compute
/// capability 9.0 or later, and `WIDE_PDL` is not `0` (read once).
pub fn pdl_enabled(device: usize) -> Result<bool> {
    static OFF: OnceLock<bool> = OnceLock::new();
    if *OFF.get_or_init(|| crate::knobs::switch("WIDE_PDL") == Some(false)) {
        return Ok(false);
    }
    Ok(compute_major(device)? >= 9)
}

/// The major compute capability of `device` (read from the driver once per device).
pub fn compute_major(device: usize) -> Result<usize> {
    cached_attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "reading the compute capability")
}

/// A 2-D tiled tensor map (`cuTensorMapEncodeTiled`) of a contiguous 2-byte-element CUDA
/// tensor `[rows, cols]` (cols innermost), boxes of `box_rows x box_cols` elements, 128-byte
/// swizzle (so `box_cols * 2` must be at most 128), for `cp.async.bulk.tensor` loads.
pub fn tensor_map_2d(t: &Tensor, f16: bool, box_rows: u32, box_cols: u32) -> Result<KernelArg> {
    let size = t.size();
    if size.len() != 2 || !t.is_contiguous() || t.kind().elt_size_in_bytes() != 2 {
        bail!("tensor_map_2d: needs a contiguous 2-D tensor of 2-byte elements, got {size:?} {:?}", t.kind());
    }
    let (rows, cols) = (size[0] as u64, size[1] as u64);
    tensor_map(t, f16, &[cols, rows], &[cols * 2], &[box_cols, box_rows])
}

/// A tiled tensor map with the 128-byte swizzle over a 2-byte-element CUDA tensor: `dims`
/// innermost first (the innermost contiguous), `strides` in bytes of every dimension but the
/// innermost (multiples of 16), `boxes` in elements (the innermost at most 64). Reads outside
/// `dims` fill zeros.
pub fn tensor_map(t: &Tensor, f16: bool, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<KernelArg> {
    let device = match t.device() {
        Device::Cuda(d) => d,
        d => bail!("tensor_map: needs a CUDA tensor, got one on {d:?}"),
    };
    let rank = dims.len();
    if !(1..=5).contains(&rank) || strides.len() + 1 != rank || boxes.len() != rank || t.kind().elt_size_in_bytes() != 2 {
        bail!("tensor_map: {rank} dimensions with {} strides and {} boxes over {:?} (needs 1-5 dimensions of 2-byte elements)", strides.len(), boxes.len(), t.kind());
    }
    if strides.iter().any(|s| s % 16 != 0) || t.data_ptr() as usize % 16 != 0 || boxes[0] * 2 > 128 {
        bail!("tensor_map: strides {strides:?} bytes must be multiples of 16, the data 16-byte aligned and the inner box at most 64 elements ({boxes:?})");
    }
    ensure_context(device)?;
    let elem = vec![1u32; rank];
    let dtype = if f16 { sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16 } else { sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            rank as u32,
            t.data_ptr(),
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("CUDA driver error while encoding a tensor map of dims {dims:?} (strides {strides:?} bytes): {r:?}");
    }
    // SAFETY: initialised by the successful call above.
    Ok(KernelArg::TensorMap(unsafe { map.assume_init() }.opaque))
}

/// The device's marketing name (e.g. "NVIDIA H200").
pub fn device_name(device: usize) -> Result<String> {
    ensure_context(device)?;
    let dev = drv::device::get(device as i32).map_err(|e| driver_err(e, "opening the device"))?;
    drv::device::get_name(dev).map_err(|e| driver_err(e, "reading the device name"))
}

/// Device-side timing with CUDA events on libtorch's current stream: `start`, queue work,
/// `stop_ms` waits for the end event and returns the elapsed milliseconds.
pub struct GpuTimer {
    start: sys::CUevent,
    end: sys::CUevent,
    device: usize,
}

impl GpuTimer {
    pub fn new(device: usize) -> Result<Self> {
        ensure_context(device)?;
        let start = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| driver_err(e, "creating an event"))?;
        let end = drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| driver_err(e, "creating an event"))?;
        Ok(Self { start, end, device })
    }

    pub fn start(&self) -> Result<()> {
        let stream = shim::current_stream(self.device)? as sys::CUstream;
        unsafe { drv::event::record(self.start, stream) }.map_err(|e| driver_err(e, "recording an event"))
    }

    pub fn stop_ms(&self) -> Result<f64> {
        let stream = shim::current_stream(self.device)? as sys::CUstream;
        unsafe { drv::event::record(self.end, stream) }.map_err(|e| driver_err(e, "recording an event"))?;
        unsafe { drv::event::synchronize(self.end) }.map_err(|e| driver_err(e, "waiting for an event (a kernel may have faulted)"))?;
        let ms = unsafe { drv::event::elapsed(self.start, self.end) }.map_err(|e| driver_err(e, "reading event time"))?;
        Ok(ms as f64)
    }
}

impl Drop for GpuTimer {
    fn drop(&mut self) {
        unsafe {
            let _ = drv::event::destroy(self.start);
            let _ = drv::event::destroy(self.end);
        }
    }
}

fn device_attribute(device: usize, attr: sys::CUdevice_attribute, what: &str) -> Result<usize> {
    ensure_context(device)?;
    let dev = drv::device::get(device as i32).map_err(|e| driver_err(e, "opening the device"))?;
    let v = unsafe { drv::device::get_attribute(dev, attr) }.map_err(|e| driver_err(e, what))?;
    Ok(v as usize)
}

/// L2 cache size of a device in bytes.
pub fn l2_cache_bytes(device: usize) -> Result<usize> {
    device_attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "reading the L2 size")
}

/// [`device_attribute`], read from the driver once per device and attribute (launch paths
/// ask on every call).
fn cached_attribute(device: usize, attr: sys::CUdevice_attribute, what: &str) -> Result<usize> {
    static CACHE: OnceLock<Mutex<HashMap<(usize, i64), usize>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (device, attr as i64);
    if let Some(&v) = cache.lock().unwrap().get(&key) {
        return Ok(v);
    }
    let v = device_attribute(device, attr, what)?;
    cache.lock().unwrap().insert(key, v);
    Ok(v)
}

/// Number of multiprocessors of a device (read once per device).
pub fn multiprocessor_count(device: usize) -> Result<usize> {
    cached_attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "reading the multiprocessor count")
}

/// Most shared memory one block of a device may use after opting in (227 KiB on compute
/// capability 9.0, 99 KiB on 8.6 / 8.9; read once per device).
pub fn max_shared_per_block_optin(device: usize) -> Result<usize> {
    cached_attribute(device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "reading the shared memory limit")
}

/// Grid `(gx, gy, 1)` for a kernel whose blocks each cover `gx`-th of a row and loop over rows
/// (`for m = blockIdx.y; m < rows; m += gridDim.y`): about 16 blocks a multiprocessor. One
/// block per row would launch hundreds of thousands of blocks at prefill sizes and spend more
/// time scheduling them than moving the bytes.
pub fn row_loop_grid(device: usize, gx: u32, rows: i64) -> Result<(u32, u32, u32)> {
    let gy = (16 * multiprocessor_count(device)? as u32 / gx.max(1)).clamp(1, rows.clamp(1, 65535) as u32);
    Ok((gx, gy, 1))
}
