//! Compute kernels: scalar reference twins (`reference`, in `ref.rs`), SIMD variants (`neon` on
//! aarch64, `x86` on x86_64) with the same signatures, and the run-time choice between them
//! ([`KernelPath`]).
//!
//! Each dispatch below matches on [`KernelPath::isa`], exhaustive on every target; the packed
//! matmul's kernel comes from one table per (format, path), [`matmul::MatmulKernel::new`], which the
//! executor reads once per bound graph.

#[path = "ref/mod.rs"]
pub mod reference;

pub mod attn_tile;
pub mod dot;
pub mod f16_gemm;
pub mod kv_attn;
pub mod layout;
pub mod matmul;
pub mod packed;
pub mod widen;

#[cfg(target_arch = "aarch64")]
pub mod neon;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use core::ops::Range;

use packed::{ActBlock, PackedMatrix};

use crate::quant::blocks::F16Le;
use crate::quant::GgmlType;

pub use reference::{merge_attn_parts, RowSoftmax, FLASH_ROWS};

/// Which implementation runs the SIMD-able kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// The portable scalar twins.
    Reference,
    /// aarch64 NEON without the dot-product extension (A72/A53-class cores).
    Neon,
    /// aarch64 NEON with `sdot` (Cortex-A76/A55 with FEAT_DotProd).
    NeonDotprod,
    /// [`KernelPath::NeonDotprod`] with flash attention in FEAT_FP16 arithmetic, as llama.cpp's
    /// aarch64 build computes it (f16 score sums and value updates). Chosen on every core that
    /// has both extensions (Cortex-A76 and A55 do): same numerics as llama.cpp on the board, and
    /// fewer instructions per prompt token than the x86-exact f32 arithmetic of `dotprod`.
    NeonFp16,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// [`KernelPath::Avx2`] with the packed matmul's block dots in `vpdpbusd` (AVX512-VNNI +
    /// AVX512VL on ymm registers: Zen 4, Ice Lake and later server parts). The integer dots are
    /// identical; results agree with `avx2` within the matmul tolerance.
    Avx2Vnni,
}

impl KernelPath {
    /// Every path, in the order of the help texts.
    pub const ALL: [KernelPath; 6] = [
        KernelPath::Reference,
        KernelPath::Neon,
        KernelPath::NeonDotprod,
        KernelPath::NeonFp16,
        KernelPath::Avx2,
        KernelPath::Avx2Vnni,
    ];

    /// Name as accepted by [`KernelPath::parse`] and printed in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Reference => "ref",
            Self::Neon => "neon",
            Self::NeonDotprod => "dotprod",
            Self::NeonFp16 => "fp16",
            Self::Avx2 => "avx2",
            Self::Avx2Vnni => "vnni",
        }
    }

    /// Parses a name from [`KernelPath::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Self::Reference => true,
            Self::Neon => cfg!(target_arch = "aarch64"),
            Self::NeonDotprod => has_dotprod(),
            Self::NeonFp16 => has_dotprod() && has_fp16(),
            Self::Avx2 => has_avx2(),
            Self::Avx2Vnni => has_avx2() && has_vnni(),
        }
    }

    /// The fastest path this CPU supports.
    pub fn detect() -> Self {
        if has_dotprod() && has_fp16() {
            Self::NeonFp16
        } else if has_dotprod() {
            Self::NeonDotprod
        } else if cfg!(target_arch = "aarch64") {
            Self::Neon
        } else if has_avx2() && has_vnni() {
            Self::Avx2Vnni
        } else if has_avx2() {
            Self::Avx2
        } else {
            Self::Reference
        }
    }
}

/// The instruction set a path's SIMD kernels run on when this CPU has it, else the scalar twins:
/// what every dispatch below matches on (a variant exists only on its architecture, so each
/// match is exhaustive on every target without a catch-all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// The portable scalar twins.
    Scalar,
    /// aarch64 NEON (in the baseline: every aarch64 CPU has it).
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// x86_64 AVX2 + FMA + F16C, checked on this CPU when the value is made.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl KernelPath {
    /// The instruction set this path's kernels run on here: a path of another architecture, or
    /// one whose features this CPU lacks, runs the scalar twins.
    pub(crate) fn isa(self) -> Isa {
        match self {
            Self::Reference => Isa::Scalar,
            #[cfg(target_arch = "aarch64")]
            Self::Neon | Self::NeonDotprod | Self::NeonFp16 => Isa::Neon,
            #[cfg(not(target_arch = "aarch64"))]
            Self::Neon | Self::NeonDotprod | Self::NeonFp16 => Isa::Scalar,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 | Self::Avx2Vnni if has_avx2() => Isa::Avx2,
            Self::Avx2 | Self::Avx2Vnni => Isa::Scalar,
        }
    }
}

#[cfg(all(target_arch = "aarch64", feature = "std"))]
fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}
#[cfg(all(target_arch = "aarch64", not(feature = "std")))]
fn has_dotprod() -> bool {
    cfg!(target_feature = "dotprod")
}
#[cfg(not(target_arch = "aarch64"))]
fn has_dotprod() -> bool {
    false
}

#[cfg(all(target_arch = "aarch64", feature = "std"))]
fn has_fp16() -> bool {
    std::arch::is_aarch64_feature_detected!("fp16")
}
#[cfg(all(target_arch = "aarch64", not(feature = "std")))]
fn has_fp16() -> bool {
    cfg!(target_feature = "fp16")
}
#[cfg(not(target_arch = "aarch64"))]
fn has_fp16() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", feature = "std"))]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}
#[cfg(all(target_arch = "x86_64", not(feature = "std")))]
fn has_avx2() -> bool {
    cfg!(all(target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))
}
#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    x86::has_vnni()
}
#[cfg(not(target_arch = "x86_64"))]
fn has_vnni() -> bool {
    false
}

/// Packed matmul on `path` (see [`reference::matmul_ref`] for the contract), the kernel looked up
/// in [`matmul::MatmulKernel::new`]'s table on each call (the executor looks it up once per bound
/// graph). A path this CPU lacks runs the reference.
pub fn packed_matmul(
    path: KernelPath,
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    matmul::MatmulKernel::new(w.format, path).run(w, groups, acts, outs)
}

/// [`widen::widen_ref`] on `path` (same bytes on every path): the widening step of the NEON
/// matmul kernels.
pub fn widen_blocks(
    path: KernelPath,
    w: &PackedMatrix<'_>,
    g: usize,
    blocks: Range<usize>,
    quants: &mut [u8],
    scales: &mut [u8],
) {
    match path.isa() {
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => match w.format {
            packed::PackedFormat::Q6K => neon::widen_q6k(w, g, blocks, quants, scales),
            packed::PackedFormat::Q5 | packed::PackedFormat::Q5Min | packed::PackedFormat::Q5K => {
                neon::widen_q5(w, g, blocks, quants, scales)
            }
            packed::PackedFormat::Q4
            | packed::PackedFormat::Q4Min
            | packed::PackedFormat::Q8
            | packed::PackedFormat::Q8Min
            | packed::PackedFormat::Q8Sub16
            | packed::PackedFormat::Q4K => widen::widen_ref(w, g, blocks, quants, scales),
        },
        // (x86 unpacks the narrow layouts in registers: nothing is widened there.)
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => widen::widen_ref(w, g, blocks, quants, scales),
        Isa::Scalar => widen::widen_ref(w, g, blocks, quants, scales),
    }
}

/// [`widen::q4k_scales_ref`] on `path` (the same bytes on every path): the scale-decoding step
/// of the NEON matmul kernels (x86 decodes inside its passes, with the same function).
pub fn decode_q4k_scales(path: KernelPath, units: &[u8], out: &mut [u8]) {
    match path.isa() {
        #[cfg(target_arch = "aarch64")]
        Isa::Neon if KernelPath::NeonFp16.is_available() && path == KernelPath::NeonFp16 => {
            // SAFETY: the CPU has FEAT_FP16 (checked on this line).
            unsafe { neon::q4k_scales_fp16(units, out) }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::q4k_scales(units, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::q4k_scales(units, out) }
        }
        Isa::Scalar => widen::q4k_scales_ref(units, out),
    }
}

/// Activation quantization on `path` (see [`reference::quantize_act_ref`]); every path gives the same
/// bytes.
pub fn quantize_act(path: KernelPath, x: &[f32], out: &mut [ActBlock]) {
    match path.isa() {
        Isa::Scalar => reference::quantize_act_ref(x, out),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::quantize_act(x, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::quantize_act_avx2(x, out) }
        }
    }
}

/// RMS norm on `path` (see [`reference::rms_norm_ref`]).
pub fn rms_norm(path: KernelPath, x: &[f32], out: &mut [f32], eps: f32) {
    match path.isa() {
        Isa::Scalar => reference::rms_norm_ref(x, out, eps),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::rms_norm(x, out, eps),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::rms_norm_avx2(x, out, eps) }
        }
    }
}

/// f16 dot product of a matmul on f16 weights on `path` (see [`dot::vec_dot_f16_lanes`], its
/// twin [`dot::vec_dot_f16_ggml_ref`]).
pub fn dot_f16(path: KernelPath, x: &[F16Le], y: &[F16Le]) -> f32 {
    match path.isa() {
        Isa::Scalar => dot::vec_dot_f16_lanes(x, y),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::dot_f16(x, y),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::dot_f16_avx2(x, y) }
        }
    }
}

/// Most weight rows of one tile of [`dot_f16_tile`] (each path's [`f16_tile_shape`] is within
/// this and [`F16_TILE_TOKENS`]).
pub const F16_TILE_ROWS: usize = 12;
/// Most tokens of one tile of [`dot_f16_tile`].
pub const F16_TILE_TOKENS: usize = 6;

/// Weight rows and tokens of one [`dot_f16_tile`] on `path` (its registers' tile).
pub fn f16_tile_shape(path: KernelPath) -> (usize, usize) {
    match path.isa() {
        Isa::Scalar => (F16_TILE_ROWS, F16_TILE_TOKENS),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::F16_TILE_NEON,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::F16_TILE_AVX2,
    }
}

/// The matmul on f16 weights for a tile of weight rows `ws` (one length, at most
/// [`f16_tile_shape`]`.0`) and tokens `xs` widened by [`dot::widen_f16_padded`] (each at least the
/// rows' length rounded up to 32 values; at most `.1` of them): `out[r][j]` is bit for bit
/// [`dot_f16`]`(path, ws[r], x_j)`, so a token's numbers do not depend on the tokens beside it.
pub fn dot_f16_tile(
    path: KernelPath,
    ws: &[&[F16Le]],
    xs: &[&[f32]],
    out: &mut [[f32; F16_TILE_TOKENS]; F16_TILE_ROWS],
) {
    match path.isa() {
        Isa::Scalar => {
            for (w, o) in ws.iter().zip(out.iter_mut()) {
                dot::vec_dot_f16_rows_lanes(w, xs, o);
            }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::dot_f16_tile(ws, xs, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::dot_f16_tile_avx2(ws, xs, out) }
        }
    }
}

/// One panel of the encoder's f16 GEMM ([`f16_gemm`]): sums `acc` (one tile per micro-panel of
/// `xt`, packed `[tile][kk][t]` from tokens rounded to f16) continued over a chunk of `kc`
/// elements of weight rows `ws` (at most [`f16_gemm::GEMM_ROWS`], each `kc` long), widened into
/// the scratch `wp`. Every path gives [`f16_gemm::panel_ref`]'s bits.
pub fn f16_gemm_panel(
    path: KernelPath,
    ws: &[&[F16Le]],
    xt: &[f32],
    kc: usize,
    wp: &mut [f32],
    acc: &mut [f16_gemm::GemmTile],
) {
    match path.isa() {
        Isa::Scalar => f16_gemm::panel_ref(ws, xt, kc, acc),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::f16_gemm_panel(ws, xt, kc, wp, acc),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::f16_gemm_panel_avx2(ws, xt, kc, wp, acc) }
        }
    }
}

/// `x` rounded to f16 and widened back into `out` (what [`f32_to_f16`] then widening gives; NaN
/// for NaN), zeros after it up to `out`'s length: the tokens of [`dot_f16_tile`] made from f32
/// activations in one pass.
pub fn round_f16_padded(path: KernelPath, x: &[f32], out: &mut [f32]) {
    let n = x.len().min(out.len());
    match path.isa() {
        Isa::Scalar => reference::round_f16_ref(&x[..n], &mut out[..n]),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::round_f16(&x[..n], &mut out[..n]),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::round_f16_avx2(&x[..n], &mut out[..n]) }
        }
    }
    out[n..].fill(0.0);
}

/// f32 dot product on `path`: the SIMD kernels (twin [`dot::vec_dot_f32_lanes`]), or on the
/// reference path ggml's scalar dot (f64 sum). Used for LoRA adapters' weights and products of
/// two computed tensors (training's backward matmuls and written-out attention); F32 weights of
/// the model file keep the scalar dot.
pub fn dot_f32(path: KernelPath, x: &[f32], y: &[f32]) -> f32 {
    match path.isa() {
        Isa::Scalar if path == KernelPath::Reference => {
            let (x, y): (&[crate::quant::blocks::F32Le], &[crate::quant::blocks::F32Le]) =
                (bytemuck::cast_slice(x), bytemuck::cast_slice(y));
            dot::vec_dot_f32_f32_ref(x, y)
        }
        // (A SIMD path this CPU lacks: the SIMD kernels' twin.)
        Isa::Scalar => dot::vec_dot_f32_lanes(x, y),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::dot_f32(x, y),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::dot_f32_avx2(x, y) }
        }
    }
}

/// `out[e] += d[0] * rows[0][e] + d[1] * rows[1][e] + ...`, the terms added one at a time in row
/// order (a frozen weight's transposed product, `mul_mat_t`). On AVX2 the same loop is compiled
/// for 256-bit vectors: the same roundings, bit for bit.
pub fn add_scaled_rows<const R: usize, const C: usize>(
    path: KernelPath,
    out: &mut [f32],
    d: &[f32; R],
    rows: &[[f32; C]; R],
) {
    match path.isa() {
        Isa::Scalar => add_scaled_rows_impl(out, d, rows),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => add_scaled_rows_impl(out, d, rows),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { add_scaled_rows_avx2(out, d, rows) }
        }
    }
}

#[inline(always)]
fn add_scaled_rows_impl<const R: usize, const C: usize>(out: &mut [f32], d: &[f32; R], rows: &[[f32; C]; R]) {
    for (e, o) in out.iter_mut().take(C).enumerate() {
        let mut acc = *o;
        for r in 0..R {
            acc += d[r] * rows[r][e];
        }
        *o = acc;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_scaled_rows_avx2<const R: usize, const C: usize>(out: &mut [f32], d: &[f32; R], rows: &[[f32; C]; R]) {
    add_scaled_rows_impl(out, d, rows)
}

/// `silu(gate) * up` on `path` (see [`reference::swiglu_ref`]).
pub fn swiglu(path: KernelPath, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match path.isa() {
        Isa::Scalar => reference::swiglu_ref(gate, up, out),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::swiglu(gate, up, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::swiglu_avx2(gate, up, out) }
        }
    }
}

/// GELU on `path` (see [`reference::gelu_ref`]: ggml's f16 table), bit for bit the reference.
pub fn gelu(path: KernelPath, x: &[f32], out: &mut [f32]) {
    match path.isa() {
        Isa::Scalar => reference::gelu_ref(x, out),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::gelu(x, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::gelu_avx2(x, out) }
        }
    }
}

/// `gelu(gate) * up` on `path` (see [`reference::geglu_ref`]), bit for bit the reference (the
/// product is one rounding either way).
pub fn geglu(path: KernelPath, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let out = &mut out[..n];
    gelu(path, &gate[..n], out);
    for (o, &u) in out.iter_mut().zip(up) {
        *o *= u;
    }
}

/// `silu(x)` on `path` (see [`reference::silu_ref`]): SwiGLU's kernel with an up projection of
/// ones, bit for bit the reference (a product by 1 is exact), in runs of 64 values.
pub fn silu(path: KernelPath, x: &[f32], out: &mut [f32]) {
    const ONES: [f32; 64] = [1.0; 64];
    for (x, out) in x.chunks(64).zip(out.chunks_mut(64)) {
        swiglu(path, x, &ONES[..x.len()], out);
    }
}

/// One query row of flash attention on `path` (see [`reference::flash_attn_row_ref`]); returns
/// where its softmax ended.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row<'k>(
    path: KernelPath,
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) -> RowSoftmax {
    match path.isa() {
        Isa::Scalar => reference::flash_attn_row_ref(q, q16, keys, key, value, scale, acc16, out),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon if path == KernelPath::NeonFp16 && has_fp16() => {
            // SAFETY: the CPU has FEAT_FP16 (checked on this line).
            unsafe { neon::flash_attn_row_fp16(q, q16, keys, key, value, scale, acc16, out) }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::flash_attn_row(q, q16, keys, key, value, scale, acc16, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::flash_attn_row_avx2(q, q16, keys, key, value, scale, acc16, out) }
        }
    }
}

/// Up to [`FLASH_ROWS`] query rows of flash attention over the same keys on `path` (see
/// [`reference::flash_attn_rows_ref`]); every row's result is [`flash_attn_row`]'s. Returns where
/// each row's softmax ended.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows<'k>(
    path: KernelPath,
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; FLASH_ROWS] {
    match path.isa() {
        Isa::Scalar => reference::flash_attn_rows_ref(qs, q16, keys, key, value, scale, acc16, outs),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon if path == KernelPath::NeonFp16 && has_fp16() => {
            // SAFETY: the CPU has FEAT_FP16 (checked on this line).
            unsafe { neon::flash_attn_rows_fp16(qs, q16, keys, key, value, scale, acc16, outs) }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::flash_attn_rows(qs, q16, keys, key, value, scale, acc16, outs),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::flash_attn_rows_avx2(qs, q16, keys, key, value, scale, acc16, outs) }
        }
    }
}

/// RoPE of one row by a table of its position's angles on `path` (see
/// [`reference::rope_rotate_ref`]); bit-identical on every path.
pub fn rope_rotate(path: KernelPath, x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    match path.isa() {
        Isa::Scalar => reference::rope_rotate_ref(x, out, cos, sin, neox),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::rope_rotate(x, out, cos, sin, neox),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => reference::rope_rotate_ref(x, out, cos, sin, neox),
    }
}

/// A row of f32 rounded to f16 on `path` (see [`reference::f32_to_f16_ref`]); the same bits on
/// every path (NaNs stay NaNs).
pub fn f32_to_f16(path: KernelPath, x: &[f32], out: &mut [F16Le]) {
    match path.isa() {
        Isa::Scalar => reference::f32_to_f16_ref(x, out),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::f32_to_f16(x, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => reference::f32_to_f16_ref(x, out),
    }
}

/// Query rows `qs` of flash attention over an f16 or f32 (`ty`) cache, row `r` over keys
/// `keys[r]`, on `path`: `outs[r] = sum_j softmax(scale * q.k_j) v_j`, as [`attn_tile::flash_attn_tile_ref`]
/// computes it (every path gives its bits when the cache holds finite values). At most
/// [`attn_tile::tile_rows`] rows; rows whose sizes differ from the first's, or a type or head size that
/// [`attn_tile::takes_tiles`] refuses, leave `outs` untouched (the executor checks both).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_tile<'k>(
    path: KernelPath,
    ty: GgmlType,
    qs: &[&[f32]],
    keys: &[Range<usize>],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scale: f32,
    scratch: &mut attn_tile::TileScratch,
    outs: &mut [&mut [f32]],
) {
    let n = qs.len().min(outs.len()).min(keys.len());
    let (Some(dk), Some(dv)) = (qs.first().map(|q| q.len()), outs.first().map(|o| o.len())) else { return };
    if !attn_tile::takes_tiles(ty, ty, dk, dv)
        || n > attn_tile::tile_rows(dk, dv)
        || qs[..n].iter().any(|q| q.len() != dk)
        || outs[..n].iter().any(|o| o.len() != dv)
    {
        return;
    }
    let t = attn_tile::Tiles { ty, dk, dv, scale, keys: &keys[..n] };
    match path.isa() {
        Isa::Scalar => {
            for r in 0..n {
                attn_tile::flash_attn_tile_ref(ty, qs[r], keys[r].clone(), &key, &value, scale, outs[r]);
            }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::attn_tile(&t, &qs[..n], key, value, scratch, &mut outs[..n]),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::Avx2`).
            unsafe { x86::attn_tile_avx2(&t, &qs[..n], key, value, scratch, &mut outs[..n]) }
        }
    }
}

/// Up to [`kv_attn::TYPED_ROWS`] query rows `qs` of flash attention over keys of the same cache, row `r`
/// over keys `keys[r]` (the tokens of a prompt see different keys): for each of its keys `j`,
/// `s = dot(key(j), q) * scale`, then the online softmax of ggml (a new maximum rescales the
/// accumulator by `exp(old - new)` and adds the value with weight 1, else the value is added with
/// weight `exp(s - max)`), and `outs[r] = acc / sum`. Each row's result is the one it gets alone.
/// Scratch: `qconv` holds the converted queries ([`kv_attn::KvOps::query_bytes`] each), `acc`
/// `outs.len() * dv` accumulators and `vals` widened values of at least one key (`dv = outs[r].len()`;
/// [`kv_attn::KEY_CHUNK`] keys' worth lets every row take a chunk of keys at once). An empty
/// range gives zeros. Rows whose sizes do not fit the scratch are left untouched (the executor
/// sizes it). Every path gives the reference operations' bits. Returns where each row's softmax
/// ended.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows_typed<'k>(
    ops: &kv_attn::KvOps,
    qs: &[&[f32]],
    qconv: &mut [u8],
    keys: &[Range<usize>],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scale: f32,
    acc: &mut [f32],
    vals: &mut [f32],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; kv_attn::TYPED_ROWS] {
    flash_attn_rows_typed_alibi(ops, qs, qconv, keys, None, key, value, scale, acc, vals, outs)
}

/// [`flash_attn_rows_typed`] with row `r`'s scores biased by `alibi[r]` (after the scale, as
/// ggml adds its ALiBi mask; `None`: no bias, the same bits as [`flash_attn_rows_typed`]); with
/// fewer biases than rows nothing is computed. Every path gives the reference operations' bits.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows_typed_alibi<'k>(
    ops: &kv_attn::KvOps,
    qs: &[&[f32]],
    qconv: &mut [u8],
    keys: &[Range<usize>],
    alibi: Option<&[kv_attn::Alibi]>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scale: f32,
    acc: &mut [f32],
    vals: &mut [f32],
    outs: &mut [&mut [f32]],
) -> [RowSoftmax; kv_attn::TYPED_ROWS] {
    let Some(a) = kv_attn::prepare(ops, qs, qconv, keys, alibi, scale, acc.len(), vals.len(), outs) else {
        return [RowSoftmax::EMPTY; kv_attn::TYPED_ROWS];
    };
    let acc = &mut acc[..a.n * a.dv];
    let ends = match ops.simd() {
        #[cfg(target_arch = "x86_64")]
        Some(kv_attn::Simd::Avx2) => {
            // SAFETY: `KvOps::new` chose Avx2 after checking that the CPU has AVX2, FMA and F16C.
            unsafe { x86::kv_attend_avx2(ops, &a, key, value, acc, vals) }
        }
        #[cfg(target_arch = "aarch64")]
        Some(kv_attn::Simd::Neon) => neon::kv_attend(ops, &a, key, value, acc, vals),
        #[cfg(target_arch = "aarch64")]
        Some(kv_attn::Simd::NeonDotprod) => {
            // SAFETY: `KvOps::new` chose NeonDotprod after checking that the CPU has FEAT_DotProd.
            unsafe { neon::kv_attend_dotprod(ops, &a, key, value, acc, vals) }
        }
        None => kv_attn::attend_ref(ops, &a, key, value, acc, vals),
    };
    kv_attn::normalise(&ends, acc, a.dv, &mut outs[..a.n]);
    ends
}
