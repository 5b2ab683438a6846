//! The device side: matmul contexts on the NPU cores, weights in native layout, and the run.
//!
//! * Per distinct (K, N) shape: N is split into aligned slices, one per core (wide slices cut
//!   again, long K in segments; [`super::split`]), and for every batch bucket M (16, 32, 64 by
//!   default) each slice gets its own context pinned to its core, its own C buffer, and the A buffer
//!   of its K segment, shared by the contexts of all cores. A batch of `t` rows runs in the smallest
//!   bucket with M ≥ t (rows beyond `t` are left as they are: the rows of a product are independent,
//!   and their results are not read).
//! * Per weight matrix and slice: one B buffer in the native layout, written once at load (fp16 from
//!   the dequantized weights, or int8 with a scale per output feature); it is bound to the slice's
//!   context before each run (skipped when it is still bound).
//! * A run: thread 0 of the executor converts the input into the A buffers (native layout, fp16 or
//!   int8 with a scale per token), syncs them, hands cores 1 and 2 to two helper threads and runs
//!   core 0 itself; each core runs its contexts, syncs its C buffers and un-tiles them into its
//!   columns of the f32 output (K segments summed; int8 scales applied). One lock serialises runs.
//! * Failures: a shape whose contexts cannot be created is left to the CPU at load; a run that fails
//!   disables its shape (from the next graph run on; the executor computes the failed node on the
//!   CPU). Each logs one line.

use std::boxed::Box;
use std::string::{String, ToString};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::vec::Vec;
use std::{eprintln, format, vec};

use half::f16;
use rknn_sys::layout::{pack_native_b, BTile};
use rknn_sys::{
    rknn_core_mask, rknn_matmul_info, rknn_matmul_layout, rknn_matmul_type, rknn_mem_sync_mode, Matmul,
    Operand, RknnError, Runtime, TensorMem,
};

use super::check::{abs_max, int8_scale};
use super::{split, NpuConfig, NpuPlan, Part, Precision, K_SEGMENT};
use crate::exec::MatmulOffload;
use crate::quant::{dequantize_row_ref, GgmlType};

/// Largest finite fp16.
const F16_MAX: f32 = 65504.0;

/// Prints the one line a failure is reported with.
pub(crate) fn log(msg: &str) {
    eprintln!("pinfer: npu: {msg}");
}

/// Why no backend was built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NpuError {
    /// The runtime library could not be loaded (no NPU software on this machine).
    Missing(String),
    /// Nothing qualifies for the NPU.
    Nothing(String),
    /// The NPU is there but unusable (context creation failed, ...).
    Failed(String),
}

impl NpuError {
    /// The message, ending with what happens instead.
    pub fn message(&self) -> String {
        match self {
            Self::Missing(m) | Self::Failed(m) => format!("{m}; all matmuls run on the CPU"),
            Self::Nothing(m) => m.clone(),
        }
    }
}

/// Counters of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct NpuStats {
    /// Weight matrices on the NPU.
    pub matmuls: usize,
    /// Distinct shapes usable (not disabled).
    pub shapes: usize,
    /// Shapes disabled after a failure.
    pub disabled: usize,
    /// Matmul calls the NPU completed.
    pub calls: u64,
    /// Seconds in those calls (input conversion and output un-tiling included).
    pub seconds: f64,
    /// Bytes of NPU memory (weights and buffers).
    pub bytes: usize,
    /// Seconds spent converting the weights at load.
    pub load_seconds: f64,
}

/// One batch bucket of a shape: contexts (one per part) for M rows, their buffers.
struct Bucket {
    m: usize,
    /// A, per K segment (shared by the parts of that segment).
    a: Vec<TensorMem<'static>>,
    /// C, per part.
    c: Vec<TensorMem<'static>>,
    /// Per part: 1 + index of the weight whose B is bound (0: none).
    bound: Vec<AtomicUsize>,
    /// Native A run length and native C run length reported by the runtime.
    a_tile: usize,
    c_tile: usize,
    /// Contexts, per part (after the buffers: dropped last).
    ctx: Vec<Matmul<'static>>,
}

/// A (K, N) shape and its contexts.
struct Shape {
    k: usize,
    n: usize,
    parts: Vec<Part>,
    /// Cores with at least one part.
    cores: usize,
    buckets: Vec<Bucket>,
    /// Native B tile per part.
    tiles: Vec<BTile>,
    /// B bytes per part.
    b_sizes: Vec<u32>,
    enabled: AtomicBool,
    latched: AtomicBool,
    calls: AtomicU64,
    nanos: AtomicU64,
}

/// A weight matrix on the NPU.
struct Weight {
    offset: usize,
    shape: usize,
    /// B per part of its shape.
    b: Vec<TensorMem<'static>>,
    /// int8: scale per output feature.
    scales: Vec<f32>,
}

/// What the helper threads share with the caller.
struct Inner {
    rt: &'static Runtime,
    precision: Precision,
    min_batch: usize,
    // Drop order: weights' buffers, then the shapes (whose contexts allocated them).
    weights: Vec<Weight>,
    shapes: Vec<Shape>,
    /// Serialises runs (the A buffers and the helper slots are shared); holds the per-token int8
    /// scales of the run.
    run: Mutex<Vec<f32>>,
}

/// One run handed to the core threads.
#[derive(Clone, Copy)]
struct Job {
    shape: usize,
    weight: usize,
    bucket: usize,
    rows: usize,
    out: *mut f32,
    a_scales: *const f32,
}

// SAFETY: the pointers address the caller's output and scales, which outlive the job (the caller
// waits for every helper); each core writes only its own columns.
unsafe impl Send for Job {}

/// The NPU backend of a session: implements [`MatmulOffload`] for the planned matmuls.
pub struct NpuBackend {
    // Dropped first: stops the helper threads, which hold `inner`.
    crew: Crew,
    inner: Arc<Inner>,
    plan: NpuPlan,
    bytes: usize,
    load_seconds: f64,
}

impl std::fmt::Debug for NpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpuBackend").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

/// Raises the soft limit on open files towards `needed` (the runtime holds one fd per buffer).
fn raise_fd_limit(needed: u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    if soft >= needed {
        return;
    }
    // As rk-llama advises (ulimit -n 65536), within the hard limit.
    let target = needed.max(65536).min(hard);
    if setrlimit(Resource::RLIMIT_NOFILE, target, hard).is_err() || target < needed {
        log(&format!(
            "the NPU needs about {needed} open files, the limit is {} (raise it with ulimit -n)",
            target.max(soft)
        ));
    }
}

/// librknnrt unmaps ranges that can alias glibc's mmap-backed large allocations (rk-llama saw heap
/// corruption while weights were uploaded): from now on glibc serves large blocks from the heap.
fn keep_malloc_off_mmap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes a tuning parameter of the allocator.
    unsafe {
        nix::libc::mallopt(nix::libc::M_MMAP_MAX, 0);
    }
}

/// The bytes of a runtime buffer, writable.
///
/// # Safety
/// The caller must be the only one accessing the buffer (the run lock, or load time).
#[allow(clippy::mut_from_ref)]
unsafe fn bytes_mut<'m>(mem: &'m TensorMem<'_>) -> &'m mut [u8] {
    let d = mem.descriptor();
    // SAFETY: the runtime maps `size` bytes at `virt_addr` (checked by TensorMem) for the buffer's
    // life; exclusivity is the caller's.
    unsafe { core::slice::from_raw_parts_mut((d.virt_addr as *mut u8).add(d.offset as usize), mem.len()) }
}

/// Dequantizes rows `rows` of a weight matrix (`k` elements each, type `ty`, rows from byte 0 of
/// `data`) into `out` (row-major).
pub fn dequantize_rows(
    ty: GgmlType,
    data: &[u8],
    k: usize,
    rows: core::ops::Range<usize>,
    out: &mut [f32],
) -> Result<(), String> {
    let row_bytes = ty.bytes_for(k as u64).ok_or("bad row length")? as usize;
    for (i, r) in rows.enumerate() {
        let src = data.get(r * row_bytes..(r + 1) * row_bytes).ok_or("weights outside the file")?;
        dequantize_row_ref(ty, src, &mut out[i * k..(i + 1) * k]).map_err(|e| format!("{e:?}"))?;
    }
    Ok(())
}

fn layout_error(what: &str, k: usize, n: usize) -> RknnErrorText {
    RknnErrorText(format!("the runtime reports an unexpected {what} for K = {k}, N = {n}"))
}

/// An error as the text of its log line.
struct RknnErrorText(String);

impl From<RknnError> for RknnErrorText {
    fn from(e: RknnError) -> Self {
        Self(e.to_string())
    }
}

impl NpuBackend {
    /// Loads the runtime, creates the contexts of every shape of `plan` and uploads its weights
    /// (read from `data`, the model file's bytes). Shapes or weights that fail are logged (one line
    /// each) and left to the CPU; if none is left, or the runtime is missing or unusable, the error
    /// says why (the caller logs it).
    pub fn new(data: &[u8], plan: &NpuPlan, config: &NpuConfig) -> Result<Self, NpuError> {
        if plan.matmuls.is_empty() {
            return Err(NpuError::Nothing(format!(
                "no matmul of this model qualifies for the NPU (K % 32, N % {}, batches of {}+); all run on the CPU",
                plan.precision.n_align(),
                plan.min_batch
            )));
        }
        let started = std::time::Instant::now();
        let rt = match &config.library {
            Some(path) => Runtime::load_from(path),
            None => Runtime::load(),
        }
        .map_err(|e| NpuError::Missing(e.to_string()))?;
        let rt: &'static Runtime = Box::leak(Box::new(rt));
        // Before the first runtime buffer and the conversion's large temporary allocations.
        keep_malloc_off_mmap();
        let (buffers, contexts) = plan.handles();
        raise_fd_limit((buffers + contexts) as u64 + 512);

        let precision = plan.precision;
        let mut shapes = Vec::new();
        let mut shape_of: Vec<((usize, usize), Option<usize>)> = Vec::new();
        for (k, n) in plan.shapes() {
            match create_shape(rt, plan, k, n) {
                Ok(s) => {
                    shape_of.push(((k, n), Some(shapes.len())));
                    shapes.push(s);
                }
                Err(RknnErrorText(e)) if shapes.is_empty() && shape_of.is_empty() => {
                    // The first shape: the device itself is unusable; one line for everything.
                    return Err(NpuError::Failed(format!("cannot create NPU matmul contexts ({e})")));
                }
                Err(RknnErrorText(e)) => {
                    log(&format!(
                        "cannot create contexts for K = {k}, N = {n} ({e}); that shape runs on the CPU"
                    ));
                    shape_of.push(((k, n), None));
                }
            }
        }
        let mut weights = Vec::new();
        let mut bytes = 0usize;
        for m in &plan.matmuls {
            let Some(&(_, Some(si))) = shape_of.iter().find(|(s, _)| *s == (m.k, m.n)) else { continue };
            let Some(src) = data.get(m.offset..) else { continue };
            match upload_weight(rt, &shapes[si], precision, m.ty, src) {
                Ok((b, scales)) => {
                    bytes += m.k * m.n * precision.weight_bytes();
                    weights.push(Weight { offset: m.offset, shape: si, b, scales });
                }
                Err(RknnErrorText(e)) => {
                    log(&format!("cannot upload {} ({e}); it runs on the CPU", m.weight));
                }
            }
        }
        if weights.is_empty() {
            return Err(NpuError::Failed("no weight matrix could be uploaded to the NPU".into()));
        }
        weights.sort_by_key(|w| w.offset);
        for s in &shapes {
            for b in &s.buckets {
                bytes += b.a.iter().chain(&b.c).map(TensorMem::len).sum::<usize>();
            }
        }
        let max_cores = shapes.iter().map(|s| s.cores).max().unwrap_or(1);
        let inner = Arc::new(Inner {
            rt,
            precision,
            min_batch: plan.min_batch,
            weights,
            shapes,
            run: Mutex::new(Vec::new()),
        });
        let crew = Crew::new(&inner, max_cores, config.cpu_cores.as_deref());
        Ok(Self { crew, inner, plan: plan.clone(), bytes, load_seconds: started.elapsed().as_secs_f64() })
    }

    /// The plan the backend was built from.
    pub fn plan(&self) -> &NpuPlan {
        &self.plan
    }

    /// The runtime library in use.
    pub fn library(&self) -> &std::path::Path {
        self.inner.rt.path()
    }

    /// Whether the weights at `offset` are on the NPU (and their shape is not disabled).
    pub fn has(&self, offset: usize) -> bool {
        self.inner.weight(offset).is_some_and(|w| self.inner.shapes[w.shape].enabled.load(Ordering::Relaxed))
    }

    /// Counters.
    pub fn stats(&self) -> NpuStats {
        let s = &self.inner.shapes;
        NpuStats {
            matmuls: self.inner.weights.len(),
            shapes: s.iter().filter(|s| s.enabled.load(Ordering::Relaxed)).count(),
            disabled: s.iter().filter(|s| !s.enabled.load(Ordering::Relaxed)).count(),
            calls: s.iter().map(|s| s.calls.load(Ordering::Relaxed)).sum(),
            seconds: s.iter().map(|s| s.nanos.load(Ordering::Relaxed)).sum::<u64>() as f64 * 1e-9,
            bytes: self.bytes,
            load_seconds: self.load_seconds,
        }
    }
}

/// Creates the contexts and A/C buffers of shape (K, N) for every bucket it needs.
fn create_shape(rt: &'static Runtime, plan: &NpuPlan, k: usize, n: usize) -> Result<Shape, RknnErrorText> {
    let precision = plan.precision;
    let parts = split(k, n, precision.n_align(), plan.cores);
    let (ty, esize) = match precision {
        Precision::Fp16 => (rknn_matmul_type::RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32, 2),
        Precision::Int8 => (rknn_matmul_type::RKNN_INT8_MM_INT8_TO_INT32, 1),
    };
    let native = rknn_matmul_layout::RKNN_MM_LAYOUT_NATIVE.0 as i16;
    let segments = k.div_ceil(K_SEGMENT);
    let mut buckets = Vec::new();
    let mut tiles = vec![BTile { n: 0, k: 0 }; parts.len()];
    let mut b_sizes = vec![0u32; parts.len()];
    for m in plan.buckets_for(plan.max_tokens(k, n)) {
        let mut ctx = Vec::with_capacity(parts.len());
        let (mut a_tile, mut c_tile) = (0, 0);
        for (pi, p) in parts.iter().enumerate() {
            let info = rknn_matmul_info {
                M: m as i32,
                K: p.k_len as i32,
                N: p.n_len as i32,
                type_: ty,
                B_layout: native,
                AC_layout: native,
                ..Default::default()
            };
            let mm = Matmul::new(rt, &info)?;
            // One core per context; a single-core SoC may refuse the mask, which changes nothing.
            let _ = mm.set_core_mask(rknn_core_mask(1 << p.core));
            let io = *mm.io_attr();
            let (a, b, c) = (io.A, io.B, io.C);
            // Native A [K/s, M, s], C [N/s, M, s], B [N/sN, K/sK, sN, sK]: check what we rely on.
            let (sa, sc) = (a.dims[2] as usize, c.dims[2] as usize);
            let a_ok = a.n_dims == 3
                && sa > 0
                && a.dims[1] as usize == m
                && a.dims[0] as usize * sa == p.k_len
                && a.size as usize == m * p.k_len * esize;
            let c_ok = c.n_dims == 3
                && sc > 0
                && c.dims[1] as usize == m
                && c.dims[0] as usize * sc == p.n_len
                && c.size as usize == m * p.n_len * 4;
            let tile = BTile { n: b.dims[2] as usize, k: b.dims[3] as usize };
            let b_ok = b.n_dims == 4
                && tile.n > 0
                && tile.k > 0
                && b.dims[0] as usize * tile.n == p.n_len
                && b.dims[1] as usize * tile.k == p.k_len
                && b.size as usize == p.k_len * p.n_len * esize;
            if !(a_ok && c_ok && b_ok) {
                return Err(layout_error("native layout", k, n));
            }
            if (a_tile, c_tile) != (0, 0) && (a_tile, c_tile) != (sa, sc) {
                return Err(layout_error("tile width", k, n));
            }
            (a_tile, c_tile) = (sa, sc);
            tiles[pi] = tile;
            b_sizes[pi] = b.size;
            ctx.push(mm);
        }
        let mut a = Vec::with_capacity(segments);
        for seg in 0..segments {
            let first = parts.iter().position(|p| p.segment == seg).ok_or(layout_error("split", k, n))?;
            a.push(ctx[first].alloc(Operand::A)?);
        }
        let mut c = Vec::with_capacity(parts.len());
        for (pi, p) in parts.iter().enumerate() {
            c.push(ctx[pi].alloc(Operand::C)?);
            // SAFETY: the buffers live in the same Bucket as the contexts and are dropped first.
            unsafe {
                ctx[pi].bind(Operand::A, &a[p.segment])?;
                ctx[pi].bind(Operand::C, &c[pi])?;
            }
        }
        let bound = parts.iter().map(|_| AtomicUsize::new(0)).collect();
        buckets.push(Bucket { m, a, c, bound, a_tile, c_tile, ctx });
    }
    let cores = parts.iter().map(|p| p.core + 1).max().unwrap_or(0);
    Ok(Shape {
        k,
        n,
        parts,
        cores,
        buckets,
        tiles,
        b_sizes,
        enabled: AtomicBool::new(true),
        latched: AtomicBool::new(true),
        calls: AtomicU64::new(0),
        nanos: AtomicU64::new(0),
    })
}

/// Converts one weight matrix (bytes from `data[0]`, type `ty`) into the B buffers of `shape`.
fn upload_weight(
    rt: &'static Runtime,
    shape: &Shape,
    precision: Precision,
    ty: GgmlType,
    data: &[u8],
) -> Result<(Vec<TensorMem<'static>>, Vec<f32>), RknnErrorText> {
    let k = shape.k;
    let ctx0 = shape.buckets.first().ok_or(layout_error("bucket list", k, shape.n))?;
    let mut scales = vec![0f32; if precision == Precision::Int8 { shape.n } else { 0 }];
    let mut rows = Vec::new();
    let mut out = Vec::with_capacity(shape.parts.len());
    let mut dequantized = usize::MAX; // n0 of the slice in `rows`
    for (pi, p) in shape.parts.iter().enumerate() {
        if dequantized != p.n0 {
            rows.resize(p.n_len * k, 0f32);
            dequantize_rows(ty, data, k, p.n0..p.n0 + p.n_len, &mut rows).map_err(RknnErrorText)?;
            dequantized = p.n0;
            if precision == Precision::Int8 {
                for (j, row) in rows.chunks_exact(k).enumerate() {
                    scales[p.n0 + j] = int8_scale(abs_max(row));
                }
            } else if abs_max(&rows) > F16_MAX {
                return Err(RknnErrorText("weights beyond the fp16 range".into()));
            }
        }
        let mem = TensorMem::new(rt, ctx0.ctx[pi].ctx(), shape.b_sizes[pi])?;
        // SAFETY: a new buffer, not shared yet.
        let bytes = unsafe { bytes_mut(&mem) };
        let tile = shape.tiles[pi];
        let at = |nn: usize, kk: usize| rows[nn * k + p.k0 + kk];
        let packed = match precision {
            Precision::Fp16 => {
                let b: &mut [f16] = bytemuck::try_cast_slice_mut(bytes)
                    .map_err(|_| layout_error("B alignment", k, shape.n))?;
                pack_native_b(p.k_len, p.n_len, tile, K_SEGMENT, b, |kk, nn| f16::from_f32(at(nn, kk)))
            }
            Precision::Int8 => {
                let b: &mut [i8] = bytemuck::cast_slice_mut(bytes);
                pack_native_b(p.k_len, p.n_len, tile, K_SEGMENT, b, |kk, nn| {
                    quantize_i8(at(nn, kk), scales[p.n0 + nn])
                })
            }
        };
        packed.map_err(|e| RknnErrorText(e.to_string()))?;
        mem.sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_TO_DEVICE)?;
        out.push(mem);
    }
    Ok((out, scales))
}

/// `round(v / scale)` in -127..=127.
fn quantize_i8(v: f32, scale: f32) -> i8 {
    (v / scale).round().clamp(-127.0, 127.0) as i8
}

impl Inner {
    fn weight(&self, offset: usize) -> Option<&Weight> {
        let at = self.weights.binary_search_by_key(&offset, |w| w.offset).ok()?;
        Some(&self.weights[at])
    }

    /// Disables shape `si` after a failure, logging once.
    fn disable(&self, si: usize, what: &str) {
        let s = &self.shapes[si];
        if s.enabled.swap(false, Ordering::AcqRel) {
            log(&format!("{what} for K = {}, N = {}; that shape runs on the CPU from now on", s.k, s.n));
        }
    }

    /// Writes rows `x` (`rows` x K) into the A buffers of bucket `b` (native layout), int8 with
    /// the per-token `scales`.
    ///
    /// # Safety
    /// The run lock must be held.
    unsafe fn fill_a(&self, shape: &Shape, b: &Bucket, x: &[f32], rows: usize, scales: &[f32]) -> bool {
        let (k, m, s) = (shape.k, b.m, b.a_tile);
        for (seg, mem) in b.a.iter().enumerate() {
            let (k0, k_len) = (seg * K_SEGMENT, (k - seg * K_SEGMENT).min(K_SEGMENT));
            // SAFETY: exclusive under the run lock (guaranteed by the caller).
            let bytes = unsafe { bytes_mut(mem) };
            match self.precision {
                Precision::Fp16 => {
                    let Ok(a) = bytemuck::try_cast_slice_mut::<u8, f16>(bytes) else { return false };
                    for kb in 0..k_len / s {
                        for r in 0..rows {
                            let src = &x[r * k + k0 + kb * s..][..s];
                            let dst = &mut a[(kb * m + r) * s..][..s];
                            for (d, &v) in dst.iter_mut().zip(src) {
                                *d = f16::from_f32(v);
                            }
                        }
                    }
                }
                Precision::Int8 => {
                    let a: &mut [i8] = bytemuck::cast_slice_mut(bytes);
                    for kb in 0..k_len / s {
                        for r in 0..rows {
                            let src = &x[r * k + k0 + kb * s..][..s];
                            let dst = &mut a[(kb * m + r) * s..][..s];
                            for (d, &v) in dst.iter_mut().zip(src) {
                                *d = quantize_i8(v, scales[r]);
                            }
                        }
                    }
                }
            }
            if mem.sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_TO_DEVICE).is_err() {
                return false;
            }
        }
        true
    }

    /// Runs core `core`'s parts of `job` and un-tiles their results into the output.
    fn run_core(&self, core: usize, job: &Job) -> Result<(), String> {
        let shape = &self.shapes[job.shape];
        let bucket = &shape.buckets[job.bucket];
        let weight = &self.weights[job.weight];
        let (m, n, s) = (bucket.m, shape.n, bucket.c_tile);
        for (pi, p) in shape.parts.iter().enumerate().filter(|(_, p)| p.core == core) {
            let ctx = &bucket.ctx[pi];
            let tag = job.weight + 1;
            if bucket.bound[pi].load(Ordering::Relaxed) != tag {
                bucket.bound[pi].store(0, Ordering::Relaxed);
                // SAFETY: the weight's buffers live in `Inner` as long as the contexts.
                unsafe { ctx.bind(Operand::B, &weight.b[pi]) }
                    .map_err(|e| format!("rknn_matmul_set_io_mem failed ({e})"))?;
                bucket.bound[pi].store(tag, Ordering::Relaxed);
            }
            // SAFETY: A, B and C are bound to live buffers; A is not written during runs (the
            // caller waits for every core), C belongs to this context alone.
            unsafe { ctx.run() }.map_err(|e| format!("rknn_matmul_run failed on core {core} ({e})"))?;
            let c_mem = &bucket.c[pi];
            c_mem
                .sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_FROM_DEVICE)
                .map_err(|e| format!("rknn_mem_sync failed ({e})"))?;
            let first = p.segment == 0;
            let c = c_mem.as_slice();
            let blocks = p.n_len / s;
            for r in 0..job.rows {
                let a_scale = if self.precision == Precision::Int8 {
                    // SAFETY: `rows` scales written before the job started.
                    unsafe { *job.a_scales.add(r) }
                } else {
                    1.0
                };
                for jb in 0..blocks {
                    let at = (jb * m + r) * s * 4;
                    let cells = &c[at..at + s * 4];
                    for (i, cell) in cells.chunks_exact(4).enumerate() {
                        let j = p.n0 + jb * s + i;
                        let raw = [cell[0], cell[1], cell[2], cell[3]];
                        let v = match self.precision {
                            Precision::Fp16 => f32::from_le_bytes(raw),
                            Precision::Int8 => i32::from_le_bytes(raw) as f32 * (a_scale * weight.scales[j]),
                        };
                        // SAFETY: row r < rows, column j < n: inside the caller's output; only this
                        // core writes columns [n0, n0 + n_len).
                        unsafe {
                            let o = job.out.add(r * n + j);
                            *o = if first { v } else { *o + v };
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn run(
        &self,
        crew: &Crew,
        weights: usize,
        k: usize,
        n: usize,
        input: &[f32],
        output: &mut [f32],
    ) -> bool {
        let Ok(wi) = self.weights.binary_search_by_key(&weights, |w| w.offset) else { return false };
        let si = self.weights[wi].shape;
        let shape = &self.shapes[si];
        if shape.k != k || shape.n != n || !shape.enabled.load(Ordering::Acquire) || input.len() % k != 0 {
            return false;
        }
        let total = input.len() / k;
        if output.len() != total * n {
            return false;
        }
        if self.precision == Precision::Fp16 && abs_max(input) > F16_MAX {
            return false; // this call only: the input does not fit fp16
        }
        let started = std::time::Instant::now();
        let mut scales = self.run.lock().unwrap_or_else(|e| e.into_inner());
        let largest = shape.buckets.last().map_or(1, |b| b.m);
        let mut done = 0;
        while done < total {
            let rows = (total - done).min(largest);
            let Some(bi) = shape.buckets.iter().position(|b| b.m >= rows) else { return false };
            let bucket = &shape.buckets[bi];
            let x = &input[done * k..(done + rows) * k];
            scales.clear();
            if self.precision == Precision::Int8 {
                scales.extend(x.chunks_exact(k).map(|row| int8_scale(abs_max(row))));
            }
            // SAFETY: we hold the run lock.
            if !unsafe { self.fill_a(shape, bucket, x, rows, &scales) } {
                self.disable(si, "writing the NPU input failed");
                return false;
            }
            let out = output[done * n..].as_mut_ptr();
            let job = Job { shape: si, weight: wi, bucket: bi, rows, out, a_scales: scales.as_ptr() };
            if let Err(e) = crew.run(self, shape.cores, job) {
                self.disable(si, &e);
                return false;
            }
            done += rows;
        }
        shape.calls.fetch_add(1, Ordering::Relaxed);
        shape.nanos.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        true
    }
}

impl MatmulOffload for NpuBackend {
    fn begin(&self) {
        for s in &self.inner.shapes {
            s.latched.store(s.enabled.load(Ordering::Acquire), Ordering::Relaxed);
        }
    }

    fn accepts(&self, weights: usize, k: usize, n: usize, n_tokens: usize) -> bool {
        if n_tokens < self.inner.min_batch {
            return false;
        }
        self.inner.weight(weights).is_some_and(|w| {
            let s = &self.inner.shapes[w.shape];
            s.k == k && s.n == n && s.latched.load(Ordering::Relaxed)
        })
    }

    fn run(&self, weights: usize, k: usize, n: usize, input: &[f32], output: &mut [f32]) -> bool {
        self.inner.run(&self.crew, weights, k, n, input, output)
    }
}

/// What a helper thread is doing.
enum SlotState {
    Idle,
    Work(Job),
    Done(Result<(), String>),
    Exit,
}

struct Slot {
    state: Mutex<SlotState>,
    cv: Condvar,
}

/// Helper threads for cores 1.. (the caller runs core 0).
struct Crew {
    slots: Vec<Arc<Slot>>,
    handles: Vec<JoinHandle<()>>,
}

impl Crew {
    /// Helpers for NPU cores `1..cores`, the one of NPU core `i` pinned to `cpus[i % len]` if given.
    fn new(inner: &Arc<Inner>, cores: usize, cpus: Option<&[usize]>) -> Self {
        let mut crew = Self { slots: Vec::new(), handles: Vec::new() };
        for core in 1..cores {
            let slot = Arc::new(Slot { state: Mutex::new(SlotState::Idle), cv: Condvar::new() });
            let (inner, mine) = (Arc::clone(inner), Arc::clone(&slot));
            let cpu = cpus.filter(|c| !c.is_empty()).map(|c| c[core % c.len()]);
            let spawned = std::thread::Builder::new().name(format!("pinfer-npu-{core}")).spawn(move || {
                if let Some(cpu) = cpu {
                    // Best effort: an unpinned helper still works.
                    crate::board::thread::pin_current_thread(cpu);
                }
                helper(&inner, &mine, core)
            });
            match spawned {
                Ok(h) => {
                    crew.slots.push(slot);
                    crew.handles.push(h);
                }
                // Without the thread, the caller runs that core's parts itself.
                Err(_) => break,
            }
        }
        crew
    }

    /// Runs `job` on cores `0..cores`: helpers for those that have one, the caller for the rest.
    fn run(&self, inner: &Inner, cores: usize, job: Job) -> Result<(), String> {
        let helpers = self.slots.len().min(cores.saturating_sub(1));
        for slot in &self.slots[..helpers] {
            *slot.state.lock().unwrap_or_else(|e| e.into_inner()) = SlotState::Work(job);
            slot.cv.notify_all();
        }
        let mut result = inner.run_core(0, &job);
        for core in helpers + 1..cores {
            result = result.and(inner.run_core(core, &job));
        }
        for slot in &self.slots[..helpers] {
            let mut state = slot.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                match std::mem::replace(&mut *state, SlotState::Idle) {
                    SlotState::Done(r) => {
                        result = result.and(r);
                        break;
                    }
                    other => {
                        *state = other;
                        state = slot.cv.wait(state).unwrap_or_else(|e| e.into_inner());
                    }
                }
            }
        }
        result
    }
}

fn helper(inner: &Inner, slot: &Slot, core: usize) {
    loop {
        let job = {
            let mut state = slot.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                match &*state {
                    SlotState::Work(job) => break *job,
                    SlotState::Exit => return,
                    _ => state = slot.cv.wait(state).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        let result = inner.run_core(core, &job);
        *slot.state.lock().unwrap_or_else(|e| e.into_inner()) = SlotState::Done(result);
        slot.cv.notify_all();
    }
}

impl Drop for Crew {
    fn drop(&mut self) {
        for slot in &self.slots {
            *slot.state.lock().unwrap_or_else(|e| e.into_inner()) = SlotState::Exit;
            slot.cv.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
