//! The matmul API through `Runtime`, against the CPU emulator (2.x symbol set, RK3588 rules):
//! every type RK3588 supports, every layout, our native-B converters against the runtime's, the
//! create-time checks, one context per NPU core, memory calls.

mod common;

use common::*;
use rknn_sys::layout::*;
use rknn_sys::*;

const F16: rknn_matmul_type = rknn_matmul_type::RKNN_FLOAT16_MM_FLOAT16_TO_FLOAT32;
const I8: rknn_matmul_type = rknn_matmul_type::RKNN_INT8_MM_INT8_TO_INT32;
const I4: rknn_matmul_type = rknn_matmul_type::RKNN_INT4_MM_INT4_TO_INT16;
const NORM: u32 = rknn_matmul_layout::RKNN_MM_LAYOUT_NORM.0;
const NATIVE: u32 = rknn_matmul_layout::RKNN_MM_LAYOUT_NATIVE.0;
const TP_NORM: u32 = rknn_matmul_layout::RKNN_MM_LAYOUT_TP_NORM.0;

/// A or B in normal (row-major) order: f16 bits, or int8 / int4 values one per byte.
#[derive(Clone)]
enum Data {
    F16(Vec<u16>),
    I8(Vec<i8>),
    I4(Vec<i8>),
}

impl Data {
    fn random(ty: rknn_matmul_type, len: usize, rng: &mut Rng) -> Data {
        match ty {
            F16 => Data::F16(rng.f16s(len)),
            I8 => Data::I8(rng.i8s(len, -128, 127)),
            _ => Data::I4(rng.i8s(len, -8, 7)),
        }
    }

    /// Bytes of the matrix stored as given (int4 packed).
    fn bytes(&self) -> Vec<u8> {
        match self {
            Data::F16(v) => bytes_of(v).to_vec(),
            Data::I8(v) => bytes_of(v).to_vec(),
            Data::I4(v) => {
                let mut out = vec![0u8; v.len() / 2];
                pack_int4(v, &mut out).unwrap();
                out
            }
        }
    }

    fn map(&self, f16: impl Fn(&[u16]) -> Vec<u16>, i8: impl Fn(&[i8]) -> Vec<i8>) -> Data {
        match self {
            Data::F16(v) => Data::F16(f16(v)),
            Data::I8(v) => Data::I8(i8(v)),
            Data::I4(v) => Data::I4(i8(v)),
        }
    }
}

fn transpose<T: Copy>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..rows * cols).map(|i| v[(i % rows) * cols + i / rows]).collect()
}

/// B in RK3588 native layout with our converter.
fn our_native_b(b: &Data, k: usize, n: usize) -> Vec<u8> {
    match b {
        Data::F16(v) => {
            let mut out = vec![0u16; k * n];
            native_b_fp16(v, k, n, &mut out).unwrap();
            bytes_of(&out).to_vec()
        }
        Data::I8(v) => {
            let mut out = vec![0i8; k * n];
            native_b_int8(v, k, n, &mut out).unwrap();
            bytes_of(&out).to_vec()
        }
        Data::I4(v) => {
            let mut out = vec![0u8; k * n / 2];
            native_b_int4(v, k, n, &mut out).unwrap();
            out
        }
    }
}

/// B in native layout with the runtime's `rknn_B_normal_layout_to_native_layout` (int4 input
/// unpacked, one value per byte, as the real runtime expects).
fn runtime_native_b(
    b: &Data,
    k: usize,
    n: usize,
    info: &rknn_matmul_info,
    out_len: usize,
) -> Result<Vec<u8>, i32> {
    let convert = rt().b_normal_layout_to_native_layout.expect("2.x emulator has the converter");
    let mut input = match b {
        Data::F16(v) => bytes_of(v).to_vec(),
        Data::I8(v) | Data::I4(v) => bytes_of(v).to_vec(),
    };
    let mut out = vec![0u8; out_len];
    let mut info = *info;
    // SAFETY: input holds K·N elements as the type requires, out the native size.
    let ret =
        unsafe { convert(input.as_mut_ptr().cast(), out.as_mut_ptr().cast(), k as i32, n as i32, &mut info) };
    if ret == RKNN_SUCC {
        Ok(out)
    } else {
        Err(ret)
    }
}

/// Creates a context, checks what the runtime reports, fills A and B in the requested layouts,
/// runs, and compares C (back in normal order) with the reference.
fn run_case(ty: rknn_matmul_type, m: usize, k: usize, n: usize, b_layout: u32, ac_layout: u32, seed: u64) {
    let what = format!("type {} M={m} K={k} N={n} B_layout={b_layout} AC_layout={ac_layout}", ty.0);
    let mut rng = Rng::new(seed);
    let a = Data::random(ty, m * k, &mut rng);
    let b = Data::random(ty, k * n, &mut rng);
    let info = info(ty, m, k, n, b_layout, ac_layout);
    let mm = Matmul::new(rt(), &info).unwrap_or_else(|e| panic!("{what}: create: {e}"));
    let io = *mm.io_attr();

    // What the runtime reports.
    let (a_type, c_type, esize_num, esize_den, a_tile, c_tile, b_tile) = match ty {
        F16 => (
            rknn_tensor_type::RKNN_TENSOR_FLOAT16,
            rknn_tensor_type::RKNN_TENSOR_FLOAT32,
            2,
            1,
            8,
            4,
            B_TILE_FP16,
        ),
        I8 => (
            rknn_tensor_type::RKNN_TENSOR_INT8,
            rknn_tensor_type::RKNN_TENSOR_INT32,
            1,
            1,
            16,
            4,
            B_TILE_INT8,
        ),
        _ => (
            rknn_tensor_type::RKNN_TENSOR_INT4,
            rknn_tensor_type::RKNN_TENSOR_INT16,
            1,
            2,
            32,
            8,
            B_TILE_INT4,
        ),
    };
    let c_esize = if ty == I4 { 2 } else { 4 };
    assert_eq!(io.A.type_, a_type, "{what}");
    assert_eq!(io.B.type_, a_type, "{what}");
    assert_eq!(io.C.type_, c_type, "{what}");
    assert_eq!(io.A.size as usize, m * k * esize_num / esize_den, "{what}");
    assert_eq!(io.B.size as usize, k * n * esize_num / esize_den, "{what}");
    assert_eq!(io.C.size as usize, m * n * c_esize, "{what}");
    let name = |attr: &rknn_matmul_tensor_attr| {
        // c_char is i8 on x86 and u8 on aarch64: the cast is needed on one of them.
        #[allow(clippy::unnecessary_cast)]
        attr.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8 as char).collect::<String>()
    };
    assert_eq!((name(&io.A).as_str(), name(&io.B).as_str(), name(&io.C).as_str()), ("A", "B", "C"));
    let dims = |attr: &rknn_matmul_tensor_attr| attr.dims[..attr.n_dims as usize].to_vec();
    let (m32, k32, n32) = (m as u32, k as u32, n as u32);
    if ac_layout == NATIVE {
        assert_eq!(dims(&io.A), [k32 / a_tile, m32, a_tile], "{what}");
        assert_eq!(dims(&io.C), [n32 / c_tile, m32, c_tile], "{what}");
    } else {
        assert_eq!(dims(&io.A), [m32, k32], "{what}");
        assert_eq!(dims(&io.C), [m32, n32], "{what}");
    }
    match b_layout {
        NATIVE => assert_eq!(
            dims(&io.B),
            [n32 / b_tile.n as u32, k32 / b_tile.k as u32, b_tile.n as u32, b_tile.k as u32],
            "{what}"
        ),
        TP_NORM => assert_eq!(dims(&io.B), [n32, k32], "{what}"),
        _ => assert_eq!(dims(&io.B), [k32, n32], "{what}"),
    }

    // A and B in the chosen layouts, tile sizes taken from the runtime as pinfer will.
    let a_bytes = if ac_layout == NATIVE {
        let s = io.A.dims[2] as usize;
        a.map(
            |v| {
                let mut o = vec![0; v.len()];
                to_native_ac(v, m, k, s, &mut o).unwrap();
                o
            },
            |v| {
                let mut o = vec![0; v.len()];
                to_native_ac(v, m, k, s, &mut o).unwrap();
                o
            },
        )
        .bytes()
    } else {
        a.bytes()
    };
    let b_bytes = match b_layout {
        NATIVE => {
            let ours = our_native_b(&b, k, n);
            let theirs = runtime_native_b(&b, k, n, &info, io.B.size as usize).unwrap();
            assert!(ours == theirs, "{what}: our native B differs from the runtime's");
            ours
        }
        TP_NORM => b.map(|v| transpose(v, k, n), |v| transpose(v, k, n)).bytes(),
        _ => b.bytes(),
    };

    let mut am = mm.alloc(Operand::A).unwrap();
    let mut bm = mm.alloc(Operand::B).unwrap();
    let cm = mm.alloc(Operand::C).unwrap();
    am.as_mut_slice()[..a_bytes.len()].copy_from_slice(&a_bytes);
    bm.as_mut_slice()[..b_bytes.len()].copy_from_slice(&b_bytes);
    am.sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_TO_DEVICE).unwrap();
    bm.sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_TO_DEVICE).unwrap();
    // SAFETY: the buffers outlive the context's runs (dropped after `mm` is last used).
    unsafe {
        mm.bind(Operand::A, &am).unwrap();
        mm.bind(Operand::B, &bm).unwrap();
        mm.bind(Operand::C, &cm).unwrap();
        mm.run().unwrap_or_else(|e| panic!("{what}: run: {e}"));
    }
    cm.sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_FROM_DEVICE).unwrap();
    let c_raw = &cm.as_slice()[..io.C.size as usize];

    fn normal<T: Copy + Default>(raw: Vec<T>, m: usize, n: usize, native_s: Option<usize>) -> Vec<T> {
        match native_s {
            Some(s) => {
                let mut o = vec![T::default(); raw.len()];
                from_native_ac(&raw, m, n, s, &mut o).unwrap();
                o
            }
            None => raw,
        }
    }
    let c_s = (ac_layout == NATIVE).then_some(io.C.dims[2] as usize);
    match (&a, &b) {
        (Data::F16(av), Data::F16(bv)) => {
            let got = normal(from_bytes::<f32>(c_raw), m, n, c_s);
            let (want, mag) = ref_fp16(av, bv, m, k, n);
            assert_close(&got, &want, &mag, &what);
        }
        (Data::I8(av), Data::I8(bv)) => {
            let got = normal(from_bytes::<i32>(c_raw), m, n, c_s);
            assert!(got == ref_int(av, bv, m, k, n), "{what}: C differs from the reference");
        }
        (Data::I4(av), Data::I4(bv)) => {
            let got = normal(from_bytes::<i16>(c_raw), m, n, c_s);
            let want: Vec<i16> = ref_int(av, bv, m, k, n).into_iter().map(|x| x as i16).collect();
            assert!(got == want, "{what}: C differs from the reference");
        }
        _ => unreachable!(),
    }
    drop((am, bm, cm));
}

fn all_layouts(ty: rknn_matmul_type, shapes: &[(usize, usize, usize)]) {
    for (i, &(m, k, n)) in shapes.iter().enumerate() {
        for b_layout in [NORM, NATIVE, TP_NORM] {
            for ac_layout in [NORM, NATIVE] {
                run_case(
                    ty,
                    m,
                    k,
                    n,
                    b_layout,
                    ac_layout,
                    (i as u64) << 8 | (b_layout as u64) << 4 | ac_layout as u64,
                );
            }
        }
    }
}

#[test]
fn fp16_to_fp32_every_layout() {
    all_layouts(F16, &[(1, 32, 16), (1, 64, 48), (5, 96, 32), (16, 128, 64)]);
}

#[test]
fn int8_to_int32_every_layout() {
    all_layouts(I8, &[(1, 32, 32), (3, 64, 96), (17, 128, 64)]);
}

#[test]
fn int4_to_int16_every_layout() {
    all_layouts(I4, &[(1, 32, 64), (4, 64, 128), (9, 96, 64)]);
}

#[test]
fn k_above_8192_uses_segmented_native_b() {
    // Two K segments (8192 + 64 rows); M = 2 so native A/C differ from normal.
    run_case(F16, 2, 8192 + 64, 16, NATIVE, NATIVE, 1);
    run_case(I8, 1, 8192 + 64, 32, NATIVE, NORM, 2);
}

#[test]
fn our_converters_equal_the_runtimes() {
    let mut rng = Rng::new(7);
    for (ty, k, n) in [
        (F16, 32, 16),
        (F16, 256, 128),
        (F16, 8192 + 96, 32),
        (I8, 64, 32),
        (I8, 8192 + 32, 64),
        (I4, 32, 64),
        (I4, 128, 192),
        (I4, 8192 + 32, 64),
    ] {
        let b = Data::random(ty, k * n, &mut rng);
        let info = info(ty, 1, k, n, NATIVE, NORM);
        let size = match ty {
            F16 => k * n * 2,
            I8 => k * n,
            _ => k * n / 2,
        };
        let theirs = runtime_native_b(&b, k, n, &info, size).unwrap();
        assert!(our_native_b(&b, k, n) == theirs, "type {} K={k} N={n}", ty.0);
    }
    // The runtime's converter refuses what create refuses.
    let b = Data::F16(vec![0; 48 * 16]);
    assert_eq!(runtime_native_b(&b, 48, 16, &info(F16, 1, 48, 16, NATIVE, NORM), 48 * 16 * 2), Err(-5));
}

#[test]
fn create_checks_alignment_types_and_limits() {
    let create = |info: rknn_matmul_info| Matmul::new(rt(), &info).map(|_| ()).map_err(|e| e.0);
    let bad = RKNN_ERR_PARAM_INVALID;
    // K must be a multiple of 32; N of 16 (f16), 32 (int8), 64 (int4).
    assert_eq!(create(info(F16, 1, 48, 16, NATIVE, NORM)), Err(bad));
    assert_eq!(create(info(F16, 1, 64, 24, NATIVE, NORM)), Err(bad));
    assert_eq!(create(info(F16, 1, 64, 16, NATIVE, NORM)), Ok(()));
    assert_eq!(create(info(I8, 1, 64, 16, NATIVE, NORM)), Err(bad));
    assert_eq!(create(info(I8, 1, 64, 32, NATIVE, NORM)), Ok(()));
    assert_eq!(create(info(I4, 1, 64, 32, NATIVE, NATIVE)), Err(bad));
    assert_eq!(create(info(I4, 1, 64, 64, NATIVE, NATIVE)), Ok(()));
    // The alignment applies in every layout.
    assert_eq!(create(info(F16, 1, 40, 16, NORM, NORM)), Err(bad));
    // K at most 10240; M, K, N positive.
    assert_eq!(create(info(F16, 1, 10240, 16, NATIVE, NORM)), Ok(()));
    assert_eq!(create(info(F16, 1, 10240 + 32, 16, NATIVE, NORM)), Err(bad));
    assert_eq!(create(info(F16, 0, 32, 16, NATIVE, NORM)), Err(bad));
    assert_eq!(create(info(F16, 1, 0, 16, NATIVE, NORM)), Err(bad));
    assert_eq!(create(info(F16, 1, 32, -16i32 as usize, NATIVE, NORM)), Err(bad));
    // Buffers must fit an IOMMU domain (< 2 GiB): C of 65536 x 8192 f32 is 2 GiB.
    assert_eq!(create(info(F16, 65536, 32, 8192, NATIVE, NORM)), Err(bad));
    // RK3588 supports only types 1, 2 and 10.
    for ty in [0, 3, 4, 5, 6, 7, 8, 9, 11, 12, 15, 99] {
        assert_eq!(create(info(rknn_matmul_type(ty), 1, 64, 64, NATIVE, NORM)), Err(bad), "type {ty}");
    }
    // Unknown layouts; TP_NORM is for B only; quantized B needs other types.
    assert_eq!(create(info(F16, 1, 64, 16, 3, NORM)), Err(bad));
    assert_eq!(create(info(F16, 1, 64, 16, NATIVE, TP_NORM)), Err(bad));
    let mut per_channel = info(I8, 1, 64, 32, NATIVE, NORM);
    per_channel.B_quant_type = rknn_matmul_quant_type::RKNN_QUANT_TYPE_PER_CHANNEL_SYM.0 as i16;
    assert_eq!(create(per_channel), Err(bad));
    // The error reads well.
    assert_eq!(RknnError(bad).to_string(), "RKNN_ERR_PARAM_INVALID (-5)");
}

type RunCount = unsafe extern "C" fn(core::ffi::c_int) -> u64;

fn run_count(core: i32) -> u64 {
    let sym = rt().symbol(c"rknn_emu_run_count").expect("emulator test hook");
    // SAFETY: the emulator defines rknn_emu_run_count as uint64_t(int).
    let f: RunCount = unsafe { std::mem::transmute::<*mut core::ffi::c_void, RunCount>(sym.as_ptr()) };
    // SAFETY: plain call.
    unsafe { f(core) }
}

#[test]
fn one_context_per_core_sharing_a() {
    // rk-llama's pattern: N split in three 16-aligned slices, one context per core, one shared A.
    let (m, k, n) = (3, 128, 80);
    let slices = [(0, 32), (32, 32), (64, 16)];
    let mut rng = Rng::new(42);
    let a = rng.f16s(m * k);
    let b = rng.f16s(k * n);
    let masks =
        [rknn_core_mask::RKNN_NPU_CORE_0, rknn_core_mask::RKNN_NPU_CORE_1, rknn_core_mask::RKNN_NPU_CORE_2];

    let ctxs: Vec<Matmul> = slices
        .iter()
        .zip(masks)
        .map(|(&(_, ni), mask)| {
            let mm = Matmul::new(rt(), &info(F16, m, k, ni, NATIVE, NORM)).unwrap();
            // RK3588 refuses every multi-core mask for a matmul context.
            for multi in [
                rknn_core_mask::RKNN_NPU_CORE_0_1,
                rknn_core_mask::RKNN_NPU_CORE_0_1_2,
                rknn_core_mask::RKNN_NPU_CORE_ALL,
            ] {
                assert_eq!(mm.set_core_mask(multi), Err(RknnError(RKNN_ERR_FAIL)));
            }
            assert_eq!(
                mm.set_core_mask(rknn_core_mask::RKNN_NPU_CORE_UNDEFINED),
                Err(RknnError(RKNN_ERR_PARAM_INVALID))
            );
            mm.set_core_mask(mask).unwrap();
            mm
        })
        .collect();

    let mut am = ctxs[0].alloc(Operand::A).unwrap();
    am.as_mut_slice().copy_from_slice(bytes_of(&a));
    am.sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_TO_DEVICE).unwrap();
    let mut bms = Vec::new();
    let mut cms = Vec::new();
    for (mm, &(off, ni)) in ctxs.iter().zip(&slices) {
        // B_i = columns off..off+ni, packed straight from the full B.
        let mut bm = mm.alloc(Operand::B).unwrap();
        let mut packed = vec![0u16; k * ni];
        pack_native_b(k, ni, B_TILE_FP16, K_SEGMENT_RK3588, &mut packed, |kk, nn| b[kk * n + off + nn])
            .unwrap();
        bm.as_mut_slice().copy_from_slice(bytes_of(&packed));
        bms.push(bm);
        cms.push(mm.alloc(Operand::C).unwrap());
    }
    let before: Vec<u64> = (0..3).map(run_count).collect();
    for ((mm, bm), cm) in ctxs.iter().zip(&bms).zip(&cms) {
        // SAFETY: all buffers outlive the runs below.
        unsafe {
            mm.bind(Operand::A, &am).unwrap();
            mm.bind(Operand::B, bm).unwrap();
            mm.bind(Operand::C, cm).unwrap();
        }
    }
    std::thread::scope(|s| {
        for mm in &ctxs {
            // SAFETY: each context writes only its own C; A and B are not written meanwhile.
            s.spawn(move || unsafe { mm.run() }.unwrap());
        }
    });
    for (core, &runs) in (0..3).zip(&before) {
        assert!(run_count(core) > runs, "no run on core {core}");
    }

    let (want, mag) = ref_fp16(&a, &b, m, k, n);
    let mut got = vec![0f32; m * n];
    for (cm, &(off, ni)) in cms.iter().zip(&slices) {
        cm.sync(rknn_mem_sync_mode::RKNN_MEMORY_SYNC_FROM_DEVICE).unwrap();
        let ci = from_bytes::<f32>(cm.as_slice());
        for i in 0..m {
            got[i * n + off..i * n + off + ni].copy_from_slice(&ci[i * ni..(i + 1) * ni]);
        }
    }
    assert_close(&got, &want, &mag, "three cores");
    drop((am, bms, cms));
}

#[test]
fn memory_calls() {
    let mm = Matmul::new(rt(), &info(F16, 1, 64, 32, NATIVE, NORM)).unwrap();
    let mem = mm.alloc(Operand::B).unwrap();
    let d = mem.descriptor();
    assert!(!d.virt_addr.is_null());
    assert!(d.fd >= 0, "a dma-buf-like fd");
    assert_eq!(d.size, 64 * 32 * 2);
    assert_eq!(d.offset, 0);
    assert_eq!(d.flags, rknn_tensor_mem_flags::RKNN_TENSOR_MEMORY_FLAGS_ALLOC_INSIDE.0);
    assert!(mem.as_slice().iter().all(|&x| x == 0), "zero-filled");
    assert_eq!(mem.len(), 4096);
    for mode in [
        rknn_mem_sync_mode::RKNN_MEMORY_SYNC_TO_DEVICE,
        rknn_mem_sync_mode::RKNN_MEMORY_SYNC_FROM_DEVICE,
        rknn_mem_sync_mode::RKNN_MEMORY_SYNC_BIDIRECTIONAL,
    ] {
        mem.sync(mode).unwrap();
    }
    assert_eq!(mem.sync(rknn_mem_sync_mode(9)), Err(RknnError(RKNN_ERR_PARAM_INVALID)));

    // create_mem needs a context; create_mem2 can do without one.
    assert_eq!(TensorMem::new(rt(), 0, 4096).unwrap_err(), RknnError(RKNN_ERR_MALLOC_FAIL));
    assert!(TensorMem::new2(rt(), 0, 4096, 0).is_err());
    let flags =
        RKNN_MEM_FLAG_ALLOC_NO_CONTEXT | u64::from(rknn_mem_alloc_flags::RKNN_FLAG_MEMORY_NON_CACHEABLE.0);
    let shared = TensorMem::new2(rt(), 0, 4096, flags).unwrap();
    assert!(TensorMem::new(rt(), mm.ctx(), 0).is_err(), "empty buffer");

    // Binding checks the size and the name; running checks every matrix is bound.
    let small = TensorMem::new(rt(), mm.ctx(), 128).unwrap();
    // SAFETY: every buffer bound here outlives the runs (dropped before `mm` below).
    unsafe {
        assert_eq!(mm.bind(Operand::A, &small), Ok(()), "A is 1 x 64 f16: 128 bytes");
        assert_eq!(mm.bind(Operand::B, &small), Err(RknnError(RKNN_ERR_PARAM_INVALID)), "too small");
        assert_eq!(mm.run(), Err(RknnError(RKNN_ERR_INPUT_INVALID)));
        mm.bind(Operand::B, &mem).unwrap();
        assert_eq!(mm.run(), Err(RknnError(RKNN_ERR_OUTPUT_INVALID)));
        mm.bind(Operand::C, &shared).unwrap();
        mm.run().unwrap();
        let mut attr = *mm.attr(Operand::A);
        attr.name[0] = b'X' as core::ffi::c_char;
        assert_eq!((rt().matmul_set_io_mem)(mm.ctx(), mem.as_ptr(), &mut attr), RKNN_ERR_PARAM_INVALID);
    }

    // A destroyed context is invalid.
    let ctx = mm.ctx();
    drop((small, shared, mem));
    drop(mm);
    // SAFETY: the emulator validates handles; a stale one is an error, not UB.
    unsafe {
        assert_eq!((rt().matmul_run)(ctx), RKNN_ERR_CTX_INVALID);
        assert_eq!((rt().matmul_destroy)(ctx), RKNN_ERR_CTX_INVALID);
    }
}

#[test]
fn a_1_6_runtime_lacks_the_optional_functions() {
    let old = Runtime::load_from(emulator_v16_path()).unwrap();
    assert!(old.create_mem2.is_none());
    assert!(old.b_normal_layout_to_native_layout.is_none());
    assert!(rt().create_mem2.is_some() && rt().b_normal_layout_to_native_layout.is_some());
    assert_eq!(
        TensorMem::new2(&old, 0, 64, RKNN_MEM_FLAG_ALLOC_NO_CONTEXT).unwrap_err(),
        RknnError(RKNN_ERR_FAIL)
    );
    // The required functions are enough for a matmul (B converted by us).
    let (m, k, n) = (1, 32, 16);
    let a: Vec<i8> = (0..k as i8).collect();
    let b: Vec<i8> = (0..(k * n) as i32).map(|i| (i % 7 - 3) as i8).collect();
    let mm = Matmul::new(&old, &info(I8, m, k, 32, NATIVE, NORM));
    assert!(mm.is_ok());
    let mm = Matmul::new(&old, &info(F16, m, k, n, NATIVE, NORM)).unwrap();
    let to_f16 = |v: &[i8]| v.iter().map(|&x| half::f16::from_f32(x as f32).to_bits()).collect::<Vec<u16>>();
    let (a16, b16) = (to_f16(&a), to_f16(&b));
    let mut native = vec![0u16; k * n];
    native_b_fp16(&b16, k, n, &mut native).unwrap();
    let mut am = mm.alloc(Operand::A).unwrap();
    let mut bm = mm.alloc(Operand::B).unwrap();
    let cm = mm.alloc(Operand::C).unwrap();
    am.as_mut_slice().copy_from_slice(bytes_of(&a16));
    bm.as_mut_slice().copy_from_slice(bytes_of(&native));
    // SAFETY: the buffers outlive the run.
    unsafe {
        mm.bind(Operand::A, &am).unwrap();
        mm.bind(Operand::B, &bm).unwrap();
        mm.bind(Operand::C, &cm).unwrap();
        mm.run().unwrap();
    }
    let got = from_bytes::<f32>(cm.as_slice());
    let want: Vec<f32> = ref_int(&a, &b, m, k, n).into_iter().map(|x| x as f32).collect();
    assert_eq!(got, want);
    drop((am, bm, cm));
}
