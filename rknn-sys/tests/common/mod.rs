//! Helpers shared by the integration tests: the emulator, data, reference products.
#![allow(dead_code)]

use std::path::Path;
use std::sync::OnceLock;

use half::f16;
use rknn_sys::*;

/// The 2.x emulator library built by build.rs.
pub fn emulator_path() -> &'static Path {
    let Some(path) = option_env!("RKNN_EMULATOR_LIB") else { no_emulator() };
    Path::new(path)
}

/// The emulator built with only the 1.6 symbol set.
pub fn emulator_v16_path() -> &'static Path {
    let Some(path) = option_env!("RKNN_EMULATOR_LIB_V16") else { no_emulator() };
    Path::new(path)
}

fn no_emulator() -> ! {
    panic!(
        "build.rs did not build the emulator (no C compiler, or RKNN_SYS_NO_EMULATOR set): see its warnings"
    )
}

/// One loaded emulator for the whole test binary.
pub fn rt() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| Runtime::load_from(emulator_path()).expect("load the emulator"))
}

/// A deterministic xorshift generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in lo..=hi.
    pub fn int(&mut self, lo: i32, hi: i32) -> i32 {
        lo + (self.next() % (hi - lo + 1) as u64) as i32
    }
    /// f16 values in [-2, 2) with a few exponents, as bits.
    pub fn f16s(&mut self, n: usize) -> Vec<u16> {
        (0..n).map(|_| f16::from_f32(self.int(-512, 511) as f32 / 256.0).to_bits()).collect()
    }
    pub fn i8s(&mut self, n: usize, lo: i32, hi: i32) -> Vec<i8> {
        (0..n).map(|_| self.int(lo, hi) as i8).collect()
    }
}

pub fn info(
    ty: rknn_matmul_type,
    m: usize,
    k: usize,
    n: usize,
    b_layout: u32,
    ac_layout: u32,
) -> rknn_matmul_info {
    rknn_matmul_info {
        M: m as i32,
        K: k as i32,
        N: n as i32,
        type_: ty,
        B_layout: b_layout as i16,
        AC_layout: ac_layout as i16,
        ..Default::default()
    }
}

/// C = A x B for f16 bits, summed in f32 in k order, plus the sum of |a·b| per element (the
/// scale of the rounding error).
pub fn ref_fp16(a: &[u16], b: &[u16], m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let f = |x: u16| f16::from_bits(x).to_f32();
    let mut c = vec![0f32; m * n];
    let mut mag = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut acc, mut abs) = (0f32, 0f32);
            for kk in 0..k {
                let p = f(a[i * k + kk]) * f(b[kk * n + j]);
                acc += p;
                abs += p.abs();
            }
            c[i * n + j] = acc;
            mag[i * n + j] = abs;
        }
    }
    (c, mag)
}

/// C = A x B for integers (int8, or int4 values one per byte).
pub fn ref_int(a: &[i8], b: &[i8], m: usize, k: usize, n: usize) -> Vec<i32> {
    let mut c = vec![0i32; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|kk| a[i * k + kk] as i32 * b[kk * n + j] as i32).sum();
        }
    }
    c
}

pub fn assert_close(got: &[f32], want: &[f32], mag: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(mag).enumerate() {
        // f32 sums of up to ~10k terms in possibly another association (FMA): a few ulps of the
        // magnitude sum.
        let tol = 1e-5 * s + 1e-6;
        assert!((g - w).abs() <= tol, "{what}: C[{i}] = {g}, want {w} (tolerance {tol})");
    }
}

pub fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: reading plain integer/float data as bytes; the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

pub fn from_bytes<T: Copy + Default>(b: &[u8]) -> Vec<T> {
    let n = b.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    // SAFETY: `v` has room for exactly `n` values, and every bit pattern is a valid T for the
    // integer and float types used here.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr().cast::<u8>(), n * std::mem::size_of::<T>())
    };
    v
}
