//! Packed matmul and activation quantization (AVX2, optionally AVX512-VNNI).
//!
//! # Packed matmul
//! A 32-byte load of an interleaved block covers two 16-byte chunks: 4 rows x 4 elements each, so
//! 32-bit lane `4h + r` belongs to row `r` and to the elements of chunk `h`. Each activation block is
//! first *expanded* into a small stack scratch: four vectors holding the 4-byte activation group of
//! the matching chunk in all 4 row lanes of each half. The inner loop is then loads and integer
//! dot products only; the int32 lane sums of both halves are added (exactly), and the 4 row sums
//! of two blocks side by side scaled by `d_w * d_a` into one f32 accumulator (see [`row_step`]).
//!
//! Every kernel shape (one token, tiles of up to 4) sums a row in the same order of arithmetic,
//! so a token's results do not depend on the batch it is in: a batch of guesses (`--lookup`,
//! `-md`) verifies what single tokens would compute, and a server's shared batch gives each
//! request what it would get alone (`tests/kernels_simd.rs` checks it bit for bit).
//!
//! - 4-bit: the stored two's-complement nibble `q` is turned into `u = q + 8` (XOR 8, 0..15), which
//!   `maddubs` takes as its unsigned operand directly; four products per i16 lane stay below 2^15,
//!   so a whole block is summed in i16 before one `madd`, and `8 * sum(a)` (precomputed with the
//!   expansion) is subtracted in int32: the block dot is exact.
//! - 8-bit: the sign trick, `maddubs(|w|, sign(a, w))`, then `madd` per vector (the i16 pair sums
//!   use the whole i16 range).
//! - With AVX512-VNNI + AVX512VL (detected at run time, see [`vnni`]) `vpdpbusd` replaces each
//!   `maddubs` + `madd` + add; int8 weights are taken as `q + 128` and `128 * sum(a)` subtracted.
//!
//! Tokens are processed in tiles of up to 4 (weights unpacked once per tile). The groups are cut
//! into strips that stay in L2, so a call with many tokens reads each weight from memory once. A
//! single token (decode, where the weights stream from DRAM and memory sets the pace) goes one
//! row group at a time, so each plane is read as one linear stream that the hardware prefetchers
//! follow, with software prefetches 8 KiB ahead (see [`pass1`]).

use core::arch::x86_64::*;
use core::mem::MaybeUninit;
use core::ops::Range;

use crate::kernels::layout::Layout;
use crate::kernels::packed::{
    ActBlock, PackedFormat, PackedMatrix, BLOCK, GROUP_ROWS, Q4K_SCALE_BYTES, SUPER_BLOCKS, SUPER_SCALE_BYTES,
};
use crate::kernels::reference::matmul_ref;

/// Packed matmul of layout `L` (see [`matmul_ref`] for the contract; float sums are in another
/// order): a matrix of format `L`, or for `L` = Q4Min and Q5Min one of Q4K and Q5K, whose scales
/// the passes decode into that form per chunk. A matrix of another format runs the reference.
///
/// Activation quants are assumed in `-127..=127`, which [`crate::kernels::reference::quantize_act_ref`] gives
/// for every block whose largest magnitude is at least `127 / f32::MAX` (about 4e-37).
///
/// With `VNNI`, the block dots are `vpdpbusd` on ymm registers (integer results identical).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and with `VNNI` AVX512-VNNI and AVX512VL ([`has_vnni`]).
pub unsafe fn matmul_avx2<L: Layout, const VNNI: bool>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { matmul_impl::<L, VNNI>(w, groups, acts, outs) }
}

/// Activation quantization, byte-identical to [`crate::kernels::reference::quantize_act_ref`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn quantize_act_avx2(x: &[f32], out: &mut [ActBlock]) {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { quantize_act_impl(x, out) }
}

// ---------------------------------------------------------------------------------------------
// Packed matmul
// ---------------------------------------------------------------------------------------------

/// Whether the CPU has `vpdpbusd` on ymm registers (AVX512-VNNI + AVX512VL, EVEX encoded;
/// AVX-VNNI-only CPUs keep the AVX2 code): what [`crate::kernels::KernelPath::Avx2Vnni`] needs.
/// Without std, what the build targets.
pub fn has_vnni() -> bool {
    #[cfg(feature = "std")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni") && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(feature = "std"))]
    {
        cfg!(all(target_feature = "avx512vnni", target_feature = "avx512vl"))
    }
}

/// `acc + sum of 4 u8 x i8 products` per int32 lane: `vpdpbusd` (fuses `maddubs`, `madd` and the
/// add, without the i16 saturation). Inline assembly because the intrinsic needs the AVX-512
/// target features, stable only since Rust 1.89 (the crate declares 1.85).
///
/// # Safety
/// The CPU must have AVX512-VNNI and AVX512VL.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dpbusd(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    let mut acc = acc;
    // SAFETY: the caller guarantees the instruction exists; register operands only.
    unsafe {
        core::arch::asm!(
            "{{evex}} vpdpbusd {acc}, {u}, {s}",
            acc = inout(ymm_reg) acc,
            u = in(ymm_reg) u,
            s = in(ymm_reg) s,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// Formats read through a nibble plane ([`nibble_operands`]): 4-bit, and 5-bit with its bit plane.
const fn is_4bit(f: PackedFormat) -> bool {
    f.is_4bit() || f.is_5bit()
}

/// Whether layout `L` is format `f`.
const fn is<L: Layout>(f: PackedFormat) -> bool {
    L::FORMAT.index() == f.index()
}

/// Tokens per tile (weights are unpacked once per tile).
const TILE: usize = 4;
/// Expanded token-blocks held at once: 24 KiB of stack, so it stays in L1 next to the weights.
const SCRATCH: usize = 128;
/// Quant bytes of the groups one pass over the tokens works on: well inside a 1 MiB L2.
const STRIP_BYTES: usize = 512 << 10;

/// One activation block expanded for the interleaved layout.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Expanded {
    /// `e[v]`: 4-byte groups `2v` (low half) and `2v + 1` (high half), each in all 4 row lanes.
    /// Q8: `e[v]` pairs with the `v`-th 32-byte load. Q4: `e[0]`, `e[1]` with the low nibbles of
    /// loads 0 and 1, `e[2]`, `e[3]` with their high nibbles.
    e: [__m256i; 4],
    /// `-8` (4-bit formats) or `-128` (int8 formats, VNNI) times the sum of the
    /// activations a half meets, per int32 lane (see [`Corr`]); Q6K: `-32` times the sum over
    /// elements 0..16 only; else zero.
    neg_corr: __m256i,
    /// Q6K: `-32` times the sum over elements 16..32 per int32 lane; else zero.
    neg_corr_hi: __m256i,
    /// `[d; 4, d'; 4]`, `d` this block's activation scale and `d'` the next one's (this one's
    /// again at the last block): what the kernels that go two blocks at a time scale by.
    d_pair: __m256,
    /// `[s; 4, s'; 4]` likewise.
    s_pair: __m256,
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matmul_impl<L: Layout, const VNNI: bool>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    let tokens = acts.len().min(outs.len());
    let nb = w.blocks();
    let ng = groups.len();
    // Anything outside the kernel's fast path (shapes the reference handles by truncation) goes to
    // the reference; the pointer arithmetic below relies on these checks.
    let sane = w.format.decoded() == L::FORMAT
        && w.is_consistent()
        && nb > 0
        && groups.end <= w.groups()
        && acts[..tokens].iter().all(|a| a.len() >= nb)
        && outs[..tokens].iter().all(|o| o.len() >= GROUP_ROWS * ng);
    if !sane {
        return matmul_ref(w, groups, acts, outs);
    }
    if tokens == 0 || ng == 0 {
        return;
    }
    let (acts, outs) = (&acts[..tokens], &mut outs[..tokens]);
    // SAFETY: the checks above (`w` of layout `L`, consistent planes, groups inside the matrix,
    // activation and output rows long enough) are what `run` requires; `VNNI` is the caller's.
    unsafe { run::<L, VNNI>(w, groups, acts, outs) }
}

/// Cuts the groups into strips whose quants stay in L2 and `k` into chunks whose expanded
/// activations fit the scratch. Several tokens go chunk by chunk, every token tile of a chunk in
/// turn (a Q4K strip's scales decoded once per chunk for all of them); one token goes group by
/// group ([`pass1`]). Each strip's weights are fetched from memory once per call, whatever the
/// token count (activations are re-expanded per strip instead, which costs a few percent when
/// there is more than one).
///
/// # Safety
/// `w` consistent with format `F`, `groups` inside it, every activation row at least `w.blocks()`
/// blocks and every output row at least `4 * groups.len()` long, `acts.len() == outs.len()`;
/// `VNNI` only when the CPU has AVX512-VNNI and AVX512VL. `F` is Q4Min for a Q4K matrix.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<F: Layout, const VNNI: bool>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    let nb = w.blocks();
    let mut scratch = MaybeUninit::<[Expanded; SCRATCH]>::uninit();
    let sp = scratch.as_mut_ptr().cast::<Expanded>();
    // (Q4K, Q5K: super-block scales, decoded into F's per-block ones.)
    let q4k = w.format.decoded() != w.format;
    let corr = if is::<F>(PackedFormat::Q5) {
        Corr::Times16
    } else if is::<F>(PackedFormat::Q5Min) {
        // Q5Min's values are taken as the unsigned u they are (`w = d u + m`).
        Corr::None
    } else if is_4bit(F::FORMAT) {
        Corr::Times8
    } else if is::<F>(PackedFormat::Q6K) {
        Corr::Times32Halves
    } else if VNNI && !F::FORMAT.has_sub16() {
        Corr::Times128
    } else {
        Corr::None
    };
    // Chunks of whole segments (so every token's row sums fold at the same blocks, see
    // `row_step`; whole scale units too) that a full tile's expansion fits.
    let tile = acts.len().min(TILE);
    let kc = nb.min(SCRATCH / tile / SEG * SEG);
    let mut strip = (STRIP_BYTES / (nb * F::FORMAT.quant_bytes())).max(1);
    // Several tokens of a Q4K matrix: the strip's scales decoded per chunk (as many groups as fit).
    let mut decoded: Option<[u8; Q4K_DECODED]> = None;
    if q4k && acts.len() > 1 {
        strip = strip.min(Q4K_DECODED / (kc * Q4MIN_SCALES));
    }
    let mut s0 = groups.start;
    while s0 < groups.end {
        let strip = s0..(s0 + strip).min(groups.end);
        let mut c0 = 0;
        while c0 < nb {
            let kn = kc.min(nb - c0);
            let scales = if !q4k {
                Scales::Plane
            } else if acts.len() == 1 {
                Scales::DecodePerGroup
            } else {
                let buf = decoded.get_or_insert([0; Q4K_DECODED]);
                decode_scales(w, strip.clone(), c0..c0 + kn, buf);
                Scales::Decoded { base: buf.as_ptr(), stride: kn * Q4MIN_SCALES }
            };
            let mut t0 = 0;
            while t0 < acts.len() {
                let tt = (acts.len() - t0).min(TILE);
                for ti in 0..tt {
                    // SAFETY: blocks c0..c0 + kn of a row of at least nb blocks; entries ti * kc..
                    // of the scratch (tt * kc <= SCRATCH).
                    unsafe { expand(acts[t0 + ti].as_ptr().add(c0), kn, sp.add(ti * kc), corr) };
                }
                let chunk = Chunk {
                    w,
                    groups: strip.clone(),
                    base: groups.start,
                    c0,
                    kn,
                    exp: sp,
                    estride: kc,
                    scales,
                };
                let (a, o) = (&acts[t0..t0 + tt], &mut outs[t0..t0 + tt]);
                // SAFETY: the scratch holds the tt x kn expanded blocks (and `decoded` the strip's
                // Q4K scales); the rest is `run`'s contract.
                unsafe {
                    match tt {
                        1 if acts.len() == 1 => pass1::<F, VNNI>(&chunk, a, o),
                        1 => pass::<F, VNNI, 1>(&chunk, a, o),
                        2 => pass::<F, VNNI, 2>(&chunk, a, o),
                        3 => pass::<F, VNNI, 3>(&chunk, a, o),
                        _ => pass::<F, VNNI, 4>(&chunk, a, o),
                    }
                }
                t0 += tt;
            }
            c0 += kn;
        }
        s0 = strip.end;
    }
}

/// Bytes of decoded Q4K scales [`run`] holds for several tokens: a strip's groups for one chunk.
const Q4K_DECODED: usize = 64 << 10;

/// Where the kernels read a chunk's scales.
#[derive(Clone, Copy)]
enum Scales {
    /// From the scale plane.
    Plane,
    /// Q4K (run as Q4Min), one token: each group's decoded as it is reached (see [`chunk_scales`]).
    DecodePerGroup,
    /// Q4K, several tokens: the strip's, decoded for the chunk by [`run`]: group `g` of
    /// the strip at `base + (g - strip start) * stride`.
    Decoded { base: *const u8, stride: usize },
}

/// One k-chunk of one token tile over one strip of groups.
struct Chunk<'w, 'a> {
    w: &'w PackedMatrix<'a>,
    /// The strip's groups.
    groups: Range<usize>,
    /// The group whose rows are at the start of the output rows.
    base: usize,
    /// First block of the chunk.
    c0: usize,
    /// Blocks in the chunk.
    kn: usize,
    /// Expanded activations: token `t`, block `b` (relative to `c0`) at `exp + t * estride + b`.
    exp: *const Expanded,
    estride: usize,
    /// Where the scales are (a Q4K matrix runs as Q4Min on its scales decoded into that form).
    scales: Scales,
}

/// Decoded Q4K scales of up to 2 groups of a chunk (16 bytes per block).
type ScaleBuf = [u8; 2 * SCRATCH * Q4MIN_SCALES];
const Q4MIN_SCALES: usize = PackedFormat::Q4Min.scale_bytes();

/// The scale pointer and group stride the kernels read for `n` groups from `g` (at most 2): the
/// plane's, the strip's decoded ones, or for a lone token of a Q4K matrix the chunk's blocks of
/// those groups decoded into `buf` (made on first use) as Q4Min scales.
///
/// # Safety
/// Groups `g..g + n` inside the matrix, the chunk's blocks inside its rows, `n * kn <= 2 *
/// SCRATCH`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn chunk_scales<F: Layout>(
    chunk: &Chunk<'_, '_>,
    g: usize,
    n: usize,
    buf: &mut Option<ScaleBuf>,
) -> (*const u8, usize) {
    let w = chunk.w;
    match chunk.scales {
        Scales::Plane => {
            let sstride = w.blocks() * F::FORMAT.scale_bytes();
            // SAFETY: g and c0 inside the plane (the contract).
            return (
                unsafe { w.scales.as_ptr().add(g * sstride + chunk.c0 * F::FORMAT.scale_bytes()) },
                sstride,
            );
        }
        Scales::Decoded { base, stride } => {
            // SAFETY: the strip's groups were decoded there (`Scales::Decoded`), g among them.
            return (unsafe { base.add((g - chunk.groups.start) * stride) }, stride);
        }
        Scales::DecodePerGroup => {}
    }
    let buf = buf.get_or_insert([0; 2 * SCRATCH * Q4MIN_SCALES]);
    decode_scales(w, g..g + n, chunk.c0..chunk.c0 + chunk.kn, buf);
    (buf.as_ptr(), chunk.kn * Q4MIN_SCALES)
}

/// Decodes the super-block scales of blocks `blocks` (whole units) of groups `groups` of a Q4K or
/// Q5K matrix into Q4Min form, group after group at the start of `out`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn decode_scales(w: &PackedMatrix<'_>, groups: Range<usize>, blocks: Range<usize>, out: &mut [u8]) {
    let stride = blocks.len() * Q4MIN_SCALES;
    let units = blocks.start / SUPER_BLOCKS * Q4K_SCALE_BYTES..blocks.end / SUPER_BLOCKS * Q4K_SCALE_BYTES;
    for (g, out) in groups.zip(out.chunks_exact_mut(stride)) {
        q4k_scales_impl(&w.group_scales(g)[units.clone()], out);
    }
}

/// One Q4K scale unit (a group's super-block, 64 bytes) decoded into the 8 blocks' Q4Min scales
/// (`f16(d * sc)`, `f16(-dmin * m)`, 16 bytes per block): the twin of
/// [`crate::kernels::widen::q4k_scales_ref`], unit after unit. Lengths that do not match write
/// nothing.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
pub unsafe fn q4k_scales(units: &[u8], out: &mut [u8]) {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { q4k_scales_impl(units, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4k_scales_impl(units: &[u8], out: &mut [u8]) {
    if !crate::kernels::widen::q4k_lengths_match(units, out) {
        return;
    }
    for (unit, out) in
        units.chunks_exact(Q4K_SCALE_BYTES).zip(out.chunks_exact_mut(SUPER_BLOCKS * Q4MIN_SCALES))
    {
        q4k_unit(unit, out);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4k_unit(unit: &[u8], out: &mut [u8]) {
    let (unit, out): (&[u8; Q4K_SCALE_BYTES], &mut [u8; SUPER_BLOCKS * Q4MIN_SCALES]) =
        match (unit.try_into(), out.try_into()) {
            (Ok(u), Ok(o)) => (u, o),
            _ => return,
        };
    // SAFETY: 64 bytes read from `unit`, 128 written to `out` (the arrays above).
    unsafe {
        let dd = _mm256_cvtph_ps(_mm_loadu_si128(unit.as_ptr().cast()));
        // [d, -dmin]: the min term is subtracted.
        let dd = _mm256_mul_ps(dd, _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0));
        let lo0 = _mm_loadu_si128(unit.as_ptr().add(16).cast());
        let lo1 = _mm_loadu_si128(unit.as_ptr().add(32).cast());
        let hi = _mm_loadu_si128(unit.as_ptr().add(48).cast());
        let (m4, m30) = (_mm_set1_epi8(0x0F), _mm_set1_epi8(0x30));
        // Scales and mins of blocks 0..4 and 4..8 as bytes (the 16-bit shifts carry across bytes
        // only bits the masks drop).
        let sc = [
            _mm_or_si128(_mm_and_si128(lo0, m4), _mm_and_si128(_mm_slli_epi16::<4>(hi), m30)),
            _mm_or_si128(_mm_and_si128(lo1, m4), _mm_and_si128(_mm_slli_epi16::<2>(hi), m30)),
        ];
        let mn = [
            _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(lo0), m4), _mm_and_si128(hi, m30)),
            _mm_or_si128(
                _mm_and_si128(_mm_srli_epi16::<4>(lo1), m4),
                _mm_and_si128(_mm_srli_epi16::<2>(hi), m30),
            ),
        ];
        for h in 0..2 {
            // [sc, m] of blocks 4h, 4h + 1 and of 4h + 2, 4h + 3.
            let pairs = [_mm_unpacklo_epi32(sc[h], mn[h]), _mm_unpackhi_epi32(sc[h], mn[h])];
            for (i, v) in pairs.into_iter().enumerate() {
                for (j, v) in [v, _mm_srli_si128::<8>(v)].into_iter().enumerate() {
                    let f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), dd);
                    let p = 4 * h + 2 * i + j;
                    let dst = out.as_mut_ptr().add(p * Q4MIN_SCALES);
                    _mm_storeu_si128(dst.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f));
                }
            }
        }
    }
}

/// Which multiple of the activation sums [`Expanded::neg_corr`] holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Corr {
    /// None (zero).
    None,
    /// `-8 * sum`: 4-bit weights taken as `q + 8`.
    Times8,
    /// `-16 * sum`: 5-bit weights taken as `q + 16`.
    Times16,
    /// `-128 * sum`: int8 weights taken as `q + 128` (with VNNI, see [`block_ops`]).
    Times128,
    /// `-32 * sum` of each 16-element half apart: Q6K's 6-bit weights taken as `q + 32`.
    Times32Halves,
}

/// Expands `n` activation blocks from `src` into `dst`.
///
/// # Safety
/// `src` readable for `n` blocks, `dst` writable for `n` entries.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn expand(src: *const ActBlock, n: usize, dst: *mut Expanded, corr: Corr) {
    let idx = [
        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
        _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
        _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
        _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7),
    ];
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    for b in 0..n {
        // SAFETY: block b < n of `src` (the caller's contract); `qs` is 32 bytes.
        let qs = unsafe { _mm256_loadu_si256((*src.add(b)).qs.as_ptr().cast()) };
        let e = [
            _mm256_permutevar8x32_epi32(qs, idx[0]),
            _mm256_permutevar8x32_epi32(qs, idx[1]),
            _mm256_permutevar8x32_epi32(qs, idx[2]),
            _mm256_permutevar8x32_epi32(qs, idx[3]),
        ];
        let zero = _mm256_setzero_si256();
        let (neg_corr, neg_corr_hi) = if corr == Corr::None {
            (zero, zero)
        } else {
            // Per int32 lane, the sums of the activations its half meets in loads 0, 1 (elements
            // 0..16) and 2, 3 (16..32).
            let lo16 = _mm256_add_epi16(_mm256_maddubs_epi16(ones8, e[0]), _mm256_maddubs_epi16(ones8, e[1]));
            let hi16 = _mm256_add_epi16(_mm256_maddubs_epi16(ones8, e[2]), _mm256_maddubs_epi16(ones8, e[3]));
            match corr {
                Corr::Times32Halves => (
                    _mm256_sub_epi32(zero, _mm256_slli_epi32::<5>(_mm256_madd_epi16(lo16, ones16))),
                    _mm256_sub_epi32(zero, _mm256_slli_epi32::<5>(_mm256_madd_epi16(hi16, ones16))),
                ),
                _ => {
                    let sum = _mm256_madd_epi16(_mm256_add_epi16(lo16, hi16), ones16);
                    let scaled = if corr == Corr::Times8 {
                        _mm256_slli_epi32::<3>(sum)
                    } else if corr == Corr::Times16 {
                        _mm256_slli_epi32::<4>(sum)
                    } else {
                        _mm256_slli_epi32::<7>(sum)
                    };
                    (_mm256_sub_epi32(zero, scaled), zero)
                }
            }
        };
        // SAFETY: blocks b and (b + 1).min(n - 1) < n of `src`.
        let (a0, a1) = unsafe { (&*src.add(b), &*src.add((b + 1).min(n - 1))) };
        let (d_pair, s_pair) = (halves(&a0.d, &a1.d), halves(&a0.s, &a1.s));
        // SAFETY: entry b < n of `dst` (the caller's contract).
        unsafe { dst.add(b).write(Expanded { e, neg_corr, neg_corr_hi, d_pair, s_pair }) };
    }
}

/// All of `chunk.groups` for the `T` tokens of a tile, one group at a time, segment by segment:
/// continues the row sums in `outs` (from zero at the first chunk).
///
/// # Safety
/// `run`'s contract, `acts.len() == outs.len() == T`, and the scratch of `chunk` filled for them.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass<F: Layout, const VNNI: bool, const T: usize>(
    chunk: &Chunk<'_, '_>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    let w = chunk.w;
    let qstride = w.blocks() * F::FORMAT.quant_bytes();
    let mut ap = [core::ptr::null::<ActBlock>(); T];
    for (p, a) in ap.iter_mut().zip(acts) {
        // SAFETY: c0 < nb <= a.len().
        *p = unsafe { a.as_ptr().add(chunk.c0) };
    }
    let first = chunk.c0 == 0;
    // (Only a lone token decodes Q4K scales per group, in `pass1`; a pass finds them decoded.)
    let mut sbuf: Option<ScaleBuf> = None;
    for g in chunk.groups.clone() {
        let at = GROUP_ROWS * (g - chunk.base);
        // SAFETY: g < groups.end <= w.groups() and c0 < nb: inside the planes.
        let (q, (s, _)) = unsafe {
            (
                w.quants.as_ptr().add(g * qstride + chunk.c0 * F::FORMAT.quant_bytes()),
                chunk_scales::<F>(chunk, g, 1, &mut sbuf),
            )
        };
        let mut acc = init_tile::<T>(outs, at, first);
        for seg in segments(chunk.kn) {
            // SAFETY: group g exists with the chunk's blocks c0..c0 + kn; the activation rows and
            // the scratch as `pass` requires; VNNI only when the CPU has it.
            let v = unsafe { tile::<F, VNNI, T>(q, s, chunk, &ap, seg) };
            for (a, v) in acc.iter_mut().zip(v) {
                *a = _mm_add_ps(*a, v);
            }
        }
        store_tile(&acc, outs, at);
    }
}

/// Blocks per segment: the x86 kernels sum a row's blocks in two chains (even and odd blocks)
/// that are folded into the row's sum at the end of every segment (see [`row_step`]); chunks are
/// whole segments.
const SEG: usize = 32;

/// The segments of a chunk of `kn` blocks (relative to its start, a multiple of [`SEG`]).
fn segments(kn: usize) -> impl Iterator<Item = Range<usize>> {
    (0..kn).step_by(SEG).map(move |b| b..(b + SEG).min(kn))
}

/// How far ahead of its reads a single-token pass prefetches the quant plane, in bytes (the scale
/// plane at the same fraction of its own).
const PREFETCH_BYTES: usize = 8192;
/// Token tiles this small are memory-bound like a single token: their passes prefetch too.
const SMALL_TILE: usize = 4;

/// One token over `chunk.groups`, one group at a time: the quant and the scale plane are then
/// read as two linear streams, which the hardware prefetchers follow and software prefetches run
/// ahead of (several groups side by side read several short streams a group apart, which the
/// prefetchers do not follow: twice the time per token when the weights come from DRAM).
///
/// # Safety
/// As for [`pass`] with `T == 1`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass1<F: Layout, const VNNI: bool>(
    chunk: &Chunk<'_, '_>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    if F::FORMAT.has_sub16() {
        // SAFETY: `pass`'s contract, which is ours.
        return unsafe { pass::<F, VNNI, 1>(chunk, acts, outs) };
    }
    let w = chunk.w;
    let (qstride, sstride) = (w.blocks() * F::FORMAT.quant_bytes(), w.blocks() * F::FORMAT.scale_bytes());
    // SAFETY: c0 < nb <= acts[0].len().
    let ap = unsafe { acts[0].as_ptr().add(chunk.c0) };
    let first = chunk.c0 == 0;
    // Prefetch distances: a fixed one along the planes when the chunk is whole rows, else the
    // next group's part of the chunk (the rest of this row is read by later chunks). Decoded Q4K
    // scales are in L1 already (their plane is read in order by the decoding, an eighth of the
    // quant stream that the hardware prefetchers follow).
    let dist = if !matches!(chunk.scales, Scales::Plane) {
        (if chunk.kn < w.blocks() { qstride } else { PREFETCH_BYTES }, 0)
    } else if chunk.kn < w.blocks() {
        (qstride, sstride)
    } else {
        (PREFETCH_BYTES, PREFETCH_BYTES * F::FORMAT.scale_bytes() / F::FORMAT.quant_bytes())
    };
    let mut sbuf: Option<ScaleBuf> = None;
    for g in chunk.groups.clone() {
        let at = GROUP_ROWS * (g - chunk.base);
        let mut acc = init4(outs[0], at, first);
        // SAFETY: g < groups.end <= w.groups() and c0 < nb: inside both planes.
        let (q, (s, _)) = unsafe {
            (
                w.quants.as_ptr().add(g * qstride + chunk.c0 * F::FORMAT.quant_bytes()),
                chunk_scales::<F>(chunk, g, 1, &mut sbuf),
            )
        };
        for seg in segments(chunk.kn) {
            // SAFETY: the group has the chunk's blocks c0..c0 + kn, the activation row and the
            // scratch have them too.
            acc = _mm_add_ps(acc, unsafe { dot1::<F, VNNI>(q, s, chunk.exp, ap, seg, dist) });
        }
        store4(acc, outs[0], at);
    }
}

/// The unsigned `maddubs` / `vpdpbusd` operands of one nibble-plane block at `qp`, for the chunk
/// pairs (0, 1), (2, 3), (4, 5), (6, 7) (low, high 128-bit half): `q + 8` of the 4-bit formats
/// (their two's-complement nibbles XOR 8), `q + 16` of Q5 (its nibbles as stored, with the high bit
/// of each element's `u` from the bit plane, stored XOR 1: one XOR of the plane undoes it).
///
/// # Safety
/// `F::FORMAT.quant_bytes()` readable bytes at `qp`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibble_operands<F: Layout>(qp: *const u8) -> [__m256i; 4] {
    let low4 = _mm256_set1_epi8(0x0F);
    // SAFETY: 64 bytes at qp.
    let (w0, w1) = unsafe { (_mm256_loadu_si256(qp.cast()), _mm256_loadu_si256(qp.add(32).cast())) };
    if is::<F>(PackedFormat::Q5) || is::<F>(PackedFormat::Q5Min) {
        // SAFETY: the 16 bytes of the bit plane after the nibbles.
        let b = _mm_xor_si128(unsafe { _mm_loadu_si128(qp.add(64).cast()) }, _mm_set1_epi8(-1));
        // Chunk c's bit is bit c of each byte; shifted right by 1 in the high half, the bits of
        // the pair (2v, 2v + 1) both sit at bit 2v (the 16-bit shift carries into bit 7 only).
        let b2 = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(b), _mm_srli_epi16::<1>(b));
        let bit = |v: i32| _mm256_and_si256(b2, _mm256_set1_epi8(1 << (2 * v)));
        [
            _mm256_or_si256(_mm256_and_si256(w0, low4), _mm256_slli_epi16::<4>(bit(0))),
            _mm256_or_si256(_mm256_and_si256(w1, low4), _mm256_slli_epi16::<2>(bit(1))),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(w0), low4), bit(2)),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(w1), low4),
                _mm256_srli_epi16::<2>(bit(3)),
            ),
        ]
    } else {
        let x88 = _mm256_set1_epi8(0x88u8 as i8);
        let (x0, x1) = (_mm256_xor_si256(w0, x88), _mm256_xor_si256(w1, x88));
        [
            _mm256_and_si256(x0, low4),
            _mm256_and_si256(x1, low4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(x0), low4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(x1), low4),
        ]
    }
}

/// One group against one token over the blocks `seg` of a segment (formats other than Q8Sub16
/// and Q6K): the segment's 4 row sums in [`row_step`]'s arithmetic, two blocks at a time (the
/// even block's chain in the low half, the odd one's in the high half).
///
/// Prefetches run `dist` bytes ahead in the (quant, scale) planes.
///
/// # Safety
/// `q`, `s` at block `c0` of a group with at least `c0 + seg.end` blocks, `ap` at block `c0` of
/// an activation row with `seg.end` more, `exp` the chunk's expanded blocks; `VNNI` only when
/// the CPU has it.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot1<F: Layout, const VNNI: bool>(
    q: *const u8,
    s: *const u8,
    exp: *const Expanded,
    ap: *const ActBlock,
    seg: Range<usize>,
    (qdist, sdist): (usize, usize),
) -> __m128 {
    let (qb, sb) = (F::FORMAT.quant_bytes(), F::FORMAT.scale_bytes());
    let isum = |b: usize| -> __m256i {
        // SAFETY: b inside the segment, the contract's blocks.
        unsafe {
            let (qp, sp) = (q.add(b * qb), s.add(b * sb));
            // Prefetches never fault; past the matrix they fetch what follows it in the buffer.
            _mm_prefetch::<_MM_HINT_T0>(qp.wrapping_add(qdist).cast());
            if qb > 64 {
                _mm_prefetch::<_MM_HINT_T0>(qp.wrapping_add(qdist + 64).cast());
            }
            if (sp as usize) % 64 < sb {
                _mm_prefetch::<_MM_HINT_T0>(sp.wrapping_add(sdist).cast());
            }
            block_dots::<F, VNNI>(&block_ops::<F, VNNI>(qp), &*exp.add(b)).0
        }
    };
    let mut acc = _mm256_setzero_ps();
    let mut b = seg.start;
    while b + 2 <= seg.end {
        let (x, y) = (isum(b), isum(b + 1));
        // [row sums of block b, of block b + 1] (`fold_halves` of both).
        let i = _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(x, y),
            _mm256_permute2x128_si256::<0x31>(x, y),
        );
        // SAFETY: blocks b, b + 1 of the contract (the expansion of b holds both's activation
        // scales).
        let (ex, (d, m)) = unsafe { (&*exp.add(b), pair_scales::<F>(s.add(b * sb), s.add((b + 1) * sb))) };
        let prod = _mm256_mul_ps(d, ex.d_pair);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), prod, acc);
        if F::FORMAT.has_min() {
            acc = _mm256_fmadd_ps(m, ex.s_pair, acc);
        }
        b += 2;
    }
    let (mut even, odd) = (_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    if b < seg.end {
        // SAFETY: block b of the contract.
        even =
            unsafe { row_step::<F>(even, fold_halves(isum(b)), row_scales::<F>(s.add(b * sb)), &*ap.add(b)) };
    }
    _mm_add_ps(even, odd)
}

/// `[lo; 4, hi; 4]`: two broadcasting loads and a blend.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn halves(lo: &f32, hi: &f32) -> __m256 {
    _mm256_blend_ps::<0xF0>(_mm256_broadcast_ss(lo), _mm256_broadcast_ss(hi))
}

/// The `i32` sums of the two 128-bit halves (chunk parities) of a block dot: one lane per row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fold_halves(v: __m256i) -> __m128i {
    _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v))
}

/// A block's scales for [`row_step`]: the 4 rows' `d` and `m'` (`m + 8d` for Q4Min, rounded once
/// as in the reference: its quants are taken as `q - 8`; `m` for the other formats with a min;
/// zero without).
///
/// # Safety
/// `sp` at the block's scales (8 bytes, 16 with a min).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn row_scales<F: Layout>(sp: *const u8) -> (__m128, __m128) {
    // SAFETY: the scale bytes at sp (the contract).
    unsafe {
        let d = _mm_cvtph_ps(_mm_loadl_epi64(sp.cast()));
        let m = if F::FORMAT.has_min() {
            _mm_cvtph_ps(_mm_loadl_epi64(sp.add(8).cast()))
        } else {
            _mm_setzero_ps()
        };
        (d, if is::<F>(PackedFormat::Q4Min) { _mm_fmadd_ps(d, _mm_set1_ps(8.0), m) } else { m })
    }
}

/// [`row_scales`] of two blocks (scales at `s0` and `s1`) side by side: `[d0, d1]`, `[m0, m1]`.
///
/// # Safety
/// As for [`row_scales`] at both.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pair_scales<F: Layout>(s0: *const u8, s1: *const u8) -> (__m256, __m256) {
    // SAFETY: the scale bytes at s0 and s1 (the contract).
    unsafe {
        if F::FORMAT.has_min() {
            let (x, y) =
                (_mm256_cvtph_ps(_mm_loadu_si128(s0.cast())), _mm256_cvtph_ps(_mm_loadu_si128(s1.cast())));
            let (d, m) = (_mm256_permute2f128_ps::<0x20>(x, y), _mm256_permute2f128_ps::<0x31>(x, y));
            (d, if is::<F>(PackedFormat::Q4Min) { _mm256_fmadd_ps(d, _mm256_set1_ps(8.0), m) } else { m })
        } else {
            let d =
                _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_loadl_epi64(s0.cast()), _mm_loadl_epi64(s1.cast())));
            (d, _mm256_setzero_ps())
        }
    }
}

/// One block's step of a chain of the 4 row sums of a group (formats without a second scale).
///
/// The x86 kernels have one order of arithmetic, so a row's result does not depend on how many
/// tokens a call computes beside it (a batch of guesses then decodes what single tokens would, and
/// a server's batch what each request would alone): the block dot's halves are added in int32
/// (exact); per row, even and odd blocks go to two chains (two chains keep the FMA latency off a
/// lone token's pace; the kernels hold them side by side in one register), `acc + isum * (d *
/// d_a)` as one FMA, then with a min term `acc + m' * s_a`, a second (see [`row_scales`]); at the
/// end of every [`SEG`] blocks the segment's sum `even + odd` is added to the row's sum, which is
/// carried from chunk to chunk in the output (chunks are whole segments).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn row_step<F: Layout>(acc: __m128, isum: __m128i, (d, m): (__m128, __m128), ab: &ActBlock) -> __m128 {
    let acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_mul_ps(d, _mm_set1_ps(ab.d)), acc);
    if F::FORMAT.has_min() {
        _mm_fmadd_ps(m, _mm_set1_ps(ab.s), acc)
    } else {
        acc
    }
}

/// [`row_step`] of the formats with a scale per 16 elements: `acc + lo * (dl * d_a)`, then `+ hi *
/// (dh * d_a)` (FMAs), `lo`/`hi` the dots of elements 0..16 and 16..32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn row_step_sub16(acc: __m128, lo: __m128i, hi: __m128i, dl: __m128, dh: __m128, da: f32) -> __m128 {
    let da = _mm_set1_ps(da);
    let acc = _mm_fmadd_ps(_mm_cvtepi32_ps(lo), _mm_mul_ps(dl, da), acc);
    _mm_fmadd_ps(_mm_cvtepi32_ps(hi), _mm_mul_ps(dh, da), acc)
}

/// The sums a call continues for a group's 4 rows at `at` of `out`: zero at the first chunk, else
/// what the earlier chunks left there.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn init4(out: &[f32], at: usize, first: bool) -> __m128 {
    if first {
        return _mm_setzero_ps();
    }
    let src: &[f32; 4] = (&out[at..at + 4]).try_into().unwrap();
    // SAFETY: `src` holds 4 f32.
    unsafe { _mm_loadu_ps(src.as_ptr()) }
}

/// Writes the 4 row sums of a group to `at` of `out`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn store4(acc: __m128, out: &mut [f32], at: usize) {
    let dst: &mut [f32; 4] = (&mut out[at..at + 4]).try_into().unwrap();
    // SAFETY: `dst` holds 4 f32.
    unsafe { _mm_storeu_ps(dst.as_mut_ptr(), acc) };
}

/// [`init4`] of a group's rows at `at` for each of `T` tokens.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn init_tile<const T: usize>(outs: &[&mut [f32]], at: usize, first: bool) -> [__m128; T] {
    let mut acc = [_mm_setzero_ps(); T];
    for (a, out) in acc.iter_mut().zip(outs) {
        *a = init4(out, at, first);
    }
    acc
}

/// [`store4`] of a group's rows at `at` for each of `T` tokens.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn store_tile<const T: usize>(acc: &[__m128; T], outs: &mut [&mut [f32]], at: usize) {
    for (a, out) in acc.iter().zip(outs.iter_mut()) {
        store4(*a, out, at);
    }
}

/// One block's weights as the integer dots take them: `wv` the unsigned `maddubs`/`vpdpbusd`
/// operands, `ws` the sign sources (8-bit formats).
#[derive(Clone, Copy)]
struct BlockOps {
    wv: [__m256i; 4],
    ws: [__m256i; 4],
}

/// The operands of the block at `qp`.
///
/// # Safety
/// `F::FORMAT.quant_bytes()` readable bytes at `qp`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_ops<F: Layout, const VNNI: bool>(qp: *const u8) -> BlockOps {
    let low4 = _mm256_set1_epi8(0x0F);
    let mut wv = [_mm256_setzero_si256(); 4];
    let mut ws = [_mm256_setzero_si256(); 4];
    if is_4bit(F::FORMAT) {
        // SAFETY: a block at qp.
        wv = unsafe { nibble_operands::<F>(qp) };
    } else if is::<F>(PackedFormat::Q6K) {
        // Low nibbles of chunk pairs (0,1), (2,3) in the 64 bytes at qp, their high nibbles
        // (4,5), (6,7); the high bits of pair v at bits 2v of the 32 bytes after them,
        // moved to bits 4..6 (the 16-bit shifts carry across bytes only bits the mask drops).
        // The stored high bits are XOR 2 per field: one XOR of the plane undoes all four.
        // SAFETY: 96 bytes at qp.
        let (n0, n1, h) = unsafe {
            (
                _mm256_loadu_si256(qp.cast()),
                _mm256_loadu_si256(qp.add(32).cast()),
                _mm256_xor_si256(_mm256_loadu_si256(qp.add(64).cast()), _mm256_set1_epi8(0xAAu8 as i8)),
            )
        };
        let x30 = _mm256_set1_epi8(0x30);
        let u = [
            _mm256_or_si256(_mm256_and_si256(n0, low4), _mm256_and_si256(_mm256_slli_epi16::<4>(h), x30)),
            _mm256_or_si256(_mm256_and_si256(n1, low4), _mm256_and_si256(_mm256_slli_epi16::<2>(h), x30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(n0), low4), _mm256_and_si256(h, x30)),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(n1), low4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(h), x30),
            ),
        ];
        // u = q + 32, unsigned: `maddubs` takes it as is (the -32 sum is the expansion's).
        wv = u;
    } else if VNNI && !F::FORMAT.has_sub16() {
        // The weights as the unsigned operand, q + 128 (XOR 0x80): sum((q + 128) a) - 128
        // sum(a), the correction precomputed with the expansion (`Corr::Times128`). Exact, as
        // `vpdpbusd` does not saturate, and four XORs instead of four ABS and four SIGN.
        for (v, wv) in wv.iter_mut().enumerate() {
            // SAFETY: 128 bytes at qp.
            let w = unsafe { _mm256_loadu_si256(qp.add(32 * v).cast()) };
            *wv = _mm256_xor_si256(w, _mm256_set1_epi8(0x80u8 as i8));
        }
    } else {
        for v in 0..4 {
            // SAFETY: 128 bytes at qp.
            ws[v] = unsafe { _mm256_loadu_si256(qp.add(32 * v).cast()) };
            wv[v] = _mm256_abs_epi8(ws[v]);
        }
    }
    BlockOps { wv, ws }
}

/// The scales of block `b` (its scales at `sp`; Q6K: its super-block's unit) per row: `(d, m')`
/// (see [`row_scales`]) or the two halves' `(dl, dh)` for the sub16 formats.
///
/// # Safety
/// The block's scale bytes at `sp`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_scales<F: Layout>(sp: *const u8, b: usize) -> (__m128, __m128) {
    if is::<F>(PackedFormat::Q6K) {
        // f16(d * sc) of both halves (the reference's rounding), from the super-block's d
        // (4 f16 at sp) and the block's 8 int8 scales at 8 + 8 (b % 8): the rows'
        // low-half scales in lanes 0..4, their high-half ones in 4..8.
        // SAFETY: the 72-byte scale unit at sp.
        let f = unsafe {
            let d4 = _mm256_cvtph_ps(_mm_set1_epi64x(sp.cast::<i64>().read_unaligned()));
            let sc = _mm_loadl_epi64(sp.add(8 + 8 * (b % SUPER_BLOCKS)).cast());
            _mm256_mul_ps(d4, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)))
        };
        let f = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f));
        (_mm256_castps256_ps128(f), _mm256_extractf128_ps::<1>(f))
    } else if is::<F>(PackedFormat::Q8Sub16) {
        // SAFETY: 16 scale bytes at sp for Q8Sub16.
        unsafe { (_mm_cvtph_ps(_mm_loadl_epi64(sp.cast())), _mm_cvtph_ps(_mm_loadl_epi64(sp.add(8).cast()))) }
    } else {
        // SAFETY: the block's scales at sp.
        unsafe { row_scales::<F>(sp) }
    }
}

/// The int32 dots of a block (operands `w`) with one token's expansion `ex`, per lane `4h + r`:
/// whole (lo) or, for the sub16 formats, of elements 0..16 (lo) and 16..32 (hi).
///
/// # Safety
/// `VNNI` only when the CPU has it.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_dots<F: Layout, const VNNI: bool>(w: &BlockOps, ex: &Expanded) -> (__m256i, __m256i) {
    let ones16 = _mm256_set1_epi16(1);
    let (wv, ws) = (&w.wv, &w.ws);
    if is_4bit(F::FORMAT) {
        let isum = if VNNI {
            // SAFETY: VNNI only when the CPU has it (the contract).
            unsafe {
                let mut i = dpbusd(ex.neg_corr, wv[0], ex.e[0]);
                i = dpbusd(i, wv[1], ex.e[1]);
                i = dpbusd(i, wv[2], ex.e[2]);
                dpbusd(i, wv[3], ex.e[3])
            }
        } else {
            let p = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(wv[0], ex.e[0]), _mm256_maddubs_epi16(wv[1], ex.e[1])),
                _mm256_add_epi16(_mm256_maddubs_epi16(wv[2], ex.e[2]), _mm256_maddubs_epi16(wv[3], ex.e[3])),
            );
            _mm256_add_epi32(_mm256_madd_epi16(p, ones16), ex.neg_corr)
        };
        (isum, _mm256_setzero_si256())
    } else if is::<F>(PackedFormat::Q6K) {
        // Each half's dot of u = q + 32, plus -32 times its activation sum: exact (two
        // products of 63 * 127 per i16 lane, two lanes added: 32004 < 2^15).
        if VNNI {
            // SAFETY: VNNI only when the CPU has it (the contract).
            unsafe {
                (
                    dpbusd(dpbusd(ex.neg_corr, wv[0], ex.e[0]), wv[1], ex.e[1]),
                    dpbusd(dpbusd(ex.neg_corr_hi, wv[2], ex.e[2]), wv[3], ex.e[3]),
                )
            }
        } else {
            let half = |a: usize, c: __m256i| {
                let p = _mm256_add_epi16(
                    _mm256_maddubs_epi16(wv[a], ex.e[a]),
                    _mm256_maddubs_epi16(wv[a + 1], ex.e[a + 1]),
                );
                _mm256_add_epi32(_mm256_madd_epi16(p, ones16), c)
            };
            (half(0, ex.neg_corr), half(2, ex.neg_corr_hi))
        }
    } else {
        if VNNI && !F::FORMAT.has_sub16() {
            // `wv` holds q + 128 (see `block_ops`), the expansion -128 times the sums.
            // SAFETY: as above.
            unsafe {
                let a = dpbusd(dpbusd(ex.neg_corr, wv[0], ex.e[0]), wv[1], ex.e[1]);
                let b = dpbusd(dpbusd(_mm256_setzero_si256(), wv[2], ex.e[2]), wv[3], ex.e[3]);
                (_mm256_add_epi32(a, b), _mm256_setzero_si256())
            }
        } else if VNNI {
            let se = [0, 1, 2, 3].map(|v| _mm256_sign_epi8(ex.e[v], ws[v]));
            // SAFETY: as above.
            unsafe {
                let lo = dpbusd(dpbusd(_mm256_setzero_si256(), wv[0], se[0]), wv[1], se[1]);
                (lo, dpbusd(dpbusd(_mm256_setzero_si256(), wv[2], se[2]), wv[3], se[3]))
            }
        } else {
            let se = [0, 1, 2, 3].map(|v| _mm256_sign_epi8(ex.e[v], ws[v]));
            let m = [0, 1, 2, 3].map(|v| _mm256_madd_epi16(_mm256_maddubs_epi16(wv[v], se[v]), ones16));
            let (lo, hi) = (_mm256_add_epi32(m[0], m[1]), _mm256_add_epi32(m[2], m[3]));
            if F::FORMAT.has_sub16() {
                (lo, hi)
            } else {
                (_mm256_add_epi32(lo, hi), _mm256_setzero_si256())
            }
        }
    }
}

/// The dot products of one group (quants at `q`, scales at `s`) with the `T` tokens of the chunk
/// over the blocks `seg` of a segment, two blocks at a time as [`dot1`] goes: per token one
/// accumulator, the even block's chain in lanes `r`, the odd one's in `4 + r` ([`row_step`]'s
/// arithmetic); returns the segment's 4 row sums per token.
///
/// # Safety
/// `q`, `s` point at block `c0` of a group with at least `c0 + seg.end` blocks; `ap[t]` at block
/// `c0` of a row with `seg.end` more blocks; the chunk's scratch filled for `T` tokens; `VNNI`
/// only when the CPU has it.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<F: Layout, const VNNI: bool, const T: usize>(
    q: *const u8,
    s: *const u8,
    chunk: &Chunk<'_, '_>,
    ap: &[*const ActBlock; T],
    seg: Range<usize>,
) -> [__m128; T] {
    let qb = F::FORMAT.quant_bytes();
    // The block's quants and scales (Q6K: `sp` is the block's super-block scale unit, `c0` being
    // a multiple of 8), prefetching ahead for a few tokens (batched decode, and Q6K's decode: see
    // `pass1`; prefetches never fault).
    // SAFETY: in the closure, block b of the group (the contract).
    let at = |b: usize| unsafe {
        let sb = if is::<F>(PackedFormat::Q6K) {
            b / SUPER_BLOCKS * SUPER_SCALE_BYTES
        } else {
            b * F::FORMAT.scale_bytes()
        };
        let (qp, sp) = (q.add(b * qb), s.add(sb));
        if T <= SMALL_TILE {
            _mm_prefetch::<_MM_HINT_T0>(qp.wrapping_add(PREFETCH_BYTES).cast());
            _mm_prefetch::<_MM_HINT_T0>(qp.wrapping_add(PREFETCH_BYTES + 64).cast());
            if b % SUPER_BLOCKS == 0 {
                _mm_prefetch::<_MM_HINT_T0>(sp.wrapping_add(PREFETCH_BYTES * 3 / 32).cast());
            }
        }
        (qp, sp)
    };
    // [row sums of a block, of the next] per lane (`fold_halves` of both).
    let pair = |x: __m256i, y: __m256i| {
        _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(x, y), _mm256_permute2x128_si256::<0x31>(x, y))
    };
    let mut acc = [_mm256_setzero_ps(); T];
    let mut b = seg.start;
    while b + 2 <= seg.end {
        let ((q0, s0), (q1, s1)) = (at(b), at(b + 1));
        // SAFETY: blocks b and b + 1 of the group.
        let (w0, w1, (d0, y0), (d1, y1)) = unsafe {
            (
                block_ops::<F, VNNI>(q0),
                block_ops::<F, VNNI>(q1),
                block_scales::<F>(s0, b),
                block_scales::<F>(s1, b + 1),
            )
        };
        let (d, y) = (_mm256_set_m128(d1, d0), _mm256_set_m128(y1, y0));
        for (t, acc) in acc.iter_mut().enumerate() {
            // SAFETY: token t's expansions of blocks b and b + 1 (the contract; b's holds both's
            // activation scales); VNNI only when the CPU has it.
            let (ex, (x, xh), (z, zh)) = unsafe {
                let ex = &*chunk.exp.add(t * chunk.estride + b);
                (
                    ex,
                    block_dots::<F, VNNI>(&w0, ex),
                    block_dots::<F, VNNI>(&w1, &*chunk.exp.add(t * chunk.estride + b + 1)),
                )
            };
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair(x, z)), _mm256_mul_ps(d, ex.d_pair), *acc);
            if F::FORMAT.has_sub16() {
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair(xh, zh)), _mm256_mul_ps(y, ex.d_pair), *acc);
            } else if F::FORMAT.has_min() {
                *acc = _mm256_fmadd_ps(y, ex.s_pair, *acc);
            }
        }
        b += 2;
    }
    let mut sums = [_mm_setzero_ps(); T];
    // SAFETY: block b of the group, when the segment has it.
    let last = (b < seg.end).then(|| unsafe {
        let (qp, sp) = at(b);
        (block_ops::<F, VNNI>(qp), block_scales::<F>(sp, b))
    });
    for (t, (sum, acc)) in sums.iter_mut().zip(acc).enumerate() {
        let (mut even, odd) = (_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        if let Some((w, (d, y))) = &last {
            // SAFETY: token t's expansion and activation of block b (the contract).
            let (ab, (lo, hi)) =
                unsafe { (&*ap[t].add(b), block_dots::<F, VNNI>(w, &*chunk.exp.add(t * chunk.estride + b))) };
            even = if F::FORMAT.has_sub16() {
                row_step_sub16(even, fold_halves(lo), fold_halves(hi), *d, *y, ab.d)
            } else {
                row_step::<F>(even, fold_halves(lo), (*d, *y), ab)
            };
        }
        *sum = _mm_add_ps(even, odd);
    }
    sums
}

// ---------------------------------------------------------------------------------------------
// Activation quantization
// ---------------------------------------------------------------------------------------------

/// f32 -> nearest f16 -> f32 (what `half` does, with F16C).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn f16_round(x: f32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x))))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_act_impl(x: &[f32], out: &mut [ActBlock]) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    for (x, b) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let mut v = [_mm256_setzero_ps(); 4];
        for (i, v) in v.iter_mut().enumerate() {
            // SAFETY: 8 of the block's 32 f32.
            *v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) };
        }
        // |v| with NaN as 0: the reference's f32::max skips NaN.
        let a = v.map(|v| {
            let a = _mm256_and_ps(v, abs_mask);
            _mm256_and_ps(a, _mm256_cmp_ps::<_CMP_ORD_Q>(a, a))
        });
        let amax = hmax(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        // rint, then `as i8`: NaN -> 0, saturated to -128..=127.
        let q = v.map(|v| {
            let r =
                _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v, id));
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        let p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `qs` is 32 bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), p) };
        b.d = f16_round(d);
        b.s = f16_round(d * sum as f32);
    }
}
