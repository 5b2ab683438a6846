//! The placement plan: where each tensor of a model lives at run time, decided at load, and why.
//!
//! Three kinds of buffer hold weights:
//!
//! - **repacked**: the one CPU buffer of row-interleaved matrices the SIMD kernels read (which
//!   layout: [`PackedFormat::name`]);
//! - **mapped**: the file's bytes, read in place through the memory map (plain CPU);
//! - **NPU**: fp16/int8 copies in the NPU's native layout. This plan does not place anything
//!   there yet: with the `npu` feature, `crate::npu::plan` decides which matmul weights also get
//!   an NPU copy (`pinfer npu-plan`), and those keep the CPU placement given here (decode and
//!   fallback run on it).
//!
//! Norms, biases and MoE routers are never repacked or offloaded, whatever their type: they are
//! small, read whole by element-wise ops, and precision matters more there than anywhere.
//! [`crate::session::Session`] repacks exactly the tensors [`place`] says, so `pinfer info
//! --placement` and a running session cannot disagree.

use core::fmt;

use crate::gguf::TensorInfo;
use crate::graph::{Graph, Op};
use crate::kernels::packed::{can_pack, packed_bytes, PackedFormat, GROUP_ROWS};
use crate::quant::GgmlType;
use crate::tensor::Storage;

/// Types the NPU matmul accepts (for plans; no tensor is placed there yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NpuType {
    /// Half-precision weights.
    Fp16,
    /// int8 weights.
    Int8,
}

/// The buffer a tensor lives in at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// Repacked into the CPU weight buffer in this layout.
    Repacked(PackedFormat),
    /// Read in place from the mapped file (plain CPU).
    Mapped,
    /// Converted for the NPU (never chosen yet: offload is not implemented).
    Npu(NpuType),
}

impl fmt::Display for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Repacked(format) => write!(f, "repacked {}", format.name()),
            Self::Mapped => write!(f, "mapped"),
            Self::Npu(NpuType::Fp16) => write!(f, "npu fp16"),
            Self::Npu(NpuType::Int8) => write!(f, "npu int8"),
        }
    }
}

/// Why a tensor is where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A matmul weight with a packed layout.
    Repacked,
    /// The embedding doubles as the output matrix: repacked for the output matmul, while
    /// `get_rows` still reads token rows from the file (those pages fault in on demand): the
    /// repacked layout of its type does not hold the file's values exactly.
    TiedEmbedding,
    /// The embedding doubles as the output matrix, repacked once: the output matmul and
    /// `get_rows` both read the repacked copy (it holds the file's values exactly).
    SharedEmbedding,
    /// A norm weight (never repacked or offloaded).
    Norm,
    /// A bias (never repacked or offloaded).
    Bias,
    /// An MoE router (never repacked or offloaded).
    Router,
    /// An embedding table: `get_rows` reads a few rows per token from the file.
    Embedding,
    /// Expert matrices (3-D), repacked with one slab per expert that `mul_mat_id` reads in place.
    Experts,
    /// The weight type has no packed layout.
    NoLayout(GgmlType),
    /// The shape does not divide into packed groups and blocks.
    Shape {
        /// Rows.
        rows: usize,
        /// Elements per row.
        k: usize,
    },
    /// Repacking is off (`--no-repack`, `PINFER_NO_REPACK`).
    RepackOff,
    /// Read whole by an element-wise op (RoPE factors and the like).
    ReadInPlace,
    /// The forward graph does not read it.
    Unused,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Repacked => write!(f, "mul_mat weight, rows interleaved for the SIMD kernels"),
            Self::TiedEmbedding => {
                write!(
                    f,
                    "tied embedding: repacked for the output mul_mat; get_rows reads rows from the file"
                )
            }
            Self::SharedEmbedding => {
                write!(f, "tied embedding: repacked once; the output mul_mat and get_rows read that one copy")
            }
            Self::Norm => write!(f, "norm weight: stays in the file's type (never repacked or offloaded)"),
            Self::Bias => write!(f, "bias: stays in the file's type (never repacked or offloaded)"),
            Self::Router => write!(f, "MoE router: stays in the file's type (never repacked or offloaded)"),
            Self::Embedding => write!(f, "embedding table: get_rows reads a few rows per token"),
            Self::Experts => write!(f, "expert matrices, one slab per expert, read in place by mul_mat_id"),
            Self::NoLayout(ty) => write!(f, "mul_mat weight: {ty} has no packed layout"),
            Self::Shape { rows, k } => {
                write!(f, "mul_mat weight: {rows} x {k} does not pack (k % 32 needed; experts' rows % 4)")
            }
            Self::RepackOff => write!(f, "mul_mat weight: repacking is off"),
            Self::ReadInPlace => write!(f, "read whole by an element-wise op"),
            Self::Unused => write!(f, "not read by the forward graph"),
        }
    }
}

/// A tensor's placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Where it lives.
    pub buffer: Buffer,
    /// Why.
    pub reason: Reason,
    /// Bytes it takes in that buffer (the repacked planes, or the file bytes).
    pub bytes: usize,
}

/// How the forward graph reads a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Use {
    /// As the weights of a `mul_mat`.
    pub mul_mat: bool,
    /// As the experts of a `mul_mat_id`.
    pub mul_mat_id: bool,
    /// As the table of a `get_rows`.
    pub get_rows: bool,
    /// As an operand of any other op.
    pub other: bool,
}

impl Use {
    /// Whether the graph reads the tensor at all.
    pub fn any(self) -> bool {
        self.mul_mat || self.mul_mat_id || self.get_rows || self.other
    }
}

/// What a tensor is by its name: norm, bias, router or anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `*norm*` weights.
    Norm,
    /// `*.bias`.
    Bias,
    /// `ffn_gate_inp*`: MoE routers and shared-expert gates.
    Router,
    /// Everything else.
    Weight,
}

/// The role of tensor `name`.
pub fn role(name: &str) -> Role {
    if name.ends_with(".bias") {
        Role::Bias
    } else if name.contains("ffn_gate_inp") {
        Role::Router
    } else if name.contains("norm") {
        Role::Norm
    } else {
        Role::Weight
    }
}

/// How graph `g` reads the model-buffer tensor whose data starts at byte `offset` of buffer 0.
pub fn use_in<const N: usize>(g: &Graph<N>, offset: usize) -> Use {
    let mut u = Use::default();
    for &id in g.order() {
        let t = g.tensor(id);
        for (i, src) in t.src.iter().enumerate() {
            let Some(src) = *src else { continue };
            if g.tensor(src).storage != (Storage::External { buffer: 0, offset }) {
                continue;
            }
            match (t.op, i) {
                (Op::MulMat, 0) => u.mul_mat = true,
                (Op::MulMatId, 0) => u.mul_mat_id = true,
                (Op::GetRows, 0) => u.get_rows = true,
                _ => u.other = true,
            }
        }
    }
    u
}

/// How a model of an architecture pinfer cannot build a graph for yet (MoE) would read tensor
/// `t`, judged from its name and shape.
pub fn use_by_name(t: &TensorInfo<'_>, tied_output: bool) -> Use {
    let name = t.name;
    let mut u = Use::default();
    if role(name) != Role::Weight || t.n_dims < 2 {
        u.other = true;
    } else if name == "token_embd.weight" {
        u.get_rows = true;
        u.mul_mat = tied_output;
    } else if t.ne[2] > 1 {
        u.mul_mat_id = true;
    } else {
        u.mul_mat = true;
    }
    u
}

/// The placement of tensor `t`, read by the forward graph as `u`, with repacking on or off.
pub fn place(t: &TensorInfo<'_>, u: Use, repack: bool) -> Placement {
    let mapped = |reason| Placement { buffer: Buffer::Mapped, reason, bytes: t.nbytes as usize };
    match role(t.name) {
        Role::Norm => return mapped(Reason::Norm),
        Role::Bias => return mapped(Reason::Bias),
        Role::Router => return mapped(Reason::Router),
        Role::Weight => {}
    }
    if !u.any() {
        return mapped(Reason::Unused);
    }
    if !u.mul_mat && !u.mul_mat_id {
        return mapped(if u.get_rows { Reason::Embedding } else { Reason::ReadInPlace });
    }
    let (k, rows) = (t.ne[0] as usize, t.ne[1] as usize);
    if !repack {
        return mapped(Reason::RepackOff);
    }
    // Experts `[k, m, n_expert]` pack as one matrix of m * n_expert rows: each expert's row
    // groups are then one contiguous slab in each plane, which `mul_mat_id` addresses in place.
    let experts = t.ne[2] as usize * t.ne[3] as usize;
    if experts != 1 && !u.mul_mat_id {
        return mapped(Reason::ReadInPlace);
    }
    let Some(format) = PackedFormat::for_type(t.ty) else { return mapped(Reason::NoLayout(t.ty)) };
    // (An expert's rows must fill whole groups: each expert is a slab of groups.)
    if !can_pack(t.ty, rows, k) || (experts != 1 && rows % GROUP_ROWS != 0) {
        return mapped(Reason::Shape { rows, k });
    }
    let (qn, sn) = packed_bytes(format, rows * experts, k);
    let reason = match (u.get_rows, u.mul_mat_id) {
        (true, _) if t.ty.traits().rows_from_packed => Reason::SharedEmbedding,
        (true, _) => Reason::TiedEmbedding,
        (false, true) => Reason::Experts,
        (false, false) => Reason::Repacked,
    };
    Placement { buffer: Buffer::Repacked(format), reason, bytes: qn + sn }
}

/// Tensors and bytes per buffer kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    /// Repacked tensors and bytes, per layout (in [`FORMATS`] order).
    pub repacked: [(usize, usize); FORMATS.len()],
    /// Tensors read in place from the file, and their bytes.
    pub mapped: (usize, usize),
    /// Tensors repacked whose rows are also read from the file (tied embeddings), and bytes.
    pub mapped_rows: (usize, usize),
    /// NPU tensors and bytes (none until offload exists).
    pub npu: (usize, usize),
    /// Of the above, MoE expert matrices (`*_exps`): tensors and bytes where they live.
    pub experts: (usize, usize),
    /// Of the above, shared-expert matrices (`*_shexp`, qwen2moe).
    pub shared_experts: (usize, usize),
    /// Of the above, MoE routers and shared-expert gates (`ffn_gate_inp*`).
    pub routers: (usize, usize),
}

/// The packed layouts, in the order [`Summary::repacked`] counts them.
pub const FORMATS: [PackedFormat; PackedFormat::ALL.len()] = PackedFormat::ALL;

impl Summary {
    /// Counts tensor `name` of `file_bytes` placed as `p`.
    pub fn add(&mut self, name: &str, p: &Placement, file_bytes: usize) {
        let moe_part = if role(name) == Role::Router {
            Some(&mut self.routers)
        } else if name.contains("_exps") {
            Some(&mut self.experts)
        } else if name.contains("_shexp") {
            Some(&mut self.shared_experts)
        } else {
            None
        };
        if let Some((n, bytes)) = moe_part {
            *n += 1;
            *bytes += p.bytes;
        }
        match p.buffer {
            Buffer::Repacked(format) => {
                let i = format.index();
                self.repacked[i].0 += 1;
                self.repacked[i].1 += p.bytes;
                if p.reason == Reason::TiedEmbedding {
                    self.mapped_rows.0 += 1;
                    self.mapped_rows.1 += file_bytes;
                }
            }
            Buffer::Mapped => {
                self.mapped.0 += 1;
                self.mapped.1 += p.bytes;
            }
            Buffer::Npu(_) => {
                self.npu.0 += 1;
                self.npu.1 += p.bytes;
            }
        }
    }

    /// Repacked tensors and bytes over all layouts.
    pub fn repacked_total(&self) -> (usize, usize) {
        self.repacked.iter().fold((0, 0), |(n, b), &(n2, b2)| (n + n2, b + b2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, ty: GgmlType, ne: [u64; 4]) -> TensorInfo<'_> {
        let n: u64 = ne.iter().product();
        let nbytes = ty.bytes_for(n).unwrap();
        TensorInfo { name, ty, n_dims: if ne[2] > 1 { 3 } else { 2 }, ne, offset: 0, nbytes }
    }

    #[test]
    fn norms_biases_and_routers_are_never_repacked() {
        let mm = Use { mul_mat: true, ..Use::default() };
        for name in
            ["blk.0.attn_norm.weight", "blk.0.attn_q.bias", "blk.0.ffn_gate_inp.weight", "output_norm.weight"]
        {
            // Even typed and shaped like a packable matrix and read by a mul_mat.
            let p = place(&info(name, GgmlType::Q8_0, [64, 8, 1, 1]), mm, true);
            assert_eq!(p.buffer, Buffer::Mapped, "{name}");
            assert!(matches!(p.reason, Reason::Norm | Reason::Bias | Reason::Router), "{name}");
        }
    }

    #[test]
    fn matmul_weights_are_repacked_when_they_can_be() {
        let mm = Use { mul_mat: true, ..Use::default() };
        let q = info("blk.0.attn_q.weight", GgmlType::Q4_0, [64, 8, 1, 1]);
        let p = place(&q, mm, true);
        assert_eq!((p.buffer, p.reason), (Buffer::Repacked(PackedFormat::Q4), Reason::Repacked));
        assert_eq!(p.bytes, 8 * 64 / 2 + 8 * 2 * 2);
        assert_eq!(place(&q, mm, false).reason, Reason::RepackOff);
        // Rows that do not fill the last group of 4 pack (its last row repeated); blocks must fill k.
        let odd = info("blk.0.attn_q.weight", GgmlType::Q4_0, [64, 6, 1, 1]);
        let p = place(&odd, mm, true);
        assert_eq!((p.reason, p.bytes), (Reason::Repacked, 8 * 64 / 2 + 8 * 2 * 2));
        let short_k = info("blk.0.attn_q.weight", GgmlType::Q4_0, [48, 8, 1, 1]);
        assert_eq!(place(&short_k, mm, true).reason, Reason::Shape { rows: 8, k: 48 });
        // Experts are slabs of whole groups.
        let moe = Use { mul_mat_id: true, ..Use::default() };
        let exps = info("blk.0.ffn_up_exps.weight", GgmlType::Q4_0, [64, 6, 4, 1]);
        assert_eq!(place(&exps, moe, true).reason, Reason::Shape { rows: 6, k: 64 });
        let f16 = info("blk.0.attn_q.weight", GgmlType::F16, [64, 8, 1, 1]);
        assert_eq!(place(&f16, mm, true).reason, Reason::NoLayout(GgmlType::F16));
        let tied = Use { mul_mat: true, get_rows: true, ..Use::default() };
        let embd = info("token_embd.weight", GgmlType::Q8_0, [64, 8, 1, 1]);
        // Every repacked layout holds the file's values: one copy serves both uses.
        assert_eq!(place(&embd, tied, true).reason, Reason::SharedEmbedding);
        let k6_embd = info("token_embd.weight", GgmlType::Q6_K, [256, 8, 1, 1]);
        assert_eq!(place(&k6_embd, tied, true).reason, Reason::SharedEmbedding);
        let k4_embd = info("token_embd.weight", GgmlType::Q4_K, [256, 8, 1, 1]);
        assert_eq!(place(&k4_embd, tied, true).reason, Reason::SharedEmbedding);
        let k5_embd = info("token_embd.weight", GgmlType::Q5_K, [256, 8, 1, 1]);
        assert_eq!(place(&k5_embd, tied, true).reason, Reason::SharedEmbedding);
        let rows = Use { get_rows: true, ..Use::default() };
        assert_eq!(place(&embd, rows, true).reason, Reason::Embedding);
        assert_eq!(place(&embd, Use::default(), true).reason, Reason::Unused);
        let exps = info("blk.0.ffn_up_exps.weight", GgmlType::Q4_0, [64, 8, 4, 1]);
        assert_eq!(place(&exps, use_by_name(&exps, false), true).reason, Reason::Experts);

        let mut s = Summary::default();
        s.add(q.name, &place(&q, mm, true), q.nbytes as usize);
        s.add(embd.name, &place(&embd, tied, true), embd.nbytes as usize);
        s.add(f16.name, &place(&f16, mm, true), f16.nbytes as usize);
        s.add(k5_embd.name, &place(&k5_embd, tied, true), k5_embd.nbytes as usize);
        assert_eq!(s.repacked_total().0, 3);
        assert_eq!(s.mapped, (1, f16.nbytes as usize));
        // Only an embedding whose rows are still read from the file would count there.
        assert_eq!(s.mapped_rows, (0, 0));
        assert_eq!(s.npu, (0, 0));
    }
}
