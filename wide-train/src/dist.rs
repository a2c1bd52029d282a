//! Data-parallel training over processes, one per GPU, on one or many machines.
//!
//! Where a process sits comes from the variables launchers set: `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (`wide launch`, torchrun-style launchers), or
//! Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (with `MASTER_ADDR` defaulting to
//! `SLURM_LAUNCH_NODE_IPADDR`). Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank
//! connects to it twice (a control connection and a heartbeat connection). Over the control
//! connection rank 0 hands out the NCCL unique id, and small host values (losses, metrics, the
//! stop flag, barriers) are reduced through rank 0. Gradients of CUDA tensors are all-reduced by
//! NCCL on tch's current stream; CPU tensors (CPU runs and tests) go over the control plane.
//!
//! Failure behaviour: a rank whose peer closes its heartbeat connection (the process died), or
//! sends no heartbeat for `WIDE_DIST_HEARTBEAT_TIMEOUT` seconds (60; the machine is gone), or
//! that itself makes no training progress for `WIDE_DIST_TIMEOUT` seconds (1800; a collective
//! waits on a rank that hangs) prints one error line and exits with status 1. Its own
//! connections close with it, so the stop propagates to every rank within about a second.
//! Checkpoints are written by rank 0 only, atomically, so the last good one stays intact.
//!
//! Every rank holds the whole frozen backbone. Sharding it for models that do not fit one GPU
//! would add a second communicator over the ranks of a model replica; the data-parallel
//! reduction here would then run over the replicas, with the same sharding of samples.
use anyhow::{anyhow, bail, Context, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// This process's place in a distributed run, read from the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct DistEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

fn parse_var<T: std::str::FromStr>(get: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<T>> {
    match get(name) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v.trim().parse::<T>().map(Some).map_err(|_| anyhow!("{name}={v:?} is not a valid number")),
    }
}

impl DistEnv {
    /// `None` for a single process (no `WORLD_SIZE` / `SLURM_NTASKS`, or a world of 1).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let (rank, world, local, addr_default) = if let Some(world) = parse_var::<usize>(&get, "WORLD_SIZE")? {
            let rank: usize = parse_var(&get, "RANK")?.ok_or_else(|| anyhow!("WORLD_SIZE is set but RANK is not: a launcher must set both (or use `wide launch`)"))?;
            let local = parse_var(&get, "LOCAL_RANK")?.unwrap_or(rank);
            (rank, world, local, None)
        } else if let (Some(world), Some(rank)) = (parse_var::<usize>(&get, "SLURM_NTASKS")?, parse_var::<usize>(&get, "SLURM_PROCID")?) {
            // A task started by srun (a shell inside an allocation has no SLURM_PROCID and runs
            // as a single process).
            let local = parse_var(&get, "SLURM_LOCALID")?.unwrap_or(0);
            (rank, world, local, get("SLURM_LAUNCH_NODE_IPADDR"))
        } else {
            return Ok(None);
        };
        if world == 0 {
            bail!("WORLD_SIZE must be at least 1");
        }
        if rank >= world {
            bail!("RANK {rank} is not below WORLD_SIZE {world}");
        }
        if world == 1 {
            return Ok(None);
        }
        let master_addr = get("MASTER_ADDR").filter(|s| !s.trim().is_empty()).or(addr_default).unwrap_or_else(|| "127.0.0.1".to_string());
        let master_port = parse_var::<u16>(&get, "MASTER_PORT")?.unwrap_or(29500);
        Ok(Some(Self { rank, world, local_rank: local, master_addr, master_port }))
    }

    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }
}

/// Which micro-batches of an optimizer step this rank runs: micro-batch `k` of the step's
/// `grad_accum` (over all ranks) goes to rank `k % world`. Returns, per local micro-batch, the
/// global sample positions it covers. The union over ranks is the single-process step's.
pub fn shard_positions(step_start: u64, micro_batch: usize, grad_accum: usize, rank: usize, world: usize) -> Vec<Vec<u64>> {
    (0..grad_accum)
        .filter(|k| k % world == rank)
        .map(|k| {
            let s = step_start + (k * micro_batch) as u64;
            (s..s + micro_batch as u64).collect()
        })
        .collect()
}

/// Every process's view of the run: a single process, or one rank of several.
pub struct Dist {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    control: Mutex<Control>,
    nccl: Mutex<Option<nccl::Comm>>,
    nccl_id: Option<[u8; 128]>,
}

enum Control {
    Single,
    Root(Vec<TcpStream>),
    Peer(TcpStream),
}

static CURRENT: OnceLock<Dist> = OnceLock::new();
static CLOSING: AtomicBool = AtomicBool::new(false);
static PROGRESS_MS: AtomicU64 = AtomicU64::new(0);
static START: OnceLock<Instant> = OnceLock::new();
const MAGIC: &[u8; 4] = b"WIDE";

fn now_ms() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// A count (seconds, MiB) from the environment knob `name`, or `default`; a value that is not a
/// count is named in a warning and the default kept.
fn env_secs(name: &str, default: u64) -> u64 {
    wide_kernels::knobs::int(name, 0..=i64::MAX, "a count").map_or(default, |v| v as u64)
}

/// Prints one error line and ends the process at once (a rank blocked in a collective cannot
/// be unwound; exiting closes its connections, which stops the others).
fn fatal(rank: usize, msg: &str) -> ! {
    fatal_with(rank, msg, 1)
}

/// Exit status of a rank that stops because another rank stopped or went silent: the launcher
/// then reports the rank that failed first, not the ones that followed it.
pub const PEER_STOPPED_EXIT: i32 = 75;

/// The line goes out in one write, and the stderr lock is held until the process ends: two
/// threads can fail at once (the heartbeat watcher and a reduction), and a second message
/// started between the first one's write and `_exit` would be cut off mid-line, after the
/// first (the launcher's report must stay the last complete line).
fn fatal_with(rank: usize, msg: &str, code: i32) -> ! {
    let line = format!("error: rank {rank}: {msg}\n");
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
    unsafe { libc::_exit(code) }
}

/// The process's distributed context: set up from the environment on first use (a single
/// process when no launcher variables are set).
pub fn current() -> &'static Dist {
    CURRENT.get_or_init(|| match DistEnv::from_env() {
        Ok(None) => Dist::single(),
        Ok(Some(env)) => match Dist::connect(&env) {
            Ok(d) => d,
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "error: rank {}: {e:#}", env.rank);
                std::process::exit(1)
            }
        },
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            std::process::exit(1)
        }
    })
}

/// Sets up the context now (so that bootstrap errors surface before any work).
pub fn init() -> Result<&'static Dist> {
    if CURRENT.get().is_none() {
        let env = DistEnv::from_env()?;
        let d = match env {
            None => Dist::single(),
            Some(env) => Dist::connect(&env)?,
        };
        let _ = CURRENT.set(d);
    }
    Ok(current())
}

/// Marks training progress (the hang watchdog measures time since the last mark).
pub fn progress() {
    PROGRESS_MS.store(now_ms(), Ordering::Relaxed);
}

fn write_frame(s: &mut TcpStream, payload: &[u8]) -> std::io::Result<()> {
    s.write_all(&(payload.len() as u64).to_le_bytes())?;
    s.write_all(payload)
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut n = [0u8; 8];
    s.read_exact(&mut n)?;
    let mut buf = vec![0u8; u64::from_le_bytes(n) as usize];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn f64s_to_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_to_f64s(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// How host values combine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reduce {
    Sum,
    Max,
}

impl Dist {
    fn single() -> Self {
        Self { rank: 0, world: 1, local_rank: 0, control: Mutex::new(Control::Single), nccl: Mutex::new(None), nccl_id: None }
    }

    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    pub fn is_distributed(&self) -> bool {
        self.world > 1
    }

    /// Bootstrap over TCP: rank 0 accepts a control and a heartbeat connection from every
    /// other rank, checks that they agree on the world size, and hands out the NCCL id.
    pub fn connect(env: &DistEnv) -> Result<Self> {
        let timeout = Duration::from_secs(env_secs("WIDE_DIST_BOOTSTRAP_TIMEOUT", 300));
        let hb_timeout = Duration::from_secs(env_secs("WIDE_DIST_HEARTBEAT_TIMEOUT", 60));
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        let deadline = Instant::now() + timeout;
        // NCCL is only needed (and only loadable) where training runs on CUDA.
        let want_nccl = tch::Cuda::is_available();
        let (control, id, heartbeats) = if env.rank == 0 {
            let listener = TcpListener::bind(("0.0.0.0", env.master_port))
                .with_context(|| format!("rank 0 could not listen on port {} (MASTER_PORT): is another run using it?", env.master_port))?;
            listener.set_nonblocking(true)?;
            let mut control: Vec<Option<TcpStream>> = (0..env.world).map(|_| None).collect();
            let mut hb: Vec<Option<TcpStream>> = (0..env.world).map(|_| None).collect();
            let need = 2 * (env.world - 1);
            let mut got = 0;
            while got < need {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false)?;
                        s.set_nodelay(true)?;
                        s.set_read_timeout(Some(Duration::from_secs(30)))?;
                        let mut hello = [0u8; 4 + 8 + 8 + 1];
                        s.read_exact(&mut hello).context("reading a peer's hello")?;
                        if &hello[..4] != MAGIC {
                            continue; // not one of ours
                        }
                        let rank = u64::from_le_bytes(hello[4..12].try_into().unwrap()) as usize;
                        let world = u64::from_le_bytes(hello[12..20].try_into().unwrap()) as usize;
                        if world != env.world {
                            bail!("rank {rank} says WORLD_SIZE is {world}, rank 0 says {}: start every process with the same WORLD_SIZE", env.world);
                        }
                        if rank == 0 || rank >= env.world {
                            bail!("a process joined with RANK {rank}; ranks must be 1..{} besides rank 0", env.world - 1);
                        }
                        let slot = if hello[20] == 0 { &mut control[rank] } else { &mut hb[rank] };
                        if slot.is_some() {
                            bail!("two processes joined with RANK {rank}: every process needs its own RANK");
                        }
                        s.set_read_timeout(None)?;
                        *slot = Some(s);
                        got += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let missing: Vec<String> = (1..env.world).filter(|r| control[*r].is_none()).map(|r| r.to_string()).collect();
                            bail!(
                                "rank 0 waited {} s for the other ranks; missing: {} (check that every process was started with MASTER_ADDR={} MASTER_PORT={})",
                                timeout.as_secs(),
                                missing.join(", "),
                                env.master_addr,
                                env.master_port
                            );
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(e).context("accepting a peer connection"),
                }
            }
            let id = if want_nccl { Some(nccl::unique_id()?) } else { None };
            let mut peers: Vec<TcpStream> = control.into_iter().skip(1).map(|s| s.unwrap()).collect();
            for p in &mut peers {
                write_frame(p, id.as_ref().map(|i| &i[..]).unwrap_or(&[]))?;
            }
            let hbs: Vec<(usize, TcpStream)> = hb.into_iter().enumerate().skip(1).map(|(r, s)| (r, s.unwrap())).collect();
            (Control::Root(peers), id, hbs)
        } else {
            let dial = |channel: u8| -> Result<TcpStream> {
                loop {
                    let attempt = addr.to_socket_addrs().ok().and_then(|mut a| a.next()).and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok());
                    if let Some(mut s) = attempt {
                        s.set_nodelay(true)?;
                        let mut hello = MAGIC.to_vec();
                        hello.extend((env.rank as u64).to_le_bytes());
                        hello.extend((env.world as u64).to_le_bytes());
                        hello.push(channel);
                        s.write_all(&hello)?;
                        return Ok(s);
                    }
                    if Instant::now() > deadline {
                        bail!("could not reach rank 0 at {addr} within {} s: check MASTER_ADDR / MASTER_PORT and that rank 0 started", timeout.as_secs());
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            };
            let mut c = dial(0)?;
            let h = dial(1)?;
            let frame = read_frame(&mut c).context("receiving the NCCL id from rank 0")?;
            let id = (frame.len() == 128).then(|| <[u8; 128]>::try_from(&frame[..]).unwrap());
            (Control::Peer(c), id, vec![(0, h)])
        };
        progress();
        for (peer, s) in heartbeats {
            let me = env.rank;
            std::thread::spawn(move || heartbeat(me, peer, s, hb_timeout));
        }
        let rank = env.rank;
        let limit = env_secs("WIDE_DIST_TIMEOUT", 1800) * 1000;
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500));
            if CLOSING.load(Ordering::SeqCst) {
                return;
            }
            let idle = now_ms().saturating_sub(PROGRESS_MS.load(Ordering::Relaxed));
            if idle > limit {
                fatal(rank, &format!("no training progress for {} s (WIDE_DIST_TIMEOUT): a collective is waiting for a rank that hangs; stopping", idle / 1000));
            }
        });
        Ok(Self { rank: env.rank, world: env.world, local_rank: env.local_rank, control: Mutex::new(control), nccl: Mutex::new(None), nccl_id: id })
    }

    /// Combines `values` element-wise over all ranks (in place, identical everywhere).
    pub fn all_reduce_f64(&self, values: &mut [f64], op: Reduce) -> Result<()> {
        let mut c = self.control.lock().unwrap();
        let rank = self.rank;
        // Another rank stopped: stop like the heartbeat does, as a follower (PEER_STOPPED_EXIT),
        // naming that rank in the heartbeat's words (whichever notices first says the same).
        let lost = |peer: usize, e: std::io::Error| -> anyhow::Error {
            fatal_with(rank, &format!("rank {peer} stopped (its connection broke while reducing: {e}); stopping this one"), PEER_STOPPED_EXIT)
        };
        match &mut *c {
            Control::Single => {}
            Control::Root(peers) => {
                for (i, p) in peers.iter_mut().enumerate() {
                    let v = bytes_to_f64s(&read_frame(p).map_err(|e| lost(i + 1, e))?);
                    if v.len() != values.len() {
                        bail!("ranks disagree in a reduction: rank {} sent {} values, rank 0 has {}", i + 1, v.len(), values.len());
                    }
                    for (a, b) in values.iter_mut().zip(v) {
                        *a = match op {
                            Reduce::Sum => *a + b,
                            Reduce::Max => a.max(b),
                        };
                    }
                }
                let out = f64s_to_bytes(values);
                for (i, p) in peers.iter_mut().enumerate() {
                    write_frame(p, &out).map_err(|e| lost(i + 1, e))?;
                }
            }
            Control::Peer(s) => {
                write_frame(s, &f64s_to_bytes(values)).map_err(|e| lost(0, e))?;
                let v = bytes_to_f64s(&read_frame(s).map_err(|e| lost(0, e))?);
                if v.len() != values.len() {
                    bail!("ranks disagree in a reduction: rank 0 returned {} values, expected {}", v.len(), values.len());
                }
                values.copy_from_slice(&v);
            }
        }
        Ok(())
    }

    /// Runs `f` on rank 0 first and on the other ranks once it is done (shared folders that
    /// rank 0 builds and the others only open).
    pub fn main_first<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if !self.is_distributed() {
            return f();
        }
        if self.is_main() {
            let r = f()?;
            self.barrier()?;
            Ok(r)
        } else {
            self.barrier()?;
            f()
        }
    }

    /// Waits until every rank gets here.
    pub fn barrier(&self) -> Result<()> {
        self.all_reduce_f64(&mut [0.0], Reduce::Sum)
    }

    /// True on every rank when `flag` is true on any.
    pub fn any(&self, flag: bool) -> Result<bool> {
        if !self.is_distributed() {
            return Ok(flag);
        }
        let mut v = [flag as u8 as f64];
        self.all_reduce_f64(&mut v, Reduce::Max)?;
        Ok(v[0] > 0.0)
    }

    /// Mean of named scalars over ranks (every rank must pass the same names).
    pub fn mean_metrics(&self, metrics: Vec<(String, f64)>) -> Result<Vec<(String, f64)>> {
        if !self.is_distributed() {
            return Ok(metrics);
        }
        let mut v: Vec<f64> = metrics.iter().map(|m| m.1).collect();
        self.all_reduce_f64(&mut v, Reduce::Sum)?;
        Ok(metrics.into_iter().zip(v).map(|((k, _), s)| (k, s / self.world as f64)).collect())
    }

    /// Sums the gradients of `params` over all ranks, in place, in buckets of at most
    /// `WIDE_DIST_BUCKET_MB` (64) MB: NCCL on tch's current CUDA stream for CUDA tensors, the
    /// control plane for CPU tensors. Sums run in the gradients' own dtype, as gradient
    /// accumulation on one GPU does (with two ranks the result is the same as accumulating two
    /// micro-batches on one). A parameter without a gradient contributes zeros and keeps none.
    pub fn all_reduce_grads(&self, params: &[Tensor]) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        let grads: Vec<(Tensor, bool)> = params
            .iter()
            .map(|p| {
                let g = p.grad();
                if g.defined() {
                    (g, true)
                } else {
                    (p.zeros_like(), false)
                }
            })
            .collect();
        let cap_bytes = (env_secs("WIDE_DIST_BUCKET_MB", 64) as i64 * (1 << 20)).max(1);
        let mut start = 0;
        while start < grads.len() {
            let mut end = start;
            let mut n = 0i64;
            let (device, kind) = (grads[start].0.device(), grads[start].0.kind());
            let cap = cap_bytes / kind.elt_size_in_bytes() as i64;
            while end < grads.len() && (end == start || n + grads[end].0.numel() as i64 <= cap) && grads[end].0.device() == device && grads[end].0.kind() == kind {
                n += grads[end].0.numel() as i64;
                end += 1;
            }
            let bucket = &grads[start..end];
            let flat = Tensor::cat(&bucket.iter().map(|(g, _)| g.reshape([-1])).collect::<Vec<_>>(), 0);
            let reduced = self.all_reduce_tensor_sum(flat)?;
            let mut off = 0;
            let _g = tch::no_grad_guard();
            for (g, keep) in bucket {
                let k = g.numel() as i64;
                if *keep {
                    let mut g = g.shallow_clone();
                    g.copy_(&reduced.narrow(0, off, k).view_as(&g).to_kind(g.kind()));
                }
                off += k;
            }
            start = end;
        }
        Ok(())
    }

    /// Copies rank 0's values of `params` to every rank.
    pub fn broadcast_from_main(&self, params: &[Tensor]) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        let _g = tch::no_grad_guard();
        for p in params {
            // A sum with one nonzero term (rank 0's) is exact in any dtype.
            let flat = p.detach().reshape([-1]).copy();
            let flat = if self.is_main() { flat } else { flat.zeros_like() };
            p.detach().copy_(&self.all_reduce_tensor_sum(flat)?.view_as(p));
        }
        Ok(())
    }

    /// Sum over ranks of a 1-D tensor (returns the reduced tensor on the same device and dtype).
    pub fn all_reduce_tensor_sum(&self, t: Tensor) -> Result<Tensor> {
        if !self.is_distributed() {
            return Ok(t);
        }
        match t.device() {
            Device::Cuda(d) => {
                let t = t.contiguous();
                let mut comm = self.nccl.lock().unwrap();
                if comm.is_none() {
                    let id = self.nccl_id.ok_or_else(|| anyhow!("rank {}: no NCCL id (rank 0 has no CUDA device?): every rank must run on a GPU", self.rank))?;
                    *comm = Some(nccl::Comm::new(id, self.rank, self.world, d)?);
                }
                comm.as_ref().unwrap().all_reduce_sum(&t)?;
                Ok(t)
            }
            _ => {
                let mut v: Vec<f64> = Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1]))?;
                self.all_reduce_f64(&mut v, Reduce::Sum)?;
                Ok(Tensor::from_slice(&v).to_kind(t.kind()))
            }
        }
    }

    /// The device this rank trains on: `cuda` (or `auto` on a GPU machine) means the GPU of
    /// this rank's `LOCAL_RANK`.
    pub fn device(&self, requested: Device) -> Result<Device> {
        match requested {
            Device::Cuda(0) if self.is_distributed() => {
                let n = tch::Cuda::device_count() as usize;
                if self.local_rank >= n {
                    bail!("rank {} has LOCAL_RANK {} but this machine has {n} GPU(s): start at most {n} processes per machine", self.rank, self.local_rank);
                }
                wide_kernels::shim::set_device(self.local_rank)?;
                Ok(Device::Cuda(self.local_rank))
            }
            d => Ok(d),
        }
    }

    /// Ends the distributed part: every rank waits here, then closed connections are no longer
    /// errors (rank 0 may go on alone, e.g. to evaluate and write the final files).
    pub fn finish(&self) -> Result<()> {
        if self.is_distributed() {
            self.barrier()?;
            CLOSING.store(true, Ordering::SeqCst);
            // Nobody leaves before every rank has stopped watching its connections.
            self.barrier()?;
        }
        Ok(())
    }
}

/// Test hook for the failure behaviour: `WIDE_FAULT=RANK:STEP:exit|hang` makes that rank exit
/// with status 3, or stop making progress, when it reaches that optimizer step.
pub fn inject_fault(step: u64) {
    static SPEC: OnceLock<Option<(usize, u64, bool)>> = OnceLock::new();
    let spec = *SPEC.get_or_init(|| wide_kernels::knobs::value("WIDE_FAULT").and_then(|v| wide_kernels::knobs::report(fault_from(&v).map(Some))));
    let Some((rank, at, exit)) = spec else { return };
    let d = current();
    if rank != d.rank || at != step {
        return;
    }
    if exit {
        let _ = writeln!(std::io::stderr(), "rank {}: WIDE_FAULT: exiting at step {step}", d.rank);
        unsafe { libc::_exit(3) }
    }
    let _ = writeln!(std::io::stderr(), "rank {}: WIDE_FAULT: hanging at step {step}", d.rank);
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// `WIDE_FAULT`'s parse: `RANK:STEP:exit|hang` as (rank, step, exit).
fn fault_from(v: &str) -> Result<(usize, u64, bool), String> {
    let bad = || format!("WIDE_FAULT takes RANK:STEP:exit or RANK:STEP:hang, got '{v}'");
    match v.split(':').collect::<Vec<_>>()[..] {
        [r, s, how] => {
            let exit = match how {
                "exit" => true,
                "hang" => false,
                _ => return Err(bad()),
            };
            Ok((r.parse().map_err(|_| bad())?, s.parse().map_err(|_| bad())?, exit))
        }
        _ => Err(bad()),
    }
}

/// The variables that keep NVLink multicast off (set for every rank unless already set).
pub const NVLS_OFF: [(&str, &str); 3] = [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")];

/// `wide launch`: what to start.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// `None`: a free port (one machine) or 29500 (several).
    pub master_port: Option<u16>,
    /// Seconds between SIGTERM and SIGKILL when stopping the other ranks.
    pub grace_seconds: u64,
}

/// Starts `nproc_per_node` copies of this program with `args`, each with `RANK`,
/// `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and NVLink
/// multicast off; forwards SIGINT/SIGTERM; when one exits with an error, stops the others
/// and reports which rank failed.
pub fn launch(cfg: &LaunchConfig, args: &[String]) -> Result<()> {
    if cfg.nproc_per_node == 0 || cfg.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be at least 1");
    }
    if cfg.node_rank >= cfg.nnodes {
        bail!("--node-rank {} is not below --nnodes {}", cfg.node_rank, cfg.nnodes);
    }
    if args.is_empty() {
        bail!("nothing to launch: give the wide subcommand after `--`, e.g. `wide launch --nproc-per-node 2 -- calibrate --config RECIPE`");
    }
    let port = match cfg.master_port {
        Some(p) => p,
        None if cfg.nnodes == 1 => TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
        None => 29500,
    };
    let world = cfg.nnodes * cfg.nproc_per_node;
    let exe = std::env::current_exe().context("finding the wide executable")?;
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, std::sync::Arc::clone(&stop)).context("installing signal handlers")?;
    }
    let mut children = vec![];
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let mut c = std::process::Command::new(&exe);
        c.args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string());
        for (k, v) in NVLS_OFF {
            if std::env::var_os(k).is_none() {
                c.env(k, v);
            }
        }
        let child = c.spawn().with_context(|| format!("starting rank {rank}"))?;
        children.push((rank, child));
    }
    let signal_all = |children: &mut Vec<(usize, std::process::Child)>, sig: i32| {
        for (_, c) in children.iter_mut() {
            if c.try_wait().ok().flatten().is_none() {
                unsafe { libc::kill(c.id() as i32, sig) };
            }
        }
    };
    let mut failed: Option<(usize, String, bool)> = None;
    let mut forwarded = false;
    let mut stop_deadline: Option<Instant> = None;
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        if stop.load(Ordering::SeqCst) && !forwarded {
            forwarded = true;
            signal_all(&mut children, libc::SIGTERM);
        }
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            if let Some(status) = c.try_wait()? {
                done[i] = true;
                if !status.success() && reports_instead(failed.as_ref().map(|f| f.2), status.code()) {
                    let how = match (status.code(), std::os::unix::process::ExitStatusExt::signal(&status)) {
                        (Some(code), _) => format!("exited with status {code}"),
                        (None, Some(sig)) => format!("was killed by signal {sig}"),
                        _ => "failed".to_string(),
                    };
                    failed = Some((*rank, how, status.code() == Some(PEER_STOPPED_EXIT)));
                }
            }
        }
        if failed.is_some() && stop_deadline.is_none() {
            stop_deadline = Some(Instant::now() + Duration::from_secs(cfg.grace_seconds));
            signal_all(&mut children, libc::SIGTERM);
        }
        if stop_deadline.is_some_and(|d| Instant::now() > d) {
            signal_all(&mut children, libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Some((rank, how, _)) = failed {
        bail!("rank {rank} {how}; the other ranks were stopped (see the messages above; the last good checkpoint is kept)");
    }
    Ok(())
}

/// Whether a rank that just failed with `code` is reported instead of the failure kept so far
/// (`kept`: none yet, or whether it only followed another rank): the first failure is the cause,
/// unless it exited with [`PEER_STOPPED_EXIT`] and the cause shows up later (two ranks can end
/// within one polling interval, and the launcher polls them in rank order).
fn reports_instead(kept: Option<bool>, code: Option<i32>) -> bool {
    match kept {
        None => true,
        Some(kept_follows) => kept_follows && code != Some(PEER_STOPPED_EXIT),
    }
}

/// Beats once a second on `s` and watches the peer's beats.
fn heartbeat(me: usize, peer: usize, mut s: TcpStream, timeout: Duration) {
    let _ = s.set_read_timeout(Some(Duration::from_millis(1000)));
    let mut last = Instant::now();
    let mut buf = [0u8; 64];
    loop {
        if CLOSING.load(Ordering::SeqCst) {
            // Keep the connection open until the process ends: closing it now would look like
            // a crash to a peer that has not reached the end yet.
            std::mem::forget(s);
            return;
        }
        if s.write_all(&[1]).is_err() && !CLOSING.load(Ordering::SeqCst) {
            fatal_with(me, &format!("rank {peer} stopped (its connection broke); stopping this one"), PEER_STOPPED_EXIT);
        }
        match s.read(&mut buf) {
            Ok(0) => {
                if CLOSING.load(Ordering::SeqCst) {
                    return;
                }
                fatal_with(me, &format!("rank {peer} stopped (its connection closed); stopping this one"), PEER_STOPPED_EXIT);
            }
            Ok(_) => last = Instant::now(),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => {
                if CLOSING.load(Ordering::SeqCst) {
                    return;
                }
                fatal_with(me, &format!("rank {peer} stopped (its connection broke: {e}); stopping this one"), PEER_STOPPED_EXIT);
            }
        }
        if last.elapsed() > timeout {
            fatal_with(me, &format!("no heartbeat from rank {peer} for {} s (WIDE_DIST_HEARTBEAT_TIMEOUT); stopping this one", timeout.as_secs()), PEER_STOPPED_EXIT);
        }
    }
}

/// NCCL through cudarc (loaded at run time, only on GPU runs).
mod nccl {
    use anyhow::{anyhow, bail, Result};
    use cudarc::nccl::{result, sys};
    use tch::{Kind, Tensor};

    pub fn unique_id() -> Result<[u8; 128]> {
        let id = result::get_uniqueid().map_err(|e| anyhow!("ncclGetUniqueId failed: {e:?} (is libnccl.so on LD_LIBRARY_PATH?)"))?;
        Ok(id.internal.map(|c| c as u8))
    }

    pub struct Comm {
        comm: sys::ncclComm_t,
        device: usize,
    }

    // The communicator is used under the Dist mutex only.
    unsafe impl Send for Comm {}

    impl Comm {
        pub fn new(id: [u8; 128], rank: usize, world: usize, device: usize) -> Result<Self> {
            // NVLink multicast stays off in every process, however it was started (NCCL reads
            // these when the communicator is created).
            for (k, v) in super::NVLS_OFF {
                if std::env::var_os(k).is_none() {
                    std::env::set_var(k, v);
                }
            }
            wide_kernels::shim::set_device(device)?;
            wide_kernels::cuda::ensure_context(device)?;
            let id = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }.map_err(|e| anyhow!("ncclCommInitRank (rank {rank} of {world}, GPU {device}) failed: {e:?}"))?;
            Ok(Self { comm, device })
        }

        /// In-place sum of a contiguous CUDA tensor, on tch's current stream.
        pub fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
            let dtype = match t.kind() {
                Kind::Float => sys::ncclDataType_t::ncclFloat32,
                Kind::BFloat16 => sys::ncclDataType_t::ncclBfloat16,
                Kind::Half => sys::ncclDataType_t::ncclFloat16,
                Kind::Double => sys::ncclDataType_t::ncclFloat64,
                k => bail!("NCCL all-reduce of {k:?} tensors is not supported"),
            };
            let stream = wide_kernels::shim::current_stream(self.device)? as sys::cudaStream_t;
            let p = t.data_ptr();
            unsafe { result::all_reduce(p, p, t.numel(), dtype, sys::ncclRedOp_t::ncclSum, self.comm, stream) }.map_err(|e| anyhow!("ncclAllReduce failed: {e:?}"))?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn fault_specs_parse_or_are_named() {
        assert_eq!(fault_from("1:3:exit"), Ok((1, 3, true)));
        assert_eq!(fault_from("0:12:hang"), Ok((0, 12, false)));
        for bad in ["1:3", "1:3:crash", "x:3:exit", "1:-3:exit", "1:3:exit:4"] {
            assert_eq!(fault_from(bad).unwrap_err(), format!("WIDE_FAULT takes RANK:STEP:exit or RANK:STEP:hang, got '{bad}'"));
        }
    }

    /// Two threads that fail at once (the heartbeat watcher and a reduction, in a real run)
    /// leave whole lines only: run in child processes of this test binary, many times, since a
    /// cut-off second line needs the second thread to start writing inside the first one's
    /// window between its write and `_exit`.
    #[test]
    fn two_threads_failing_at_once_leave_whole_lines() {
        const CHILD: &str = "WIDE_TEST_FATAL_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let go = std::sync::Arc::new(std::sync::Barrier::new(2));
            let other = go.clone();
            std::thread::spawn(move || {
                other.wait();
                fatal_with(0, "second thread: rank 1 stopped (its connection broke); stopping this one", PEER_STOPPED_EXIT)
            });
            go.wait();
            fatal_with(0, "first thread: rank 1 stopped (its connection broke while reducing); stopping this one", PEER_STOPPED_EXIT)
        }
        let exe = std::env::current_exe().unwrap();
        for run in 0..60 {
            let o = std::process::Command::new(&exe)
                .args(["--exact", "dist::tests::two_threads_failing_at_once_leave_whole_lines", "--nocapture"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            assert_eq!(o.status.code(), Some(PEER_STOPPED_EXIT), "run {run}");
            let err = String::from_utf8_lossy(&o.stderr);
            let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ") || l.contains("rank 0")).collect();
            assert!(!lines.is_empty(), "run {run}: no error line in {err:?}");
            for l in &lines {
                assert!(l.starts_with("error: rank 0: ") && l.ends_with("; stopping this one"), "run {run}: cut-off line {l:?} in {err:?}");
            }
            assert!(err.ends_with("stopping this one\n"), "run {run}: the output ends mid-line: {err:?}");
        }
    }

    #[test]
    fn the_launcher_names_the_rank_that_failed_first() {
        assert!(reports_instead(None, Some(3)));
        assert!(reports_instead(None, Some(PEER_STOPPED_EXIT)), "a follower is kept until the cause shows up");
        // Rank 0 followed rank 1 and was polled first: rank 1's own failure replaces it.
        assert!(reports_instead(Some(true), Some(3)));
        assert!(reports_instead(Some(true), None), "killed by a signal");
        assert!(!reports_instead(Some(true), Some(PEER_STOPPED_EXIT)));
        assert!(!reports_instead(Some(false), Some(3)), "the first real failure stays the cause");
    }

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn environment_of_launchers_and_slurm() {
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "1"), ("RANK", "0")])).unwrap(), None);
        let e = DistEnv::from_vars(vars(&[("WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node7"), ("MASTER_PORT", "1234")])).unwrap().unwrap();
        assert_eq!(e, DistEnv { rank: 3, world: 4, local_rank: 1, master_addr: "node7".into(), master_port: 1234 });
        assert_eq!(DistEnv::from_vars(vars(&[("SLURM_NTASKS", "8")])).unwrap(), None);
        let s = DistEnv::from_vars(vars(&[("SLURM_NTASKS", "8"), ("SLURM_PROCID", "5"), ("SLURM_LOCALID", "1"), ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.2")])).unwrap().unwrap();
        assert_eq!(s, DistEnv { rank: 5, world: 8, local_rank: 1, master_addr: "10.0.0.2".into(), master_port: 29500 });
        let err = |p: &[(&str, &str)]| format!("{:#}", DistEnv::from_vars(vars(p)).unwrap_err());
        assert!(err(&[("WORLD_SIZE", "2")]).contains("RANK is not"));
        assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("not below WORLD_SIZE"));
        assert!(err(&[("WORLD_SIZE", "two"), ("RANK", "0")]).contains("not a valid number"));
    }

    /// Any world size covers exactly the samples of the single-process step, each once.
    #[test]
    fn sharding_partitions_the_step() {
        for world in [1, 2, 4] {
            let mut all: Vec<u64> = (0..world).flat_map(|r| shard_positions(96, 3, 8, r, world).into_iter().flatten()).collect();
            all.sort();
            assert_eq!(all, (96..96 + 24).collect::<Vec<u64>>(), "world {world}");
            for r in 0..world {
                assert_eq!(shard_positions(96, 3, 8, r, world).len(), 8 / world);
            }
        }
        assert_eq!(shard_positions(0, 2, 4, 1, 2), vec![vec![2, 3], vec![6, 7]]);
    }

    /// Bootstrap, reductions and barriers between threads standing in for ranks on loopback.
    #[test]
    fn control_plane_on_loopback() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let world = 3;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                std::thread::spawn(move || {
                    let env = DistEnv { rank, world, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port };
                    let d = Dist::connect(&env).unwrap();
                    let mut v = [rank as f64, 10.0 * rank as f64];
                    d.all_reduce_f64(&mut v, Reduce::Sum).unwrap();
                    assert_eq!(v, [3.0, 30.0]);
                    let mut m = [rank as f64];
                    d.all_reduce_f64(&mut m, Reduce::Max).unwrap();
                    assert_eq!(m, [2.0]);
                    assert!(d.any(rank == 1).unwrap());
                    assert!(!d.any(false).unwrap());
                    let t = Tensor::from_slice(&[1.0f32, rank as f32]);
                    let r = d.all_reduce_tensor_sum(t).unwrap();
                    assert_eq!(Vec::<f32>::try_from(r).unwrap(), vec![3.0, 3.0]);
                    let means = d.mean_metrics(vec![("loss".into(), rank as f64)]).unwrap();
                    assert_eq!(means, vec![("loss".to_string(), 1.0)]);
                    d.finish().unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
