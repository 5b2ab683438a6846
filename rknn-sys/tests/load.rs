//! Loading the runtime: the `PINFER_RKNNRT` override, missing libraries and symbols, and the
//! emulator's failure knob. One test, because it changes the process environment.

mod common;

use std::path::Path;

use common::*;
use rknn_sys::*;

fn live(rt: &Runtime, hook: &std::ffi::CStr) -> i32 {
    let sym = rt.symbol(hook).expect("emulator test hook");
    // SAFETY: the emulator's rknn_emu_live_* hooks are int(void).
    let f = unsafe { std::mem::transmute::<*mut core::ffi::c_void, extern "C" fn() -> i32>(sym.as_ptr()) };
    f()
}

#[test]
fn loading_and_environment() {
    // A library that is not there: one clear line naming it.
    let err = Runtime::load_from(Path::new("/nonexistent/librknnrt.so")).unwrap_err();
    assert!(matches!(&err, LoadError::Open { path, .. } if path == Path::new("/nonexistent/librknnrt.so")));
    let msg = err.to_string();
    assert!(msg.starts_with("cannot load /nonexistent/librknnrt.so: "), "{msg}");
    assert!(msg.contains("No such file"), "{msg}");
    assert!(!msg.contains('\n'));

    // A library that is not an RKNN runtime.
    let err = Runtime::load_from(Path::new("libc.so.6")).unwrap_err();
    assert_eq!(err, LoadError::MissingSymbol { path: "libc.so.6".into(), symbol: "rknn_matmul_create" });
    assert_eq!(err.to_string(), "libc.so.6 is not a usable RKNN runtime: no symbol rknn_matmul_create");

    // Without the override: the system's librknnrt.so (absent off-board), else a clear error.
    // SAFETY: (edition 2021: safe fns) this test binary has a single test, so nothing reads the
    // environment concurrently.
    std::env::remove_var(LIBRARY_ENV);
    match Runtime::load() {
        Ok(rt) => assert_eq!(rt.path(), Path::new(LIBRARY_NAME)),
        Err(e) => assert!(e.to_string().starts_with("cannot load librknnrt.so: "), "{e}"),
    }

    // PINFER_RKNNRT points Runtime::load at the emulator ...
    std::env::set_var(LIBRARY_ENV, emulator_path());
    let rt = Runtime::load().expect("load the emulator through PINFER_RKNNRT");
    assert_eq!(rt.path(), emulator_path());
    assert!(rt.create_mem2.is_some() && rt.b_normal_layout_to_native_layout.is_some());
    // ... and at a missing file, which is an error, not a fallback to the system library.
    std::env::set_var(LIBRARY_ENV, "/nonexistent/emu.so");
    assert!(
        matches!(Runtime::load(), Err(LoadError::Open { path, .. }) if path == Path::new("/nonexistent/emu.so"))
    );
    std::env::remove_var(LIBRARY_ENV);

    // The emulator can play a board whose NPU is unusable: create fails with the given code.
    let info = rknn_matmul_info {
        M: 1,
        K: 32,
        N: 16,
        type_: rknn_matmul_type::RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32,
        B_layout: 1,
        ..Default::default()
    };
    std::env::set_var("RKNN_EMU_FAIL_CREATE", "-3");
    let err = Matmul::new(&rt, &info).unwrap_err();
    assert_eq!(err, RknnError(RKNN_ERR_DEVICE_UNAVAILABLE));
    assert_eq!(err.to_string(), "RKNN_ERR_DEVICE_UNAVAILABLE (-3)");
    std::env::remove_var("RKNN_EMU_FAIL_CREATE");

    // Contexts and buffers are released on drop.
    let (ctxs, mems) = (live(&rt, c"rknn_emu_live_contexts"), live(&rt, c"rknn_emu_live_mems"));
    {
        let mm = Matmul::new(&rt, &info).unwrap();
        let _a = mm.alloc(Operand::A).unwrap();
        let _b = mm.alloc(Operand::B).unwrap();
        assert_eq!(live(&rt, c"rknn_emu_live_contexts"), ctxs + 1);
        assert_eq!(live(&rt, c"rknn_emu_live_mems"), mems + 2);
    }
    assert_eq!(live(&rt, c"rknn_emu_live_contexts"), ctxs);
    assert_eq!(live(&rt, c"rknn_emu_live_mems"), mems);
}
