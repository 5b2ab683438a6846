//! Weights repacked at load into row-interleaved groups for `sdot`-style kernels, the activation
//! format those kernels read, and the portable reference matmul every SIMD twin is tested against.
//!
//! # Layout (version [`LAYOUT_VERSION`])
//! A weight matrix of `rows` x `k` (`k` a multiple of [`BLOCK`]) becomes `ceil(rows / 4)` groups of
//! 4 consecutive rows, each cut into `k / 32` blocks of 32 elements; when `rows` is not a multiple
//! of 4 (Granite's 49155-token vocabulary), the last group repeats the last row, and its extra
//! outputs are dropped. Two planes:
//! - **quants**: group `g`, block `b` at `(g * nb + b) * format.quant_bytes()`. Inside a block the 4
//!   rows are interleaved in 4-byte chunks, so one 16-byte vector holds 4 consecutive elements of
//!   each row and lane `r` of an `sdot` by element is row `r`:
//!   - 4-bit formats (64 bytes): byte `16c + 4r + j` (c, j in 0..4) holds element `4c + j` of row
//!     `r` in its low nibble and element `16 + 4c + j` in its high nibble, both as 4-bit two's
//!     complement (`q - 8`: the XOR-0x88 trick applied at pack time). Shifting a byte left by 4, or
//!     masking it with 0xF0, gives 16 times the signed value as an int8.
//!   - 8-bit formats (128 bytes): byte `16c + 4r + j` (c in 0..8) is element `4c + j` of row `r`.
//!   - 5-bit [`PackedFormat::Q5`] (80 bytes): the 64 bytes of a 4-bit block holding the low 4 bits
//!     of the unsigned value `u = q + 16` (same places), then 16 bytes of high bits: byte
//!     `64 + 4r + j` holds at bit `c` (c in 0..8) `(u >> 4) ^ 1` of element `4c + j` of row `r`.
//!     The XOR makes `(high << 7) | (low << 3)` the int8 `8q` (NEON: `shl` and `sri` per 16
//!     values); x86 takes `u` for `maddubs`.
//!   - 6-bit [`PackedFormat::Q6K`] (96 bytes): the 64 bytes of a 4-bit block holding the low 4 bits
//!     of the unsigned value `u = q + 32` (same places), then 32 bytes of high bits: byte
//!     `64 + 16h + 4r + j` (h in 0..2) holds, at bits `2f..2f+2` (f in 0..4), `(u >> 4) ^ 2` of
//!     element `4c + j` of row `r` with `c = 2f + h`. The XOR makes `(high << 6) | (low << 2)`
//!     the int8 `4q` (NEON: one `shl` and one `sri` per 16 values, for `sdot`), and the high bits
//!     of the chunk pairs `(2f, 2f + 1)` sit at one shift in both halves of a 32-byte load (x86:
//!     `u` is `(low | high << 4) ^ 0x20`, what `maddubs` takes).
//! - **scales**: group `g`, block `b` at `(g * nb + b) * format.scale_bytes()`, f16 little-endian:
//!   `d[4]` (one per row), then `m[4]` for the formats with a min, or for [`PackedFormat::Q8Sub16`]
//!   the 4 scales of elements 16..32 after the 4 of elements 0..16.
//!   [`PackedFormat::Q6K`] keeps the file's super-block scales, 72 bytes per group and 256
//!   elements (9 per block): `d[4]` f16, then per block `p` of the super-block 8 int8 sub-block
//!   scales, `sc[2p][r]` at byte `8 + 8p + r` and `sc[2p + 1][r]` at `12 + 8p + r`.
//!   [`PackedFormat::Q4K`] keeps the file's super-block scales too, 64 bytes per group and 256
//!   elements (8 per block): `d[4]`, `dmin[4]` f16, then the 6-bit scale `sc[p][r]` and min
//!   `m[p][r]` of block `p` of the super-block split into a nibble plane, byte `16 + 4p + r` =
//!   `(sc & 15) | (m & 15) << 4`, and a 2-bit plane, byte `48 + 4 (p % 4) + r` holding `sc >> 4`
//!   at bits `2 (p / 4)` and `m >> 4` at bits `4 + 2 (p / 4)`: a few vector shifts and masks give
//!   all 64 fields of a unit as bytes. [`PackedFormat::Q5K`]'s scale plane is the same.
//!
//! One row range (or one expert of a stacked tensor) is therefore one contiguous slab in each plane.
//!
//! # Values
//! With `q` the stored signed value, `d`, `m` the block's row scales, and activations `a = d_a * q_a`:
//! - [`PackedFormat::Q4`], [`PackedFormat::Q8`], [`PackedFormat::Q5`]: `w = d * q`.
//! - [`PackedFormat::Q5Min`]: `w = d * u + m` with `u = q + 16` the unsigned 5-bit value (what the
//!   reference and the kernels take, as the int8 copy did).
//! - [`PackedFormat::Q5K`]: `w = (d * sc) * u - dmin * m`, the file's values exactly; the matmul
//!   takes it as Q5Min with `f16(d * sc)` and `f16(-dmin * m)` (decoded as Q4K's scales).
//! - [`PackedFormat::Q4Min`]: `w = d * (q + 8) + m` (the stored `q` is the unsigned nibble minus 8).
//! - [`PackedFormat::Q8Min`]: `w = d * q + m`.
//! - [`PackedFormat::Q8Sub16`]: `w = d_half * q`, one scale per 16 elements.
//! - [`PackedFormat::Q4K`]: `w = (d * sc) * (q + 8) - dmin * m`, the file's values exactly. The
//!   matmul takes it as the [`PackedFormat::Q4Min`] block with `f16(d * sc)` and `f16(-dmin * m)`
//!   ([`block_scales`]): the kernels decode a chunk's scales into that form (see
//!   [`super::widen`]) and run the Q4Min code on the quant plane as it is.
//! - [`PackedFormat::Q6K`]: `w = (d * sc) * q`, `sc` the 16-element sub-block's int8 scale: the
//!   file's values exactly (so a tied embedding's rows are read from it). The matmul uses
//!   `d * sc` rounded to f16 (a relative 2^-11, far below the 6-bit step): x86 unpacks values and
//!   scales in registers, the NEON paths widen chunks into Q8Sub16 (see [`super::widen`]).
//!
//! Sources: Q4_0 -> Q4; Q4_1 -> Q4Min; Q4_K -> Q4K; Q5_0 -> Q5; Q5_1 -> Q5Min; Q5_K -> Q5K; Q8_0 ->
//! Q8; Q6_K -> Q6K. Q8Sub16 and Q8Min are what Q6K and Q5Min are widened into for some kernels;
//! no file type packs to them.

use bytemuck::{Pod, Zeroable};

use crate::quant::blocks::{
    scale_min_k4, BlockQ4_0, BlockQ4_1, BlockQ4_K, BlockQ5_0, BlockQ5_1, BlockQ5_K, BlockQ6_K, BlockQ8_0,
    F16Le,
};
use crate::quant::{GgmlType, QK_K};

/// Bumped whenever the byte layout above changes (repacked-weight caches record it).
pub const LAYOUT_VERSION: u32 = 4;
/// Rows per interleaved group.
pub const GROUP_ROWS: usize = 4;
/// Elements per block (one scale per row and block).
pub const BLOCK: usize = 32;

/// Declares [`PackedFormat`] and [`PackedFormat::ALL`] from one list: a new format is in `ALL` by
/// construction, and every fact about it is an exhaustive match the compiler asks for.
macro_rules! packed_formats {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// The repacked formats.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum PackedFormat {
            $($(#[doc = $doc])* $name,)*
        }

        impl PackedFormat {
            /// Every format, in declaration order ([`PackedFormat::index`]).
            pub const ALL: [PackedFormat; [$(PackedFormat::$name),*].len()] = [$(PackedFormat::$name),*];
        }
    };
}

packed_formats! {
    /// Signed 4-bit values, one scale per block.
    Q4,
    /// Signed 4-bit values (`nibble - 8`), scale and min per block.
    Q4Min,
    /// int8 values, one scale per block.
    Q8,
    /// int8 values, scale and min per block.
    Q8Min,
    /// int8 values, one scale per 16 elements.
    Q8Sub16,
    /// 6-bit values in a 4-bit and a 2-bit plane, int8 scales per 16 elements and an f16 scale per
    /// 256 (Q6_K's own scales, as tight as the file).
    Q6K,
    /// Unsigned 4-bit values (stored as [`PackedFormat::Q4Min`]'s), 6-bit scales and mins per block
    /// and an f16 scale and min per 256 (Q4_K's own scales, as tight as the file).
    Q4K,
    /// Signed 5-bit values in a 4-bit and a 1-bit plane, one scale per block.
    Q5,
    /// Unsigned 5-bit values (stored as [`PackedFormat::Q5`]'s), scale and min per block.
    Q5Min,
    /// Unsigned 5-bit values (stored as [`PackedFormat::Q5`]'s) with [`PackedFormat::Q4K`]'s
    /// super-block scales (Q5_K's own, as tight as the file).
    Q5K,
}

impl PackedFormat {
    /// The format a GGUF weight type is repacked into, if any.
    pub fn for_type(ty: GgmlType) -> Option<Self> {
        ty.traits().packed
    }

    /// Quant bytes per group and block.
    pub const fn quant_bytes(self) -> usize {
        match self {
            Self::Q4 | Self::Q4Min | Self::Q4K => GROUP_ROWS * BLOCK / 2,
            Self::Q8 | Self::Q8Min | Self::Q8Sub16 => GROUP_ROWS * BLOCK,
            Self::Q6K => GROUP_ROWS * BLOCK * 6 / 8,
            Self::Q5 | Self::Q5Min | Self::Q5K => GROUP_ROWS * BLOCK * 5 / 8,
        }
    }

    /// Scale bytes per group and block.
    pub const fn scale_bytes(self) -> usize {
        match self {
            Self::Q4 | Self::Q8 | Self::Q5 => GROUP_ROWS * 2,
            Self::Q4Min | Self::Q8Min | Self::Q8Sub16 | Self::Q5Min => 2 * GROUP_ROWS * 2,
            // Per super-block: d[4] (8 bytes) and 16 int8 scales per row (64).
            Self::Q6K => SUPER_SCALE_BYTES / SUPER_BLOCKS,
            // Per super-block: d[4] and dmin[4] (16 bytes) and 16 6-bit fields per row (48).
            Self::Q4K | Self::Q5K => Q4K_SCALE_BYTES / SUPER_BLOCKS,
        }
    }

    /// Blocks that share the format's scale-plane unit: 8 for the super-block formats, else 1.
    pub const fn blocks_per_unit(self) -> usize {
        match self {
            Self::Q6K | Self::Q4K | Self::Q5K => SUPER_BLOCKS,
            Self::Q4 | Self::Q4Min | Self::Q8 | Self::Q8Min | Self::Q8Sub16 | Self::Q5 | Self::Q5Min => 1,
        }
    }

    /// The format whose kernels run a super-block-scale format once its scales are decoded per
    /// block (Q4K -> Q4Min, Q5K -> Q5Min; the quant planes are the same).
    pub const fn decoded(self) -> Self {
        match self {
            Self::Q4K => Self::Q4Min,
            Self::Q5K => Self::Q5Min,
            same @ (Self::Q4
            | Self::Q4Min
            | Self::Q8
            | Self::Q8Min
            | Self::Q8Sub16
            | Self::Q6K
            | Self::Q5
            | Self::Q5Min) => same,
        }
    }

    /// Position in [`PackedFormat::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// Whether values are 4-bit (else int8).
    pub const fn is_4bit(self) -> bool {
        match self {
            Self::Q4 | Self::Q4Min | Self::Q4K => true,
            Self::Q8 | Self::Q8Min | Self::Q8Sub16 | Self::Q6K | Self::Q5 | Self::Q5Min | Self::Q5K => false,
        }
    }

    /// Whether values are 5-bit (a nibble plane and a bit plane).
    pub const fn is_5bit(self) -> bool {
        match self {
            Self::Q5 | Self::Q5Min | Self::Q5K => true,
            Self::Q4 | Self::Q4Min | Self::Q8 | Self::Q8Min | Self::Q8Sub16 | Self::Q6K | Self::Q4K => false,
        }
    }

    /// Whether values carry a min per row and block (the plane's `m[4]` after `d[4]`, or Q4K's).
    pub const fn has_min(self) -> bool {
        match self {
            Self::Q4Min | Self::Q8Min | Self::Q4K | Self::Q5Min | Self::Q5K => true,
            Self::Q4 | Self::Q8 | Self::Q8Sub16 | Self::Q6K | Self::Q5 => false,
        }
    }

    /// Whether each 16-element half of a block has its own scale (Q8Sub16's second `d[4]`, Q6K's
    /// sub-block scales).
    pub const fn has_sub16(self) -> bool {
        match self {
            Self::Q8Sub16 | Self::Q6K => true,
            Self::Q4
            | Self::Q4Min
            | Self::Q8
            | Self::Q8Min
            | Self::Q4K
            | Self::Q5
            | Self::Q5Min
            | Self::Q5K => false,
        }
    }

    /// Short name for reports.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4 => "q4x4",
            Self::Q4Min => "q4mx4",
            Self::Q8 => "q8x4",
            Self::Q8Min => "q8mx4",
            Self::Q8Sub16 => "q8sx4",
            Self::Q6K => "q6kx4",
            Self::Q4K => "q4kx4",
            Self::Q5 => "q5x4",
            Self::Q5Min => "q5mx4",
            Self::Q5K => "q5kx4",
        }
    }
}

const _: () = {
    let mut i = 0;
    while i < PackedFormat::ALL.len() {
        assert!(PackedFormat::ALL[i].index() == i);
        i += 1;
    }
};

/// Blocks per K-quant super-block.
pub const SUPER_BLOCKS: usize = QK_K / BLOCK;
/// Scale-plane bytes of one group and super-block of [`PackedFormat::Q6K`].
pub const SUPER_SCALE_BYTES: usize = GROUP_ROWS * 2 + GROUP_ROWS * QK_K / 16;
/// Scale-plane bytes of one group and super-block of [`PackedFormat::Q4K`].
pub const Q4K_SCALE_BYTES: usize = 2 * GROUP_ROWS * 2 + 2 * GROUP_ROWS * SUPER_BLOCKS * 6 / 8;

/// Whether a `ty` matrix of `rows` x `k` can be repacked.
pub fn can_pack(ty: GgmlType, rows: usize, k: usize) -> bool {
    PackedFormat::for_type(ty).is_some_and(|f| k % (f.blocks_per_unit() * BLOCK) == 0)
        && rows > 0
        && k > 0
        && k % ty.block_len() == 0
        && k % BLOCK == 0
}

/// Bytes of the (quant plane, scale plane) of a packed `rows` x `k` matrix.
pub fn packed_bytes(format: PackedFormat, rows: usize, k: usize) -> (usize, usize) {
    let units = rows.div_ceil(GROUP_ROWS) * (k / BLOCK);
    (units * format.quant_bytes(), units * format.scale_bytes())
}

/// Why a matrix could not be repacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackError {
    /// The type has no packed format, or the shape does not divide into groups and blocks.
    Unsupported,
    /// A buffer has the wrong size for the shape.
    WrongSize,
}

/// A repacked weight matrix (borrowed planes).
#[derive(Debug, Clone, Copy)]
pub struct PackedMatrix<'a> {
    /// Layout of the planes.
    pub format: PackedFormat,
    /// Rows (the last group repeats the last row when this is not a multiple of [`GROUP_ROWS`]).
    pub rows: usize,
    /// Elements per row (a multiple of [`BLOCK`]).
    pub k: usize,
    /// Quant plane.
    pub quants: &'a [u8],
    /// Scale plane (f16 little-endian).
    pub scales: &'a [u8],
}

impl<'a> PackedMatrix<'a> {
    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.k / BLOCK
    }

    /// Number of row groups.
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP_ROWS)
    }

    /// Quant bytes of group `g`, all blocks.
    pub fn group_quants(&self, g: usize) -> &'a [u8] {
        let n = self.blocks() * self.format.quant_bytes();
        &self.quants[g * n..(g + 1) * n]
    }

    /// Scale bytes of group `g`, all blocks.
    pub fn group_scales(&self, g: usize) -> &'a [u8] {
        let n = self.blocks() * self.format.scale_bytes();
        &self.scales[g * n..(g + 1) * n]
    }

    /// Row groups `first..first + n` as a matrix of their own (the rows of one part of a fused
    /// weight); `None` past the end.
    pub fn row_groups(&self, first: usize, n: usize) -> Option<Self> {
        let (qn, sn) = (self.blocks() * self.format.quant_bytes(), self.blocks() * self.format.scale_bytes());
        let end = first.checked_add(n).filter(|&end| end <= self.groups())?;
        Some(Self {
            rows: n * GROUP_ROWS,
            quants: self.quants.get(first * qn..end * qn)?,
            scales: self.scales.get(first * sn..end * sn)?,
            ..*self
        })
    }

    /// Checks that the planes have the sizes the shape needs.
    pub fn is_consistent(&self) -> bool {
        self.k % (BLOCK * self.format.blocks_per_unit()) == 0
            && packed_bytes(self.format, self.rows, self.k) == (self.quants.len(), self.scales.len())
    }
}

/// One 32-element block of one row in integer form, before interleaving.
struct RowBlock {
    /// Signed values in the packed format's convention.
    q: [i8; BLOCK],
    /// Scale (of elements 0..16 for Q8Sub16).
    d: f32,
    /// Min, or the scale of elements 16..32 for Q8Sub16.
    m: f32,
}

/// Repacks a `rows` x `k` matrix of type `ty` (GGUF row-major bytes in `src`) into `quants` and
/// `scales` (sized by [`packed_bytes`]).
pub fn pack(
    ty: GgmlType,
    src: &[u8],
    rows: usize,
    k: usize,
    quants: &mut [u8],
    scales: &mut [u8],
) -> Result<PackedFormat, PackError> {
    let format = PackedFormat::for_type(ty).ok_or(PackError::Unsupported)?;
    if !can_pack(ty, rows, k) {
        return Err(PackError::Unsupported);
    }
    let row_bytes = ty.bytes_for(k as u64).ok_or(PackError::Unsupported)? as usize;
    if src.len() != row_bytes * rows || packed_bytes(format, rows, k) != (quants.len(), scales.len()) {
        return Err(PackError::WrongSize);
    }
    if format == PackedFormat::Q6K {
        return pack_q6k(src, rows, k, row_bytes, quants, scales).map(|()| format);
    }
    if matches!(format, PackedFormat::Q4K | PackedFormat::Q5K) {
        return pack_kscales(format, src, rows, k, row_bytes, quants, scales).map(|()| format);
    }
    let nb = k / BLOCK;
    let (qb, sb) = (format.quant_bytes(), format.scale_bytes());
    for g in 0..rows.div_ceil(GROUP_ROWS) {
        for b in 0..nb {
            let unit = g * nb + b;
            let qdst = &mut quants[unit * qb..(unit + 1) * qb];
            let sdst = &mut scales[unit * sb..(unit + 1) * sb];
            for r in 0..GROUP_ROWS {
                let row = &src[source_row(g, r, rows) * row_bytes..][..row_bytes];
                let rb = row_block(ty, row, b).ok_or(PackError::Unsupported)?;
                place(format, &rb, r, qdst, sdst);
            }
        }
    }
    Ok(format)
}

/// The source row of row `r` of group `g` in a matrix of `rows`: a last group that the rows do not
/// fill repeats the last row (its outputs are computed and dropped, never read).
fn source_row(g: usize, r: usize, rows: usize) -> usize {
    (g * GROUP_ROWS + r).min(rows - 1)
}

/// [`pack`] for Q6_K: the file's 6-bit values and scales, re-laid for the kernels (see the module
/// documentation), byte for byte as many as the file's.
fn pack_q6k(
    src: &[u8],
    rows: usize,
    k: usize,
    row_bytes: usize,
    quants: &mut [u8],
    scales: &mut [u8],
) -> Result<(), PackError> {
    let (nb, qb) = (k / BLOCK, PackedFormat::Q6K.quant_bytes());
    for g in 0..rows.div_ceil(GROUP_ROWS) {
        for sup in 0..nb / SUPER_BLOCKS {
            let unit = g * (nb / SUPER_BLOCKS) + sup;
            let sdst = &mut scales[unit * SUPER_SCALE_BYTES..(unit + 1) * SUPER_SCALE_BYTES];
            for r in 0..GROUP_ROWS {
                let row = &src[source_row(g, r, rows) * row_bytes..][..row_bytes];
                let blk: BlockQ6_K = one(row, sup).ok_or(PackError::Unsupported)?;
                sdst[2 * r..2 * r + 2].copy_from_slice(&blk.d.0);
                for p in 0..SUPER_BLOCKS {
                    sdst[8 + 8 * p + r] = blk.scales[2 * p] as u8;
                    sdst[12 + 8 * p + r] = blk.scales[2 * p + 1] as u8;
                    // Block p of the super-block: its low nibbles are ql[64 (p / 4) + 32 (p % 2)..]
                    // shifted by 4 ((p % 4) / 2), its high bits qh[32 (p / 4)..] shifted by 2 (p % 4).
                    let ql = &blk.ql[64 * (p / 4) + 32 * (p % 2)..][..BLOCK];
                    let qh = &blk.qh[32 * (p / 4)..][..BLOCK];
                    let low = |e: usize| (ql[e] >> (4 * ((p % 4) / 2))) & 0xF;
                    let high = |e: usize| ((qh[e] >> (2 * (p % 4))) & 3) ^ 2;
                    let b = sup * SUPER_BLOCKS + p;
                    let qdst = &mut quants[(g * nb + b) * qb..(g * nb + b + 1) * qb];
                    interleave_nibbles(qdst, r, low);
                    for h in 0..2 {
                        for j in 0..4 {
                            let e = |f: usize| 4 * (2 * f + h) + j;
                            qdst[64 + 16 * h + 4 * r + j] =
                                high(e(0)) | (high(e(1)) << 2) | (high(e(2)) << 4) | (high(e(3)) << 6);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// [`pack`] for Q4_K and Q5_K: the file's values in the 4-bit (and bit-plane) interleave and its
/// scales re-laid per group (see the module documentation), as many bytes as the file's.
fn pack_kscales(
    format: PackedFormat,
    src: &[u8],
    rows: usize,
    k: usize,
    row_bytes: usize,
    quants: &mut [u8],
    scales: &mut [u8],
) -> Result<(), PackError> {
    let (nb, qb) = (k / BLOCK, format.quant_bytes());
    for g in 0..rows.div_ceil(GROUP_ROWS) {
        for sup in 0..nb / SUPER_BLOCKS {
            let unit = g * (nb / SUPER_BLOCKS) + sup;
            let sdst = &mut scales[unit * Q4K_SCALE_BYTES..(unit + 1) * Q4K_SCALE_BYTES];
            for r in 0..GROUP_ROWS {
                let row = &src[source_row(g, r, rows) * row_bytes..][..row_bytes];
                // The K-quant fields both types share (Q5_K adds `qh`).
                let (d, dmin, kscales, qs, qh) = if format == PackedFormat::Q5K {
                    let blk: BlockQ5_K = one(row, sup).ok_or(PackError::Unsupported)?;
                    (blk.d, blk.dmin, blk.scales, blk.qs, Some(blk.qh))
                } else {
                    let blk: BlockQ4_K = one(row, sup).ok_or(PackError::Unsupported)?;
                    (blk.d, blk.dmin, blk.scales, blk.qs, None)
                };
                sdst[2 * r..2 * r + 2].copy_from_slice(&d.0);
                sdst[8 + 2 * r..8 + 2 * r + 2].copy_from_slice(&dmin.0);
                let flip = if qh.is_some() { 0 } else { 8 };
                let fields: [(u8, u8); SUPER_BLOCKS] = core::array::from_fn(|p| scale_min_k4(p, &kscales));
                // Q5_K: bit p of qh[e] is the high bit of element e of block p. The plane byte
                // of block p, element column j holds those of elements 4c + j at bit c (XOR 1):
                // one 8x8 bit transpose per column j gives all 8 blocks' bytes.
                let bit_planes = qh.map(|qh| {
                    core::array::from_fn::<[u8; SUPER_BLOCKS], 4, _>(|j| {
                        let rows = u64::from_le_bytes(core::array::from_fn(|c| qh[4 * c + j]));
                        (!transpose8(rows)).to_le_bytes()
                    })
                });
                for p in 0..SUPER_BLOCKS {
                    let (sc, m) = fields[p];
                    sdst[16 + 4 * p + r] = (sc & 15) | (m & 15) << 4;
                    if p < 4 {
                        let (sc4, m4) = fields[p + 4];
                        sdst[48 + 4 * p + r] = (sc >> 4) | (sc4 >> 4) << 2 | (m >> 4) << 4 | (m4 >> 4) << 6;
                    }
                    // Block p: the nibbles qs[32 (p / 2)..] shifted by 4 (p % 2), stored q - 8 (Q4_K)
                    // or as the low bits of u (Q5_K, whose high bit p of qh[e] goes to the plane).
                    let b = sup * SUPER_BLOCKS + p;
                    let qdst = &mut quants[(g * nb + b) * qb..(g * nb + b + 1) * qb];
                    interleave_nibbles(qdst, r, |e| ((qs[32 * (p / 2) + e] >> (4 * (p % 2))) & 0xF) ^ flip);
                    if let Some(planes) = &bit_planes {
                        for j in 0..4 {
                            qdst[64 + 4 * r + j] = planes[j][p];
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Writes row `r`'s 32 low nibbles `nib(e)` (each below 16) into the 4-bit interleave of the block
/// `qdst`: element `4c + j` in the low nibble of byte `16c + 4r + j`, element `16 + 4c + j` in its
/// high nibble.
#[inline]
fn interleave_nibbles(qdst: &mut [u8], r: usize, nib: impl Fn(usize) -> u8) {
    for c in 0..4 {
        for j in 0..4 {
            qdst[16 * c + 4 * r + j] = nib(4 * c + j) | (nib(16 + 4 * c + j) << 4);
        }
    }
}

/// Transposes an 8x8 bit matrix: bit `c` of byte `p` of the result is bit `p` of byte `c`.
const fn transpose8(x: u64) -> u64 {
    let t = (x ^ (x >> 7)) & 0x00AA_00AA_00AA_00AA;
    let x = x ^ t ^ (t << 7);
    let t = (x ^ (x >> 14)) & 0x0000_CCCC_0000_CCCC;
    let x = x ^ t ^ (t << 14);
    let t = (x ^ (x >> 28)) & 0x0000_0000_F0F0_F0F0;
    x ^ t ^ (t << 28)
}

/// Writes row `r`'s block into the interleaved block `qdst` and its scales into `sdst`.
fn place(format: PackedFormat, rb: &RowBlock, r: usize, qdst: &mut [u8], sdst: &mut [u8]) {
    if format.is_5bit() {
        // Q5_0's blocks hold q = u - 16, Q5_1's u.
        let offset = if format == PackedFormat::Q5 { 16 } else { 0 };
        let u = |e: usize| (rb.q[e] + offset) as u8;
        let mut bits = [0u8; 4];
        interleave_nibbles(qdst, r, |e| u(e) & 15);
        for e in 0..BLOCK {
            bits[e % 4] |= ((u(e) >> 4) ^ 1) << (e / 4);
        }
        qdst[64 + 4 * r..64 + 4 * r + 4].copy_from_slice(&bits);
    } else if format.is_4bit() {
        interleave_nibbles(qdst, r, |e| (rb.q[e] as u8) & 0xF);
    } else {
        for c in 0..8 {
            for j in 0..4 {
                qdst[16 * c + 4 * r + j] = rb.q[4 * c + j] as u8;
            }
        }
    }
    sdst[2 * r..2 * r + 2].copy_from_slice(&F16Le::from_f32(rb.d).0);
    if format.scale_bytes() > GROUP_ROWS * 2 {
        let at = 2 * (GROUP_ROWS + r);
        sdst[at..at + 2].copy_from_slice(&F16Le::from_f32(rb.m).0);
    }
}

fn one<B: Pod>(row: &[u8], i: usize) -> Option<B> {
    let size = core::mem::size_of::<B>();
    row.get(i * size..(i + 1) * size).map(bytemuck::pod_read_unaligned)
}

/// Block `b` (32 elements) of a row of type `ty`, in integer form.
fn row_block(ty: GgmlType, row: &[u8], b: usize) -> Option<RowBlock> {
    let mut q = [0i8; BLOCK];
    let per_super = QK_K / BLOCK;
    Some(match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (d, m, qs) = if ty == GgmlType::Q4_0 {
                let blk: BlockQ4_0 = one(row, b)?;
                (blk.d.to_f32(), 0.0, blk.qs)
            } else {
                let blk: BlockQ4_1 = one(row, b)?;
                (blk.d.to_f32(), blk.m.to_f32(), blk.qs)
            };
            for (j, &byte) in qs.iter().enumerate() {
                q[j] = (byte & 0xF) as i8 - 8;
                q[j + 16] = (byte >> 4) as i8 - 8;
            }
            RowBlock { q, d, m }
        }
        GgmlType::Q8_0 => {
            let blk: BlockQ8_0 = one(row, b)?;
            RowBlock { q: blk.qs, d: blk.d.to_f32(), m: 0.0 }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (d, m, qh, qs, offset) = if ty == GgmlType::Q5_0 {
                let blk: BlockQ5_0 = one(row, b)?;
                (blk.d.to_f32(), 0.0, blk.qh, blk.qs, 16)
            } else {
                let blk: BlockQ5_1 = one(row, b)?;
                (blk.d.to_f32(), blk.m.to_f32(), blk.qh, blk.qs, 0)
            };
            let qh = u32::from_le_bytes(qh);
            for (j, &byte) in qs.iter().enumerate() {
                let lo = (byte & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (byte >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                q[j] = lo as i8 - offset;
                q[j + 16] = hi as i8 - offset;
            }
            RowBlock { q, d, m }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (sup, sub) = (b / per_super, b % per_super);
            let (d, dmin, scales) = if ty == GgmlType::Q4_K {
                let blk: BlockQ4_K = one(row, sup)?;
                for (l, v) in q.iter_mut().enumerate() {
                    *v = ((blk.qs[32 * (sub / 2) + l] >> (4 * (sub % 2))) & 0xF) as i8 - 8;
                }
                (blk.d.to_f32(), blk.dmin.to_f32(), blk.scales)
            } else {
                let blk: BlockQ5_K = one(row, sup)?;
                for (l, v) in q.iter_mut().enumerate() {
                    let lo = (blk.qs[32 * (sub / 2) + l] >> (4 * (sub % 2))) & 0xF;
                    *v = (lo | (((blk.qh[l] >> sub) & 1) << 4)) as i8;
                }
                (blk.d.to_f32(), blk.dmin.to_f32(), blk.scales)
            };
            let (sc, mn) = scale_min_k4(sub, &scales);
            RowBlock { q, d: d * sc as f32, m: -(dmin * mn as f32) }
        }
        GgmlType::Q6_K => {
            let (sup, sub) = (b / per_super, b % per_super);
            let blk: BlockQ6_K = one(row, sup)?;
            for (l, v) in q.iter_mut().enumerate() {
                let i = 32 * sub + l; // element within the super-block
                let (half, i) = (i / 128, i % 128);
                let low = (blk.ql[64 * half + i % 64] >> (4 * (i / 64))) & 0xF;
                let high = (blk.qh[32 * half + i % 32] >> (2 * (i / 32))) & 3;
                *v = (low | (high << 4)) as i8 - 32;
            }
            let d = blk.d.to_f32();
            RowBlock { q, d: d * blk.scales[2 * sub] as f32, m: d * blk.scales[2 * sub + 1] as f32 }
        }
        // Types without a repacked layout (see `GgmlType::traits`).
        GgmlType::F32
        | GgmlType::F16
        | GgmlType::BF16
        | GgmlType::Q8_1
        | GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q8_K
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ3_XXS
        | GgmlType::IQ1_S
        | GgmlType::IQ4_NL
        | GgmlType::IQ3_S
        | GgmlType::IQ2_S
        | GgmlType::IQ4_XS
        | GgmlType::IQ1_M
        | GgmlType::TQ1_0
        | GgmlType::TQ2_0
        | GgmlType::MXFP4
        | GgmlType::I8
        | GgmlType::I16
        | GgmlType::I32
        | GgmlType::I64
        | GgmlType::F64 => return None,
    })
}

/// One 32-element block of a quantized activation row: `a = d * qs`, and `s = d * sum(qs)` for the
/// min term. 40 bytes; `d` and `s` hold f16-representable values, as llama.cpp's Q8_0/Q8_1 do.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct ActBlock {
    /// Scale.
    pub d: f32,
    /// `d * sum(qs)`.
    pub s: f32,
    /// Quants.
    pub qs: [i8; BLOCK],
}

/// Bytes of one quantized activation row of `k` elements.
pub const fn act_row_bytes(k: usize) -> usize {
    k.div_ceil(BLOCK) * core::mem::size_of::<ActBlock>()
}

/// Dequantizes row `row` of a packed matrix (for tests, diagnostics and the rows of a tied
/// embedding).
pub fn dequantize_packed_row(w: &PackedMatrix<'_>, row: usize, out: &mut [f32]) {
    let (g, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
    let qb = w.format.quant_bytes();
    let (gq, gs) = (w.group_quants(g), w.group_scales(g));
    for (b, y) in out.chunks_exact_mut(BLOCK).enumerate().take(w.blocks()) {
        let block = &gq[b * qb..(b + 1) * qb];
        for (e, y) in y.iter_mut().enumerate() {
            let q = value(w.format, block, r, e) as f32;
            *y = match w.format {
                PackedFormat::Q4K | PackedFormat::Q5K => {
                    // The file's arithmetic (`d * sc * u - dmin * m`): its values exactly (`value`
                    // gives Q4K's nibble - 8 and Q5K's u).
                    let k = q4k_scales(gs, b, r);
                    let u = if w.format == PackedFormat::Q4K { q + 8.0 } else { q };
                    k.d * k.sc as f32 * u - k.dmin * k.m as f32
                }
                PackedFormat::Q6K => {
                    let (d, sc) = q6k_scales(gs, b, r);
                    d * sc[e / 16] as f32 * q
                }
                PackedFormat::Q4Min => {
                    let [d, m] = block_scales(w.format, gs, b, r);
                    d * (q + 8.0) + m
                }
                PackedFormat::Q8Min | PackedFormat::Q5Min => {
                    let [d, m] = block_scales(w.format, gs, b, r);
                    d * q + m
                }
                PackedFormat::Q8Sub16 => {
                    // The scales of elements 0..16, then 16..32.
                    let [lo, hi] = block_scales(w.format, gs, b, r);
                    let d = if e >= 16 { hi } else { lo };
                    d * q
                }
                PackedFormat::Q4 | PackedFormat::Q8 | PackedFormat::Q5 => {
                    block_scales(w.format, gs, b, r)[0] * q
                }
            };
        }
    }
}

/// Rounds to the nearest f16 value, kept as f32.
#[inline]
pub fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The f16 at index `i` of little-endian bytes, as f32.
#[inline]
pub(crate) fn f16_at(bytes: &[u8], i: usize) -> f32 {
    F16Le([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
}

/// Value of element `e` of row `r` in an interleaved block: signed, except the unsigned `u` of
/// Q5Min and Q5K.
#[inline]
pub fn value(format: PackedFormat, block: &[u8], r: usize, e: usize) -> i32 {
    if format == PackedFormat::Q6K {
        value_q6k(block, r, e)
    } else if format == PackedFormat::Q5 {
        value_q5(block, r, e)
    } else if format.is_5bit() {
        // Q5Min, Q5K: the unsigned value.
        value_q5(block, r, e) + 16
    } else if format.is_4bit() {
        let byte = block[16 * ((e % 16) / 4) + 4 * r + e % 4];
        let nibble = if e < 16 { byte << 4 } else { byte & 0xF0 };
        i32::from(nibble as i8) / 16
    } else {
        i32::from(block[16 * (e / 4) + 4 * r + e % 4] as i8)
    }
}

/// Signed value (-32..=31) of element `e` of row `r` in a [`PackedFormat::Q6K`] block: the low 4
/// bits as in the 4-bit layout, the high 2 (stored XOR 2) from the plane after them.
#[inline]
pub(crate) fn value_q6k(block: &[u8], r: usize, e: usize) -> i32 {
    let byte = block[16 * ((e % 16) / 4) + 4 * r + e % 4];
    let low = if e < 16 { byte & 0xF } else { byte >> 4 };
    let high = ((block[64 + 16 * ((e / 4) % 2) + 4 * r + e % 4] >> (2 * (e / 8))) & 3) ^ 2;
    i32::from(low | (high << 4)) - 32
}

/// Signed value (-16..=15) of element `e` of row `r` in a [`PackedFormat::Q5`] block: the low 4 bits
/// as in the 4-bit layout, the high bit (stored XOR 1) from the plane after them.
#[inline]
pub(crate) fn value_q5(block: &[u8], r: usize, e: usize) -> i32 {
    let byte = block[16 * ((e % 16) / 4) + 4 * r + e % 4];
    let low = if e < 16 { byte & 0xF } else { byte >> 4 };
    let high = ((block[64 + 4 * r + e % 4] >> (e / 4)) & 1) ^ 1;
    i32::from(low | (high << 4)) - 16
}

/// Row `r`'s two scales of block `b` as the matmul takes them, from a group's scale plane `gs`:
/// `[d, m]` for the formats with a min (Q4K: `f16(d * sc)`, `f16(-dmin * m)`, its Q4Min form),
/// `[d, 0]` for Q4 and Q8, and the scales of elements 0..16 and 16..32 for Q8Sub16 and Q6K
/// (`f16(d * sc)`).
#[inline]
pub fn block_scales(format: PackedFormat, gs: &[u8], b: usize, r: usize) -> [f32; 2] {
    match format {
        PackedFormat::Q4 | PackedFormat::Q8 | PackedFormat::Q5 => {
            [f16_at(&gs[b * format.scale_bytes()..], r), 0.0]
        }
        PackedFormat::Q4Min | PackedFormat::Q8Min | PackedFormat::Q8Sub16 | PackedFormat::Q5Min => {
            let sc = &gs[b * format.scale_bytes()..];
            [f16_at(sc, r), f16_at(sc, GROUP_ROWS + r)]
        }
        PackedFormat::Q4K | PackedFormat::Q5K => {
            let k = q4k_scales(gs, b, r);
            [f16_round(k.d * k.sc as f32), f16_round(-(k.dmin * k.m as f32))]
        }
        PackedFormat::Q6K => {
            let (d, sc) = q6k_scales(gs, b, r);
            [f16_round(d * sc[0] as f32), f16_round(d * sc[1] as f32)]
        }
    }
}

/// Row `r`'s super-block scale `d` and the int8 scales of both halves of block `b`, from a group's
/// [`PackedFormat::Q6K`] scale plane `gs`.
#[inline]
pub(crate) fn q6k_scales(gs: &[u8], b: usize, r: usize) -> (f32, [i8; 2]) {
    let sup = &gs[(b / SUPER_BLOCKS) * SUPER_SCALE_BYTES..][..SUPER_SCALE_BYTES];
    let p = b % SUPER_BLOCKS;
    (f16_at(sup, r), [sup[8 + 8 * p + r] as i8, sup[12 + 8 * p + r] as i8])
}

/// One row's scales of one block of a [`PackedFormat::Q4K`] matrix: the file's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Q4kScales {
    /// The super-block's scale.
    pub d: f32,
    /// The super-block's min scale.
    pub dmin: f32,
    /// The block's 6-bit scale.
    pub sc: u8,
    /// The block's 6-bit min.
    pub m: u8,
}

/// Row `r`'s scales of block `b` from a group's [`PackedFormat::Q4K`] scale plane `gs`.
#[inline]
pub fn q4k_scales(gs: &[u8], b: usize, r: usize) -> Q4kScales {
    let unit = &gs[(b / SUPER_BLOCKS) * Q4K_SCALE_BYTES..][..Q4K_SCALE_BYTES];
    let p = b % SUPER_BLOCKS;
    let (low, high) = (unit[16 + 4 * p + r], unit[48 + 4 * (p % 4) + r] >> (2 * (p / 4)));
    Q4kScales {
        d: f16_at(unit, r),
        dmin: f16_at(unit, GROUP_ROWS + r),
        sc: (low & 15) | (high & 3) << 4,
        m: (low >> 4) | ((high >> 4) & 3) << 4,
    }
}
