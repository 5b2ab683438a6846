//! aarch64 NEON kernels (with and without `sdot`), twins of `packed` and `reference`.
//!
//! The `sdot` matmuls are `asm!` loops: the dot-product intrinsics are unstable on our compiler, and
//! decode speed comes down to the instructions spent per weight block. Everything else uses
//! intrinsics inside `#[target_feature(enable = "neon")]` functions (NEON is in the aarch64
//! baseline, so calling them is always sound); f16 <-> f32 goes through `fcvtl`/`fcvtn` instead of
//! the `half` crate's software conversion.

/// `{name}`: an asm operand reference for a macro-supplied operand name.
macro_rules! op {
    ($a:ident) => {
        concat!("{", stringify!($a), "}")
    };
}

mod attn_tile;
mod elementwise;
mod f16_gemm;
mod f16_tile;
mod flash_attn;
mod gemv;
mod kv_attn;
mod matmul;
mod matmul_dotprod;
mod quantize_act;
mod widen;

pub use attn_tile::*;
pub use elementwise::*;
pub use f16_gemm::*;
pub use f16_tile::*;
pub use flash_attn::*;
pub use gemv::{gemv_q5, gemv_q5min, gemv_q6k, gemv_q6k_fp16};
pub use kv_attn::*;
pub use matmul::*;
pub use matmul_dotprod::*;
pub use quantize_act::*;
pub use widen::*;

use core::arch::aarch64::*;
use core::arch::asm;

use crate::quant::blocks::F16Le;

// ---------------------------------------------------------------------------------------------
// Small safe helpers

#[target_feature(enable = "neon")]
#[inline]
fn ld_s8x16(b: &[u8]) -> int8x16_t {
    let b: &[u8; 16] = b[..16].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `b`.
    unsafe { vld1q_s8(b.as_ptr().cast()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn ld_i8x16(b: &[i8]) -> int8x16_t {
    let b: &[i8; 16] = b[..16].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `b`.
    unsafe { vld1q_s8(b.as_ptr()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn ld_f32x4(x: &[f32]) -> float32x4_t {
    let x: &[f32; 4] = x[..4].try_into().unwrap();
    // SAFETY: reads the 4 floats of `x`.
    unsafe { vld1q_f32(x.as_ptr()) }
}

/// 16 floats as 4 vectors.
#[target_feature(enable = "neon")]
#[inline]
fn ld_f32x16(x: &[f32]) -> [float32x4_t; 4] {
    let x: &[f32; 16] = x[..16].try_into().unwrap();
    // SAFETY: reads the 16 floats of `x`.
    let r = unsafe { vld1q_f32_x4(x.as_ptr()) };
    [r.0, r.1, r.2, r.3]
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f32x16(x: &mut [f32], v: [float32x4_t; 4]) {
    let x: &mut [f32; 16] = (&mut x[..16]).try_into().unwrap();
    // SAFETY: writes the 16 floats of `x`.
    unsafe { vst1q_f32_x4(x.as_mut_ptr(), float32x4x4_t(v[0], v[1], v[2], v[3])) }
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f32x4(x: &mut [f32], v: float32x4_t) {
    let x: &mut [f32; 4] = (&mut x[..4]).try_into().unwrap();
    // SAFETY: writes the 4 floats of `x`.
    unsafe { vst1q_f32(x.as_mut_ptr(), v) }
}

/// 8 f16 values (`F16Le`s or raw little-endian bytes) as raw bits.
#[target_feature(enable = "neon")]
#[inline]
fn ld_f16x8(x: &[F16Le]) -> uint16x8_t {
    let x: &[F16Le; 8] = x[..8].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `x` (ld1 has no alignment requirement).
    unsafe { vld1q_u16(x.as_ptr().cast()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f16x8(x: &mut [F16Le], v: uint16x8_t) {
    let x: &mut [F16Le; 8] = (&mut x[..8]).try_into().unwrap();
    // SAFETY: writes the 16 bytes of `x`.
    unsafe { vst1q_u16(x.as_mut_ptr().cast(), v) }
}

/// Widens 4 f16 (8 little-endian bytes) to f32.
#[target_feature(enable = "neon")]
#[inline]
fn f16x4_to_f32(b: &[u8]) -> float32x4_t {
    let b: &[u8; 8] = b[..8].try_into().unwrap();
    // SAFETY: reads the 8 bytes of `b`.
    let h = unsafe { vld1_u16(b.as_ptr().cast()) };
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl is base AdvSIMD).
    unsafe {
        asm!("fcvtl {r:v}.4s, {h:v}.4h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Widens the low 4 of 8 f16 (raw bits) to f32.
#[inline(always)]
fn f16_lo(h: uint16x8_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl is base AdvSIMD).
    unsafe {
        asm!("fcvtl {r:v}.4s, {h:v}.4h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Widens the high 4 of 8 f16 (raw bits) to f32.
#[inline(always)]
fn f16_hi(h: uint16x8_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl2 is base AdvSIMD).
    unsafe {
        asm!("fcvtl2 {r:v}.4s, {h:v}.8h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Rounds 8 f32 to f16 (nearest even, as `F16Le::from_f32`), as raw bits.
#[inline(always)]
fn f16_narrow(lo: float32x4_t, hi: float32x4_t) -> uint16x8_t {
    let r: uint16x8_t;
    // SAFETY: register-only conversion (fcvtn/fcvtn2 are base AdvSIMD).
    unsafe {
        asm!(
            "fcvtn {r:v}.4h, {lo:v}.4s",
            "fcvtn2 {r:v}.8h, {hi:v}.4s",
            r = out(vreg) r, lo = in(vreg) lo, hi = in(vreg) hi,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    r
}

/// Rounds 4 f32 to the nearest f16 value, kept as f32.
#[inline(always)]
fn f16_round4(x: float32x4_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversions (base AdvSIMD).
    unsafe {
        asm!(
            "fcvtn {r:v}.4h, {x:v}.4s",
            "fcvtl {r:v}.4s, {r:v}.4h",
            r = out(vreg) r, x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    r
}
