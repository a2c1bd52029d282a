//! The dense+mask gemm_mn as one cuBLASLt product whose epilogue applies the mask.
//!
//! `dense+mask` (the dispatch's fallback for output-width projections) was cuBLAS and then a
//! pass that writes zeros over the skipped outputs: at M = 4096 tokens of up (4096 -> 14336)
//! that pass writes ~59 MB after a 0.6 ms product, at 16-128 tokens it is one more launch after
//! a ~40 us one. cuBLASLt's `DRELU` epilogue multiplies every output by one bit of an auxiliary
//! bitmask inside the GEMM's own epilogue (it exists for ReLU's backward pass); with the mask
//! expanded to one bit per output (M x N / 8 bytes, a 32nd of the output) the product writes
//! exact zeros where a token skips a group, and the pass after it goes away.
//!
//! Loaded at run time (`libcublasLt`, the copy PyTorch ships); where the library, an algorithm
//! for the shape, or the dtype is missing, [`masked_linear`] returns `None` and the caller
//! keeps the two-pass form. `WIDE_DENSE_MASK_LT=0` turns it off (A/B).
use super::routed_kernel;
use crate::cuda::{row_loop_grid, KernelArg, LaunchConfig};
use crate::shim;
use anyhow::{bail, Result};
use cudarc::cublaslt::sys as lt;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};
use tch::{Device, Kind, Tensor};

/// Workspace offered to cuBLASLt's heuristic and kept per device (graph-capture safe: fixed).
const WORKSPACE_BYTES: i64 = 32 << 20;

/// Whether the cuBLASLt path is on: the library loads and `WIDE_DENSE_MASK_LT` is not `0`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("WIDE_DENSE_MASK_LT").map(|v| v != "0").unwrap_or(true) && unsafe { lt::is_culib_present() })
}

/// Bits per row of the bitmask: N rounded up to cuBLASLt's 128-bit leading-dimension unit.
pub fn bitmask_ld_bits(n: i64) -> i64 {
    (n + 127) / 128 * 128
}

/// The per-element bitmask of a `[M, N / G]` group mask: `[M, ld / 8]` bytes, bit n of row m
/// set where token m keeps output column n (bytes in column order, bit 0 first). `G` a
/// multiple of 8, so a group covers whole bytes. CPU reference of the CUDA expansion.
pub fn bitmask_reference(mask: &Tensor, group: i64, n: i64) -> Tensor {
    let ld_bytes = bitmask_ld_bits(n) / 8;
    let m = mask.size()[0];
    let bytes = (mask.to_kind(Kind::Uint8) * 255).to_kind(Kind::Uint8).repeat_interleave_self_int(group / 8, 1, None::<i64>);
    let pad = Tensor::zeros([m, ld_bytes - n / 8], (Kind::Uint8, mask.device()));
    Tensor::cat(&[bytes, pad], 1)
}

/// Expands the group mask (`[M, N / group]` bytes, contiguous, on `device`) into the bitmask
/// of [`bitmask_reference`] on the GPU: one launch, 16 bytes a thread.
pub fn expand_bitmask(mask: &Tensor, group: i64, n: i64, f16: bool, device: usize) -> Result<Tensor> {
    let m = mask.size()[0];
    let ld_bytes = bitmask_ld_bits(n) / 8;
    let bits = Tensor::empty([m, ld_bytes], (Kind::Uint8, Device::Cuda(device)));
    let chunks = (ld_bytes / 16) as u32;
    let k = routed_kernel(f16, None, "expand_group_bitmask", device)?;
    let grid = row_loop_grid(device, chunks.div_ceil(128), m)?;
    unsafe {
        k.launch_pdl(
            LaunchConfig { grid, block: (128, 1, 1), shared_mem_bytes: 0 },
            &[
                KernelArg::tensor(mask)?,
                KernelArg::tensor(&bits)?,
                KernelArg::I64(m),
                KernelArg::I32((n / group) as i32),
                KernelArg::I32(group as i32),
                KernelArg::I32(n as i32),
                KernelArg::I32(chunks as i32),
            ],
        )?;
    }
    Ok(bits)
}

/// One shape's descriptors and the heuristic's first algorithm (`None`: no algorithm, the
/// caller keeps the two-pass form).
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    c: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

struct State {
    handles: HashMap<usize, usize>,
    workspaces: HashMap<usize, Tensor>,
    plans: HashMap<PlanKey, Option<Plan>>,
}
// The raw cuBLASLt handles are used only under the mutex.
unsafe impl Send for State {}

/// (device, M, N, K, f16, alignment of x, w, y, aux): the heuristic's choice depends on them.
type PlanKey = (usize, i64, i64, i64, bool, [u32; 4]);

fn state() -> &'static Mutex<State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(State { handles: HashMap::new(), workspaces: HashMap::new(), plans: HashMap::new() }))
}

fn ok(s: lt::cublasStatus_t, what: &str) -> Result<()> {
    if s != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        bail!("cuBLASLt {what} failed: {s:?}");
    }
    Ok(())
}

/// Largest power of two (at most 256) dividing a device address.
fn alignment(ptr: *mut c_void) -> u32 {
    let p = ptr as usize;
    if p == 0 {
        return 256;
    }
    (1u32 << p.trailing_zeros().min(8)).min(256)
}

unsafe fn set_desc<T>(desc: lt::cublasLtMatmulDesc_t, attr: lt::cublasLtMatmulDescAttributes_t, v: &T, what: &str) -> Result<()> {
    ok(lt::cublasLtMatmulDescSetAttribute(desc, attr, v as *const T as *const c_void, std::mem::size_of::<T>()), what)
}

unsafe fn make_plan(handle: lt::cublasLtHandle_t, key: &PlanKey, aux: *mut c_void) -> Result<Option<Plan>> {
    use lt::cublasLtMatmulDescAttributes_t as D;
    let &(_, m, n, k, f16, al) = key;
    let dt = if f16 { lt::cudaDataType::CUDA_R_16F } else { lt::cudaDataType::CUDA_R_16BF };
    let mut desc = std::ptr::null_mut();
    ok(lt::cublasLtMatmulDescCreate(&mut desc, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt::cudaDataType::CUDA_R_32F), "descriptor")?;
    // Row-major y[M, N] = x[M, K] w[N, K]^T is column-major y^T[N, M] = w^T x^T: A = w (K x N,
    // transposed), B = x (K x M), D = y^T (N x M).
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &1i32, "transa")?;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &0i32, "transb")?;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DRELU, "epilogue")?;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, "aux pointer")?;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &bitmask_ld_bits(n), "aux ld")?;
    let layout = |rows: i64, cols: i64, ld: i64| -> Result<lt::cublasLtMatrixLayout_t> {
        let mut l = std::ptr::null_mut();
        ok(lt::cublasLtMatrixLayoutCreate(&mut l, dt, rows as u64, cols as u64, ld), "matrix layout")?;
        Ok(l)
    };
    let (a, b, c) = (layout(k, n, k)?, layout(k, m, k)?, layout(n, m, n)?);
    let mut pref = std::ptr::null_mut();
    ok(lt::cublasLtMatmulPreferenceCreate(&mut pref), "preference")?;
    use lt::cublasLtMatmulPreferenceAttributes_t as P;
    let ws = WORKSPACE_BYTES as u64;
    ok(lt::cublasLtMatmulPreferenceSetAttribute(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as *const c_void, 8), "workspace preference")?;
    for (attr, v) in [
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al[1]),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al[0]),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al[2]),
        (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al[2]),
    ] {
        ok(lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, &v as *const u32 as *const c_void, 4), "alignment preference")?;
    }
    let mut res: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
    let mut count = 0i32;
    let st = lt::cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, pref, 1, &mut res, &mut count);
    lt::cublasLtMatmulPreferenceDestroy(pref);
    if st != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS || count == 0 || res.state != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        for l in [a, b, c] {
            lt::cublasLtMatrixLayoutDestroy(l);
        }
        lt::cublasLtMatmulDescDestroy(desc);
        return Ok(None);
    }
    Ok(Some(Plan { desc, a, b, c, algo: res.algo }))
}

/// `y = (x w^T) * mask` (mask `[M, N / group]` expanded over each group's columns) as one
/// cuBLASLt product with the bitmask epilogue, on libtorch's current stream; `None` where the
/// path is off or cuBLASLt has no algorithm for the case (the caller keeps its two passes).
/// x `[M, K]`, w `[N, K]`, both bf16 or both f16 on one CUDA device; `group` a multiple of 8.
pub fn masked_linear(x: &Tensor, w: &Tensor, mask: &Tensor, group: i64) -> Result<Option<Tensor>> {
    let Device::Cuda(device) = x.device() else { return Ok(None) };
    let f16 = match x.kind() {
        Kind::Half => true,
        Kind::BFloat16 => false,
        _ => return Ok(None),
    };
    if !enabled() || group % 8 != 0 || w.kind() != x.kind() || w.device() != x.device() || x.dim() != 2 {
        return Ok(None);
    }
    let (m, k) = (x.size()[0], x.size()[1]);
    let n = w.size()[0];
    if m == 0 || w.size()[1] != k || n % group != 0 || mask.size() != [m, n / group] {
        return Ok(None);
    }
    let x = x.contiguous();
    let w = w.contiguous();
    let bits = expand_bitmask(mask, group, n, f16, device)?;
    let y = Tensor::empty([m, n], (x.kind(), x.device()));
    let ptr = |t: &Tensor| t.data_ptr();
    let key: PlanKey = (device, m, n, k, f16, [alignment(ptr(&x)), alignment(ptr(&w)), alignment(ptr(&y)), alignment(ptr(&bits))]);
    let mut st = state().lock().unwrap();
    let handle = match st.handles.get(&device) {
        Some(h) => *h as lt::cublasLtHandle_t,
        None => {
            crate::cuda::ensure_context(device)?;
            let mut h = std::ptr::null_mut();
            ok(unsafe { lt::cublasLtCreate(&mut h) }, "handle creation")?;
            st.handles.insert(device, h as usize);
            h
        }
    };
    if !st.workspaces.contains_key(&device) {
        st.workspaces.insert(device, Tensor::empty([WORKSPACE_BYTES], (Kind::Uint8, Device::Cuda(device))));
    }
    let aux = ptr(&bits);
    if !st.plans.contains_key(&key) {
        let plan = unsafe { make_plan(handle, &key, aux)? };
        st.plans.insert(key, plan);
    }
    let ws = ptr(&st.workspaces[&device]);
    let Some(plan) = st.plans.get(&key).and_then(|p| p.as_ref()) else { return Ok(None) };
    let stream = shim::current_stream(device)? as lt::cudaStream_t;
    let (alpha, beta) = (1.0f32, 0.0f32);
    unsafe {
        set_desc(plan.desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, "aux pointer")?;
        ok(
            lt::cublasLtMatmul(
                handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                ptr(&w),
                plan.a,
                ptr(&x),
                plan.b,
                &beta as *const f32 as *const c_void,
                ptr(&y),
                plan.c,
                ptr(&y),
                plan.c,
                &plan.algo,
                ws,
                WORKSPACE_BYTES as usize,
                stream,
            ),
            "matmul",
        )?;
    }
    // The bitmask must outlive the product: the caching allocator reuses its memory only for
    // work queued on this stream after the product.
    drop(bits);
    Ok(Some(y))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmask_rows_are_whole_bytes_per_group_padded_to_128_bits() {
        assert_eq!(bitmask_ld_bits(14336), 14336);
        assert_eq!(bitmask_ld_bits(1000), 1024);
        // 2 tokens, N = 48 in groups of 16: ld 128 bits = 16 bytes a row, 6 of them used.
        let mask = Tensor::from_slice(&[1u8, 0, 1, 0, 1, 1]).view([2, 3]);
        let b = bitmask_reference(&mask, 16, 48);
        assert_eq!(b.size(), [2, 16]);
        let row = |i: i64| Vec::<u8>::try_from(b.get(i)).unwrap();
        assert_eq!(row(0), [255, 255, 0, 0, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(row(1), [0, 0, 255, 255, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn masked_linear_declines_cpu_tensors() {
        let x = Tensor::zeros([2, 8], (Kind::BFloat16, Device::Cpu));
        let w = Tensor::zeros([16, 8], (Kind::BFloat16, Device::Cpu));
        let mask = Tensor::ones([2, 2], (Kind::Uint8, Device::Cpu));
        assert!(masked_linear(&x, &w, &mask, 8).unwrap().is_none());
    }
}
