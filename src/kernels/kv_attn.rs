//! Flash attention over a KV cache of any cache type (`-ctk/-ctv`: f32, f16, bf16, q8_0, q4_0,
//! q4_1, q5_0, q5_1), as ggml's CPU flash attention reads a quantized cache: each query row is
//! converted once to the keys' dot partner type (q8_0 for q4_0/q5_0 keys, q8_1 for q4_1/q5_1),
//! scored against each key row in the keys' own dot product, and each value row is widened to f32
//! and added into an f32 accumulator with an online softmax. No f32 copy of the cache is made.
//! (An f16 K and V cache takes the f16 kernels of `flash_attn_rows`, or for a prompt the f32
//! tiles of `attn_tile`; the f16 kernels' accumulator is f16 as ggml's.)
//!
//! q8_0 keys are the one departure from ggml: their query is converted to 15-bit blocks
//! ([`quantize_q15`]), not to q8_0. Rounding the query to 8 bits was most of what q8_0 keys cost
//! Gemma-3-270M's perplexity (256-wide heads; figures in the README's "KV cache types"); the
//! integer block sums stay exact, and the split into a high and a low byte keeps them in byte dot
//! products (`sdot`, `maddubs`).
//!
//! One loop ([`attend`]) serves every path: the reference runs it with the types' reference
//! operations, the AVX2 and NEON kernels inline it with SIMD operations that give the same bits
//! (integer block sums, the same f32 products, fused multiply-adds) where they have them, so the
//! SIMD paths are tested bit for bit against [`KvOps::reference`].

use core::ops::Range;

use super::{Isa, KernelPath, RowSoftmax};
use crate::quant::traits::{DequantizeFn, QuantizeFn, VecDotFn};
use crate::quant::GgmlType;

/// The row operations of attention over one (K type, V type) pair, and the kernel that runs them
/// on one path.
#[derive(Clone, Copy)]
pub struct KvOps {
    /// The converted query's form.
    query: QueryForm,
    q_convert: QuantizeFn,
    dot: VecDotFn,
    widen: DequantizeFn,
    /// The SIMD kernel that runs [`attend`] (with these reference operations where it has none
    /// of its own); `None`: the reference loop.
    simd: Option<Simd>,
    k: GgmlType,
    v: GgmlType,
}

/// What a query row is converted to for the keys' dot product.
#[derive(Clone, Copy)]
enum QueryForm {
    /// The keys' ggml dot partner type.
    Ggml(GgmlType),
    /// [`quantize_q15`]'s blocks (q8_0 keys).
    Q15,
}

/// F32 keys' dot on NEON: the SIMD twin of [`super::dot::vec_dot_f32_lanes_bytes`] (rows not
/// 4-byte aligned take the twin itself).
#[cfg(target_arch = "aarch64")]
fn dot_f32_keys_neon(k: &[u8], q: &[u8]) -> f32 {
    match (bytemuck::try_cast_slice::<u8, f32>(k), bytemuck::try_cast_slice::<u8, f32>(q)) {
        (Ok(k), Ok(q)) => super::neon::dot_f32(k, q),
        _ => super::dot::vec_dot_f32_lanes_bytes(k, q),
    }
}

/// F32 keys' dot on AVX2 (only in the ops of [`KvOps::new`] for [`Isa::Avx2`], whose CPU has
/// AVX2, FMA and F16C): the SIMD twin of [`super::dot::vec_dot_f32_lanes_bytes`].
#[cfg(target_arch = "x86_64")]
fn dot_f32_keys_avx2(k: &[u8], q: &[u8]) -> f32 {
    match (bytemuck::try_cast_slice::<u8, f32>(k), bytemuck::try_cast_slice::<u8, f32>(q)) {
        // SAFETY: these ops exist only on a CPU with AVX2, FMA and F16C (`KvOps::new`).
        (Ok(k), Ok(q)) => unsafe { super::x86::dot_f32_avx2(k, q) },
        _ => super::dot::vec_dot_f32_lanes_bytes(k, q),
    }
}

/// Which SIMD kernel runs the loop.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Simd {
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "aarch64")]
    Neon,
    #[cfg(target_arch = "aarch64")]
    NeonDotprod,
}

impl KvOps {
    /// The reference operations for keys of type `k` and values of type `v`; `None` unless both
    /// are cache types ([`GgmlType::is_kv_cache_type`]).
    pub fn reference(k: GgmlType, v: GgmlType) -> Option<Self> {
        if !k.is_kv_cache_type() || !v.is_kv_cache_type() {
            return None;
        }
        let (query, q_convert, dot) = if k == GgmlType::Q8_0 {
            (QueryForm::Q15, quantize_q15 as QuantizeFn, dot_q8_0_q15_ref as VecDotFn)
        } else if k == GgmlType::F32 {
            // The f32 SIMD dot's lanes (as ggml's SIMD f32 dot, not its scalar f64 sum): an
            // encoder's keys are f32, and its attention runs this dot for every pair of tokens.
            let q_convert = GgmlType::F32.traits().from_float?;
            (QueryForm::Ggml(GgmlType::F32), q_convert, super::dot::vec_dot_f32_lanes_bytes as VecDotFn)
        } else {
            let (q_type, dot) = k.traits().vec_dot?;
            (QueryForm::Ggml(q_type), q_type.traits().from_float?, dot)
        };
        Some(Self { query, q_convert, dot, widen: v.traits().dequantize?, simd: None, k, v })
    }

    /// The operations `path` runs: [`KvOps::reference`]'s, run by the path's SIMD kernel where
    /// this CPU has one (which does q8_0 key dots, q8_0 and f16 value widening, the update and the
    /// exponentials its own way).
    pub fn new(path: KernelPath, k: GgmlType, v: GgmlType) -> Option<Self> {
        let mut ops = Self::reference(k, v)?;
        ops.simd = match path.isa() {
            Isa::Scalar => None,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => {
                let dotprod = path != KernelPath::Neon && super::has_dotprod();
                Some(if dotprod { Simd::NeonDotprod } else { Simd::Neon })
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Some(Simd::Avx2),
        };
        if k == GgmlType::F32 {
            ops.dot = match path.isa() {
                Isa::Scalar => ops.dot,
                #[cfg(target_arch = "aarch64")]
                Isa::Neon => dot_f32_keys_neon,
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => dot_f32_keys_avx2,
            };
        }
        Some(ops)
    }

    /// The SIMD kernel that runs the loop (`None`: the reference loop).
    pub(crate) fn simd(&self) -> Option<Simd> {
        self.simd
    }

    /// The keys' type.
    pub fn key_type(&self) -> GgmlType {
        self.k
    }

    /// The values' type.
    pub fn value_type(&self) -> GgmlType {
        self.v
    }

    /// The keys' reference dot product.
    pub fn dot(&self) -> VecDotFn {
        self.dot
    }

    /// The values' reference widening.
    pub fn widen(&self) -> DequantizeFn {
        self.widen
    }

    /// Bytes of a query row of `dk` elements converted for the keys (`None` if `dk` is not a
    /// whole number of the partner type's blocks).
    pub fn query_bytes(&self, dk: usize) -> Option<usize> {
        match self.query {
            QueryForm::Ggml(t) if dk % t.block_len() == 0 => t.bytes_for(dk as u64).map(|b| b as usize),
            QueryForm::Q15 if dk % Q15_LEN == 0 => Some(dk / Q15_LEN * Q15_BYTES),
            _ => None,
        }
    }
}

/// Elements of a [`quantize_q15`] block.
pub const Q15_LEN: usize = 32;
/// Bytes of a [`quantize_q15`] block: the f32 scale, the 32 high bytes, the 32 low bytes.
pub const Q15_BYTES: usize = 4 + 2 * Q15_LEN;
/// The largest quant magnitude: 127 * 128, so the high byte stays within -127..=127 (the sign
/// trick of `maddubs` cannot negate -128).
pub const Q15_MAX: i32 = 127 * 128;

/// A query row in 15-bit blocks of 32 for q8_0 keys: per block `d = amax / Q15_MAX`,
/// `q = round(x / d)` (as q8_0's `roundf(x * (1 / d))`), stored as the f32 `d` (little-endian),
/// the high parts `q >> 7` (i8, -127..=127) and the low parts `q & 127` (0..=127), so
/// `q = 128 * hi + lo` and a key's dot is two byte dot products. `false` if the sizes do not
/// match.
pub fn quantize_q15(x: &[f32], out: &mut [u8]) -> bool {
    if x.len() % Q15_LEN != 0 || out.len() != x.len() / Q15_LEN * Q15_BYTES {
        return false;
    }
    for (x, b) in x.chunks_exact(Q15_LEN).zip(out.chunks_exact_mut(Q15_BYTES)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(libm::fabsf(*v)));
        let d = amax / Q15_MAX as f32;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..4].copy_from_slice(&d.to_le_bytes());
        let (hi, lo) = b[4..].split_at_mut(Q15_LEN);
        for ((h, l), &v) in hi.iter_mut().zip(lo.iter_mut()).zip(x) {
            let q = (libm::roundf(v * id) as i32).clamp(-Q15_MAX, Q15_MAX);
            *h = (q >> 7) as i8 as u8;
            *l = (q & 127) as u8;
        }
    }
    true
}

/// The scale `d` of a [`quantize_q15`] block (its first 4 bytes; 0.0 if it has none).
#[inline(always)]
pub fn q15_scale(block: &[u8]) -> f32 {
    match block {
        [a, b, c, d, ..] => f32::from_le_bytes([*a, *b, *c, *d]),
        _ => 0.0,
    }
}

/// A q8_0 key row times a [`quantize_q15`] query row: per block the exact integer sum
/// `128 * sum(k * hi) + sum(k * lo)`, then `sumf += sumi * (dk * dq)` in f32, block by block.
/// 0.0 if the rows are not the same whole number of blocks.
pub fn dot_q8_0_q15_ref(k: &[u8], q: &[u8]) -> f32 {
    q8_0_q15_dot_by(k, q, crate::kernels::dot::f16, |x, hi, lo| {
        let q = |i: usize| 128 * i32::from(hi[i] as i8) + i32::from(lo[i]);
        x.iter().enumerate().map(|(i, &k)| i32::from(k as i8) * q(i)).sum()
    })
}

/// [`dot_q8_0_q15_ref`]'s block loop with each block's integer sum given (`sumi(kq, hi, lo)` of
/// the key block's 32 quant bytes and the query block's high and low bytes) and the keys' exact
/// f16 scale widening (`widen`): the f32 steps are the reference's, in its order, so a SIMD block
/// sum gives the reference's bits. 0.0 if the rows are not the same whole number of blocks.
#[inline(always)]
pub fn q8_0_q15_dot_by(
    k: &[u8],
    q: &[u8],
    widen: impl Fn(crate::quant::blocks::F16Le) -> f32,
    sumi: impl Fn(&[u8], &[u8], &[u8]) -> i32,
) -> f32 {
    const B: usize = 34;
    if k.len() % B != 0 || q.len() != k.len() / B * Q15_BYTES {
        return 0.0;
    }
    let mut sumf = 0.0f32;
    for (x, y) in k.chunks_exact(B).zip(q.chunks_exact(Q15_BYTES)) {
        let dk = widen(crate::quant::blocks::F16Le([x[0], x[1]]));
        let dq = q15_scale(y);
        sumf += sumi(&x[2..], &y[4..4 + Q15_LEN], &y[4 + Q15_LEN..]) as f32 * (dk * dq);
    }
    sumf
}

/// Keys scored (and their softmax weights computed) together by [`attend`].
pub const KEY_CHUNK: usize = 16;

/// ALiBi's bias of one query row: key row `j`'s score gets `slope * -|query - j|` after its
/// scale (ggml's `s * scale + slope * mask`, the mask `-|i - j|` of the positions), `query` the
/// key row at the query's own position.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Alibi {
    /// The head's slope ([`alibi_slope`]).
    pub slope: f32,
    /// The key row at the query's position.
    pub query: usize,
}

impl Alibi {
    /// The bias of key row `j`.
    #[inline(always)]
    pub fn bias(self, j: usize) -> f32 {
        self.slope * -(self.query.abs_diff(j) as f32)
    }
}

/// ALiBi's slope of query head `head` of `n_head` for the maximum bias `max_bias`, as ggml
/// computes it: `m0^(h + 1)` for the first `2^floor(log2 n_head)` heads, the others
/// `m1^(2 (h - that) + 1)` (`m0 = 2^(-max_bias / that)`, `m1 = 2^(-max_bias / 2 / that)`); 1
/// without a bias.
pub fn alibi_slope(max_bias: f32, n_head: usize, head: usize) -> f32 {
    if max_bias <= 0.0 || n_head == 0 {
        return 1.0;
    }
    let n_head_log2 = 1u32 << (usize::BITS - 1 - n_head.leading_zeros());
    let m0 = libm::powf(2.0, -max_bias / n_head_log2 as f32);
    let m1 = libm::powf(2.0, -(max_bias / 2.0) / n_head_log2 as f32);
    let h = head as u32;
    if h < n_head_log2 {
        libm::powf(m0, (h + 1) as f32)
    } else {
        libm::powf(m1, (2 * (h - n_head_log2) + 1) as f32)
    }
}

/// Most query rows one [`super::flash_attn_rows_typed`] call takes: the query heads of one KV head for
/// several tokens of a prompt, so each key and value row is read once for all of them.
pub const TYPED_ROWS: usize = 16;

/// The first step of [`super::flash_attn_rows_typed`]: checks the sizes against the scratch
/// (`acc_len`, `vals_len` floats) and converts the query rows into `qconv`; `None` when there is
/// nothing to compute or the rows do not fit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare<'a>(
    ops: &KvOps,
    qs: &[&[f32]],
    qconv: &'a mut [u8],
    keys: &'a [Range<usize>],
    alibi: Option<&'a [Alibi]>,
    scale: f32,
    acc_len: usize,
    vals_len: usize,
    outs: &[&mut [f32]],
) -> Option<Attend<'a>> {
    let n = qs.len().min(outs.len()).min(keys.len()).min(TYPED_ROWS);
    let (Some(&q0), Some(dv)) = (qs.first(), outs.first().map(|o| o.len())) else { return None };
    let qb = ops.query_bytes(q0.len())?;
    if qconv.len() < n * qb || acc_len < n * dv || vals_len < dv || alibi.is_some_and(|b| b.len() < n) {
        return None;
    }
    for (r, q) in qs[..n].iter().enumerate() {
        (ops.q_convert)(q, &mut qconv[r * qb..(r + 1) * qb]);
    }
    Some(Attend { n, qb, dv, qconv: &qconv[..n * qb], scale, keys: &keys[..n], alibi })
}

/// [`attend`] with the types' reference operations (the SIMD kernels' twin).
pub(crate) fn attend_ref<'k>(
    ops: &KvOps,
    a: &Attend<'_>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    acc: &mut [f32],
    vals: &mut [f32],
) -> [RowSoftmax; TYPED_ROWS] {
    let (dot, widen) = (ops.dot, ops.widen);
    attend(
        a,
        key,
        value,
        acc,
        vals,
        |ks, q, out| scores_by(ks, q, out, dot),
        |x| x.iter_mut().for_each(|v| *v = libm::expf(*v)),
        |v, out| {
            widen(v, out);
        },
        update_ref,
    )
}

/// The last step: each row's accumulator divided by its softmax sum.
pub(crate) fn normalise(ends: &[RowSoftmax; TYPED_ROWS], acc: &[f32], dv: usize, outs: &mut [&mut [f32]]) {
    for (r, out) in outs.iter_mut().enumerate() {
        let inv = if ends[r].sum == 0.0 { 0.0 } else { 1.0 / ends[r].sum };
        for (o, &x) in out.iter_mut().zip(&acc[r * dv..(r + 1) * dv]) {
            *o = x * inv;
        }
    }
}

/// The sizes and converted queries of one [`super::flash_attn_rows_typed`] call.
pub struct Attend<'a> {
    /// Query rows.
    pub n: usize,
    /// Bytes of one converted query.
    pub qb: usize,
    /// Elements of a value row.
    pub dv: usize,
    /// The converted queries, `qb` bytes each.
    pub qconv: &'a [u8],
    /// The scores' scale.
    pub scale: f32,
    /// Each row's keys.
    pub keys: &'a [Range<usize>],
    /// Each row's ALiBi bias, if the scores have one.
    pub alibi: Option<&'a [Alibi]>,
}

/// The reference update of one row's accumulator by the keys of a chunk: for key `i` (values
/// `vals[i * dv..]`, `dv = acc.len()`), `acc *= w[i]` then `acc += vals * 1` where the key raised
/// the row's maximum (`raises[i]`), else `acc += vals * w[i]` (fused).
pub fn update_ref(acc: &mut [f32], vals: &[f32], w: &[f32], raises: &[bool]) {
    update_tail_ref(acc, vals, 0, w, raises);
}

/// [`update_ref`] on the columns from `from` on (also the SIMD updates' tail past their vectors).
pub fn update_tail_ref(acc: &mut [f32], vals: &[f32], from: usize, w: &[f32], raises: &[bool]) {
    let dv = acc.len();
    if dv == 0 {
        return;
    }
    for ((v, &w), &raise) in vals.chunks_exact(dv).zip(w).zip(raises) {
        for (a, &x) in acc.iter_mut().zip(v).skip(from) {
            *a = if raise { libm::fmaf(x, 1.0, *a * w) } else { libm::fmaf(x, w, *a) };
        }
    }
}

/// The reference scores: `dot(keys[i], q)` into `out[i]`.
#[inline(always)]
pub fn scores_by(keys: &[&[u8]], q: &[u8], out: &mut [f32], dot: impl Fn(&[u8], &[u8]) -> f32) {
    for (o, k) in out.iter_mut().zip(keys) {
        *o = dot(k, q);
    }
}

/// The loop every path runs, its row operations given (inlined into each path's kernel, so a
/// SIMD path compiles it with its target features): the keys of every row in chunks of up to
/// [`KEY_CHUNK`] (fewer when `vals` cannot hold that many widened value rows); each chunk's values
/// widened once into `vals` (`dv` floats per key) for every row, then per row the chunk's scores
/// (`scores(keys, q, out)`: the unscaled dots of a run of keys with the row's converted query),
/// scaled and given the row's ALiBi bias if it has one, the running maximum key by key, one vector of exponentials (`exp(old - new)` where a key
/// raises the maximum, `exp(s - max)` elsewhere) and the accumulator's update over the chunk
/// (`update`, [`update_ref`]'s operations). Each row gets the operations of a key-by-key loop over
/// its own keys, in order. Returns where each row's softmax ended; `acc` holds the rows' sums of
/// weighted values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn attend<'k>(
    a: &Attend<'_>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    acc: &mut [f32],
    vals: &mut [f32],
    scores: impl Fn(&[&'k [u8]], &[u8], &mut [f32]),
    exps: impl Fn(&mut [f32; KEY_CHUNK]),
    widen: impl Fn(&[u8], &mut [f32]),
    update: impl Fn(&mut [f32], &[f32], &[f32], &[bool]),
) -> [RowSoftmax; TYPED_ROWS] {
    const R: usize = TYPED_ROWS;
    let (n, dv) = (a.n.min(R).min(a.keys.len()), a.dv);
    let rows = &a.keys[..n];
    let mut max = [f32::NEG_INFINITY; R];
    let mut sum = [0f32; R];
    let chunk = KEY_CHUNK.min(vals.len() / dv.max(1));
    if chunk == 0 || acc.len() < n * dv {
        return core::array::from_fn(|_| RowSoftmax::EMPTY);
    }
    acc.fill(0.0);
    let first = rows.iter().filter(|k| !k.is_empty()).map(|k| k.start).min().unwrap_or(0);
    let last = rows.iter().map(|k| k.end).max().unwrap_or(0);
    let empty: &[u8] = &[];
    let mut ks = [empty; KEY_CHUNK];
    let mut start = first;
    while start < last {
        let len = (last - start).min(chunk);
        // Which keys of the chunk each row sees (a run: its keys are a range), and which keys
        // any row sees.
        let mut span = [(0usize, 0usize); R];
        for (sp, k) in span.iter_mut().zip(rows) {
            let lo = k.start.clamp(start, start + len) - start;
            let hi = k.end.clamp(start, start + len) - start;
            *sp = (lo, hi.max(lo));
        }
        let lo_all = span[..n].iter().filter(|s| s.0 < s.1).map(|s| s.0).min();
        let Some(lo_all) = lo_all else {
            start += len;
            continue;
        };
        let hi_all = span[..n].iter().map(|s| s.1).max().unwrap_or(lo_all);
        for i in lo_all..hi_all {
            ks[i] = key(start + i);
            widen(value(start + i), &mut vals[i * dv..(i + 1) * dv]);
        }
        for (r, &(lo, hi)) in span[..n].iter().enumerate() {
            if lo == hi {
                continue;
            }
            // Exponents, and whether each key raises the row's maximum.
            let mut e = [0f32; KEY_CHUNK];
            let mut raises = [false; KEY_CHUNK];
            scores(&ks[lo..hi], &a.qconv[r * a.qb..(r + 1) * a.qb], &mut e[lo..hi]);
            let alibi = a.alibi.and_then(|b| b.get(r)).copied();
            for i in lo..hi {
                let mut s = e[i] * a.scale;
                if let Some(b) = alibi {
                    s += b.bias(start + i);
                }
                if s > max[r] {
                    e[i] = max[r] - s;
                    raises[i] = true;
                    max[r] = s;
                } else {
                    e[i] = s - max[r];
                }
            }
            exps(&mut e);
            for i in lo..hi {
                let (ms, vs) = if raises[i] { (e[i], 1.0) } else { (1.0, e[i]) };
                sum[r] = sum[r] * ms + vs;
            }
            update(&mut acc[r * dv..(r + 1) * dv], &vals[lo * dv..hi * dv], &e[lo..hi], &raises[lo..hi]);
        }
        start += len;
    }
    core::array::from_fn(|r| RowSoftmax { max: max[r], sum: sum[r] })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cache_types_have_operations() {
        assert!(KvOps::reference(GgmlType::Q8_0, GgmlType::Q4_0).is_some());
        assert!(KvOps::reference(GgmlType::Q4_K, GgmlType::F16).is_none());
        assert!(KvOps::reference(GgmlType::F16, GgmlType::Q8_K).is_none());
        let ops = KvOps::reference(GgmlType::Q5_1, GgmlType::F32).unwrap();
        assert_eq!(ops.query_bytes(64), Some(72));
        assert_eq!(ops.query_bytes(48), None);
        let ops = KvOps::reference(GgmlType::Q8_0, GgmlType::F16).unwrap();
        assert_eq!(ops.query_bytes(64), Some(2 * Q15_BYTES));
        assert_eq!(ops.query_bytes(80), None);
    }

    /// The 15-bit query: `128 * hi + lo` is `round(x / d)`, within half a step of `x / d`, the
    /// high byte in -127..=127 and the low one in 0..=127, at the extremes and in a zero block.
    #[test]
    fn q15_query_blocks() {
        let mut x = [0f32; 2 * Q15_LEN];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 * 0.37).sin() * 3.0;
        }
        x[5] = -3.5; // the block's extreme, negative: q = -Q15_MAX
        x[Q15_LEN..].fill(0.0);
        x[Q15_LEN + 3] = 1e30; // a huge value: q = Q15_MAX, the rest round to 0
        x[Q15_LEN + 4] = -1e-30;
        let mut out = [0u8; 2 * Q15_BYTES];
        assert!(quantize_q15(&x, &mut out));
        assert!(!quantize_q15(&x[..31], &mut out[..Q15_BYTES]));
        assert!(!quantize_q15(&x, &mut out[..Q15_BYTES]));
        for (xb, b) in x.chunks_exact(Q15_LEN).zip(out.chunks_exact(Q15_BYTES)) {
            let d = q15_scale(b);
            for (i, &v) in xb.iter().enumerate() {
                let (hi, lo) = (i32::from(b[4 + i] as i8), i32::from(b[4 + Q15_LEN + i]));
                assert!((-127..=127).contains(&hi) && (0..=127).contains(&lo), "{hi} {lo}");
                let q = 128 * hi + lo;
                assert!((f64::from(q) - f64::from(v) / f64::from(d)).abs() <= 0.5 + 1e-3, "{v}: {q} * {d}");
            }
        }
        let q = |b: &[u8], i: usize| 128 * i32::from(b[4 + i] as i8) + i32::from(b[4 + Q15_LEN + i]);
        assert_eq!(q(&out, 5), -Q15_MAX);
        assert_eq!(q(&out[Q15_BYTES..], 3), Q15_MAX);
        assert_eq!(q(&out[Q15_BYTES..], 4), 0);
        let zeros = [0f32; Q15_LEN];
        assert!(quantize_q15(&zeros, &mut out[..Q15_BYTES]));
        assert!(out[..Q15_BYTES].iter().all(|&b| b == 0));
    }

    /// A q8_0 key dotted with a 15-bit query is the dot of the two rows' decoded values (exact
    /// integers times the scales), and far closer to the f32 dot than a q8_0 query's.
    #[test]
    fn q8_0_keys_dot_a_q15_query() {
        use crate::quant::GgmlType as T;
        extern crate std;
        use std::{vec, vec::Vec};
        let n = 256;
        let k: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.91).cos() * (1.0 + (i % 5) as f32)).collect();
        let q8_0 = |v: &[f32]| {
            let mut b = vec![0u8; n / 32 * 34];
            crate::quant::quantize::quantize_row_ref(T::Q8_0, v, &mut b).unwrap();
            b
        };
        let kb = q8_0(&k);
        let mut kd = vec![0f32; n];
        crate::quant::dequantize_row_ref(T::Q8_0, &kb, &mut kd).unwrap();
        let mut q = vec![0u8; n / Q15_LEN * Q15_BYTES];
        assert!(quantize_q15(&x, &mut q));
        let exact: f64 = kd.iter().zip(&x).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
        let got = f64::from(dot_q8_0_q15_ref(&kb, &q));
        let q8 = q8_0(&x);
        let old = f64::from((T::Q8_0.traits().vec_dot.unwrap().1)(&kb, &q8));
        let scale: f64 = kd.iter().zip(&x).map(|(a, b)| f64::from(a.abs()) * f64::from(b.abs())).sum();
        assert!((got - exact).abs() <= 1e-4 * scale, "{got} vs {exact}");
        assert!((got - exact).abs() * 20.0 < (old - exact).abs(), "{got} {old} vs {exact}");
        assert_eq!(dot_q8_0_q15_ref(&kb, &q[..Q15_BYTES]), 0.0);
    }
}
