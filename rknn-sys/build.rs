//! Build script of rknn-sys.
//!
//! * Links nothing: librknnrt.so is opened at run time (`Runtime::load`), so binaries start on
//!   machines without it. `RKNN_LIB_DIR`, if set, is only remembered as one more place to look.
//! * Compiles the CPU emulator of the runtime (`emulator/rknnrt_emu.c`) into shared libraries in
//!   OUT_DIR, for tests: `RKNN_EMULATOR_LIB` (a 2.x runtime) and `RKNN_EMULATOR_LIB_V16` (a 1.6
//!   runtime: without `rknn_create_mem2` and `rknn_B_normal_layout_to_native_layout`) are set for
//!   this crate's code, and dependents' build scripts see the first as `DEP_RKNNRT_EMULATOR`.
//!   The compiler is the one the `cc` crate picks for the target (gcc, or aarch64-linux-gnu-gcc
//!   when cross-compiling). Set `RKNN_SYS_NO_EMULATOR=1` to skip it; a failed compile only warns.
//! * With the `regenerate` feature, runs bindgen on `include/rknn_matmul_subset.h` (and on the
//!   vendor's `rknn_matmul_api.h` when `RKNN_INCLUDE_DIR` names a Rockchip SDK include directory),
//!   for `tests/regenerate.rs` to compare with the committed `src/bindings.rs`.

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=include/rknn_matmul_subset.h");
    println!("cargo:rerun-if-changed=emulator/rknnrt_emu.c");
    println!("cargo:rerun-if-env-changed=RKNN_LIB_DIR");
    println!("cargo:rerun-if-env-changed=RKNN_SYS_NO_EMULATOR");

    if let Some(dir) = env::var_os("RKNN_LIB_DIR").filter(|d| !d.is_empty()) {
        let dir = dir.to_str().expect("RKNN_LIB_DIR must be valid UTF-8");
        // A fallback for Runtime::load after the dynamic loader's own search path.
        println!("cargo:rustc-env=RKNN_SYS_LIB_DIR={dir}");
        println!("cargo:lib_dir={dir}");
    }

    if env::var_os("RKNN_SYS_NO_EMULATOR").is_none_or(|v| v.is_empty() || v == "0") {
        build_emulator(&manifest, &out);
    }

    #[cfg(feature = "regenerate")]
    regen::run(&manifest, &out);
}

/// Compiles the emulator twice (2.x and 1.6 symbol sets) as `librknnrt.so` in two directories.
fn build_emulator(manifest: &Path, out: &Path) {
    let source = manifest.join("emulator/rknnrt_emu.c");
    let include = manifest.join("include");
    let mut built = Vec::new();
    for (dir, defines) in [("emulator", &[][..]), ("emulator-v16", &["-DRKNN_EMU_V16=1"][..])] {
        let dir = out.join(dir);
        std::fs::create_dir_all(&dir).expect("create emulator output directory");
        let lib = dir.join("librknnrt.so");
        // The cc crate knows the target's C compiler and flags; it builds static archives only, so
        // the shared library is linked with its compiler directly.
        let compiler = cc::Build::new().pic(true).opt_level(2).warnings(true).get_compiler();
        let mut cmd = compiler.to_command();
        cmd.args(["-std=gnu11", "-shared", "-Wl,-soname,librknnrt.so"])
            .args(["-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types"])
            .args(defines)
            .arg("-I")
            .arg(&include)
            .arg("-o")
            .arg(&lib)
            .arg(&source)
            .arg("-lpthread");
        match cmd.status() {
            Ok(s) if s.success() => built.push(lib),
            Ok(s) => {
                println!("cargo:warning=rknn-sys: emulator build failed ({s}): {cmd:?}");
                return;
            }
            Err(e) => {
                println!("cargo:warning=rknn-sys: cannot run the C compiler for the emulator: {e}");
                return;
            }
        }
    }
    let path = |p: &PathBuf| p.to_str().expect("OUT_DIR must be valid UTF-8").to_owned();
    println!("cargo:rustc-env=RKNN_EMULATOR_LIB={}", path(&built[0]));
    println!("cargo:rustc-env=RKNN_EMULATOR_LIB_V16={}", path(&built[1]));
    println!("cargo:emulator={}", path(&built[0]));
}

#[cfg(feature = "regenerate")]
mod regen {
    use std::env;
    use std::path::{Path, PathBuf};

    /// Forces the C type of the return-code and flag macros (bindgen would make `0` a u32).
    #[derive(Debug)]
    struct MacroTypes;

    impl bindgen::callbacks::ParseCallbacks for MacroTypes {
        fn int_macro(&self, name: &str, _value: i64) -> Option<bindgen::callbacks::IntKind> {
            use bindgen::callbacks::IntKind;
            if name == "RKNN_SUCC" || name.starts_with("RKNN_ERR_") || name.starts_with("RKNN_WARNING_") {
                Some(IntKind::Int)
            } else if name.starts_with("RKNN_MEM_FLAG_") {
                Some(IntKind::ULongLong)
            } else {
                None
            }
        }
    }

    /// The options used both for our header and for the vendor's (so the outputs compare).
    fn builder(header: &Path) -> bindgen::Builder {
        bindgen::Builder::default()
            .header(header.to_str().expect("header path must be valid UTF-8"))
            // The ABI of the boards; x86-64 gives the same layouts (both LP64).
            .clang_arg("--target=aarch64-unknown-linux-gnu")
            .allowlist_type("rknn_.*|_rknn_.*|PFN_rknn_.*")
            .allowlist_var("RKNN_.*")
            // Newtypes with associated constants: the runtime may return values we do not know.
            .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
            .prepend_enum_name(false)
            .use_core()
            .ctypes_prefix("::core::ffi")
            .derive_default(true)
            .generate_comments(true)
            .layout_tests(true)
            .rust_target(bindgen::RustTarget::stable(85, 0).expect("rust target"))
            .formatter(bindgen::Formatter::Prettyplease)
            .parse_callbacks(Box::new(MacroTypes))
            .raw_line(
                "// Generated by bindgen from rknn-sys/include/rknn_matmul_subset.h. Do not edit: run rknn-sys/regen.sh.",
            )
    }

    pub fn run(manifest: &Path, out: &Path) {
        let ours = out.join("bindings.rs");
        builder(&manifest.join("include/rknn_matmul_subset.h"))
            // Clang's own stdint.h, without the target's C library headers.
            .clang_arg("-ffreestanding")
            .generate()
            .expect("bindgen failed on include/rknn_matmul_subset.h (is libclang installed?)")
            .write_to_file(&ours)
            .expect("write regenerated bindings");
        println!("cargo:rustc-env=RKNN_SYS_REGEN_BINDINGS={}", ours.display());

        println!("cargo:rerun-if-env-changed=RKNN_INCLUDE_DIR");
        if let Some(dir) = env::var_os("RKNN_INCLUDE_DIR").filter(|d| !d.is_empty()) {
            let dir = PathBuf::from(dir);
            let header = dir.join("rknn_matmul_api.h");
            println!("cargo:rerun-if-changed={}", header.display());
            let vendor = out.join("bindings_vendor.rs");
            builder(&header)
                .clang_arg(format!("-I{}", dir.display()))
                .generate()
                .expect("bindgen failed on $RKNN_INCLUDE_DIR/rknn_matmul_api.h")
                .write_to_file(&vendor)
                .expect("write vendor bindings");
            println!("cargo:rustc-env=RKNN_SYS_VENDOR_BINDINGS={}", vendor.display());
        }
    }
}
