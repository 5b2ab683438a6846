//! Test harness for the graph engine: random data, weights in any type, and a runner that plans,
//! binds and executes a graph with a chosen planner and thread count.
#![allow(dead_code)]

use pinfer::arena::Arena;
use pinfer::exec::pool::Pool;
use pinfer::exec::{work_bytes, Address, Bound, PackedEntry, Step};
use pinfer::graph::{plan, plan_unshared, Graph};
use pinfer::quant::blocks::{BlockQ4_0, BlockQ4_1, BlockQ8_0};
use pinfer::quant::quantize::{quantize_row_q4_0_ref, quantize_row_q4_1_ref, quantize_row_q8_0_ref};
use pinfer::quant::{dequantize_row_ref, GgmlType};
use pinfer::tensor::{Storage, TensorId};

/// Graph capacity used by the tests.
pub const CAP: usize = 512;

/// splitmix64: small, seedable, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Bytes of `data` (rows of `row_len`) stored as `ty`. Quantized types use the reference
/// quantizers; K-quants (no quantizer needed here) get random valid blocks instead.
pub fn encode(ty: GgmlType, data: &[f32], row_len: usize, rng: &mut Rng) -> Vec<u8> {
    match ty {
        GgmlType::F32 => bytemuck::cast_slice(data).to_vec(),
        GgmlType::F16 => data.iter().flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes()).collect(),
        GgmlType::Q4_0 => quantized::<BlockQ4_0>(data, row_len, quantize_row_q4_0_ref),
        GgmlType::Q4_1 => quantized::<BlockQ4_1>(data, row_len, quantize_row_q4_1_ref),
        GgmlType::Q8_0 => quantized::<BlockQ8_0>(data, row_len, quantize_row_q8_0_ref),
        _ => random_blocks(ty, data.len() / ty.block_len(), rng),
    }
}

fn quantized<B: bytemuck::Pod + bytemuck::Zeroable>(
    data: &[f32],
    row_len: usize,
    q: fn(&[f32], &mut [B]),
) -> Vec<u8> {
    let mut out = Vec::new();
    for row in data.chunks(row_len) {
        let mut blocks = vec![B::zeroed(); row_len / 32];
        q(row, &mut blocks);
        out.extend_from_slice(bytemuck::cast_slice(&blocks));
    }
    out
}

/// Random blocks of a quantized type with small finite f16 scales at every f16 position a
/// K-quant uses (`d`/`dmin` at the start, or the end for Q6_K), random quants elsewhere.
pub fn random_blocks(ty: GgmlType, n_blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let size = ty.block_bytes();
    let mut out = Vec::with_capacity(n_blocks * size);
    for _ in 0..n_blocks {
        let mut block: Vec<u8> = (0..size).map(|_| rng.next_u64() as u8).collect();
        let scale = |r: &mut Rng| half::f16::from_f32(0.01 + 0.02 * r.f32().abs()).to_bits().to_le_bytes();
        match ty {
            GgmlType::Q6_K => block[size - 2..].copy_from_slice(&scale(rng)),
            GgmlType::Q2_K => {
                block[size - 4..size - 2].copy_from_slice(&scale(rng));
                block[size - 2..].copy_from_slice(&scale(rng));
            }
            GgmlType::Q3_K => block[size - 2..].copy_from_slice(&scale(rng)),
            _ => {
                block[..2].copy_from_slice(&scale(rng));
                block[2..4].copy_from_slice(&scale(rng));
            }
        }
        out.extend_from_slice(&block);
    }
    out
}

/// Dequantizes rows of `row_len` elements of type `ty`.
pub fn decode(ty: GgmlType, bytes: &[u8], row_len: usize) -> Vec<f32> {
    let row_bytes = ty.bytes_for(row_len as u64).unwrap() as usize;
    let mut out = vec![0.0; bytes.len() / row_bytes * row_len];
    for (src, dst) in bytes.chunks(row_bytes).zip(out.chunks_mut(row_len)) {
        dequantize_row_ref(ty, src, dst).unwrap();
    }
    out
}

/// The external buffer tests put their leaves in (8-byte aligned storage, 64-byte aligned leaves).
#[derive(Default)]
pub struct Inputs {
    words: Vec<u64>,
}

impl Inputs {
    /// Appends `bytes`; returns their offset.
    pub fn add(&mut self, bytes: &[u8]) -> usize {
        let offset = self.words.len() * 8;
        let mut padded = bytes.to_vec();
        padded.resize(bytes.len().div_ceil(64) * 64, 0);
        self.words.extend(padded.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())));
        offset
    }

    pub fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.words)
    }
}

/// A graph plus its input buffer.
pub struct Setup {
    pub g: Box<Graph<CAP>>,
    pub inputs: Inputs,
    /// Bytes of persistent arena memory (KV caches) the graph's leaves use.
    pub persistent: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Self { g: Box::new(Graph::new()), inputs: Inputs::default(), persistent: 0 }
    }
}

impl Setup {
    /// A leaf holding `data` stored as `ty`, shape `ne`.
    pub fn leaf(
        &mut self,
        name: &str,
        ty: GgmlType,
        ne: [usize; 4],
        data: &[f32],
        rng: &mut Rng,
    ) -> TensorId {
        let bytes = encode(ty, data, ne[0], rng);
        self.leaf_bytes(name, ty, ne, &bytes)
    }

    pub fn leaf_bytes(&mut self, name: &str, ty: GgmlType, ne: [usize; 4], bytes: &[u8]) -> TensorId {
        let offset = self.inputs.add(bytes);
        self.g.leaf(name, ty, ne, Storage::External { buffer: 0, offset }).unwrap()
    }

    /// I32 ids.
    pub fn ids(&mut self, name: &str, ne: [usize; 4], ids: &[i32]) -> TensorId {
        self.leaf_bytes(name, GgmlType::I32, ne, bytemuck::cast_slice(ids))
    }

    /// A zeroed persistent tensor (a KV cache) in the arena.
    pub fn persistent(&mut self, name: &str, ty: GgmlType, ne: [usize; 4]) -> TensorId {
        let offset = self.persistent.div_ceil(64) * 64;
        let id = self.g.leaf(name, ty, ne, Storage::Persistent { offset }).unwrap();
        self.persistent = offset + self.g.tensor(id).span_bytes();
        id
    }
}

/// How to run a graph.
#[derive(Clone, Copy, Default)]
pub struct RunOpts {
    pub threads: usize,
    /// Packed (greedy) plan, or every activation in its own space.
    pub packed: bool,
    /// Pin every pool thread to this one core.
    pub pin_to: Option<usize>,
    /// Repack the weights of every matmul and expert matmul that has a packed layout (as a
    /// session does at load), so the packed kernels run.
    pub repack: bool,
}

/// Repacks the input-buffer weights of `g`'s matmuls (`[k, m]`) and expert matmuls (`[k, m,
/// n_expert]`, one matrix of m * n_expert rows) that have a packed layout: the buffer and the
/// entries (sorted by source offset) for `Bound::with_packed`.
pub fn repack_inputs(g: &Graph<CAP>, inputs: &[u8]) -> (Vec<u8>, Vec<PackedEntry>) {
    use pinfer::graph::Op;
    use pinfer::kernels::packed::{can_pack, pack, packed_bytes, PackedFormat};
    let (mut buffer, mut entries) = (Vec::new(), Vec::<PackedEntry>::new());
    for &id in g.order() {
        let t = g.tensor(id);
        let Some(w) = t.src[0].filter(|_| matches!(t.op, Op::MulMat | Op::MulMatId)) else { continue };
        let tw = g.tensor(w);
        let Storage::External { buffer: 0, offset } = tw.storage else { continue };
        let Some(format) = PackedFormat::for_type(tw.ty) else { continue };
        let (k, m, n) = (tw.ne[0], tw.ne[1], tw.ne[2] * tw.ne[3]);
        // (As the placement: experts' rows fill whole groups.)
        if !can_pack(tw.ty, m, k)
            || (n > 1 && m % 4 != 0)
            || entries.iter().any(|e| e.source_offset == offset)
        {
            continue;
        }
        let rows = m * n;
        let (qn, sn) = packed_bytes(format, rows, k);
        let quants_at = buffer.len().next_multiple_of(64);
        let scales_at = (quants_at + qn).next_multiple_of(64);
        buffer.resize(scales_at + sn, 0);
        let src = &inputs[offset..offset + tw.ty.bytes_for((k * rows) as u64).unwrap() as usize];
        let (quants, scales) = buffer[quants_at..].split_at_mut(scales_at - quants_at);
        pack(tw.ty, src, rows, k, &mut quants[..qn], &mut scales[..sn]).unwrap();
        entries.push(PackedEntry { source_offset: offset, format, rows, k, quants_at, scales_at });
    }
    entries.sort_by_key(|e| e.source_offset);
    (buffer, entries)
}

/// Builds, plans, binds and runs `setup`'s graph for each step in turn (the arena, and so the KV
/// cache, persists across steps); returns the F32 contents of `outputs` after the last step, and
/// the planned peak activation bytes.
pub fn run(setup: &mut Setup, outputs: &[TensorId], steps: &[Step], opts: RunOpts) -> (Vec<Vec<f32>>, usize) {
    setup.g.build(outputs).unwrap();
    let p = if opts.packed { plan(&setup.g).unwrap() } else { plan_unshared(&setup.g).unwrap() };
    let work = work_bytes(&setup.g);
    let mut memory = vec![0u64; Arena::bytes_for(setup.persistent + p.peak_bytes + work + 256).div_ceil(8)];
    let mut arena = Arena::new(bytemuck::cast_slice_mut(&mut memory));
    let persistent = arena.alloc(setup.persistent, "persistent").unwrap();
    assert_eq!(persistent.offset, 0, "persistent offsets are relative to the arena start");
    let act = arena.alloc(p.peak_bytes, "activations").unwrap();
    let work = arena.alloc(work, "work").unwrap();
    let mut inputs = setup.inputs.bytes().to_vec();
    let (packed_buffer, entries) =
        if opts.repack { repack_inputs(&setup.g, &inputs) } else { Default::default() };
    // The repacked weights' original bytes become NaN-scaled garbage: a kernel that still read
    // them would show in the results.
    for e in &entries {
        let len = (e.rows * e.k).div_ceil(32) * 18;
        let end = (e.source_offset + len).min(inputs.len());
        inputs[e.source_offset..end].fill(0xFF);
    }
    let mut addresses = vec![Address::NOWHERE; setup.g.tensors().len()];
    let mut bound = Bound::new(&setup.g, &p, &[&inputs], arena.memory(), act, work, &mut addresses)
        .unwrap()
        .with_packed(&packed_buffer, &entries);
    let cores = opts.pin_to.map(|c| [c]);
    let pool = (opts.threads > 1)
        .then(|| Pool::new(opts.threads, cores.as_ref().map(|c| &c[..]), cores.is_some()).unwrap());
    for &step in steps {
        match &pool {
            Some(pool) => pool.run(&mut bound, step).unwrap(),
            None => bound.run(step).unwrap(),
        }
    }
    let out = outputs.iter().map(|&id| bound.data_f32(id).to_vec()).collect();
    (out, p.peak_bytes)
}

/// Asserts `got` equals `want` within `tol` relative to the largest magnitude in `want`.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g} is not finite");
        assert!((g - w).abs() <= tol * scale, "{what}[{i}]: got {g}, want {w} (tolerance {tol} x {scale})");
    }
}

/// Sizes of the test transformer block.
pub const E: usize = 256;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 64;
pub const FF: usize = 512;
pub const VOCAB: usize = 50;
pub const CTX: usize = 16;

/// One llama-style transformer block plus embedding and output head, with weights in several
/// types (Q8_0, Q4_0, F16, Q4_1, Q4_K, Q6_K, Q5_K), RoPE, a grouped-query attention over an F16 KV
/// cache (V stored transposed), SwiGLU. Returns the logits tensor `[VOCAB, tokens]`.
pub fn transformer_block(s: &mut Setup, rng: &mut Rng, tokens: &[i32]) -> TensorId {
    transformer_block_typed(s, rng, tokens, false)
}

/// [`transformer_block`], with every weight in F32 when `all_f32` (no input conversion at all).
pub fn transformer_block_typed(s: &mut Setup, rng: &mut Rng, tokens: &[i32], all_f32: bool) -> TensorId {
    use pinfer::graph::RopeMode;
    let t = tokens.len();
    let kv_w = KV_HEADS * HEAD_DIM;
    let g_w = |s: &mut Setup, rng: &mut Rng, name: &str, ty, k: usize, m: usize| {
        let ty = if all_f32 { GgmlType::F32 } else { ty };
        let data = rng.vec(k * m).iter().map(|v| v * 0.2).collect::<Vec<_>>();
        s.leaf(name, ty, [k, m, 1, 1], &data, rng)
    };
    let embd = g_w(s, rng, "token_embd", GgmlType::Q8_0, E, VOCAB);
    let attn_norm = s.leaf("attn_norm", GgmlType::F32, [E, 1, 1, 1], &rng.vec(E), rng);
    let ffn_norm = s.leaf("ffn_norm", GgmlType::F32, [E, 1, 1, 1], &rng.vec(E), rng);
    let wq = g_w(s, rng, "wq", GgmlType::Q4_0, E, HEADS * HEAD_DIM);
    let wk = g_w(s, rng, "wk", GgmlType::Q8_0, E, kv_w);
    let wv = g_w(s, rng, "wv", GgmlType::F16, E, kv_w);
    let wo = g_w(s, rng, "wo", GgmlType::Q4_1, HEADS * HEAD_DIM, E);
    let wg = g_w(s, rng, "wg", GgmlType::Q4_K, E, FF);
    let wu = g_w(s, rng, "wu", GgmlType::Q6_K, E, FF);
    let wd = g_w(s, rng, "wd", GgmlType::Q5_K, FF, E);
    let k_cache = s.persistent("k_cache", GgmlType::F16, [kv_w, CTX, 1, 1]);
    let v_cache = s.persistent("v_cache", GgmlType::F16, [CTX, kv_w, 1, 1]);
    let ids = s.ids("tokens", [t, 1, 1, 1], tokens);

    let g = &mut s.g;
    let x = g.get_rows(embd, ids).unwrap();
    let h = g.rms_norm(x, 1e-5).unwrap();
    let h = g.mul(h, attn_norm).unwrap();
    let q = g.mul_mat(wq, h).unwrap();
    let q = g.reshape(q, [HEAD_DIM, HEADS, t, 1]).unwrap();
    let q = g.rope(q, HEAD_DIM, RopeMode::Neox, 10000.0, 1.0, None).unwrap();
    let k = g.mul_mat(wk, h).unwrap();
    let k = g.reshape(k, [HEAD_DIM, KV_HEADS, t, 1]).unwrap();
    let k = g.rope(k, HEAD_DIM, RopeMode::Neox, 10000.0, 1.0, None).unwrap();
    let k = g.reshape(k, [kv_w, t, 1, 1]).unwrap();
    let k_written = g.kv_write(k_cache, k, false).unwrap();
    let v = g.mul_mat(wv, h).unwrap();
    let v_written = g.kv_write(v_cache, v, true).unwrap();
    // K as [head_dim, n_kv, kv_heads]; V transposed as [n_kv, head_dim, kv_heads].
    let k_view = g
        .view(k_written, [HEAD_DIM, CTX, KV_HEADS, 1], [2, kv_w * 2, HEAD_DIM * 2, kv_w * 2 * CTX], 0, 0b10)
        .unwrap();
    let v_view = g
        .view(
            v_written,
            [CTX, HEAD_DIM, KV_HEADS, 1],
            [2, CTX * 2, HEAD_DIM * CTX * 2, kv_w * CTX * 2],
            0,
            0b01,
        )
        .unwrap();
    let q = g.permute(q, [0, 2, 1, 3]).unwrap();
    let kq = g.mul_mat(k_view, q).unwrap();
    let kq = g.soft_max(kq, 1.0 / (HEAD_DIM as f32).sqrt(), true, 0).unwrap();
    let kqv = g.mul_mat(v_view, kq).unwrap();
    let kqv = g.permute(kqv, [0, 2, 1, 3]).unwrap();
    let attn = g.cpy(kqv, GgmlType::F32).unwrap();
    let attn = g.reshape(attn, [HEADS * HEAD_DIM, t, 1, 1]).unwrap();
    let o = g.mul_mat(wo, attn).unwrap();
    let x2 = g.add(x, o).unwrap();
    let h2 = g.rms_norm(x2, 1e-5).unwrap();
    let h2 = g.mul(h2, ffn_norm).unwrap();
    let gate = g.mul_mat(wg, h2).unwrap();
    let up = g.mul_mat(wu, h2).unwrap();
    let ff = g.swiglu(gate, up).unwrap();
    let down = g.mul_mat(wd, ff).unwrap();
    let out = g.add(x2, down).unwrap();
    let out = g.rms_norm(out, 1e-5).unwrap();
    g.mul_mat(embd, out).unwrap()
}

/// The F32 values of leaf `name` (decoded from the input buffer), row-major `[rows][ne0]`.
pub fn leaf_values(s: &Setup, name: &str) -> Vec<f32> {
    let t =
        s.g.tensors().iter().find(|t| t.name.as_str() == name).unwrap_or_else(|| panic!("no leaf {name}"));
    let Storage::External { offset, .. } = t.storage else { panic!("{name} is not an input leaf") };
    decode(t.ty, &s.inputs.bytes()[offset..offset + t.span_bytes()], t.ne[0])
}
