//! The routing layout: one routing decision (a token x group mask) turned into per-group token
//! lists, built once and shared by every op of that decision (gate, up and down share the FFN
//! mask; Q, attention and O share the attention mask).
use super::routed_kernel;
use crate::cuda::{KernelArg, LaunchConfig};
use anyhow::{bail, Context, Result};
use std::cell::OnceCell;
use tch::{Device, Kind, Tensor};

/// Per-group active-token lists of one mask.
///
/// - `mask`: u8 `[M, NG]`, 1 where token m runs group g (kept raw for the GEMV paths).
/// - `perm`: i32 `[NG, M]`, for each group the active tokens in ascending order, then the
///   inactive ones in ascending order (the tiled kernels write zeros for those).
/// - `count`: i32 `[NG]`, active tokens per group.
///
/// `perm`/`count` are built on first use (decode-size calls read only the mask).
pub struct RouteLayout {
    mask: Tensor,
    lists: OnceCell<(Tensor, Tensor)>,
    coarse: OnceCell<(i64, (Tensor, Tensor))>,
    sparsity_hint: Option<f64>,
    measured: OnceCell<f64>,
    settled: bool,
    early: bool,
    always_on_from: Option<i64>,
}

impl std::fmt::Debug for RouteLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RouteLayout {{ tokens: {}, groups: {} }}", self.tokens(), self.groups())
    }
}

impl RouteLayout {
    /// Number of tokens M.
    pub fn tokens(&self) -> i64 {
        self.mask.size()[0]
    }
    /// Number of groups NG.
    pub fn groups(&self) -> i64 {
        self.mask.size()[1]
    }
    /// The raw mask, u8 `[M, NG]`.
    pub fn mask(&self) -> &Tensor {
        &self.mask
    }
    pub fn device(&self) -> Device {
        self.mask.device()
    }
    /// `(perm [NG, M] i32, count [NG] i32)`, built on first call.
    pub fn lists(&self) -> Result<&(Tensor, Tensor)> {
        if let Some(l) = self.lists.get() {
            return Ok(l);
        }
        let l = match self.mask.device() {
            Device::Cuda(d) => build_cuda(&self.mask, d)?,
            _ => build_reference(&self.mask),
        };
        Ok(self.lists.get_or_init(|| l))
    }
    /// The lists of the coarser mask whose group j is on for a token where any of groups
    /// `j * factor .. (j + 1) * factor` is (`[NG / factor, M]` and `[NG / factor]`), built on
    /// first call: what a kernel whose tile spans `factor` groups computes on (it applies the
    /// mask itself as it writes). One factor a layout.
    pub fn coarse_lists(&self, factor: i64) -> Result<&(Tensor, Tensor)> {
        if factor == 1 {
            return self.lists();
        }
        let ng = self.groups();
        if factor < 1 || ng % factor != 0 {
            bail!("route_layout: {ng} groups cannot be merged {factor} at a time");
        }
        if let Some((f, l)) = self.coarse.get() {
            if *f != factor {
                bail!("route_layout: this layout's coarse lists merge {f} groups, not {factor}");
            }
            return Ok(l);
        }
        let coarse = self.mask.view([self.tokens(), ng / factor, factor]).amax(&[2i64][..], false).contiguous();
        let l = match self.mask.device() {
            Device::Cuda(d) => build_cuda(&coarse, d)?,
            _ => build_reference(&coarse),
        };
        Ok(&self.coarse.get_or_init(|| (factor, l)).1)
    }
    /// The same decision and declarations with nothing built yet (the token lists are built
    /// again on first use): what the autotuner times a routed kernel on, so that its time
    /// includes the lists as a call on a fresh decision pays for them.
    pub fn unbuilt(&self) -> Self {
        let measured = OnceCell::new();
        if let Some(&m) = self.measured.get() {
            let _ = measured.set(m);
        }
        RouteLayout {
            mask: self.mask.shallow_clone(),
            lists: OnceCell::new(),
            coarse: OnceCell::new(),
            sparsity_hint: self.sparsity_hint,
            measured,
            settled: self.settled,
            early: self.early,
            always_on_from: self.always_on_from,
        }
    }
    /// The caller's expected skip rate (e.g. the router's running mean), used by dispatch so it
    /// need not synchronise to measure the mask.
    pub fn with_sparsity_hint(mut self, s: f64) -> Self {
        self.sparsity_hint = Some(s.clamp(0.0, 1.0));
        self
    }
    /// Declares that the mask is written at least two launches before any gemm_k GEMV that
    /// reads it (the inference engine: the gate runs before gate+up, or before Q, RoPE and
    /// attention), so that GEMV lists its groups and loads its first weights before it waits for
    /// the launch just before it (programmatic dependent launch). Wrong for a mask written by
    /// the launch just before: leave it unset there.
    pub fn with_settled_mask(mut self) -> Self {
        self.settled = true;
        self
    }
    /// Declares that the mask is written at least two launches before every routed launch that
    /// reads it (a router folded into the projection before the norm launch, so the gate+up or
    /// Q|K|V GEMV after that norm reads it early too); implies [`with_settled_mask`](Self::with_settled_mask).
    /// The gemm_mn GEMV then reads it and loads its first weights before it waits.
    pub fn with_early_mask(mut self) -> Self {
        self.settled = true;
        self.early = true;
        self
    }
    /// See [`with_early_mask`](Self::with_early_mask).
    pub fn early(&self) -> bool {
        self.early
    }
    /// Declares that groups `g..NG` are on for every token (a dense projection: 0; a fused Q|K|V
    /// whose trailing K|V groups are always on: the first of them). The gemm_mn GEMV then
    /// gives those groups to its first warps without reading the mask, and they load their first
    /// weights before waiting for the launch just before (programmatic dependent launch).
    pub fn with_always_on_from(mut self, g: i64) -> Result<Self> {
        anyhow::ensure!((0..=self.groups()).contains(&g), "route_layout: always-on groups must start within 0..={}, got {g}", self.groups());
        self.always_on_from = Some(g);
        Ok(self)
    }
    /// The first group on for every token by declaration (NG when none is declared).
    pub fn always_on_from(&self) -> i64 {
        self.always_on_from.unwrap_or_else(|| self.groups())
    }
    /// See [`with_settled_mask`](Self::with_settled_mask).
    pub fn settled(&self) -> bool {
        self.settled
    }
    /// The skip rate given with [`with_sparsity_hint`](Self::with_sparsity_hint), if any.
    pub fn sparsity_hint(&self) -> Option<f64> {
        self.sparsity_hint
    }
    /// Skip rate: the hint if one was given, else measured once from the mask (a device sync).
    pub fn sparsity(&self) -> f64 {
        if let Some(s) = self.sparsity_hint {
            return s;
        }
        *self.measured.get_or_init(|| {
            let n = self.mask.numel().max(1) as f64;
            1.0 - self.mask.sum(Kind::Int64).int64_value(&[]) as f64 / n
        })
    }
}

/// Builds the layout of `mask` (`[M, NG]`, bool or u8, nonzero = active) on the mask's device.
pub fn route_layout(mask: &Tensor) -> Result<RouteLayout> {
    let size = mask.size();
    if size.len() != 2 {
        bail!("route_layout: mask must be [tokens, groups], got shape {size:?}");
    }
    if size[0] < 1 || size[1] < 1 {
        bail!("route_layout: mask must have at least one token and one group, got shape {size:?}");
    }
    if size[0] > i32::MAX as i64 / 2 {
        bail!("route_layout: {} tokens do not fit the i32 token lists", size[0]);
    }
    let mask = match mask.kind() {
        // A bool tensor is one byte of 0/1 per entry: viewed as u8 without a device copy.
        Kind::Bool => mask.contiguous().view_dtype(Kind::Uint8),
        Kind::Uint8 => mask.contiguous(),
        k => bail!("route_layout: mask must be bool or u8, got {k:?}"),
    };
    Ok(RouteLayout { mask, lists: OnceCell::new(), coarse: OnceCell::new(), sparsity_hint: None, measured: OnceCell::new(), settled: false, early: false, always_on_from: None })
}

/// Reference layout in tch (any device): a stable descending sort of each group's column.
pub fn route_layout_reference(mask: &Tensor) -> (Tensor, Tensor) {
    build_reference(&mask.to_kind(Kind::Uint8))
}

fn build_reference(mask: &Tensor) -> (Tensor, Tensor) {
    let mt = mask.to_kind(Kind::Int64).transpose(0, 1); // [NG, M]
    let (_, perm) = mt.sort_stable(true, 1, true);
    let count = mt.sum_dim_intlist(1, false, Kind::Int64);
    (perm.to_kind(Kind::Int).contiguous(), count.to_kind(Kind::Int))
}

/// `WIDE_LAYOUT=chunked` (read once) builds the lists with the two-pass chunked partition instead
/// of the one-pass one (an A/B knob; both give the same lists); unset, empty or `onepass` is the
/// default, anything else an error.
fn layout_chunked() -> Result<bool> {
    static V: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    match V.get_or_init(|| crate::knobs::value("WIDE_LAYOUT")).as_deref() {
        None | Some("onepass") => Ok(false),
        Some("chunked") => Ok(true),
        Some(v) => bail!("WIDE_LAYOUT={v:?}: expected `onepass` (the default) or `chunked`"),
    }
}

fn build_cuda(mask: &Tensor, device: usize) -> Result<(Tensor, Tensor)> {
    let (m, ng) = (mask.size()[0], mask.size()[1]);
    let mask = mask.contiguous();
    let perm = Tensor::empty([ng, m], (Kind::Int, mask.device()));
    let count = Tensor::empty([ng], (Kind::Int, mask.device()));
    // The layout entry is the same in both dtype modules. Through the loaded-entry map: a
    // `CudaKernel::get` here hashed the whole routed source (~77 KB) on every build, ~0.1 ms of
    // host time per layout, two or three a layer in a routed prefill.
    let entry = if layout_chunked()? { "route_layout_chunked" } else { "route_layout" };
    let k = routed_kernel(false, None, entry, device).with_context(|| format!("loading {entry}"))?;
    let threads = (m.min(1024) as u32).div_ceil(32) * 32;
    unsafe {
        k.launch(
            LaunchConfig { grid: (ng as u32, 1, 1), block: (threads, 1, 1), shared_mem_bytes: 0 },
            &[KernelArg::tensor(&mask)?, KernelArg::I32(m as i32), KernelArg::I32(ng as i32), KernelArg::tensor(&perm)?, KernelArg::tensor(&count)?],
        )?;
    }
    Ok((perm, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unbuilt_keeps_the_decision_and_builds_the_lists_again() {
        let mask = Tensor::from_slice(&[1u8, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1]).view([4, 3]);
        let l = route_layout(&mask).unwrap().with_sparsity_hint(0.4).with_early_mask().with_always_on_from(2).unwrap();
        let built = l.lists().unwrap();
        let u = l.unbuilt();
        assert!(u.lists.get().is_none(), "an unbuilt copy has no lists until asked");
        assert!(u.mask().equal(l.mask()));
        assert_eq!((u.sparsity_hint(), u.early(), u.settled(), u.always_on_from()), (Some(0.4), true, true, 2));
        let again = u.lists().unwrap();
        assert!(again.0.equal(&built.0) && again.1.equal(&built.1));
        // Its own tensors: building them did not touch the original's.
        assert_ne!(again.0.data_ptr(), built.0.data_ptr());
        // A measured skip rate carries over (no second device sync for it).
        let m = route_layout(&mask).unwrap();
        let s = m.sparsity();
        assert_eq!(m.unbuilt().measured.get(), Some(&s));
    }

    #[test]
    fn reference_lists_active_first_ascending_then_inactive() {
        let mask = Tensor::from_slice(&[1u8, 0, 0, 1, 1, 1, 0, 0, 1, 0]).view([5, 2]);
        let l = route_layout(&mask).unwrap();
        let (perm, count) = l.lists().unwrap();
        assert_eq!(Vec::<i32>::try_from(count).unwrap(), vec![3, 2]);
        // group 0: tokens 0,2,4 active; 1,3 inactive. group 1: tokens 1,2 active.
        assert_eq!(Vec::<i32>::try_from(perm.view([-1])).unwrap(), vec![0, 2, 4, 1, 3, 1, 2, 0, 3, 4]);
        assert!((l.sparsity() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn coarse_lists_merge_neighbouring_groups() {
        // 5 tokens, 4 groups merged in pairs: coarse group 0 = groups 0|1, 1 = groups 2|3.
        #[rustfmt::skip]
        let mask = Tensor::from_slice(&[
            1u8, 0, 0, 0,
            0, 0, 0, 0,
            0, 1, 1, 1,
            0, 0, 0, 1,
            1, 1, 0, 0,
        ]).view([5, 4]);
        let l = route_layout(&mask).unwrap();
        let (perm, count) = l.coarse_lists(2).unwrap();
        assert_eq!(Vec::<i32>::try_from(count).unwrap(), vec![3, 2]);
        assert_eq!(Vec::<i32>::try_from(perm.view([-1])).unwrap(), vec![0, 2, 4, 1, 3, 2, 3, 0, 1, 4]);
        // The same lists as a layout of the merged mask; the fine lists are untouched.
        let merged = Tensor::from_slice(&[1u8, 0, 0, 0, 1, 1, 0, 1, 1, 0]).view([5, 2]);
        let r = route_layout_reference(&merged);
        assert!(perm.equal(&r.0) && count.equal(&r.1));
        assert_eq!(Vec::<i32>::try_from(&l.lists().unwrap().1).unwrap(), vec![2, 2, 1, 2]);
        // Factor 1 is the layout's own lists; a factor that does not divide, or a second one, is an error.
        assert!(l.coarse_lists(1).unwrap().1.equal(&l.lists().unwrap().1));
        assert!(l.coarse_lists(3).unwrap_err().to_string().contains("cannot be merged 3"));
        assert!(l.coarse_lists(4).unwrap_err().to_string().contains("merge 2 groups, not 4"));
        // An unbuilt copy builds its own.
        assert!(l.unbuilt().coarse.get().is_none());
    }

    #[test]
    fn all_inactive_and_all_active() {
        let l = route_layout(&Tensor::zeros([7, 3], (Kind::Bool, Device::Cpu))).unwrap();
        let (perm, count) = l.lists().unwrap();
        assert_eq!(count.sum(Kind::Int64).int64_value(&[]), 0);
        assert_eq!(Vec::<i32>::try_from(perm.get(2)).unwrap(), (0..7).collect::<Vec<_>>());
        let l = route_layout(&Tensor::ones([7, 3], (Kind::Bool, Device::Cpu))).unwrap();
        assert_eq!(Vec::<i32>::try_from(&l.lists().unwrap().1).unwrap(), vec![7, 7, 7]);
        assert_eq!(l.sparsity(), 0.0);
    }

    #[test]
    fn always_on_groups_default_to_none_and_must_lie_within_the_groups() {
        let l = route_layout(&Tensor::ones([2, 5], (Kind::Bool, Device::Cpu))).unwrap();
        assert_eq!(l.always_on_from(), 5, "no group is declared always on by default");
        let l = l.with_always_on_from(3).unwrap();
        assert_eq!(l.always_on_from(), 3);
        let e = route_layout(&Tensor::ones([2, 5], (Kind::Bool, Device::Cpu))).unwrap().with_always_on_from(6).unwrap_err();
        assert!(e.to_string().contains("0..=5"), "{e}");
    }

    #[test]
    fn rejects_bad_masks() {
        assert!(route_layout(&Tensor::ones([4], (Kind::Bool, Device::Cpu))).is_err());
        assert!(route_layout(&Tensor::ones([4, 2], (Kind::Float, Device::Cpu))).is_err());
        assert!(route_layout(&Tensor::ones([0, 2], (Kind::Bool, Device::Cpu))).is_err());
    }
}
