//! Loading librknnrt.so at run time, and thin RAII wrappers over its matmul calls.

use core::ffi::{c_int, c_void, CStr};
use core::ptr::NonNull;
use std::ffi::{CString, OsStr};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::bindings::*;
use crate::{LIBRARY_ENV, LIBRARY_NAME};

/// The non-null function pointer inside one of bindgen's `PFN_*` types (`Option<fn>`).
pub type Required<P> = <P as FnPtrOption>::Fn;

/// Implemented by `Option<F>` for function pointers `F`; names `F` for [`Required`].
pub trait FnPtrOption {
    /// The function pointer type.
    type Fn: Copy;
}

impl<F: Copy> FnPtrOption for Option<F> {
    type Fn = F;
}

/// The matmul API of one loaded runtime library: typed pointers to its functions.
///
/// Functions present since runtime 1.6 are required; those added in 2.x are `Option`s. The library
/// is never unloaded (the vendor runtime keeps threads and device state), so the pointers stay
/// valid for the life of the process and a `Runtime` can be cloned freely.
#[derive(Clone)]
pub struct Runtime {
    path: PathBuf,
    /// The `dlopen` handle (kept as an address: it is only passed back to `dlsym`).
    handle: usize,
    pub matmul_create: Required<PFN_rknn_matmul_create>,
    pub matmul_set_io_mem: Required<PFN_rknn_matmul_set_io_mem>,
    pub matmul_set_core_mask: Required<PFN_rknn_matmul_set_core_mask>,
    pub matmul_run: Required<PFN_rknn_matmul_run>,
    pub matmul_destroy: Required<PFN_rknn_matmul_destroy>,
    pub create_mem: Required<PFN_rknn_create_mem>,
    pub destroy_mem: Required<PFN_rknn_destroy_mem>,
    pub mem_sync: Required<PFN_rknn_mem_sync>,
    /// Runtime >= 2.0.
    pub create_mem2: PFN_rknn_create_mem2,
    /// Runtime >= 2.1 (five-parameter form; the 2.0.0-beta0 form is not usable).
    pub b_normal_layout_to_native_layout: PFN_rknn_B_normal_layout_to_native_layout,
}

impl fmt::Debug for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runtime")
            .field("path", &self.path)
            .field("create_mem2", &self.create_mem2.is_some())
            .field("b_normal_layout_to_native_layout", &self.b_normal_layout_to_native_layout.is_some())
            .finish_non_exhaustive()
    }
}

/// Why [`Runtime::load`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// `dlopen` failed (usually: no such file). `reason` is the loader's message.
    Open { path: PathBuf, reason: String },
    /// The library lacks a function every supported runtime (>= 1.6) has.
    MissingSymbol { path: PathBuf, symbol: &'static str },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Open { path, reason } => write!(f, "cannot load {}: {reason}", path.display()),
            LoadError::MissingSymbol { path, symbol } => {
                write!(f, "{} is not a usable RKNN runtime: no symbol {symbol}", path.display())
            }
        }
    }
}

impl std::error::Error for LoadError {}

impl Runtime {
    /// Loads the NPU runtime: the file named by `PINFER_RKNNRT` if set, otherwise `librknnrt.so`
    /// from the dynamic loader's search path, then from `RKNN_LIB_DIR` as given at build time.
    pub fn load() -> Result<Runtime, LoadError> {
        if let Some(path) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
            return Runtime::load_from(Path::new(&path));
        }
        let err = match Runtime::load_from(Path::new(LIBRARY_NAME)) {
            Ok(rt) => return Ok(rt),
            Err(err) => err,
        };
        match (option_env!("RKNN_SYS_LIB_DIR"), &err) {
            (Some(dir), LoadError::Open { reason, .. }) => {
                let fallback = Path::new(dir).join(LIBRARY_NAME);
                Runtime::load_from(&fallback).map_err(|e| match e {
                    LoadError::Open { reason: r2, .. } => LoadError::Open {
                        path: PathBuf::from(LIBRARY_NAME),
                        reason: format!("{reason}; {}: {r2}", fallback.display()),
                    },
                    other => other,
                })
            }
            _ => Err(err),
        }
    }

    /// Loads the runtime from `path` (a bare file name is searched like `dlopen` does).
    pub fn load_from(path: &Path) -> Result<Runtime, LoadError> {
        let handle =
            dl_open(path.as_os_str()).map_err(|reason| LoadError::Open { path: path.to_owned(), reason })?;
        let missing = |symbol| LoadError::MissingSymbol { path: path.to_owned(), symbol };

        macro_rules! resolve {
            ($pfn:ty, $name:literal) => {{
                let sym = dl_sym(handle, $name);
                // SAFETY: `$name` is a function of the runtime's matmul API whose C signature is
                // the one `$pfn` was generated from (our header, checked against the prototypes
                // by the emulator's compile). `*mut c_void` and `Option<extern fn>` have the same
                // size, and a null symbol becomes `None`.
                unsafe { core::mem::transmute::<*mut c_void, $pfn>(sym) }
            }};
        }
        macro_rules! require {
            ($pfn:ty, $name:literal) => {
                match resolve!($pfn, $name) {
                    Some(f) => f,
                    None => {
                        dl_close(handle);
                        return Err(missing($name.to_str().unwrap_or("?")));
                    }
                }
            };
        }

        Ok(Runtime {
            path: path.to_owned(),
            handle: handle.as_ptr() as usize,
            matmul_create: require!(PFN_rknn_matmul_create, c"rknn_matmul_create"),
            matmul_set_io_mem: require!(PFN_rknn_matmul_set_io_mem, c"rknn_matmul_set_io_mem"),
            matmul_set_core_mask: require!(PFN_rknn_matmul_set_core_mask, c"rknn_matmul_set_core_mask"),
            matmul_run: require!(PFN_rknn_matmul_run, c"rknn_matmul_run"),
            matmul_destroy: require!(PFN_rknn_matmul_destroy, c"rknn_matmul_destroy"),
            create_mem: require!(PFN_rknn_create_mem, c"rknn_create_mem"),
            destroy_mem: require!(PFN_rknn_destroy_mem, c"rknn_destroy_mem"),
            mem_sync: require!(PFN_rknn_mem_sync, c"rknn_mem_sync"),
            create_mem2: resolve!(PFN_rknn_create_mem2, c"rknn_create_mem2"),
            b_normal_layout_to_native_layout: resolve!(
                PFN_rknn_B_normal_layout_to_native_layout,
                c"rknn_B_normal_layout_to_native_layout"
            ),
        })
    }

    /// The path the library was loaded from, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Looks up any other symbol of the library (e.g. the emulator's test hooks). Calling through
    /// the pointer is up to the caller, who must know its real type.
    pub fn symbol(&self, name: &CStr) -> Option<NonNull<c_void>> {
        // `handle` came from a successful dlopen and is never closed.
        NonNull::new(dl_sym(NonNull::new(self.handle as *mut c_void)?, name))
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror has no preconditions; it returns null or a NUL-terminated string that stays
    // valid until the next dl* call on this thread, and we copy it at once.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        return "unknown dynamic loader error".to_owned();
    }
    // SAFETY: non-null, NUL-terminated (see above).
    unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
}

fn dl_open(path: &OsStr) -> Result<NonNull<c_void>, String> {
    let cpath = CString::new(path.as_bytes()).map_err(|_| "path contains a NUL byte".to_owned())?;
    // SAFETY: `cpath` is a valid C string. Opening the library runs its initialisers, which is
    // the point of loading the vendor runtime (or the emulator) at all.
    let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    NonNull::new(handle).ok_or_else(dl_error)
}

fn dl_sym(handle: NonNull<c_void>, name: &CStr) -> *mut c_void {
    // SAFETY: `handle` is a live handle from dlopen and `name` a valid C string.
    unsafe { libc::dlsym(handle.as_ptr(), name.as_ptr()) }
}

fn dl_close(handle: NonNull<c_void>) {
    // SAFETY: `handle` came from dlopen, and no pointer resolved from it escapes (only called
    // when loading fails).
    unsafe { libc::dlclose(handle.as_ptr()) };
}

/// A negative return code of the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RknnError(pub c_int);

impl RknnError {
    /// The code's name in the runtime's header, or "unknown".
    pub fn name(self) -> &'static str {
        match self.0 {
            RKNN_ERR_FAIL => "RKNN_ERR_FAIL",
            RKNN_ERR_TIMEOUT => "RKNN_ERR_TIMEOUT",
            RKNN_ERR_DEVICE_UNAVAILABLE => "RKNN_ERR_DEVICE_UNAVAILABLE",
            RKNN_ERR_MALLOC_FAIL => "RKNN_ERR_MALLOC_FAIL",
            RKNN_ERR_PARAM_INVALID => "RKNN_ERR_PARAM_INVALID",
            RKNN_ERR_MODEL_INVALID => "RKNN_ERR_MODEL_INVALID",
            RKNN_ERR_CTX_INVALID => "RKNN_ERR_CTX_INVALID",
            RKNN_ERR_INPUT_INVALID => "RKNN_ERR_INPUT_INVALID",
            RKNN_ERR_OUTPUT_INVALID => "RKNN_ERR_OUTPUT_INVALID",
            RKNN_ERR_DEVICE_UNMATCH => "RKNN_ERR_DEVICE_UNMATCH",
            RKNN_ERR_INCOMPATILE_PRE_COMPILE_MODEL => "RKNN_ERR_INCOMPATILE_PRE_COMPILE_MODEL",
            RKNN_ERR_INCOMPATILE_OPTIMIZATION_LEVEL_VERSION => {
                "RKNN_ERR_INCOMPATILE_OPTIMIZATION_LEVEL_VERSION"
            }
            RKNN_ERR_TARGET_PLATFORM_UNMATCH => "RKNN_ERR_TARGET_PLATFORM_UNMATCH",
            _ => "unknown",
        }
    }
}

impl fmt::Display for RknnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

impl std::error::Error for RknnError {}

/// Maps a runtime return code to a `Result` (negative is an error).
pub fn check(ret: c_int) -> Result<(), RknnError> {
    if ret < 0 {
        Err(RknnError(ret))
    } else {
        Ok(())
    }
}

/// One of the three matrices of a matmul context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operand {
    A,
    B,
    C,
}

/// A matmul context (one fixed M, K, N, type and layout), destroyed on drop.
///
/// Buffers bound to it must outlive its last [`Matmul::run`]. Buffers allocated through a context
/// are freed with that context's handle: drop them before the context (any live context may free
/// any buffer, but what the real runtime does with a destroyed one is unknown).
#[derive(Debug)]
pub struct Matmul<'rt> {
    rt: &'rt Runtime,
    ctx: rknn_matmul_ctx,
    info: rknn_matmul_info,
    io: rknn_matmul_io_attr,
}

impl<'rt> Matmul<'rt> {
    /// `rknn_matmul_create`. `info` should start from `rknn_matmul_info::default()` (all zero).
    pub fn new(rt: &'rt Runtime, info: &rknn_matmul_info) -> Result<Self, RknnError> {
        let mut info = *info;
        let mut io = rknn_matmul_io_attr::default();
        let mut ctx: rknn_matmul_ctx = 0;
        // SAFETY: the three pointers are valid and exclusive for the call; `io` is zeroed as the
        // runtime expects.
        check(unsafe { (rt.matmul_create)(&mut ctx, &mut info, &mut io) })?;
        Ok(Matmul { rt, ctx, info, io })
    }

    /// The runtime handle, for calls not wrapped here.
    pub fn ctx(&self) -> rknn_matmul_ctx {
        self.ctx
    }

    /// The runtime this context belongs to.
    pub fn runtime(&self) -> &'rt Runtime {
        self.rt
    }

    /// The problem as it was created.
    pub fn info(&self) -> &rknn_matmul_info {
        &self.info
    }

    /// Names, dims, byte sizes and element types of A, B and C as the runtime reported them.
    pub fn io_attr(&self) -> &rknn_matmul_io_attr {
        &self.io
    }

    /// The attribute of one matrix.
    pub fn attr(&self, which: Operand) -> &rknn_matmul_tensor_attr {
        match which {
            Operand::A => &self.io.A,
            Operand::B => &self.io.B,
            Operand::C => &self.io.C,
        }
    }

    /// `rknn_matmul_set_core_mask`. On RK3588 use a single core (or AUTO); multi-core masks fail.
    pub fn set_core_mask(&self, mask: rknn_core_mask) -> Result<(), RknnError> {
        // SAFETY: `ctx` is a live context of this runtime.
        check(unsafe { (self.rt.matmul_set_core_mask)(self.ctx, mask) })
    }

    /// Allocates a runtime buffer of exactly the size the runtime reported for `which`.
    pub fn alloc(&self, which: Operand) -> Result<TensorMem<'rt>, RknnError> {
        TensorMem::new(self.rt, self.ctx, self.attr(which).size)
    }

    /// `rknn_matmul_set_io_mem`: binds `mem` as A, B or C.
    ///
    /// # Safety
    /// `mem` must stay alive (not dropped) until this context is dropped or `which` is bound to
    /// another buffer: the runtime keeps its address and [`Matmul::run`] reads or writes it.
    pub unsafe fn bind(&self, which: Operand, mem: &TensorMem<'_>) -> Result<(), RknnError> {
        let mut attr = *self.attr(which);
        // SAFETY: `ctx` is live, `mem` is a runtime buffer, `attr` a valid attribute copy.
        check(unsafe { (self.rt.matmul_set_io_mem)(self.ctx, mem.as_ptr(), &mut attr) })
    }

    /// `rknn_matmul_run`: C = A x B, blocking.
    ///
    /// # Safety
    /// A, B and C must be bound to live buffers (see [`Matmul::bind`]), and no other thread may
    /// access C's buffer, or write A's or B's, during the call. Different contexts may run
    /// concurrently (that is how several NPU cores are used).
    pub unsafe fn run(&self) -> Result<(), RknnError> {
        // SAFETY: upheld by the caller as documented.
        check(unsafe { (self.rt.matmul_run)(self.ctx) })
    }
}

impl Drop for Matmul<'_> {
    fn drop(&mut self) {
        // SAFETY: `ctx` is live and dropped once; its error code has no remedy here.
        unsafe { (self.rt.matmul_destroy)(self.ctx) };
    }
}

/// A buffer allocated by the runtime (`rknn_create_mem*`), freed on drop.
#[derive(Debug)]
pub struct TensorMem<'rt> {
    rt: &'rt Runtime,
    ctx: rknn_context,
    mem: NonNull<rknn_tensor_mem>,
}

// SAFETY: the buffer is owned by this value alone; the runtime's memory calls are not tied to the
// allocating thread, and shared access (`&self`) only reads.
unsafe impl Send for TensorMem<'_> {}
// SAFETY: as above; `&TensorMem` gives read-only access to the bytes.
unsafe impl Sync for TensorMem<'_> {}

impl<'rt> TensorMem<'rt> {
    /// `rknn_create_mem(ctx, size)` (cacheable memory). A null result is `RKNN_ERR_MALLOC_FAIL`.
    pub fn new(rt: &'rt Runtime, ctx: rknn_context, size: u32) -> Result<Self, RknnError> {
        // SAFETY: plain values; the runtime validates `ctx`.
        let mem = unsafe { (rt.create_mem)(ctx, size) };
        Self::wrap(rt, ctx, mem)
    }

    /// `rknn_create_mem2(ctx, size, flags)` (runtime >= 2.0; `RKNN_ERR_FAIL` without it). Flags are
    /// `rknn_mem_alloc_flags` values, optionally with `RKNN_MEM_FLAG_ALLOC_NO_CONTEXT` (ctx 0).
    pub fn new2(rt: &'rt Runtime, ctx: rknn_context, size: u64, flags: u64) -> Result<Self, RknnError> {
        let create = rt.create_mem2.ok_or(RknnError(RKNN_ERR_FAIL))?;
        // SAFETY: plain values; the runtime validates `ctx` and `flags`.
        let mem = unsafe { create(ctx, size, flags) };
        Self::wrap(rt, ctx, mem)
    }

    fn wrap(rt: &'rt Runtime, ctx: rknn_context, mem: *mut rknn_tensor_mem) -> Result<Self, RknnError> {
        let mem = NonNull::new(mem).ok_or(RknnError(RKNN_ERR_MALLOC_FAIL))?;
        let this = TensorMem { rt, ctx, mem };
        // SAFETY: a non-null result of rknn_create_mem* points to an initialised descriptor.
        let m = unsafe { this.mem.as_ref() };
        if m.virt_addr.is_null() || m.offset < 0 || m.offset as u64 > u64::from(m.size) {
            return Err(RknnError(RKNN_ERR_MALLOC_FAIL));
        }
        Ok(this)
    }

    /// The runtime's descriptor (for `rknn_matmul_set_io_mem` and other raw calls).
    pub fn as_ptr(&self) -> *mut rknn_tensor_mem {
        self.mem.as_ptr()
    }

    /// A copy of the descriptor: virtual and physical address, fd, offset, size, flags.
    pub fn descriptor(&self) -> rknn_tensor_mem {
        // SAFETY: the descriptor lives until drop.
        unsafe { *self.mem.as_ptr() }
    }

    /// Usable bytes (size minus offset).
    pub fn len(&self) -> usize {
        let d = self.descriptor();
        (d.size as usize) - (d.offset as usize)
    }

    /// Whether the buffer has no usable bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes at `virt_addr + offset`.
    pub fn as_slice(&self) -> &[u8] {
        let d = self.descriptor();
        // SAFETY: the runtime maps `size` bytes at `virt_addr` (checked non-null and offset <= size
        // in `wrap`) until drop; writes go through `&mut self` or an unsafe `Matmul::run`.
        unsafe { core::slice::from_raw_parts((d.virt_addr as *const u8).add(d.offset as usize), self.len()) }
    }

    /// The bytes at `virt_addr + offset`, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let d = self.descriptor();
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access from Rust.
        unsafe {
            core::slice::from_raw_parts_mut((d.virt_addr as *mut u8).add(d.offset as usize), self.len())
        }
    }

    /// `rknn_mem_sync`: TO_DEVICE after CPU writes, FROM_DEVICE before CPU reads.
    pub fn sync(&self, mode: rknn_mem_sync_mode) -> Result<(), RknnError> {
        // SAFETY: the buffer is live; the call only does cache maintenance.
        check(unsafe { (self.rt.mem_sync)(self.ctx, self.mem.as_ptr(), mode) })
    }
}

impl Drop for TensorMem<'_> {
    fn drop(&mut self) {
        // SAFETY: the buffer came from this runtime and is freed once. Any context may free it.
        unsafe { (self.rt.destroy_mem)(self.ctx, self.mem.as_ptr()) };
    }
}
