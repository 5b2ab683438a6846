//! The packed matmul's kernel for each (packed format, kernel path): one table, read when the
//! kernels are bound, so a call runs what was chosen instead of matching on the path and format.
//!
//! A [`MatmulKernel`] is the kernel that computes one format on one path, written as its steps:
//! 1. **decode scales** (Q4K, Q5K on NEON): per chunk of row groups, the super-block scales are
//!    decoded into per-block f16 scales ([`widen::matmul_decoded`]), and the rest runs on the quant
//!    plane as it is, as [`PackedFormat::decoded`] (Q4Min, Q5Min);
//! 2. **one token** (Q5, Q5Min, Q6K with `sdot`): a lone token runs a GEMV that unpacks the narrow
//!    layout in registers;
//! 3. **widen** (Q5, Q5Min, Q6K on NEON): chunks are widened into [`widen::wide_format`] (Q8, Q8Min,
//!    Q8Sub16, [`widen::matmul_widened`]) in a stack buffer;
//! 4. **kernel**: the SIMD kernel of the layout the steps leave (or the whole matmul: the reference,
//!    and x86, which unpacks every layout and decodes Q4K's scales inside its passes).
//!
//! [`MatmulKernel::new`] is the table: an exhaustive match per path and format, so a new format or
//! path is a compile error there. A path this CPU lacks gets the reference (as every kernel of
//! [`super::KernelPath`] does).

use core::ops::Range;

use super::packed::{ActBlock, PackedFormat, PackedMatrix};
use super::reference::matmul_ref;
use super::{widen, KernelPath};

/// A matmul kernel or a GEMV: the contract of [`matmul_ref`].
type MatmulFn = unsafe fn(&PackedMatrix<'_>, Range<usize>, &[&[ActBlock]], &mut [&mut [f32]]);
/// Super-block scale units decoded into per-block scales (the contract of
/// [`widen::q4k_scales_ref`]).
type DecodeFn = unsafe fn(&[u8], &mut [u8]);
/// Blocks of one group widened (the contract of [`widen::widen_ref`]).
type WidenFn = unsafe fn(&PackedMatrix<'_>, usize, Range<usize>, &mut [u8], &mut [u8]);

/// The packed matmul of one format on one path, as its steps (see the module). Made only by
/// [`MatmulKernel::new`], which checks the CPU has every step's features: that is what makes
/// [`MatmulKernel::run`] safe to call.
#[derive(Clone, Copy)]
pub struct MatmulKernel {
    /// The format the kernel was chosen for; a matrix of another format runs the reference.
    format: PackedFormat,
    decode_scales: Option<DecodeFn>,
    one_token: Option<MatmulFn>,
    widen: Option<WidenFn>,
    kernel: MatmulFn,
}

impl MatmulKernel {
    /// The table: the kernel computing `format` on `path`, or the reference where this CPU lacks
    /// the path's features.
    pub fn new(format: PackedFormat, path: KernelPath) -> Self {
        match path {
            KernelPath::Reference => Self::reference(format),
            KernelPath::Neon => Self::neon(format),
            KernelPath::NeonDotprod | KernelPath::NeonFp16 if !path.is_available() => {
                // FEAT_FP16 missing: the plain `sdot` kernels, when the CPU has those.
                if KernelPath::NeonDotprod.is_available() {
                    Self::dotprod(format, false)
                } else {
                    Self::reference(format)
                }
            }
            KernelPath::NeonDotprod => Self::dotprod(format, false),
            KernelPath::NeonFp16 => Self::dotprod(format, true),
            KernelPath::Avx2 | KernelPath::Avx2Vnni if !path.is_available() => {
                // AVX512-VNNI missing: the AVX2 kernels, when the CPU has those.
                if KernelPath::Avx2.is_available() {
                    Self::avx2(format, false)
                } else {
                    Self::reference(format)
                }
            }
            KernelPath::Avx2 => Self::avx2(format, false),
            KernelPath::Avx2Vnni => Self::avx2(format, true),
        }
    }

    /// The format this kernel computes.
    pub fn format(&self) -> PackedFormat {
        self.format
    }

    /// Packed matmul (the contract of [`matmul_ref`]) of `w`, whose format must be this kernel's
    /// (another runs the reference).
    pub fn run(
        &self,
        w: &PackedMatrix<'_>,
        groups: Range<usize>,
        acts: &[&[ActBlock]],
        outs: &mut [&mut [f32]],
    ) {
        if w.format != self.format {
            return matmul_ref(w, groups, acts, outs);
        }
        match self.decode_scales {
            Some(decode) => {
                // SAFETY: `new` checked the CPU has the decoder's features.
                let decode = |units: &[u8], out: &mut [u8]| unsafe { decode(units, out) };
                widen::matmul_decoded(decode, w, groups, acts, outs, |w, g, a, o| self.decoded(w, g, a, o))
            }
            None => self.decoded(w, groups, acts, outs),
        }
    }

    /// Steps 2 to 4, on `w` with its scales decoded (or without super-block scales).
    fn decoded(
        &self,
        w: &PackedMatrix<'_>,
        groups: Range<usize>,
        acts: &[&[ActBlock]],
        outs: &mut [&mut [f32]],
    ) {
        if let Some(gemv) = self.one_token.filter(|_| acts.len().min(outs.len()) == 1) {
            // SAFETY: `new` checked the CPU has the GEMV's features; it checks the rest.
            return unsafe { gemv(w, groups, acts, outs) };
        }
        match self.widen {
            Some(widen) => {
                let widen = |w: &PackedMatrix<'_>, g, b, q: &mut [u8], s: &mut [u8]| {
                    // SAFETY: `new` checked the CPU has the widening's features; it checks the rest.
                    unsafe { widen(w, g, b, q, s) }
                };
                let kernel = |w: &PackedMatrix<'_>, g, a: &[&[ActBlock]], o: &mut [&mut [f32]]| {
                    // SAFETY: `new` checked the CPU has the kernel's features; it checks the rest.
                    unsafe { (self.kernel)(w, g, a, o) }
                };
                widen::matmul_widened(widen, w, groups, acts, outs, kernel)
            }
            // SAFETY: `new` checked the CPU has the kernel's features; it checks the rest.
            None => unsafe { (self.kernel)(w, groups, acts, outs) },
        }
    }

    /// A kernel that reads `format` as it is.
    const fn direct(format: PackedFormat, kernel: MatmulFn) -> Self {
        Self { format, decode_scales: None, one_token: None, widen: None, kernel }
    }

    /// The portable reference (every format).
    fn reference(format: PackedFormat) -> Self {
        Self::direct(format, matmul_ref)
    }

    /// Plain NEON (no `sdot`): the 4- and 8-bit layouts directly, the 5- and 6-bit ones widened,
    /// the super-block scales decoded.
    #[cfg(target_arch = "aarch64")]
    fn neon(format: PackedFormat) -> Self {
        use super::layout::{Q4Min, Q8Min, Q8Sub16, Q4, Q8};
        use super::neon::{matmul_neon, q4k_scales, widen_q5, widen_q6k};
        let (wide, decode) = (Some(widen_q5 as WidenFn), Some(q4k_scales as DecodeFn));
        let direct = Self::direct;
        match format {
            PackedFormat::Q4 => direct(format, matmul_neon::<Q4>),
            PackedFormat::Q4Min => direct(format, matmul_neon::<Q4Min>),
            PackedFormat::Q8 => direct(format, matmul_neon::<Q8>),
            PackedFormat::Q8Min => direct(format, matmul_neon::<Q8Min>),
            PackedFormat::Q8Sub16 => direct(format, matmul_neon::<Q8Sub16>),
            PackedFormat::Q6K => Self { widen: Some(widen_q6k), ..direct(format, matmul_neon::<Q8Sub16>) },
            PackedFormat::Q5 => Self { widen: wide, ..direct(format, matmul_neon::<Q8>) },
            PackedFormat::Q5Min => Self { widen: wide, ..direct(format, matmul_neon::<Q8Min>) },
            PackedFormat::Q4K => Self { decode_scales: decode, ..direct(format, matmul_neon::<Q4Min>) },
            PackedFormat::Q5K => {
                Self { decode_scales: decode, widen: wide, ..direct(format, matmul_neon::<Q8Min>) }
            }
        }
    }
    #[cfg(not(target_arch = "aarch64"))]
    fn neon(format: PackedFormat) -> Self {
        Self::reference(format)
    }

    /// NEON with `sdot` (the caller checked the CPU has it, and FEAT_FP16 with `fp16`): the 4-
    /// and 8-bit layouts directly; a lone token of the 5- and 6-bit ones by their GEMVs, more
    /// widened; the super-block scales decoded (in FEAT_FP16 arithmetic with `fp16`, as Q6K's).
    #[cfg(target_arch = "aarch64")]
    fn dotprod(format: PackedFormat, fp16: bool) -> Self {
        use super::layout::{Q4Min, Q8Min, Q8Sub16, Q4, Q8};
        use super::neon::{gemv_q5, gemv_q5min, gemv_q6k, gemv_q6k_fp16, matmul_dotprod, q4k_scales};
        use super::neon::{q4k_scales_fp16, widen_q5, widen_q6k};
        let wide = Some(widen_q5 as WidenFn);
        let decode = Some(if fp16 { q4k_scales_fp16 as DecodeFn } else { q4k_scales });
        let q6k_gemv = if fp16 { gemv_q6k_fp16 as MatmulFn } else { gemv_q6k };
        let direct = Self::direct;
        match format {
            PackedFormat::Q4 => direct(format, matmul_dotprod::<Q4>),
            PackedFormat::Q4Min => direct(format, matmul_dotprod::<Q4Min>),
            PackedFormat::Q8 => direct(format, matmul_dotprod::<Q8>),
            PackedFormat::Q8Min => direct(format, matmul_dotprod::<Q8Min>),
            PackedFormat::Q8Sub16 => direct(format, matmul_dotprod::<Q8Sub16>),
            PackedFormat::Q6K => Self {
                one_token: Some(q6k_gemv),
                widen: Some(widen_q6k),
                ..direct(format, matmul_dotprod::<Q8Sub16>)
            },
            PackedFormat::Q5 => {
                Self { one_token: Some(gemv_q5), widen: wide, ..direct(format, matmul_dotprod::<Q8>) }
            }
            PackedFormat::Q5Min => {
                Self { one_token: Some(gemv_q5min), widen: wide, ..direct(format, matmul_dotprod::<Q8Min>) }
            }
            PackedFormat::Q4K => Self { decode_scales: decode, ..direct(format, matmul_dotprod::<Q4Min>) },
            PackedFormat::Q5K => Self {
                decode_scales: decode,
                one_token: Some(gemv_q5min),
                widen: wide,
                ..direct(format, matmul_dotprod::<Q8Min>)
            },
        }
    }
    #[cfg(not(target_arch = "aarch64"))]
    fn dotprod(format: PackedFormat, _fp16: bool) -> Self {
        Self::reference(format)
    }

    /// AVX2 (the caller checked the CPU has it, and AVX512-VNNI/VL with `vnni`): one kernel per
    /// layout that unpacks the 5- and 6-bit values in registers; Q4K and Q5K run as Q4Min and
    /// Q5Min, their scales decoded per chunk inside the kernel's passes.
    #[cfg(target_arch = "x86_64")]
    fn avx2(format: PackedFormat, vnni: bool) -> Self {
        use super::layout::{Q4Min, Q5Min, Q8Min, Q8Sub16, Q4, Q5, Q6K, Q8};
        use super::x86::matmul_avx2;
        let kernel: MatmulFn = match (format, vnni) {
            (PackedFormat::Q4, false) => matmul_avx2::<Q4, false>,
            (PackedFormat::Q4Min | PackedFormat::Q4K, false) => matmul_avx2::<Q4Min, false>,
            (PackedFormat::Q8, false) => matmul_avx2::<Q8, false>,
            (PackedFormat::Q8Min, false) => matmul_avx2::<Q8Min, false>,
            (PackedFormat::Q8Sub16, false) => matmul_avx2::<Q8Sub16, false>,
            (PackedFormat::Q6K, false) => matmul_avx2::<Q6K, false>,
            (PackedFormat::Q5, false) => matmul_avx2::<Q5, false>,
            (PackedFormat::Q5Min | PackedFormat::Q5K, false) => matmul_avx2::<Q5Min, false>,
            (PackedFormat::Q4, true) => matmul_avx2::<Q4, true>,
            (PackedFormat::Q4Min | PackedFormat::Q4K, true) => matmul_avx2::<Q4Min, true>,
            (PackedFormat::Q8, true) => matmul_avx2::<Q8, true>,
            (PackedFormat::Q8Min, true) => matmul_avx2::<Q8Min, true>,
            (PackedFormat::Q8Sub16, true) => matmul_avx2::<Q8Sub16, true>,
            (PackedFormat::Q6K, true) => matmul_avx2::<Q6K, true>,
            (PackedFormat::Q5, true) => matmul_avx2::<Q5, true>,
            (PackedFormat::Q5Min | PackedFormat::Q5K, true) => matmul_avx2::<Q5Min, true>,
        };
        Self::direct(format, kernel)
    }
    #[cfg(not(target_arch = "x86_64"))]
    fn avx2(format: PackedFormat, _vnni: bool) -> Self {
        Self::reference(format)
    }
}

/// The kernel of every format on one path: what a bound graph keeps (see
/// [`crate::exec::Bound::with_kernels`]).
#[derive(Clone, Copy)]
pub struct MatmulKernels([MatmulKernel; PackedFormat::ALL.len()]);

impl MatmulKernels {
    /// Every format's kernel on `path`.
    pub fn new(path: KernelPath) -> Self {
        Self(PackedFormat::ALL.map(|f| MatmulKernel::new(f, path)))
    }

    /// The kernel of `format`.
    pub fn of(&self, format: PackedFormat) -> &MatmulKernel {
        &self.0[format.index()]
    }
}
