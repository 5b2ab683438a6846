//! The C ABI: include/pinfer.h against this crate's exports (so they cannot drift apart),
//! examples/c/generate.c built with `cc` against the static library and held to llama.cpp's golden
//! ids, and every bad argument and wrong call order answered with a status and a message.

use std::ffi::{c_char, c_int, CStr};
use std::path::{Path, PathBuf};
use std::ptr::{null, null_mut};

use pinfer_capi::*;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Below this margin llama.cpp's own CPU configurations may pick the other token (tests/golden.rs).
const TRUSTED_MARGIN: f64 = 0.3;

// ---- the header against the Rust side ----

/// `PinferModelInfo` -> `pinfer_model_info`.
fn c_name(rust: &str) -> String {
    let mut out = String::new();
    for (i, ch) in rust.chars().enumerate() {
        if ch.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(ch.to_ascii_lowercase());
        } else {
            out.push(ch);
        }
    }
    out
}

/// A Rust parameter or field type as the header spells it.
fn c_type(rust: &str) -> String {
    let rust = rust.trim();
    if let Some(inner) = rust.strip_prefix("*const ") {
        return format!("const {} *", c_type(inner)).replace("* *", "**");
    }
    if let Some(inner) = rust.strip_prefix("*mut ") {
        return format!("{} *", c_type(inner)).replace("* *", "**");
    }
    if let Some(arr) = rust.strip_prefix('[') {
        let (ty, n) = arr.trim_end_matches(']').split_once(';').unwrap();
        return format!("{}[{}]", c_type(ty), n.trim());
    }
    match rust {
        "c_char" => "char".into(),
        "c_int" => "int".into(),
        "usize" => "size_t".into(),
        "u8" => "uint8_t".into(),
        "u32" => "uint32_t".into(),
        "i32" => "int32_t".into(),
        "u64" => "uint64_t".into(),
        "f32" => "float".into(),
        other if other.starts_with("Pinfer") => c_name(other),
        other => panic!("no C spelling for Rust type {other}"),
    }
}

/// Normalises a C type's spacing: `const char*` and `const char *` -> `const char *`.
fn squash(s: &str) -> String {
    s.replace('*', " * ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("* *", "**")
        .replace(" [", "[")
}

/// `name -> parameter types` of every `extern "C" fn` in capi/src/lib.rs.
fn rust_functions(src: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for part in src.split("pub unsafe extern \"C\" fn ").skip(1) {
        let name = part[..part.find('(').unwrap()].to_string();
        let args = &part[part.find('(').unwrap() + 1..part.find(") -> PinferStatus").unwrap()];
        let types = args
            .split(',')
            .filter(|a| !a.trim().is_empty())
            .map(|a| squash(&c_type(a.split_once(':').unwrap().1)))
            .collect();
        out.push((name, types));
    }
    out
}

/// `name -> parameter types` of every function the header declares.
fn header_functions(header: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let flat = header
        .lines()
        .filter(|l| !l.trim_start().starts_with("/*") && !l.trim_start().starts_with('*'))
        .collect::<Vec<_>>()
        .join(" ");
    for part in flat.split("pinfer_status pinfer_").skip(1) {
        let name = format!("pinfer_{}", &part[..part.find('(').unwrap()]);
        let args = &part[part.find('(').unwrap() + 1..part.find(");").unwrap()];
        let types = args
            .split(',')
            .map(|a| {
                let a = a.trim();
                // Drop the parameter's name: the last identifier.
                let cut = a.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                squash(&a[..cut])
            })
            .collect();
        out.push((name, types));
    }
    out
}

/// `struct name -> [(field, C type)]` of the `#[repr(C)] pub struct`s with public fields.
fn rust_structs(src: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut out = Vec::new();
    for part in src.split("#[repr(C)]\n#[derive(Debug, Clone, Copy").skip(1) {
        // Only a struct right after this attribute (not the next one down the file).
        let Some(rest) = part.split_once("]\n").and_then(|(_, r)| r.strip_prefix("pub struct ")) else {
            continue;
        };
        let name = c_name(rest[..rest.find(' ').unwrap()].trim());
        let body = &rest[rest.find('{').unwrap() + 1..rest.find("\n}").unwrap()];
        let fields = body
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("pub "))
            .map(|l| {
                let (field, ty) = l.trim_start_matches("pub ").trim_end_matches(',').split_once(':').unwrap();
                (field.trim().to_string(), squash(&c_type(ty)))
            })
            .collect();
        out.push((name, fields));
    }
    out
}

/// `struct name -> [(field, C type)]` of the header's `typedef struct`s with fields.
fn header_structs(header: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut out = Vec::new();
    for part in header.split("typedef struct ").skip(1) {
        let Some(open) = part.find('{') else { continue };
        let name = part[..open].trim().to_string();
        let body = &part[open + 1..part.find('}').unwrap()];
        let fields = body
            .lines()
            .map(|l| l.split("/*").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| {
                let l = l.trim_end_matches(';');
                let (decl, array) = match l.find('[') {
                    Some(i) => (&l[..i], &l[i..]),
                    None => (l, ""),
                };
                let cut = decl.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap() + 1;
                (decl[cut..].to_string(), squash(&format!("{}{array}", &decl[..cut])))
            })
            .collect();
        out.push((name, fields));
    }
    out
}

#[test]
fn the_header_declares_exactly_what_the_library_exports() {
    let src = std::fs::read_to_string(root().join("capi/src/lib.rs")).unwrap();
    let header = std::fs::read_to_string(root().join("include/pinfer.h")).unwrap();

    let mut rust = rust_functions(&src);
    let mut c = header_functions(&header);
    rust.sort();
    c.sort();
    assert!(rust.len() >= 20, "found only {} exported functions", rust.len());
    assert_eq!(rust, c, "include/pinfer.h and capi/src/lib.rs disagree on a function");

    let mut rust = rust_structs(&src);
    let mut c = header_structs(&header);
    rust.sort();
    c.sort();
    assert_eq!(rust.len(), 4, "{rust:?}");
    assert_eq!(rust, c, "include/pinfer.h and capi/src/lib.rs disagree on a struct");

    // The status values: each Rust variant's number beside the header's constant.
    for (variant, value) in [
        ("Ok", PinferStatus::Ok),
        ("ErrArgument", PinferStatus::ErrArgument),
        ("ErrHandle", PinferStatus::ErrHandle),
        ("ErrOrder", PinferStatus::ErrOrder),
        ("ErrIo", PinferStatus::ErrIo),
        ("ErrModel", PinferStatus::ErrModel),
        ("ErrMemory", PinferStatus::ErrMemory),
        ("ErrContextFull", PinferStatus::ErrContextFull),
        ("ErrBuffer", PinferStatus::ErrBuffer),
        ("ErrTokenizer", PinferStatus::ErrTokenizer),
        ("ErrInternal", PinferStatus::ErrInternal),
    ] {
        let constant = format!("PINFER_{}", c_name(variant).to_uppercase());
        let want = format!("{constant} = {}", value as i32);
        assert!(header.contains(&want), "the header should say {want}");
        assert!(src.contains(&format!("{variant} = {},", value as i32)));
    }
    for (variant, value) in [
        ("None", PinferEnd::None),
        ("EndOfGeneration", PinferEnd::EndOfGeneration),
        ("StopString", PinferEnd::StopString),
        ("ContextFull", PinferEnd::ContextFull),
    ] {
        let constant = format!("PINFER_END_{}", c_name(variant).to_uppercase());
        let want = format!("{constant} = {}", value as i32);
        assert!(header.contains(&want), "the header should say {want}");
        assert!(src.contains(&format!("{variant} = {},", value as i32)));
    }
    let constants = header.lines().filter(|l| l.trim_start().starts_with("PINFER_")).count();
    assert_eq!(constants, 11 + 4, "a status or end value in the header that the test does not list");
}

// ---- the C example ----

fn numbers(line: &str, key: &str) -> Vec<f64> {
    let at = line.find(&format!("\"{key}\": [")).unwrap() + key.len() + 5;
    let end = at + line[at..].find(']').unwrap();
    line[at..end].split(',').map(|v| v.trim().parse().unwrap()).collect()
}

/// The static library cargo built beside this test (the newest, if several builds left one).
#[cfg(target_arch = "x86_64")]
fn static_library() -> PathBuf {
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let mut libs: Vec<_> = std::fs::read_dir(&deps)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("libpinfer_capi-") && name.ends_with(".a")
        })
        .map(|e| (e.metadata().unwrap().modified().unwrap(), e.path()))
        .collect();
    libs.sort();
    libs.pop().unwrap_or_else(|| panic!("no libpinfer_capi-*.a in {}", deps.display())).1
}

/// Compiles examples/c/generate.c against the static library into `dir` (made if missing), as
/// docs/c-abi.md tells a C user to: the program's path.
#[cfg(target_arch = "x86_64")]
fn build_c_example(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let exe = dir.join("generate");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = std::process::Command::new(&cc)
        .args(["-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root().join("include"))
        .arg(root().join("examples/c/generate.c"))
        .arg(static_library())
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&exe)
        .output()
        .expect("a C compiler (cc)");
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    exe
}

/// Built on the host only: the C compiler and the program run natively (the aarch64 tier runs
/// the argument tests below under qemu).
#[test]
#[cfg(target_arch = "x86_64")]
fn the_c_example_generates_llama_cpp_s_greedy_ids() {
    let dir = std::env::temp_dir().join(format!("pinfer-capi-{}", std::process::id()));
    let exe = build_c_example(&dir);

    let golden = std::fs::read_to_string(root().join("tests/golden/smollm2.greedy.jsonl")).unwrap();
    let mut checked = 0;
    for line in golden.lines().filter(|l| !l.trim().is_empty()).take(2) {
        let prompt = line.split("\"prompt\": \"").nth(1).unwrap().split('"').next().unwrap();
        let ids = numbers(line, "generated_ids");
        let margins = numbers(line, "margins");
        let trusted: Vec<u32> = ids
            .iter()
            .zip(&margins)
            .take_while(|(_, &m)| m >= TRUSTED_MARGIN)
            .map(|(&i, _)| i as u32)
            .collect();
        let run = std::process::Command::new(&exe)
            .arg(root().join(MODEL))
            .arg(prompt)
            .arg((trusted.len() + 1).to_string())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{err}");
        let got: Vec<u32> = err
            .lines()
            .find_map(|l| l.strip_prefix("ids:"))
            .expect("ids on stderr")
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect();
        assert_eq!(&got[..trusted.len()], &trusted[..], "prompt {prompt:?}");
        assert!(!run.stdout.is_empty());
        checked += trusted.len();
    }
    assert!(checked >= 4, "only {checked} ids checked");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The C example's text (through pinfer_generate_step) is what `pinfer generate --temp 0` prints
/// for the same prompt and count: the same generator behind both.
#[test]
#[cfg(target_arch = "x86_64")]
fn the_c_example_prints_what_pinfer_generate_prints() {
    let dir = std::env::temp_dir().join(format!("pinfer-capi-text-{}", std::process::id()));
    let exe = build_c_example(&dir);
    // The CLI of this build (cargo test --workspace builds it beside the test binaries).
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let cli = deps.parent().unwrap().join("pinfer");
    if !cli.exists() {
        let status = std::process::Command::new(env!("CARGO"))
            .args(["build", "-p", "pinfer", "--bin", "pinfer"])
            .current_dir(root())
            .status()
            .unwrap();
        assert!(status.success(), "cargo build --bin pinfer");
    }
    let model = root().join(MODEL);
    for (prompt, n) in [("The capital of France is", "24"), ("Once upon a time", "40")] {
        let c = std::process::Command::new(&exe).arg(&model).arg(prompt).arg(n).output().unwrap();
        assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
        let args = ["generate", "--no-display-prompt", "-p", prompt, "-n", n, "--temp", "0", "-c", "512"];
        let cli_run = std::process::Command::new(&cli).args(args).arg("-m").arg(&model).output().unwrap();
        assert!(cli_run.status.success(), "{}", String::from_utf8_lossy(&cli_run.stderr));
        let (c_text, cli_text) =
            (String::from_utf8_lossy(&c.stdout), String::from_utf8_lossy(&cli_run.stdout));
        assert!(c_text.trim().len() > 20, "{c_text:?}");
        assert_eq!(c_text, cli_text, "prompt {prompt:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- bad arguments and call order, through the exported functions ----

struct Err([c_char; 256]);

impl Err {
    fn new() -> Self {
        Self([1; 256])
    }
    fn ptr(&mut self) -> *mut c_char {
        self.0.as_mut_ptr()
    }
    fn text(&self) -> String {
        // SAFETY: every call NUL-terminates the buffer (checked by the tests that read it).
        unsafe { CStr::from_ptr(self.0.as_ptr()) }.to_string_lossy().into_owned()
    }
}

/// Checks a status and that the message says `says`.
fn expect(status: PinferStatus, err: &Err, want: PinferStatus, says: &str) {
    assert_eq!(status, want, "message: {}", err.text());
    assert!(err.text().contains(says), "{:?} should say {says:?}", err.text());
}

fn open(e: &mut Err) -> *mut PinferModel {
    let path = std::ffi::CString::new(root().join(MODEL).to_str().unwrap()).unwrap();
    let mut model = null_mut();
    // SAFETY: valid pointers; the message buffer has 256 bytes.
    let s = unsafe { pinfer_model_open_file(path.as_ptr(), &mut model, e.ptr(), 256) };
    assert_eq!(s, PinferStatus::Ok, "{}", e.text());
    assert_eq!(e.text(), "", "success leaves an empty message");
    model
}

fn small_params() -> PinferContextParams {
    PinferContextParams { n_ctx: 16, n_batch: 8, n_threads: 1 }
}

#[test]
fn bad_arguments_and_call_order_get_a_status_and_a_message() {
    let mut e = Err::new();
    let (s, ok) = (PinferStatus::ErrArgument, PinferStatus::Ok);
    // SAFETY (all calls below): each pointer is NULL, dangling on purpose only where the library
    // must refuse it before use (freed handles are refused by the registry), or valid.
    unsafe {
        // Opening: NULL path and out-pointer, a missing file, junk and truncated bytes.
        let mut model = null_mut();
        expect(pinfer_model_open_file(null(), &mut model, e.ptr(), 256), &e, s, "path is NULL");
        let path = std::ffi::CString::new("/nonexistent/model.gguf").unwrap();
        expect(pinfer_model_open_file(path.as_ptr(), null_mut(), e.ptr(), 256), &e, s, "model is NULL");
        expect(
            pinfer_model_open_file(path.as_ptr(), &mut model, e.ptr(), 256),
            &e,
            PinferStatus::ErrIo,
            "nonexistent",
        );
        assert!(model.is_null());
        expect(pinfer_model_open_bytes(null(), 10, &mut model, e.ptr(), 256), &e, s, "bytes is NULL");
        expect(pinfer_model_open_bytes(b"x".as_ptr(), 0, &mut model, e.ptr(), 256), &e, s, "empty");
        let junk = b"GGUF\x03\x00\x00\x00 not really";
        expect(
            pinfer_model_open_bytes(junk.as_ptr(), junk.len(), &mut model, e.ptr(), 256),
            &e,
            PinferStatus::ErrModel,
            "",
        );
        let bytes = std::fs::read(root().join(MODEL)).unwrap();
        let cut = &bytes[..bytes.len() / 3];
        expect(
            pinfer_model_open_bytes(cut.as_ptr(), cut.len(), &mut model, e.ptr(), 256),
            &e,
            PinferStatus::ErrModel,
            "",
        );
        assert!(model.is_null());

        // Calls before any open: NULL handles.
        let mut ctx = null_mut();
        let tokens = [1u32, 2];
        expect(
            pinfer_decode(null_mut(), tokens.as_ptr(), 2, e.ptr(), 256),
            &e,
            PinferStatus::ErrHandle,
            "context",
        );
        expect(
            pinfer_context_new(null_mut(), &small_params(), &mut ctx, e.ptr(), 256),
            &e,
            PinferStatus::ErrHandle,
            "model",
        );
        let mut info = PinferModelInfo::default();
        expect(pinfer_model_get_info(null(), &mut info, e.ptr(), 256), &e, PinferStatus::ErrHandle, "model");

        // A model from bytes (copied: the buffer is dropped at once).
        let model = {
            let copy = bytes.clone();
            let mut m = null_mut();
            expect(pinfer_model_open_bytes(copy.as_ptr(), copy.len(), &mut m, e.ptr(), 256), &e, ok, "");
            m
        };
        expect(pinfer_model_get_info(model, &mut info, e.ptr(), 256), &e, ok, "");
        assert_eq!((info.n_vocab, info.n_layer), (49152, 30));
        assert_eq!(CStr::from_ptr(info.arch.as_ptr()).to_str().unwrap(), "llama");

        // Bad parameters.
        let zero = PinferContextParams { n_batch: 0, ..small_params() };
        expect(pinfer_context_new(model, &zero, &mut ctx, e.ptr(), 256), &e, s, "n_batch");
        expect(pinfer_context_new(model, null(), &mut ctx, e.ptr(), 256), &e, s, "params is NULL");
        let mut bytes_needed = 0usize;
        expect(pinfer_plan(model, &small_params(), &mut bytes_needed, e.ptr(), 256), &e, ok, "");
        assert!(bytes_needed > 50 << 20, "{bytes_needed}");

        // A wrong-kind handle: the model where a context goes.
        expect(
            pinfer_decode(model.cast(), tokens.as_ptr(), 2, e.ptr(), 256),
            &e,
            PinferStatus::ErrHandle,
            "context",
        );

        let mut ctx = null_mut();
        expect(pinfer_context_new(model, &small_params(), &mut ctx, e.ptr(), 256), &e, ok, "");
        // Logits before a decode; empty and NULL token lists; a token past the vocabulary.
        let (mut logits, mut n_vocab) = (null(), 0usize);
        expect(
            pinfer_logits(ctx, &mut logits, &mut n_vocab, e.ptr(), 256),
            &e,
            PinferStatus::ErrOrder,
            "decode tokens first",
        );
        expect(pinfer_decode(ctx, tokens.as_ptr(), 0, e.ptr(), 256), &e, s, "no tokens");
        expect(pinfer_decode(ctx, null(), 3, e.ptr(), 256), &e, s, "tokens is NULL");
        let bad = [49152u32];
        expect(pinfer_decode(ctx, bad.as_ptr(), 1, e.ptr(), 256), &e, s, "49152");
        // A full context: 17 tokens in 16 positions, then what fits.
        let many = [28u32; 17];
        expect(pinfer_decode(ctx, many.as_ptr(), 17, e.ptr(), 256), &e, PinferStatus::ErrContextFull, "");
        expect(pinfer_decode(ctx, many.as_ptr(), 16, e.ptr(), 256), &e, ok, "");
        expect(pinfer_logits(ctx, &mut logits, &mut n_vocab, e.ptr(), 256), &e, ok, "");
        assert_eq!(n_vocab, 49152);
        assert!(std::slice::from_raw_parts(logits, n_vocab).iter().all(|v| v.is_finite()));
        let mut n_past = 0;
        expect(pinfer_context_n_past(ctx, &mut n_past, e.ptr(), 256), &e, ok, "");
        assert_eq!(n_past, 16);
        expect(pinfer_context_reset(ctx, e.ptr(), 256), &e, ok, "");
        expect(pinfer_logits(ctx, &mut logits, &mut n_vocab, e.ptr(), 256), &e, PinferStatus::ErrOrder, "");

        // Text: a buffer too small says what it needs; invalid UTF-8 is refused.
        let text = "The capital of France is";
        let mut ids = [0u32; 2];
        let mut n = 0usize;
        expect(
            pinfer_tokenize(
                model,
                text.as_ptr().cast(),
                text.len(),
                1,
                0,
                ids.as_mut_ptr(),
                2,
                &mut n,
                e.ptr(),
                256,
            ),
            &e,
            PinferStatus::ErrBuffer,
            "5 tokens",
        );
        assert_eq!(n, 5);
        let invalid = b"\xff\xfe";
        expect(
            pinfer_tokenize(
                model,
                invalid.as_ptr().cast(),
                2,
                1,
                0,
                ids.as_mut_ptr(),
                2,
                &mut n,
                e.ptr(),
                256,
            ),
            &e,
            s,
            "UTF-8",
        );
        let mut out = [0 as c_char; 4];
        let golden = [7042u32, 30];
        expect(
            pinfer_detokenize(model, golden.as_ptr(), 2, 0, out.as_mut_ptr(), 4, &mut n, e.ptr(), 256),
            &e,
            PinferStatus::ErrBuffer,
            "",
        );
        assert_eq!(n, " Paris.".len());
        let mut eog: c_int = 0;
        expect(pinfer_token_is_eog(model, 1 << 30, &mut eog, e.ptr(), 256), &e, s, "vocabulary");

        // Chat: a bad role, then the text SmolLM2's own template gives (its default system message).
        let role = std::ffi::CString::new("robot").unwrap();
        let content = std::ffi::CString::new("hi").unwrap();
        let msgs = [PinferChatMessage { role: role.as_ptr(), content: content.as_ptr() }];
        let mut buf = [0 as c_char; 512];
        expect(
            pinfer_chat_apply(model, msgs.as_ptr(), 1, 1, buf.as_mut_ptr(), 512, &mut n, e.ptr(), 256),
            &e,
            s,
            "robot",
        );
        let user = std::ffi::CString::new("user").unwrap();
        let msgs = [PinferChatMessage { role: user.as_ptr(), content: content.as_ptr() }];
        expect(
            pinfer_chat_apply(model, msgs.as_ptr(), 1, 1, buf.as_mut_ptr(), 512, &mut n, e.ptr(), 256),
            &e,
            ok,
            "",
        );
        let rendered = std::str::from_utf8(std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n)).unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );

        // Sampler: bad parameters; sampling before a decode.
        let mut sp = std::mem::zeroed::<PinferSamplerParams>();
        expect(pinfer_sampler_default_params(&mut sp, e.ptr(), 256), &e, ok, "");
        let mut sampler = null_mut();
        let bad_sp = PinferSamplerParams { top_p: 2.0, ..sp };
        expect(pinfer_sampler_new(&bad_sp, &mut sampler, e.ptr(), 256), &e, s, "params");
        expect(pinfer_sampler_new(&sp, &mut sampler, e.ptr(), 256), &e, ok, "");
        let mut token = 0;
        expect(pinfer_sample(sampler, ctx, &mut token, e.ptr(), 256), &e, PinferStatus::ErrOrder, "decode");

        // Generation: no stream before a decode; a piece that does not fit comes again.
        let order = PinferStatus::ErrOrder;
        expect(pinfer_generate_begin(ctx, &sp, null(), 0, e.ptr(), 256), &e, order, "decode");
        let (mut piece, mut len, mut end) = ([0 as c_char; 64], 0usize, PinferEnd::None);
        let p = piece.as_mut_ptr();
        expect(
            pinfer_generate_step(ctx, &mut token, p, 64, &mut len, &mut end, e.ptr(), 256),
            &e,
            order,
            "stream",
        );
        expect(pinfer_generate_finish(ctx, p, 64, &mut len, e.ptr(), 256), &e, order, "stream");
        let greedy = PinferSamplerParams { temperature: 0.0, ..sp };
        expect(pinfer_decode(ctx, tokens.as_ptr(), 1, e.ptr(), 256), &e, ok, "");
        expect(pinfer_generate_begin(ctx, &greedy, c"\xff".as_ptr(), 2, e.ptr(), 256), &e, s, "stops");
        expect(pinfer_generate_begin(ctx, &greedy, c"\n\n".as_ptr(), 3, e.ptr(), 256), &e, ok, "");
        let mut pieces = 0;
        for _ in 0..16 {
            let status = pinfer_generate_step(ctx, &mut token, p, 0, &mut len, &mut end, e.ptr(), 256);
            if status == PinferStatus::ErrBuffer {
                pieces += 1;
                assert!(len > 0);
                expect(
                    pinfer_generate_step(ctx, &mut token, p, 64, &mut len, &mut end, e.ptr(), 256),
                    &e,
                    ok,
                    "",
                );
            } else {
                expect(status, &e, ok, "");
                assert_eq!(len, 0);
            }
            if end != PinferEnd::None {
                break;
            }
        }
        assert!(pieces > 0, "no step gave text");
        expect(pinfer_generate_finish(ctx, p, 64, &mut len, e.ptr(), 256), &e, ok, "");
        expect(pinfer_generate_finish(ctx, p, 64, &mut len, e.ptr(), 256), &e, order, "stream");

        // Order of frees: the model refuses while its context lives; double frees are refused.
        expect(pinfer_model_free(model, e.ptr(), 256), &e, PinferStatus::ErrOrder, "1 context");
        expect(pinfer_context_free(ctx, e.ptr(), 256), &e, ok, "");
        expect(pinfer_context_free(ctx, e.ptr(), 256), &e, PinferStatus::ErrHandle, "context");
        expect(pinfer_decode(ctx, tokens.as_ptr(), 1, e.ptr(), 256), &e, PinferStatus::ErrHandle, "");
        expect(pinfer_sampler_free(sampler, e.ptr(), 256), &e, ok, "");
        expect(pinfer_sampler_free(sampler, e.ptr(), 256), &e, PinferStatus::ErrHandle, "");
        expect(pinfer_model_free(model, e.ptr(), 256), &e, ok, "");
        expect(pinfer_model_free(model, e.ptr(), 256), &e, PinferStatus::ErrHandle, "");
        expect(pinfer_model_free(null_mut(), e.ptr(), 256), &e, ok, "");

        // Message buffers: NULL or empty are fine; a short one is cut and NUL-terminated.
        let mut none = null_mut();
        assert_eq!(pinfer_model_open_file(null(), &mut none, null_mut(), 0), s);
        assert_eq!(pinfer_model_open_file(null(), &mut none, e.ptr(), 0), s);
        let mut short = [1 as c_char; 5];
        assert_eq!(pinfer_model_open_file(null(), &mut none, short.as_mut_ptr(), 5), s);
        assert_eq!(CStr::from_ptr(short.as_ptr()).to_str().unwrap(), "path");
    }
}

/// Greedy decoding through the exported functions matches llama.cpp's ids on whatever CPU the
/// tests run on (the aarch64 tier runs it under qemu: its golden is the arm build's).
#[test]
fn greedy_decoding_through_the_abi_matches_llama_cpp() {
    let golden =
        if cfg!(target_arch = "aarch64") { "smollm2.arm.greedy.jsonl" } else { "smollm2.greedy.jsonl" };
    let line = std::fs::read_to_string(root().join("tests/golden").join(golden)).unwrap();
    let line = line.lines().next().unwrap();
    let prompt: Vec<u32> = numbers(line, "prompt_ids").iter().map(|&v| v as u32).collect();
    let ids = numbers(line, "generated_ids");
    let margins = numbers(line, "margins");
    let mut e = Err::new();
    // SAFETY: valid pointers throughout; handles used as the header says.
    unsafe {
        let model = open(&mut e);
        let mut ctx = null_mut();
        let params = PinferContextParams { n_ctx: 64, n_batch: 16, n_threads: 2 };
        expect(pinfer_context_new(model, &params, &mut ctx, e.ptr(), 256), &e, PinferStatus::Ok, "");
        let mut sp = std::mem::zeroed::<PinferSamplerParams>();
        pinfer_sampler_default_params(&mut sp, e.ptr(), 256);
        sp.temperature = 0.0;
        let mut sampler = null_mut();
        expect(pinfer_sampler_new(&sp, &mut sampler, e.ptr(), 256), &e, PinferStatus::Ok, "");
        expect(pinfer_decode(ctx, prompt.as_ptr(), prompt.len(), e.ptr(), 256), &e, PinferStatus::Ok, "");
        let mut checked = 0;
        for (&want, &margin) in ids.iter().zip(&margins) {
            if margin < TRUSTED_MARGIN {
                break;
            }
            let mut token = 0;
            expect(pinfer_sample(sampler, ctx, &mut token, e.ptr(), 256), &e, PinferStatus::Ok, "");
            assert_eq!(token, want as u32, "step {checked}");
            checked += 1;
            expect(pinfer_decode(ctx, &token, 1, e.ptr(), 256), &e, PinferStatus::Ok, "");
        }
        assert!(checked >= 4, "{checked}");
        pinfer_sampler_free(sampler, e.ptr(), 256);
        pinfer_context_free(ctx, e.ptr(), 256);
        expect(pinfer_model_free(model, e.ptr(), 256), &e, PinferStatus::Ok, "");
    }
}
