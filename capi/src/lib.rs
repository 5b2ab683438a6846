//! pinfer's C ABI (`include/pinfer.h`): models, contexts and samplers as opaque handles over the
//! engine's std layer ([`Session`], the one engine API of the CLI and the server).
//!
//! Every function returns a [`PinferStatus`] and writes a NUL-terminated message into the caller's
//! buffer (`err`, `err_len`; NULL or 0 for none): empty on success, what is wrong otherwise.
//! Nothing unwinds across the boundary: a panic (a bug) is caught and reported as
//! `PINFER_ERR_INTERNAL` where the build unwinds, and aborts where it is built with panic=abort.
//! Handles are checked against a registry of live handles: a NULL, freed or wrong-kind handle is
//! `PINFER_ERR_HANDLE`, never a crash. A context borrows its model: the model is freed after its
//! contexts (`PINFER_ERR_ORDER` otherwise). One handle is not used from two threads at once.
//!
//! tests/c_abi.rs checks the header against this file's signatures and runs examples/c/generate.c.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
// The exported functions check every pointer they are given (see the helpers below); their
// safety contract is the header's documentation, not a Rust doc section.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, CStr};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use pinfer::engine::{graph_slots, EngineConfig, EngineError, GraphSlot, Model};
use pinfer::generate::{Flow, GenerateError, Generator, Stop};
use pinfer::gguf::Gguf;
use pinfer::jinja::TemplateError;
use pinfer::loader::ModelFile;
use pinfer::prompt_format::{FormatChoice, FormatError, ModelTemplate, PromptFormat};
use pinfer::sampler::{Candidate, Sampler, SamplerConfig};
use pinfer::session::{Session, SessionError, SessionOptions};
use pinfer::tokenizer::{OwnedTokenizer, TokError};

/// What a call did (`pinfer_status` in the header; the values are fixed).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinferStatus {
    /// Done.
    Ok = 0,
    /// A NULL pointer, a bad length or an invalid value (the message names the argument).
    ErrArgument = 1,
    /// Not a live handle of the kind the function takes (NULL, freed, or another kind).
    ErrHandle = 2,
    /// A call out of order: logits before any decode, a model freed before its contexts.
    ErrOrder = 3,
    /// The file could not be read.
    ErrIo = 4,
    /// The bytes are not a model pinfer runs.
    ErrModel = 5,
    /// Not enough memory.
    ErrMemory = 6,
    /// The tokens do not fit the context.
    ErrContextFull = 7,
    /// The caller's output buffer is too small; the size needed is written where the size goes.
    ErrBuffer = 8,
    /// The text or tokens could not be converted.
    ErrTokenizer = 9,
    /// A bug in pinfer (a caught panic).
    ErrInternal = 10,
}

/// A model: its file in memory, its tokenizer and chat format (`pinfer_model`).
pub struct PinferModel {
    /// Boxed; freed last (the parsed view below borrows it).
    file: *mut ModelFile,
    gguf: Gguf<'static>,
    /// Its tables are its own, freed with it.
    tokenizer: OwnedTokenizer,
    /// Its chat format (its own template run as Jinja, as the CLI and the server run it), or why
    /// pinfer cannot render its template (pinfer_chat_apply says it).
    template: Result<PromptFormat, FormatError>,
    contexts: AtomicUsize,
}

impl Drop for PinferModel {
    fn drop(&mut self) {
        // SAFETY: made by Box::into_raw in open_model and freed only here; the parsed view that
        // borrows it is never used again (its drop is a no-op: it holds references only), and no
        // context is left (pinfer_model_free checks).
        unsafe { drop(Box::from_raw(self.file)) }
    }
}

/// A context: a session (KV cache, arena, threads) on a model (`pinfer_context`).
pub struct PinferContext {
    session: Session,
    model: *const PinferModel,
    /// Every token decoded since the last reset (the sampler's penalty window reads it).
    history: Vec<u32>,
    has_logits: bool,
    /// The stream `pinfer_generate_step` runs (`pinfer_generate_begin` starts it; a decode or a
    /// reset ends it).
    stream: Option<Stream>,
}

/// Why `pinfer_generate_step` ended a stream (`pinfer_end`; the values are fixed).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinferEnd {
    /// Not ended: call again for the next token.
    None = 0,
    /// An end-of-generation token (not passed on).
    EndOfGeneration = 1,
    /// A stop string appeared (it is not passed on).
    StopString = 2,
    /// The context is full.
    ContextFull = 3,
}

/// `token` of a step that ended the stream without taking one.
const NO_TOKEN: u32 = u32::MAX;

/// A stream of generation: the std generator (sampler chain, UTF-8-safe pieces, stop strings)
/// over the context's session.
struct Stream {
    generator: Generator<'static>,
    /// The last token taken is not evaluated yet: the next step evaluates it first (so a caller
    /// that stops after a token pays no forward pass for it).
    pending: bool,
    ended: bool,
    /// A step's text, and its token and end until they are handed over (kept when the caller's
    /// buffer is too small, for the next call).
    text: String,
    undelivered: Option<(u32, PinferEnd)>,
}

impl Stream {
    /// One step: evaluates the last token (if any), samples the next, passes its text on.
    fn step(&mut self, session: &mut Session, history: &mut Vec<u32>) -> Result<(u32, PinferEnd), Failure> {
        if self.ended {
            return Err(fail(PinferStatus::ErrOrder, "the stream ended: decode and begin a new one"));
        }
        let text = &mut self.text;
        let mut each = |t: &str| -> Result<Flow, std::convert::Infallible> {
            text.push_str(t);
            Ok(Flow::Continue)
        };
        let mut stop = None;
        if std::mem::take(&mut self.pending) {
            stop = self.generator.advance(session, history, usize::MAX).map_err(from_session)?;
        }
        let before = history.len();
        if stop.is_none() {
            stop = self.generator.step_in(session, history, &mut each).map_err(from_generate)?;
        }
        let token = history.get(before).copied().unwrap_or(NO_TOKEN);
        let Some(stop) = stop else {
            self.pending = true;
            return Ok((token, PinferEnd::None));
        };
        self.ended = true;
        self.generator.finish(stop, &mut each).map_err(from_generate)?;
        let end = match stop {
            Stop::StopString => PinferEnd::StopString,
            Stop::ContextFull => PinferEnd::ContextFull,
            _ => PinferEnd::EndOfGeneration,
        };
        Ok((token, end))
    }
}

fn from_generate(e: GenerateError<std::convert::Infallible>) -> Failure {
    match e {
        GenerateError::Session(e) => from_session(e),
        GenerateError::Decode(e) => from_tokenizer(e),
        e => fail(PinferStatus::ErrInternal, e),
    }
}

/// A sampler chain with its working memory (`pinfer_sampler`).
pub struct PinferSampler {
    sampler: Sampler,
    scratch: Vec<Candidate>,
}

/// `pinfer_model_info` (pinfer_model_get_info).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PinferModelInfo {
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    pub n_embd: u32,
    pub n_layer: u32,
    /// -1 when the vocabulary has none.
    pub bos: i32,
    /// -1 when the vocabulary has none.
    pub eos: i32,
    /// The architecture's name, NUL-terminated.
    pub arch: [c_char; 32],
}

/// `pinfer_context_params`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PinferContextParams {
    /// Positions (0: min(4096, the model's training context)).
    pub n_ctx: u32,
    /// Most tokens per engine step.
    pub n_batch: u32,
    /// Worker threads, the caller included.
    pub n_threads: u32,
}

/// `pinfer_sampler_params` (llama.cpp's names and defaults).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PinferSamplerParams {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: u32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: u64,
}

/// `pinfer_chat_message`: a role ("system", "user" or "assistant") and its text.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PinferChatMessage {
    pub role: *const c_char,
    pub content: *const c_char,
}

/// Why a call failed: its status and message.
struct Failure {
    status: PinferStatus,
    message: String,
}

type Outcome = Result<(), Failure>;

fn fail(status: PinferStatus, message: impl Display) -> Failure {
    Failure { status, message: message.to_string() }
}

fn argument(message: impl Display) -> Failure {
    fail(PinferStatus::ErrArgument, message)
}

fn from_session(e: SessionError) -> Failure {
    let status = match &e {
        SessionError::Load(pinfer::loader::LoadError::Io { .. }) => PinferStatus::ErrIo,
        SessionError::Load(_) | SessionError::Model(_) | SessionError::Cache(_) => PinferStatus::ErrModel,
        SessionError::Engine(EngineError::ContextFull { .. }) => PinferStatus::ErrContextFull,
        SessionError::Engine(EngineError::BadToken { .. }) => PinferStatus::ErrArgument,
        SessionError::Engine(EngineError::Memory(_)) | SessionError::OverMemory { .. } => {
            PinferStatus::ErrMemory
        }
        SessionError::Engine(EngineError::Model(_) | EngineError::Gguf(_)) => PinferStatus::ErrModel,
        SessionError::Option(_) | SessionError::Engine(EngineError::Config(_)) => PinferStatus::ErrArgument,
        _ => PinferStatus::ErrInternal,
    };
    fail(status, e)
}

fn from_tokenizer(e: TokError) -> Failure {
    fail(PinferStatus::ErrTokenizer, e)
}

/// Writes `message` into the caller's buffer, cut to fit (at a character boundary) and
/// NUL-terminated; nothing when the buffer is NULL or empty.
fn write_message(err: *mut c_char, err_len: usize, message: &str) {
    if err.is_null() || err_len == 0 {
        return;
    }
    let mut n = message.len().min(err_len - 1);
    while !message.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: the caller gives `err_len` writable bytes at `err` (the header's contract); n + 1
    // <= err_len.
    unsafe {
        std::ptr::copy_nonoverlapping(message.as_ptr(), err.cast::<u8>(), n);
        *err.add(n) = 0;
    }
}

/// Runs `body`, reports its outcome in the message buffer, and never lets a panic out.
fn guard(err: *mut c_char, err_len: usize, body: impl FnOnce() -> Outcome) -> PinferStatus {
    let (status, message) = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => (PinferStatus::Ok, String::new()),
        Ok(Err(f)) => (f.status, f.message),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            (PinferStatus::ErrInternal, format!("internal error (a bug in pinfer, please report it): {what}"))
        }
    };
    write_message(err, err_len, &message);
    status
}

/// The kinds of handle the registry knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Model,
    Context,
    Sampler,
}

/// Every live handle's address and kind.
static LIVE: Mutex<Vec<(usize, Kind)>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<(usize, Kind)>> {
    LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn register<T>(handle: Box<T>, kind: Kind) -> *mut T {
    let p = Box::into_raw(handle);
    live().push((p as usize, kind));
    p
}

fn is_live<T>(p: *const T, kind: Kind) -> bool {
    !p.is_null() && live().contains(&(p as usize, kind))
}

/// `p` as a live handle of `kind`.
fn handle<'a, T>(p: *const T, kind: Kind, name: &str) -> Result<&'a T, Failure> {
    if !is_live(p, kind) {
        return Err(fail(
            PinferStatus::ErrHandle,
            format!("{name} is not a live pinfer_{kind:?} handle").to_lowercase(),
        ));
    }
    // SAFETY: the registry holds only addresses of boxes this library made and has not freed.
    Ok(unsafe { &*p })
}

/// `p` as a live handle of `kind`, to change.
fn handle_mut<'a, T>(p: *mut T, kind: Kind, name: &str) -> Result<&'a mut T, Failure> {
    handle(p, kind, name)?;
    // SAFETY: as in `handle`; the header says a handle is not used from two threads at once, so
    // this is its only reference during the call.
    Ok(unsafe { &mut *p })
}

/// Takes `p` out of the registry and gives its box back.
fn unregister<T>(p: *mut T, kind: Kind) -> Box<T> {
    live().retain(|&e| e != (p as usize, kind));
    // SAFETY: `p` was live (checked by the caller under `handle`), made by Box::into_raw in
    // `register`, and is no longer in the registry, so it is freed once.
    unsafe { Box::from_raw(p) }
}

/// Takes live handle `p` of `kind` out of the registry once `check` accepts it (NULL: nothing).
fn free_handle<T>(
    p: *mut T,
    kind: Kind,
    name: &str,
    check: impl FnOnce(&T) -> Outcome,
) -> Result<Option<Box<T>>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    check(handle(p, kind, name)?)?;
    Ok(Some(unregister(p, kind)))
}

/// Where a result goes.
fn out<'a, T>(p: *mut T, name: &str) -> Result<&'a mut T, Failure> {
    if p.is_null() {
        return Err(argument(format!("{name} is NULL")));
    }
    // SAFETY: not NULL; the caller gives a writable, aligned T there (the header's contract).
    Ok(unsafe { &mut *p })
}

/// `n` values at `p` (NULL allowed when `n` is 0).
fn slice<'a, T>(p: *const T, n: usize, name: &str) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(argument(format!("{name} is NULL with a length of {n}")));
    }
    if n.checked_mul(std::mem::size_of::<T>()).is_none_or(|b| b > isize::MAX as usize) {
        return Err(argument(format!("the length of {name} ({n}) is impossibly large")));
    }
    // SAFETY: not NULL, size checked; the caller gives `n` readable values (header contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// `n` writable values at `p` (NULL allowed when `n` is 0).
fn slice_mut<'a, T>(p: *mut T, n: usize, name: &str) -> Result<&'a mut [T], Failure> {
    if n == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(argument(format!("{name} is NULL with a capacity of {n}")));
    }
    if n.checked_mul(std::mem::size_of::<T>()).is_none_or(|b| b > isize::MAX as usize) {
        return Err(argument(format!("the capacity of {name} ({n}) is impossibly large")));
    }
    // SAFETY: not NULL, size checked; the caller gives `n` writable values (header contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// A NUL-terminated UTF-8 string.
fn c_str<'a>(p: *const c_char, name: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(argument(format!("{name} is NULL")));
    }
    // SAFETY: not NULL; the caller gives a NUL-terminated string (header contract).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|e| argument(format!("{name} is not valid UTF-8 ({e})")))
}

/// UTF-8 text of `len` bytes at `p`.
fn text<'a>(p: *const c_char, len: usize, name: &str) -> Result<&'a str, Failure> {
    let bytes = slice(p.cast::<u8>(), len, name)?;
    std::str::from_utf8(bytes).map_err(|e| argument(format!("{name} is not valid UTF-8 ({e})")))
}

/// A model from a file in memory: parsed, checked, its tokenizer built.
fn open_model(file: ModelFile) -> Result<*mut PinferModel, Failure> {
    let file = Box::into_raw(Box::new(file));
    // SAFETY: the box lives until PinferModel's Drop (or the error path below) frees it; the
    // borrows made from it are stored in that same handle and never outlive it.
    let file_ref: &'static ModelFile = unsafe { &*file };
    let built = (|| {
        let gguf = file_ref.parse().map_err(|e| fail(PinferStatus::ErrModel, e))?;
        pinfer::model::HParams::from_gguf(&gguf).map_err(|e| fail(PinferStatus::ErrModel, e))?;
        let tokenizer = OwnedTokenizer::new(&gguf).map_err(|e| fail(PinferStatus::ErrModel, e))?;
        let template_text = gguf.get_str_opt("tokenizer.chat_template").ok().flatten();
        let token = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_text(id).ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        let (bos, eos) = (token(tokenizer.bos()), token(tokenizer.eos()));
        let model = ModelTemplate {
            text: template_text,
            bos_token: &bos,
            eos_token: &eos,
            adds_bos: tokenizer.add_bos(),
        };
        let template = PromptFormat::choose(FormatChoice::default(), model);
        Ok(PinferModel { file, gguf, tokenizer, template, contexts: AtomicUsize::new(0) })
    })();
    match built {
        Ok(model) => Ok(register(Box::new(model), Kind::Model)),
        Err(f) => {
            // SAFETY: made by Box::into_raw above; nothing borrows it after the failed build.
            drop(unsafe { Box::from_raw(file) });
            Err(f)
        }
    }
}

/// Opens the GGUF model at `path` (mapped, not copied).
#[no_mangle]
pub unsafe extern "C" fn pinfer_model_open_file(
    path: *const c_char,
    model: *mut *mut PinferModel,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let model = out(model, "model")?;
        *model = std::ptr::null_mut();
        let path = c_str(path, "path")?;
        let file = ModelFile::open(Path::new(path)).map_err(|e| {
            let status = match e {
                pinfer::loader::LoadError::Io { .. } => PinferStatus::ErrIo,
                _ => PinferStatus::ErrModel,
            };
            fail(status, e)
        })?;
        *model = open_model(file)?;
        Ok(())
    })
}

/// Opens a GGUF model from `len` bytes at `bytes` (copied: the buffer may be freed afterwards).
#[no_mangle]
pub unsafe extern "C" fn pinfer_model_open_bytes(
    bytes: *const u8,
    len: usize,
    model: *mut *mut PinferModel,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let model = out(model, "model")?;
        *model = std::ptr::null_mut();
        let bytes = slice(bytes, len, "bytes")?;
        if bytes.is_empty() {
            return Err(argument("bytes is empty (a model has at least a GGUF header)"));
        }
        let file = ModelFile::from_bytes(bytes, Path::new("<memory>"))
            .map_err(|e| fail(PinferStatus::ErrMemory, e))?;
        *model = open_model(file)?;
        Ok(())
    })
}

/// Frees a model (after its contexts). NULL is accepted and does nothing.
#[no_mangle]
pub unsafe extern "C" fn pinfer_model_free(
    model: *mut PinferModel,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let unused = |m: &PinferModel| match m.contexts.load(Ordering::Acquire) {
            0 => Ok(()),
            n => Err(fail(
                PinferStatus::ErrOrder,
                format!("the model still has {n} context(s): free them first"),
            )),
        };
        drop(free_handle(model, Kind::Model, "model", unused)?);
        Ok(())
    })
}

/// The model's sizes, special tokens and architecture.
#[no_mangle]
pub unsafe extern "C" fn pinfer_model_get_info(
    model: *const PinferModel,
    info: *mut PinferModelInfo,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let m = handle(model, Kind::Model, "model")?;
        let info = out(info, "info")?;
        let hp = pinfer::model::HParams::from_gguf(&m.gguf).map_err(|e| fail(PinferStatus::ErrModel, e))?;
        let mut arch = [0 as c_char; 32];
        for (slot, &b) in arch.iter_mut().zip(hp.arch.name().as_bytes().iter().take(31)) {
            *slot = b as c_char;
        }
        *info = PinferModelInfo {
            n_vocab: m.tokenizer.n_vocab(),
            n_ctx_train: hp.n_ctx_train,
            n_embd: hp.n_embd,
            n_layer: hp.n_layer,
            bos: m.tokenizer.bos().map_or(-1, |t| t as i32),
            eos: m.tokenizer.eos().map_or(-1, |t| t as i32),
            arch,
        };
        Ok(())
    })
}

/// Fills `params` with the defaults (context 0 = the model's up to 4096, batch 64, 1 thread).
#[no_mangle]
pub unsafe extern "C" fn pinfer_context_default_params(
    params: *mut PinferContextParams,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        *out(params, "params")? = PinferContextParams { n_ctx: 0, n_batch: 64, n_threads: 1 };
        Ok(())
    })
}

fn context_params<'a>(params: *const PinferContextParams) -> Result<&'a PinferContextParams, Failure> {
    if params.is_null() {
        return Err(argument("params is NULL (pinfer_context_default_params fills one)"));
    }
    // SAFETY: not NULL; the caller gives a readable pinfer_context_params (header contract).
    let p = unsafe { &*params };
    if p.n_batch == 0 || p.n_threads == 0 {
        return Err(argument("params: n_batch and n_threads must be at least 1"));
    }
    if p.n_threads > 256 {
        return Err(argument(format!("params: {} threads is more than 256", p.n_threads)));
    }
    Ok(p)
}

/// Bytes of memory a context with `params` takes beside the model file: the engine's arena
/// (repacked weights, KV cache, activations, work area) and its graphs.
#[no_mangle]
pub unsafe extern "C" fn pinfer_plan(
    model: *const PinferModel,
    params: *const PinferContextParams,
    bytes: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let m = handle(model, Kind::Model, "model")?;
        let p = context_params(params)?;
        let bytes = out(bytes, "bytes")?;
        let config =
            EngineConfig { n_ctx: p.n_ctx as usize, n_batch: p.n_batch as usize, ..EngineConfig::default() };
        // SAFETY: the model handle keeps its file alive for this call.
        let file = unsafe { &*m.file };
        let gguf = file.parse().map_err(|e| fail(PinferStatus::ErrModel, e))?;
        let engine_model =
            Model::from_gguf(file.bytes(), gguf).map_err(|e| fail(PinferStatus::ErrModel, e))?;
        let n_slots = graph_slots(&config);
        let planned = pinfer::engine::heap::plan(engine_model, &config).map_err(|e| {
            let status = match e {
                EngineError::Config(_) => PinferStatus::ErrArgument,
                EngineError::Memory(_) => PinferStatus::ErrMemory,
                _ => PinferStatus::ErrModel,
            };
            fail(status, e)
        })?;
        *bytes = planned.layout().bytes_needed() + n_slots * std::mem::size_of::<GraphSlot>();
        Ok(())
    })
}

/// A context on `model`: repacks its weights and plans its memory.
#[no_mangle]
pub unsafe extern "C" fn pinfer_context_new(
    model: *mut PinferModel,
    params: *const PinferContextParams,
    context: *mut *mut PinferContext,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let context = out(context, "context")?;
        *context = std::ptr::null_mut();
        let m = handle(model, Kind::Model, "model")?;
        let p = context_params(params)?;
        let opts = SessionOptions {
            n_ctx: p.n_ctx as usize,
            n_batch: p.n_batch as usize,
            threads: p.n_threads as usize,
            pin: false,
            ..SessionOptions::default()
        };
        // SAFETY: the session borrows the file for its life; the model is freed only when its
        // context count (raised below, lowered when the context is freed) is 0.
        let file: &'static ModelFile = unsafe { &*m.file };
        let session = Session::new(file, &opts).map_err(from_session)?;
        m.contexts.fetch_add(1, Ordering::AcqRel);
        let ctx = PinferContext { session, model, history: Vec::new(), has_logits: false, stream: None };
        *context = register(Box::new(ctx), Kind::Context);
        Ok(())
    })
}

/// Frees a context. NULL is accepted and does nothing.
#[no_mangle]
pub unsafe extern "C" fn pinfer_context_free(
    context: *mut PinferContext,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let Some(ctx) = free_handle(context, Kind::Context, "context", |_| Ok(()))? else { return Ok(()) };
        let model = ctx.model;
        drop(ctx);
        if let Ok(m) = handle(model, Kind::Model, "model") {
            m.contexts.fetch_sub(1, Ordering::AcqRel);
        }
        Ok(())
    })
}

/// Forgets every decoded token: the next decode starts at position 0.
#[no_mangle]
pub unsafe extern "C" fn pinfer_context_reset(
    context: *mut PinferContext,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let ctx = handle_mut(context, Kind::Context, "context")?;
        let _ = ctx.session.truncate(0);
        ctx.history.clear();
        ctx.has_logits = false;
        ctx.stream = None;
        Ok(())
    })
}

/// Tokens in the context so far.
#[no_mangle]
pub unsafe extern "C" fn pinfer_context_n_past(
    context: *const PinferContext,
    n_past: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let ctx = handle(context, Kind::Context, "context")?;
        *out(n_past, "n_past")? = ctx.session.n_past();
        Ok(())
    })
}

/// Text to tokens. `n_tokens` receives the count; when `capacity` is too small it receives the
/// count needed and the status is PINFER_ERR_BUFFER.
#[no_mangle]
pub unsafe extern "C" fn pinfer_tokenize(
    model: *const PinferModel,
    text_bytes: *const c_char,
    text_len: usize,
    add_special: c_int,
    parse_special: c_int,
    tokens: *mut u32,
    capacity: usize,
    n_tokens: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let m = handle(model, Kind::Model, "model")?;
        let n_tokens = out(n_tokens, "n_tokens")?;
        let text = text(text_bytes, text_len, "text")?;
        let tokens = slice_mut(tokens, capacity, "tokens")?;
        let mut scratch = vec![0u32; m.tokenizer.scratch_words(text.len())];
        match m.tokenizer.encode_with_scratch(
            text,
            parse_special != 0,
            add_special != 0,
            tokens,
            &mut scratch,
        ) {
            Ok(n) => {
                *n_tokens = n;
                Ok(())
            }
            Err(TokError::OutputTooSmall { needed, got }) => {
                *n_tokens = needed;
                Err(fail(
                    PinferStatus::ErrBuffer,
                    format!("the text has {needed} tokens; tokens holds {got}"),
                ))
            }
            Err(e) => Err(from_tokenizer(e)),
        }
    })
}

/// Tokens to text (the bytes of their pieces; special tokens rendered when `special`). `text_len`
/// receives the length; when `capacity` is too small, the length needed and PINFER_ERR_BUFFER.
/// The text is not NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn pinfer_detokenize(
    model: *const PinferModel,
    tokens: *const u32,
    n_tokens: usize,
    special: c_int,
    text: *mut c_char,
    capacity: usize,
    text_len: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let m = handle(model, Kind::Model, "model")?;
        let text_len = out(text_len, "text_len")?;
        let tokens = slice(tokens, n_tokens, "tokens")?;
        let buf = slice_mut(text.cast::<u8>(), capacity, "text")?;
        match m.tokenizer.decode(tokens, special != 0, buf) {
            Ok(n) => {
                *text_len = n;
                Ok(())
            }
            Err(TokError::BufferTooSmall { needed, got }) => {
                *text_len = needed;
                Err(fail(PinferStatus::ErrBuffer, format!("the text takes {needed} bytes; text holds {got}")))
            }
            Err(e) => Err(from_tokenizer(e)),
        }
    })
}

/// Whether `token` ends a generation (end of sequence, end of turn).
#[no_mangle]
pub unsafe extern "C" fn pinfer_token_is_eog(
    model: *const PinferModel,
    token: u32,
    is_eog: *mut c_int,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let m = handle(model, Kind::Model, "model")?;
        let is_eog = out(is_eog, "is_eog")?;
        if token >= m.tokenizer.n_vocab() {
            return Err(argument(format!(
                "token {token} is not below the vocabulary's {}",
                m.tokenizer.n_vocab()
            )));
        }
        *is_eog = c_int::from(m.tokenizer.is_eog(token));
        Ok(())
    })
}

/// Writes a conversation as the model's chat format (its own template run as Jinja, as the CLI
/// and the server run it; a model without one gets ChatML),
/// ending with the assistant's opening when `add_generation_prompt`. Lengths as
/// pinfer_detokenize; the text is not NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn pinfer_chat_apply(
    model: *const PinferModel,
    messages: *const PinferChatMessage,
    n_messages: usize,
    add_generation_prompt: c_int,
    text: *mut c_char,
    capacity: usize,
    text_len: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let m = handle(model, Kind::Model, "model")?;
        let text_len = out(text_len, "text_len")?;
        let buf = slice_mut(text.cast::<u8>(), capacity, "text")?;
        let template = m
            .template
            .as_ref()
            .map_err(|e| fail(PinferStatus::ErrModel, format!("the model's chat template: {e}")))?;
        let given = slice(messages, n_messages, "messages")?;
        let mut list = Vec::with_capacity(given.len());
        for (i, msg) in given.iter().enumerate() {
            let role = match c_str(msg.role, &format!("messages[{i}].role"))? {
                role @ ("system" | "user" | "assistant") => role,
                other => {
                    return Err(argument(format!(
                        "messages[{i}].role is {other:?}: system, user or assistant"
                    )))
                }
            };
            let content = c_str(msg.content, &format!("messages[{i}].content"))?;
            list.push(serde_json::json!({ "role": role, "content": content }));
        }
        // A template's own refusal of the conversation is the caller's to fix.
        let rendered = template
            .render(&serde_json::Value::Array(list), None, add_generation_prompt != 0, None)
            .map_err(|e| match e {
                FormatError::Template(TemplateError::Raised(_)) => argument(e.to_string()),
                e => fail(PinferStatus::ErrModel, e),
            })?;
        *text_len = rendered.len();
        let Some(dst) = buf.get_mut(..rendered.len()) else {
            return Err(fail(
                PinferStatus::ErrBuffer,
                format!("the conversation takes {} bytes; text holds {}", rendered.len(), buf.len()),
            ));
        };
        dst.copy_from_slice(rendered.as_bytes());
        Ok(())
    })
}

/// Evaluates `n_tokens` tokens after the context's (in batches of n_batch); afterwards
/// pinfer_logits gives the last one's logits.
#[no_mangle]
pub unsafe extern "C" fn pinfer_decode(
    context: *mut PinferContext,
    tokens: *const u32,
    n_tokens: usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let ctx = handle_mut(context, Kind::Context, "context")?;
        let tokens = slice(tokens, n_tokens, "tokens")?;
        if tokens.is_empty() {
            return Err(argument("no tokens to decode"));
        }
        ctx.has_logits = false;
        ctx.stream = None;
        ctx.session.eval(tokens).map_err(from_session)?;
        ctx.history.extend_from_slice(tokens);
        ctx.has_logits = true;
        Ok(())
    })
}

/// The logits of the last decoded token: `n_vocab` floats owned by the context, valid until its
/// next decode, reset or free.
#[no_mangle]
pub unsafe extern "C" fn pinfer_logits(
    context: *const PinferContext,
    logits: *mut *const f32,
    n_vocab: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let ctx = handle(context, Kind::Context, "context")?;
        let logits = out(logits, "logits")?;
        let n_vocab = out(n_vocab, "n_vocab")?;
        let row = last_logits(ctx)?;
        *logits = row.as_ptr();
        *n_vocab = row.len();
        Ok(())
    })
}

fn last_logits(ctx: &PinferContext) -> Result<&[f32], Failure> {
    if !ctx.has_logits {
        return Err(fail(PinferStatus::ErrOrder, "no logits yet: decode tokens first"));
    }
    ctx.session.logits(0).ok_or_else(|| fail(PinferStatus::ErrOrder, "no logits yet: decode tokens first"))
}

/// Fills `params` with llama.cpp's defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
/// no penalties, a fixed seed).
#[no_mangle]
pub unsafe extern "C" fn pinfer_sampler_default_params(
    params: *mut PinferSamplerParams,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let d = SamplerConfig::default();
        *out(params, "params")? = PinferSamplerParams {
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            min_p: d.min_p,
            repeat_penalty: d.repeat_penalty,
            repeat_last_n: d.repeat_last_n,
            frequency_penalty: d.frequency_penalty,
            presence_penalty: d.presence_penalty,
            seed: d.seed,
        };
        Ok(())
    })
}

/// A sampler chain (penalties, top-k, top-p, min-p, temperature; greedy at temperature 0).
#[no_mangle]
pub unsafe extern "C" fn pinfer_sampler_new(
    params: *const PinferSamplerParams,
    sampler: *mut *mut PinferSampler,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let sampler = out(sampler, "sampler")?;
        *sampler = std::ptr::null_mut();
        let s = Sampler::new(sampler_config(params)?).map_err(|e| argument(format!("params: {e}")))?;
        *sampler = register(Box::new(PinferSampler { sampler: s, scratch: Vec::new() }), Kind::Sampler);
        Ok(())
    })
}

/// The sampler configuration `params` gives (checked when a sampler is made from it).
fn sampler_config(params: *const PinferSamplerParams) -> Result<SamplerConfig, Failure> {
    if params.is_null() {
        return Err(argument("params is NULL (pinfer_sampler_default_params fills one)"));
    }
    // SAFETY: not NULL; the caller gives a readable pinfer_sampler_params (header contract).
    let p = unsafe { &*params };
    Ok(SamplerConfig {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repeat_penalty: p.repeat_penalty,
        repeat_last_n: p.repeat_last_n,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        seed: p.seed,
    })
}

/// Picks the next token from the context's last logits.
#[no_mangle]
pub unsafe extern "C" fn pinfer_sample(
    sampler: *mut PinferSampler,
    context: *const PinferContext,
    token: *mut u32,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let s = handle_mut(sampler, Kind::Sampler, "sampler")?;
        let ctx = handle(context, Kind::Context, "context")?;
        let token = out(token, "token")?;
        let logits = last_logits(ctx)?;
        if s.scratch.len() < logits.len() {
            s.scratch.resize(logits.len(), Candidate::default());
        }
        *token = s
            .sampler
            .sample(logits, &ctx.history, &mut s.scratch)
            .map_err(|e| fail(PinferStatus::ErrInternal, e))?;
        Ok(())
    })
}

/// Frees a sampler. NULL is accepted and does nothing.
#[no_mangle]
pub unsafe extern "C" fn pinfer_sampler_free(
    sampler: *mut PinferSampler,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        drop(free_handle(sampler, Kind::Sampler, "sampler", |_| Ok(()))?);
        Ok(())
    })
}

/// Starts a stream of generation after the decoded tokens: `params`' sampler chain, ending at an
/// end-of-generation token, a full context, or one of the stop strings (`stops`: `stops_len`
/// bytes of UTF-8 strings, each ended by a NUL; NULL and 0 for none).
#[no_mangle]
pub unsafe extern "C" fn pinfer_generate_begin(
    context: *mut PinferContext,
    params: *const PinferSamplerParams,
    stops: *const c_char,
    stops_len: usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let ctx = handle_mut(context, Kind::Context, "context")?;
        last_logits(ctx)?;
        let config = sampler_config(params)?;
        let stops = if stops_len == 0 { "" } else { text(stops, stops_len, "stops")? };
        let stops: Vec<&str> = stops.split_terminator('\0').collect();
        // SAFETY: the context keeps its model alive (pinfer_model_free refuses a model with
        // contexts), and the stream, which borrows its tokenizer, lives in the context.
        let m: &'static PinferModel = unsafe { &*ctx.model };
        let mut generator = Generator::new(&m.tokenizer, ctx.session.n_vocab(), config)
            .map_err(|e| argument(format!("params: {e}")))?;
        generator.set_stop_strings(&stops);
        generator.begin();
        // The history holds every token the context can (a full one ends the stream).
        let room = (ctx.session.n_ctx() + 1).saturating_sub(ctx.history.len());
        ctx.history.try_reserve_exact(room).map_err(|_| fail(PinferStatus::ErrMemory, "no memory"))?;
        ctx.stream =
            Some(Stream { generator, pending: false, ended: false, text: String::new(), undelivered: None });
        Ok(())
    })
}

/// One token of the stream: evaluates the last one, samples the next, and writes the text that
/// is now complete (UTF-8 whole characters; possibly none; text that may begin a stop string is
/// held back) into `piece` (`capacity` bytes, not NUL-terminated), its length into `piece_len`,
/// the token into `token` (`UINT32_MAX` when the stream ended without one) and why the stream
/// ended into `end` (`PINFER_END_NONE`: call again). When `capacity` is too small the status is
/// PINFER_ERR_BUFFER with the length needed; the next call gives the same step's output.
#[no_mangle]
pub unsafe extern "C" fn pinfer_generate_step(
    context: *mut PinferContext,
    token: *mut u32,
    piece: *mut c_char,
    capacity: usize,
    piece_len: *mut usize,
    end: *mut PinferEnd,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let ctx = handle_mut(context, Kind::Context, "context")?;
        let (token, piece_len, end) = (out(token, "token")?, out(piece_len, "piece_len")?, out(end, "end")?);
        let dst = slice_mut(piece.cast::<u8>(), capacity, "piece")?;
        let PinferContext { session, history, stream, .. } = ctx;
        let s = stream.as_mut().ok_or_else(|| {
            fail(PinferStatus::ErrOrder, "no stream: decode a prompt, then pinfer_generate_begin")
        })?;
        let (id, why) = match s.undelivered {
            Some(step) => step,
            None => {
                s.text.clear();
                s.step(session, history)?
            }
        };
        *piece_len = s.text.len();
        if s.text.len() > dst.len() {
            s.undelivered = Some((id, why));
            return Err(fail(
                PinferStatus::ErrBuffer,
                "the piece does not fit: the next call gives it again",
            ));
        }
        dst[..s.text.len()].copy_from_slice(s.text.as_bytes());
        s.undelivered = None;
        (*token, *end) = (id, why);
        Ok(())
    })
}

/// Ends the stream before it ended itself (the caller's limit): writes the text still held back
/// (an incomplete character as U+FFFD, the start of a stop string as it is) into `piece` as
/// pinfer_generate_step does. The last token taken stays out of the context (it was not
/// evaluated): decode it to go on from there.
#[no_mangle]
pub unsafe extern "C" fn pinfer_generate_finish(
    context: *mut PinferContext,
    piece: *mut c_char,
    capacity: usize,
    piece_len: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> PinferStatus {
    guard(err, err_len, || {
        let ctx = handle_mut(context, Kind::Context, "context")?;
        let piece_len = out(piece_len, "piece_len")?;
        let dst = slice_mut(piece.cast::<u8>(), capacity, "piece")?;
        let s = ctx.stream.as_mut().ok_or_else(|| {
            fail(PinferStatus::ErrOrder, "no stream: decode a prompt, then pinfer_generate_begin")
        })?;
        if s.undelivered.is_some() {
            return Err(fail(
                PinferStatus::ErrOrder,
                "a step's piece is not handed over yet: call pinfer_generate_step",
            ));
        }
        s.text.clear();
        if !s.ended {
            let text = &mut s.text;
            let mut each = |t: &str| -> Result<Flow, std::convert::Infallible> {
                text.push_str(t);
                Ok(Flow::Continue)
            };
            s.generator.finish(Stop::Limit, &mut each).map_err(from_generate)?;
        }
        *piece_len = s.text.len();
        if s.text.len() > dst.len() {
            return Err(fail(PinferStatus::ErrBuffer, "the piece does not fit: call again with more room"));
        }
        dst[..s.text.len()].copy_from_slice(s.text.as_bytes());
        if std::mem::take(&mut s.pending) {
            ctx.history.pop();
        }
        ctx.stream = None;
        Ok(())
    })
}
