//! The NPU's matrix layouts on RK3588 (and RK3576), converted on the CPU.
//!
//! Notation: A is M x K, B is K x N, C is M x N; "normal" is row-major.
//!
//! * Native B: tiles of `sN` columns x `sK` rows, `[N/sN, K/sK, sN, sK]`: tiles column-block major,
//!   and inside a tile each column's `sK` values contiguous. For K > [`K_SEGMENT_RK3588`] B is cut
//!   into segments of that many rows, each laid out on its own, concatenated.
//! * Native A and C: `[X/s, M, s]` with X = K for A and X = N for C: the X axis in runs of `s`; for
//!   each run, the M rows one after another. For M = 1 native equals normal.
//! * int4: two's-complement nibbles, two per byte; the element with the even index in buffer order
//!   goes in the low nibble.
//!
//! Tile sizes are the fact sheet's for RK3588; the runtime reports them too (`io_attr.B.dims[2..4]`,
//! `io_attr.A.dims[2]`, `io_attr.C.dims[2]`), and callers should check they agree.

use core::fmt;

/// Native B tile: `n` columns x `k` rows (`sN`, `sK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BTile {
    pub n: usize,
    pub k: usize,
}

/// Native B tile of f16 B on RK3588/RK3576 (1 KiB).
pub const B_TILE_FP16: BTile = BTile { n: 16, k: 32 };
/// Native B tile of int8 B on RK3588/RK3576 (1 KiB).
pub const B_TILE_INT8: BTile = BTile { n: 32, k: 32 };
/// Native B tile of int4 B on RK3588/RK3576 (1 KiB).
pub const B_TILE_INT4: BTile = BTile { n: 64, k: 32 };

/// Native A run length for f16 A on RK3588 (the header's value; an old guide says 16: check
/// `io_attr.A.dims[2]`).
pub const A_TILE_FP16: usize = 8;
/// Native A run length for int8 A on RK3588.
pub const A_TILE_INT8: usize = 16;
/// Native A run length for int4 A on RK3588.
pub const A_TILE_INT4: usize = 32;
/// Native C run length for 32-bit outputs (f32, i32).
pub const C_TILE_32BIT: usize = 4;
/// Native C run length for the i16 output of int4 x int4 on RK3588.
pub const C_TILE_INT16: usize = 8;

/// Rows per K segment of native B on RK3588 (RK3576: 4096).
pub const K_SEGMENT_RK3588: usize = 8192;

/// A shape or buffer that does not fit a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutError {
    /// `what` = `value` is not a multiple of `multiple` (or is zero).
    Misaligned { what: &'static str, value: usize, multiple: usize },
    /// A buffer of `got` elements where `expected` are needed.
    Length { what: &'static str, expected: usize, got: usize },
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutError::Misaligned { what, value, multiple } => {
                write!(f, "{what} = {value} is not a positive multiple of {multiple}")
            }
            LayoutError::Length { what, expected, got } => {
                write!(f, "{what} has {got} elements, expected {expected}")
            }
        }
    }
}

impl std::error::Error for LayoutError {}

fn aligned(what: &'static str, value: usize, multiple: usize) -> Result<(), LayoutError> {
    if value == 0 || value % multiple != 0 {
        return Err(LayoutError::Misaligned { what, value, multiple });
    }
    Ok(())
}

fn length(what: &'static str, expected: usize, got: usize) -> Result<(), LayoutError> {
    if expected != got {
        return Err(LayoutError::Length { what, expected, got });
    }
    Ok(())
}

/// Element index of B\[k\]\[n\] in native B of `kdim` x `ndim` (`kdim` a multiple of `tile.k`,
/// `segment` a multiple of `tile.k`).
pub fn native_b_index(k: usize, n: usize, kdim: usize, ndim: usize, tile: BTile, segment: usize) -> usize {
    let k0 = k / segment * segment;
    let kt = (kdim - k0).min(segment);
    let kk = k - k0;
    let block = (n / tile.n) * (kt / tile.k) + kk / tile.k;
    k0 * ndim + block * tile.n * tile.k + (n % tile.n) * tile.k + kk % tile.k
}

/// Visits B's elements in native order: calls `put(i, k, n)` for i = 0, 1, ... (`i` is the native
/// element index of B\[k\]\[n\]). Checks alignment only.
pub fn for_each_native_b(
    kdim: usize,
    ndim: usize,
    tile: BTile,
    segment: usize,
    mut put: impl FnMut(usize, usize, usize),
) -> Result<(), LayoutError> {
    aligned("K", kdim, tile.k)?;
    aligned("N", ndim, tile.n)?;
    aligned("K segment", segment, tile.k)?;
    let mut i = 0;
    for k0 in (0..kdim).step_by(segment) {
        let kt = (kdim - k0).min(segment);
        for nb in (0..ndim).step_by(tile.n) {
            for kb in (k0..k0 + kt).step_by(tile.k) {
                for n in nb..nb + tile.n {
                    for k in kb..kb + tile.k {
                        put(i, k, n);
                        i += 1;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Packs a `kdim` x `ndim` matrix, read through `get(k, n)`, into native B (`out.len()` =
/// kdim·ndim). Lets callers pack from any source: a column slice for one NPU core, or an
/// N x K (transposed) weight.
pub fn pack_native_b<T: Copy>(
    kdim: usize,
    ndim: usize,
    tile: BTile,
    segment: usize,
    out: &mut [T],
    mut get: impl FnMut(usize, usize) -> T,
) -> Result<(), LayoutError> {
    length("native B", kdim * ndim, out.len())?;
    for_each_native_b(kdim, ndim, tile, segment, |i, k, n| out[i] = get(k, n))
}

/// Normal (row-major K x N) f16 B, as raw bits, to RK3588 native B.
pub fn native_b_fp16(b: &[u16], k: usize, n: usize, out: &mut [u16]) -> Result<(), LayoutError> {
    length("B", k * n, b.len())?;
    pack_native_b(k, n, B_TILE_FP16, K_SEGMENT_RK3588, out, |kk, nn| b[kk * n + nn])
}

/// Normal (row-major K x N) int8 B to RK3588 native B.
pub fn native_b_int8(b: &[i8], k: usize, n: usize, out: &mut [i8]) -> Result<(), LayoutError> {
    length("B", k * n, b.len())?;
    pack_native_b(k, n, B_TILE_INT8, K_SEGMENT_RK3588, out, |kk, nn| b[kk * n + nn])
}

/// Normal (row-major K x N) int4 B, unpacked (one value in -8..=7 per byte), to RK3588 native B,
/// packed (`out.len()` = k·n/2).
pub fn native_b_int4(b: &[i8], k: usize, n: usize, out: &mut [u8]) -> Result<(), LayoutError> {
    length("B", k * n, b.len())?;
    length("packed native B", k * n / 2, out.len())?;
    for_each_native_b(k, n, B_TILE_INT4, K_SEGMENT_RK3588, |i, kk, nn| set_nibble(out, i, b[kk * n + nn]))
}

fn set_nibble(out: &mut [u8], i: usize, v: i8) {
    let nib = (v as u8) & 0x0f;
    let byte = &mut out[i / 2];
    *byte = if i % 2 == 0 { (*byte & 0xf0) | nib } else { (*byte & 0x0f) | (nib << 4) };
}

/// Packs int4 values (one per byte, -8..=7; higher bits dropped) two per byte, even index in the
/// low nibble. `values.len()` must be even and `out.len()` half of it.
pub fn pack_int4(values: &[i8], out: &mut [u8]) -> Result<(), LayoutError> {
    if values.len() % 2 != 0 {
        return Err(LayoutError::Misaligned { what: "int4 count", value: values.len(), multiple: 2 });
    }
    length("packed int4", values.len() / 2, out.len())?;
    for (o, pair) in out.iter_mut().zip(values.chunks_exact(2)) {
        *o = ((pair[0] as u8) & 0x0f) | (((pair[1] as u8) & 0x0f) << 4);
    }
    Ok(())
}

/// Unpacks int4 (see [`pack_int4`]) to one sign-extended value per byte.
pub fn unpack_int4(packed: &[u8], out: &mut [i8]) -> Result<(), LayoutError> {
    length("unpacked int4", packed.len() * 2, out.len())?;
    for (pair, &b) in out.chunks_exact_mut(2).zip(packed) {
        pair[0] = ((b << 4) as i8) >> 4;
        pair[1] = (b as i8) >> 4;
    }
    Ok(())
}

/// Element index of X\[m\]\[x\] in native A/C `[cols/s, rows, s]`.
pub fn native_ac_index(m: usize, x: usize, rows: usize, s: usize) -> usize {
    (x / s) * rows * s + m * s + x % s
}

/// Normal `rows` x `cols` A (or C) to native `[cols/s, rows, s]`.
pub fn to_native_ac<T: Copy>(
    src: &[T],
    rows: usize,
    cols: usize,
    s: usize,
    out: &mut [T],
) -> Result<(), LayoutError> {
    aligned("columns", cols, s)?;
    length("normal matrix", rows * cols, src.len())?;
    length("native matrix", rows * cols, out.len())?;
    let mut i = 0;
    for x0 in (0..cols).step_by(s) {
        for m in 0..rows {
            out[i..i + s].copy_from_slice(&src[m * cols + x0..m * cols + x0 + s]);
            i += s;
        }
    }
    Ok(())
}

/// Native `[cols/s, rows, s]` C (or A) to normal `rows` x `cols`.
pub fn from_native_ac<T: Copy>(
    src: &[T],
    rows: usize,
    cols: usize,
    s: usize,
    out: &mut [T],
) -> Result<(), LayoutError> {
    aligned("columns", cols, s)?;
    length("native matrix", rows * cols, src.len())?;
    length("normal matrix", rows * cols, out.len())?;
    let mut i = 0;
    for x0 in (0..cols).step_by(s) {
        for m in 0..rows {
            out[m * cols + x0..m * cols + x0 + s].copy_from_slice(&src[i..i + s]);
            i += s;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_b_visits_every_index_in_order() {
        for (k, n, tile, seg) in
            [(64, 32, B_TILE_FP16, 8192), (96, 64, B_TILE_INT8, 64), (160, 128, B_TILE_INT4, 64)]
        {
            let mut next = 0;
            for_each_native_b(k, n, tile, seg, |i, kk, nn| {
                assert_eq!(i, next);
                assert_eq!(native_b_index(kk, nn, k, n, tile, seg), i, "k={kk} n={nn}");
                next += 1;
            })
            .unwrap();
            assert_eq!(next, k * n);
        }
    }

    #[test]
    fn native_b_fp16_matches_the_fact_sheet_formula() {
        // ((n / sN)·(K/sK) + (k / sK))·sN·sK + (n % sN)·sK + (k % sK), K ≤ 8192.
        let (k, n) = (128, 256);
        let b: Vec<u16> = (0..k * n).map(|i| i as u16).collect();
        let mut out = vec![0u16; k * n];
        native_b_fp16(&b, k, n, &mut out).unwrap();
        for kk in 0..k {
            for nn in 0..n {
                let idx = ((nn / 16) * (k / 32) + kk / 32) * 16 * 32 + (nn % 16) * 32 + kk % 32;
                assert_eq!(out[idx], b[kk * n + nn]);
            }
        }
    }

    #[test]
    fn native_b_segments_large_k() {
        // K = 8192 + 64: the last 64 rows form a second segment after the first 8192·N elements.
        let (k, n) = (8192 + 64, 32);
        let b: Vec<i8> = (0..k * n).map(|i| (i % 251) as i8).collect();
        let mut out = vec![0i8; k * n];
        native_b_int8(&b, k, n, &mut out).unwrap();
        let base = 8192 * n;
        for kk in 0..64 {
            for nn in 0..n {
                // Second segment: K_t = 64, one 32 x 32 tile row per 32 columns.
                let idx = base + ((nn / 32) * 2 + kk / 32) * 32 * 32 + (nn % 32) * 32 + kk % 32;
                assert_eq!(out[idx], b[(8192 + kk) * n + nn]);
            }
        }
    }

    #[test]
    fn misaligned_shapes_are_rejected() {
        let mut out = vec![0u16; 48 * 16];
        let err = native_b_fp16(&vec![0; 48 * 16], 48, 16, &mut out).unwrap_err();
        assert_eq!(err, LayoutError::Misaligned { what: "K", value: 48, multiple: 32 });
        let mut out = vec![0i8; 32 * 48];
        let err = native_b_int8(&[0; 32 * 48], 32, 48, &mut out).unwrap_err();
        assert_eq!(err, LayoutError::Misaligned { what: "N", value: 48, multiple: 32 });
        let err = native_b_int8(&[0; 10], 32, 32, &mut [0; 1024]).unwrap_err();
        assert!(matches!(err, LayoutError::Length { what: "B", .. }), "{err}");
    }

    #[test]
    fn int4_nibbles_low_first() {
        let mut packed = [0u8; 2];
        pack_int4(&[1, -1, -8, 7], &mut packed).unwrap();
        assert_eq!(packed, [0xf1, 0x78]);
        let mut back = [0i8; 4];
        unpack_int4(&packed, &mut back).unwrap();
        assert_eq!(back, [1, -1, -8, 7]);
    }

    #[test]
    fn native_ac_round_trip() {
        let (rows, cols, s) = (5, 24, 8);
        let a: Vec<u32> = (0..(rows * cols) as u32).collect();
        let mut native = vec![0; a.len()];
        to_native_ac(&a, rows, cols, s, &mut native).unwrap();
        for m in 0..rows {
            for x in 0..cols {
                assert_eq!(native[native_ac_index(m, x, rows, s)], a[m * cols + x]);
            }
        }
        let mut back = vec![0; a.len()];
        from_native_ac(&native, rows, cols, s, &mut back).unwrap();
        assert_eq!(back, a);
        // M = 1: native is normal.
        let row: Vec<u32> = (0..32).collect();
        let mut n1 = vec![0; 32];
        to_native_ac(&row, 1, 32, 16, &mut n1).unwrap();
        assert_eq!(n1, row);
    }
}
