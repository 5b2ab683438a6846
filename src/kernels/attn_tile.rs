//! Flash attention for the tokens of a prompt over an f16 or f32 cache, in tiles, as llama.cpp's
//! CPU backend computes batches of [`TILE_MIN_TOKENS`] tokens or more: the keys and values of a
//! tile of [`TILE_KEYS`] cache rows are widened to f32 once for every query row of the call (the
//! query heads of one KV head for several tokens), scores are a small f32 matrix product, the
//! online softmax runs once per tile and row, and the accumulators are f32. (One token at a time
//! keeps the f16 kernels of `flash_attn_rows`, whose accumulator is ggml's f16.)
//!
//! The SIMD kernels put query rows in the vector lanes: the queries are transposed once per call
//! (`qt[d][row]`), so a score is one lane's chain of fused multiply-adds over the head dimension,
//! the softmax is lane-wise, and the accumulators are `acc[d][row]`. Each lane does exactly what
//! [`flash_attn_tile_ref`] does for its row alone (tiles aligned at multiples of [`TILE_KEYS`] of
//! the cache, the same f32 operations in the same order), so the kernels are tested bit for bit
//! against it, and a row's result does not depend on which rows share its call.

use core::ops::Range;

use super::KernelPath;
use crate::quant::GgmlType;

/// Cache rows per tile: the unit of the online softmax, aligned at multiples of it.
pub const TILE_KEYS: usize = 32;
/// Most query rows per call.
pub const TILE_ROWS: usize = 32;
/// Largest head size the tiles hold.
pub const TILE_DIM: usize = 256;
/// Query tokens in an attention node from which it takes the tiles (llama.cpp's `GGML_FA_TILE_Q`).
pub const TILE_MIN_TOKENS: usize = 64;
/// Floats of the transposed queries and of the accumulators of one call (rows x head size).
const ROW_FLOATS: usize = 4096;
/// Widest vector of the kernels, in lanes: rows per call are a multiple of it.
const MAX_LANES: usize = 8;

/// Whether keys of type `k` and values of type `v` with heads of `dk` and `dv` take the tiles:
/// one float type for both (f16 or f32, as llama.cpp), heads up to [`TILE_DIM`].
pub fn takes_tiles(k: GgmlType, v: GgmlType, dk: usize, dv: usize) -> bool {
    k == v
        && matches!(k, GgmlType::F16 | GgmlType::F32)
        && (1..=TILE_DIM).contains(&dk)
        && (1..=TILE_DIM).contains(&dv)
}

/// Whether an attention node of `tokens` query tokens over keys of type `k` and values of type
/// `v` takes the tiles on `path`: a prompt batch ([`TILE_MIN_TOKENS`] tokens or more) over a cache
/// [`takes_tiles`] accepts, on every path but FEAT_FP16's, whose f16 kernels (8 lanes of f16
/// arithmetic, as llama.cpp's aarch64 build computes attention) cost fewer instructions: about
/// 67 per query row and key against 144 for these f32 tiles in 4 lanes (qemu cortex-a76,
/// SmolLM2-135M, prompt tokens at depth 448-512).
pub fn prompt_takes_tiles(
    path: KernelPath,
    tokens: usize,
    k: GgmlType,
    v: GgmlType,
    dk: usize,
    dv: usize,
) -> bool {
    path != KernelPath::NeonFp16 && tokens >= TILE_MIN_TOKENS && takes_tiles(k, v, dk, dv)
}

/// Query rows one call takes for heads of `dk` and `dv` (a multiple of the widest vector).
pub fn tile_rows(dk: usize, dv: usize) -> usize {
    let fit = ROW_FLOATS / dk.max(dv).max(1);
    TILE_ROWS.min(fit / MAX_LANES * MAX_LANES).max(MAX_LANES)
}

/// The working memory of one call (about 100 KiB: callers keep it on a frame of its own).
pub struct TileScratch {
    /// Queries transposed, `qt[d * lanes + row]`.
    qt: [f32; ROW_FLOATS],
    /// Accumulators, `acc[d * lanes + row]`.
    acc: [f32; ROW_FLOATS],
    /// The tile's keys widened, `kf[j * dk + d]`.
    kf: [f32; TILE_KEYS * TILE_DIM],
    /// The tile's values widened, `vf[j * dv + d]`.
    vf: [f32; TILE_KEYS * TILE_DIM],
    /// Scores, then softmax weights, `s[j * lanes + row]`; masks `mask[j * lanes + row]`.
    s: [f32; TILE_KEYS * TILE_ROWS],
    mask: [f32; TILE_KEYS * TILE_ROWS],
}

impl TileScratch {
    /// Zeroed scratch.
    pub const fn new() -> Self {
        Self {
            qt: [0.0; ROW_FLOATS],
            acc: [0.0; ROW_FLOATS],
            kf: [0.0; TILE_KEYS * TILE_DIM],
            vf: [0.0; TILE_KEYS * TILE_DIM],
            s: [0.0; TILE_KEYS * TILE_ROWS],
            mask: [0.0; TILE_KEYS * TILE_ROWS],
        }
    }
}

impl Default for TileScratch {
    fn default() -> Self {
        Self::new()
    }
}

/// One query row `q` over keys `keys` of an f16 or f32 (`ty`) cache, the tiles' operations
/// written out for one row: for each tile of [`TILE_KEYS`] cache rows (aligned at its multiples)
/// holding some of the row's keys, the scores `s_j = (q . k_j, one f32 fused multiply-add per
/// element in order) * scale`, the tile's maximum `m`, the rescale `ms = exp(max(M, MIN) -
/// max(M', MIN))` of the accumulator and the sum (`M' = max(M, m)`), the weights `p_j = exp(s_j -
/// max(M', MIN))` added to the sum in order, and `acc = fma(v_j, p_j, acc)` per element in key
/// order; at the end `out = acc / sum` (zeros for no keys). `libm::expf` for the exponentials.
pub fn flash_attn_tile_ref<'k>(
    ty: GgmlType,
    q: &[f32],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scale: f32,
    out: &mut [f32],
) {
    let (dk, dv) = (q.len(), out.len());
    if !takes_tiles(ty, ty, dk, dv) {
        return;
    }
    let mut acc = [0f32; TILE_DIM];
    let acc = &mut acc[..dv];
    let (mut kf, mut vf) = ([0f32; TILE_DIM], [0f32; TILE_DIM]);
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
    let mut t = keys.start / TILE_KEYS * TILE_KEYS;
    while t < keys.end {
        let seen = keys.start.max(t)..keys.end.min(t + TILE_KEYS);
        let mut s = [0f32; TILE_KEYS];
        let mut m = f32::NEG_INFINITY;
        for j in seen.clone() {
            widen_ref(ty, key(j), &mut kf[..dk]);
            let mut x = 0f32;
            for (a, b) in kf[..dk].iter().zip(q) {
                x = libm::fmaf(*a, *b, x);
            }
            s[j - t] = x * scale;
            m = m.max(s[j - t]);
        }
        let new = max.max(m);
        let ms = libm::expf(max.max(f32::MIN) - new.max(f32::MIN));
        acc.iter_mut().for_each(|a| *a *= ms);
        sum *= ms;
        max = new;
        for j in seen {
            let p = libm::expf(s[j - t] - new.max(f32::MIN));
            sum += p;
            widen_ref(ty, value(j), &mut vf[..dv]);
            for (a, v) in acc.iter_mut().zip(&vf[..dv]) {
                *a = libm::fmaf(*v, p, *a);
            }
        }
        t += TILE_KEYS;
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = a * inv;
    }
}

/// An f16 or f32 cache row to f32 (exact); a row of the wrong length leaves `out` as it is.
fn widen_ref(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    let width = if ty == GgmlType::F16 { 2 } else { 4 };
    if row.len() != out.len() * width {
        return;
    }
    if let (GgmlType::F32, Ok(values)) = (ty, bytemuck::try_cast_slice::<u8, f32>(row)) {
        // (An aligned f32 row, an encoder's activations: a copy.)
        out.copy_from_slice(values);
        return;
    }
    for (o, b) in out.iter_mut().zip(row.chunks_exact(width)) {
        *o = match b {
            [a, b] => super::dot::f16(crate::quant::blocks::F16Le([*a, *b])),
            _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        };
    }
}

/// The shapes of one call.
pub struct Tiles<'a> {
    /// The cache type of keys and values.
    pub ty: GgmlType,
    /// Head size of the keys.
    pub dk: usize,
    /// Head size of the values.
    pub dv: usize,
    /// The scores' scale.
    pub scale: f32,
    /// Each row's keys.
    pub keys: &'a [Range<usize>],
}

/// A vector of f32 lanes as a SIMD path gives it to [`tile_loop`] (lanes are query rows).
pub trait Lanes: Copy {
    /// Lanes per vector (at most 8).
    const N: usize;
    /// Every lane `x`.
    fn splat(x: f32) -> Self;
    /// The first `N` floats of `x`.
    fn load(x: &[f32]) -> Self;
    /// Into the first `N` floats of `x`.
    fn store(self, x: &mut [f32]);
    /// `self * b + c`, fused.
    fn mul_add(self, b: Self, c: Self) -> Self;
    /// `self * b`.
    fn mul(self, b: Self) -> Self;
    /// `self + b`.
    fn add(self, b: Self) -> Self;
    /// `self - b`.
    fn sub(self, b: Self) -> Self;
    /// Lane-wise maximum (either operand for equal values; finite inputs only).
    fn max(self, b: Self) -> Self;
    /// `libm::expf` per lane, bit for bit.
    fn exp(self) -> Self;
    /// An f16 row (little-endian bytes) to f32: `out.len() * 2` bytes.
    fn widen_f16(row: &[u8], out: &mut [f32]);
}

/// Row vectors a scores or update block holds in registers (x 2 keys or 2 dimensions).
const GROUP: usize = 4;

/// The tiled loop of [`flash_attn_tile`] in vectors `L` (inlined into each path's kernel, which
/// compiles it with its target features). `outs.len()` rows, at most [`tile_rows`].
#[inline(always)]
pub fn tile_loop<'k, L: Lanes>(
    t: &Tiles<'_>,
    qs: &[&[f32]],
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    sc: &mut TileScratch,
    outs: &mut [&mut [f32]],
) {
    let (dk, dv) = (t.dk, t.dv);
    let n = qs.len().min(outs.len()).min(t.keys.len());
    let lanes = n.div_ceil(L::N) * L::N;
    if n == 0 || lanes * dk.max(dv) > ROW_FLOATS || lanes > TILE_ROWS || dk.max(dv) > TILE_DIM {
        return;
    }
    let keys = &t.keys[..n];
    for (d, col) in sc.qt[..dk * lanes].chunks_exact_mut(lanes).enumerate() {
        for (r, x) in col.iter_mut().enumerate() {
            *x = if r < n { qs[r][d] } else { 0.0 };
        }
    }
    sc.acc[..dv * lanes].fill(0.0);
    let mut max = [f32::NEG_INFINITY; TILE_ROWS];
    let mut sum = [0f32; TILE_ROWS];
    let first = keys.iter().filter(|k| !k.is_empty()).map(|k| k.start).min().unwrap_or(0);
    let last = keys.iter().map(|k| k.end).max().unwrap_or(0);
    let mut base = first / TILE_KEYS * TILE_KEYS;
    while base < last {
        let tile = base..base + TILE_KEYS;
        base += TILE_KEYS;
        // The keys of the tile some row sees (a..b), and whether every row sees all of them.
        let seen = |k: &Range<usize>| k.start.max(tile.start)..k.end.min(tile.end);
        let (mut a, mut b, mut every) = (usize::MAX, 0, true);
        for k in keys {
            let s = seen(k);
            if s.start < s.end {
                a = a.min(s.start);
                b = b.max(s.end);
            }
        }
        if a >= b {
            continue;
        }
        for k in keys {
            let s = seen(k);
            every &= s.start <= a && s.end >= b;
        }
        let (ja, jb) = (a - tile.start, b - tile.start);
        // The tile's key and value rows as f32: aligned f32 rows (an encoder's activations) in
        // place, others widened into the scratch.
        let mut krows: [&[f32]; TILE_KEYS] = [&[]; TILE_KEYS];
        let mut vrows: [&[f32]; TILE_KEYS] = [&[]; TILE_KEYS];
        let slots = sc.kf.chunks_exact_mut(dk).zip(sc.vf.chunks_exact_mut(dv));
        for (j, (kslot, vslot)) in slots.enumerate().take(jb).skip(ja) {
            krows[j] = as_f32::<L>(t.ty, key(tile.start + j), kslot);
            vrows[j] = as_f32::<L>(t.ty, value(tile.start + j), vslot);
        }
        if !every {
            for j in ja..jb {
                let row = &mut sc.mask[j * lanes..(j + 1) * lanes];
                for (r, m) in row.iter_mut().enumerate() {
                    let sees = keys.get(r).is_some_and(|k| seen(k).contains(&(tile.start + j)));
                    *m = if sees { 0.0 } else { f32::NEG_INFINITY };
                }
            }
        }
        scores::<L>(&sc.qt[..dk * lanes], &krows, lanes, ja..jb, &mut sc.s);
        // Softmax per row vector: scale (and mask), tile maximum, rescale, weights, sums.
        let mut ms = [1f32; TILE_ROWS];
        let mut rescale = false;
        for v in (0..lanes).step_by(L::N) {
            let scale = L::splat(t.scale);
            let mut m = L::splat(f32::NEG_INFINITY);
            for j in ja..jb {
                let at = j * lanes + v;
                let mut x = L::load(&sc.s[at..]).mul(scale);
                if !every {
                    x = x.add(L::load(&sc.mask[at..]));
                }
                x.store(&mut sc.s[at..]);
                m = m.max(x);
            }
            let old = L::load(&max[v..]);
            let new = old.max(m);
            let floor = L::splat(f32::MIN);
            let shift = new.max(floor);
            let r = old.max(floor).sub(shift).exp();
            r.store(&mut ms[v..]);
            new.store(&mut max[v..]);
            let mut total = L::load(&sum[v..]).mul(r);
            for j in ja..jb {
                let at = j * lanes + v;
                let p = L::load(&sc.s[at..]).sub(shift).exp();
                p.store(&mut sc.s[at..]);
                total = total.add(p);
            }
            total.store(&mut sum[v..]);
        }
        for &x in &ms[..lanes] {
            rescale |= x != 1.0;
        }
        if rescale {
            for col in sc.acc[..dv * lanes].chunks_exact_mut(lanes) {
                for v in (0..lanes).step_by(L::N) {
                    L::load(&col[v..]).mul(L::load(&ms[v..])).store(&mut col[v..]);
                }
            }
        }
        update::<L>(&mut sc.acc[..dv * lanes], &vrows, dv, lanes, ja..jb, &sc.s);
    }
    for (r, out) in outs[..n].iter_mut().enumerate() {
        let inv = if sum[r] == 0.0 { 0.0 } else { 1.0 / sum[r] };
        for (d, o) in out.iter_mut().enumerate() {
            *o = sc.acc[d * lanes + r] * inv;
        }
    }
}

/// An f16 or f32 cache row as f32: an aligned f32 row of `slot`'s length itself (no copy: an
/// encoder's attention would otherwise copy every key and value once per call), any other row
/// widened into `slot` with `L`'s widening (a row of the wrong length leaves `slot` as it is).
#[inline(always)]
fn as_f32<'a, L: Lanes>(ty: GgmlType, row: &'a [u8], slot: &'a mut [f32]) -> &'a [f32] {
    if ty == GgmlType::F16 {
        if row.len() == slot.len() * 2 {
            L::widen_f16(row, slot);
        }
        return slot;
    }
    match bytemuck::try_cast_slice::<u8, f32>(row) {
        Ok(values) if ty == GgmlType::F32 && values.len() == slot.len() => values,
        _ => {
            widen_ref(ty, row, slot);
            slot
        }
    }
}

/// `s[j][row] = sum_d k[j][d] * qt[d][row]` for keys `js` (one fused chain per lane, in `d`
/// order), two keys and up to [`GROUP`] row vectors at a time.
#[inline(always)]
fn scores<L: Lanes>(qt: &[f32], k: &[&[f32]], lanes: usize, js: Range<usize>, s: &mut [f32]) {
    let mut v = 0;
    while v < lanes {
        let g = ((lanes - v) / L::N).min(GROUP);
        match g {
            1 => scores_group::<L, 1>(qt, k, lanes, v, js.clone(), s),
            2 => scores_group::<L, 2>(qt, k, lanes, v, js.clone(), s),
            3 => scores_group::<L, 3>(qt, k, lanes, v, js.clone(), s),
            _ => scores_group::<L, GROUP>(qt, k, lanes, v, js.clone(), s),
        }
        v += g * L::N;
    }
}

#[inline(always)]
fn scores_group<L: Lanes, const G: usize>(
    qt: &[f32],
    k: &[&[f32]],
    lanes: usize,
    v: usize,
    js: Range<usize>,
    s: &mut [f32],
) {
    // Each step's row vectors as one slice of exactly G vectors (one bounds check per step).
    let w = G * L::N;
    let col = |d: usize| &qt[d * lanes + v..d * lanes + v + w];
    let mut j = js.start;
    while j + 2 <= js.end {
        let (k0, k1) = (k[j], k[j + 1]);
        let mut acc = [[L::splat(0.0); G]; 2];
        for (d, (&x0, &x1)) in k0.iter().zip(k1).enumerate() {
            let q = col(d);
            let (x0, x1) = (L::splat(x0), L::splat(x1));
            for g in 0..G {
                let q = L::load(&q[g * L::N..]);
                acc[0][g] = x0.mul_add(q, acc[0][g]);
                acc[1][g] = x1.mul_add(q, acc[1][g]);
            }
        }
        for (i, row) in acc.iter().enumerate() {
            let out = &mut s[(j + i) * lanes + v..(j + i) * lanes + v + w];
            for (g, x) in row.iter().enumerate() {
                x.store(&mut out[g * L::N..]);
            }
        }
        j += 2;
    }
    if j < js.end {
        let k0 = k[j];
        let mut acc = [L::splat(0.0); G];
        for (d, &x0) in k0.iter().enumerate() {
            let (q, x0) = (col(d), L::splat(x0));
            for (g, a) in acc.iter_mut().enumerate() {
                *a = x0.mul_add(L::load(&q[g * L::N..]), *a);
            }
        }
        let out = &mut s[j * lanes + v..j * lanes + v + w];
        for (g, x) in acc.iter().enumerate() {
            x.store(&mut out[g * L::N..]);
        }
    }
}

/// `acc[d][row] = fma(v[j][d], p[j][row], acc[d][row])` for keys `js` in order (value rows of
/// `dv`), two dimensions and up to [`GROUP`] row vectors at a time.
#[inline(always)]
fn update<L: Lanes>(
    acc: &mut [f32],
    values: &[&[f32]],
    dv: usize,
    lanes: usize,
    js: Range<usize>,
    p: &[f32],
) {
    let mut v = 0;
    while v < lanes {
        let g = ((lanes - v) / L::N).min(GROUP);
        match g {
            1 => update_group::<L, 1>(acc, values, dv, lanes, v, js.clone(), p),
            2 => update_group::<L, 2>(acc, values, dv, lanes, v, js.clone(), p),
            3 => update_group::<L, 3>(acc, values, dv, lanes, v, js.clone(), p),
            _ => update_group::<L, GROUP>(acc, values, dv, lanes, v, js.clone(), p),
        }
        v += g * L::N;
    }
}

#[inline(always)]
fn update_group<L: Lanes, const G: usize>(
    acc: &mut [f32],
    rows: &[&[f32]],
    dv: usize,
    lanes: usize,
    v: usize,
    js: Range<usize>,
    p: &[f32],
) {
    let w = G * L::N;
    // Each key's weights as one slice of exactly G vectors, and its value row.
    let weights = |j: usize| &p[j * lanes + v..j * lanes + v + w];
    let values = |j: usize| rows[j];
    let mut d = 0;
    while d + 2 <= dv {
        let (c0, c1) = (d * lanes + v, (d + 1) * lanes + v);
        let mut a = [[L::splat(0.0); G]; 2];
        for g in 0..G {
            a[0][g] = L::load(&acc[c0 + g * L::N..c0 + w]);
            a[1][g] = L::load(&acc[c1 + g * L::N..c1 + w]);
        }
        for j in js.clone() {
            let (p, x) = (weights(j), values(j));
            let (x0, x1) = (L::splat(x[d]), L::splat(x[d + 1]));
            for g in 0..G {
                let p = L::load(&p[g * L::N..]);
                a[0][g] = x0.mul_add(p, a[0][g]);
                a[1][g] = x1.mul_add(p, a[1][g]);
            }
        }
        for g in 0..G {
            a[0][g].store(&mut acc[c0 + g * L::N..c0 + w]);
            a[1][g].store(&mut acc[c1 + g * L::N..c1 + w]);
        }
        d += 2;
    }
    if d < dv {
        let c0 = d * lanes + v;
        let mut a = [L::splat(0.0); G];
        for (g, a) in a.iter_mut().enumerate() {
            *a = L::load(&acc[c0 + g * L::N..c0 + w]);
        }
        for j in js.clone() {
            let (p, x0) = (weights(j), L::splat(values(j)[d]));
            for (g, a) in a.iter_mut().enumerate() {
                *a = x0.mul_add(L::load(&p[g * L::N..]), *a);
            }
        }
        for (g, a) in a.iter().enumerate() {
            a.store(&mut acc[c0 + g * L::N..c0 + w]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_per_call_fit_the_scratch() {
        for d in 1..=TILE_DIM {
            let rows = tile_rows(d, d);
            assert!(rows % MAX_LANES == 0 && rows <= TILE_ROWS && rows * d <= ROW_FLOATS, "d {d}");
        }
        assert_eq!(tile_rows(64, 64), 32);
        assert_eq!(tile_rows(256, 256), 16);
        assert!(takes_tiles(GgmlType::F16, GgmlType::F16, 64, 64));
        assert!(!takes_tiles(GgmlType::F16, GgmlType::F32, 64, 64));
        assert!(!takes_tiles(GgmlType::Q8_0, GgmlType::Q8_0, 64, 64));
        assert!(!takes_tiles(GgmlType::F16, GgmlType::F16, 512, 512));
    }
}
