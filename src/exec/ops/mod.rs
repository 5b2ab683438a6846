//! One file per family of ops, each an `impl` block of [`Bound`](super::Bound); here the dispatch
//! of a node to its op, how many phases it runs in, and the work region the ops need.

mod attention;
mod elementwise;
mod matmul;
mod recurrent;
mod rows;
mod train;

use crate::graph::Op;
use crate::tensor::TensorId;

use super::{Bound, Step};
use crate::exec::work::split_bytes;
use elementwise::{Binary, Unary};
use train::{Reshape, TrainRows};

impl<const N: usize> Bound<'_, N> {
    /// How many phases node `id` runs in, with a barrier after each: 0 for leaves and views, 2
    /// for matmuls that first convert their input (once per node, split over the threads) and
    /// for attention that may split its keys (parts, then their merge), else 1.
    pub(crate) fn phases(&self, id: TensorId) -> usize {
        let t = self.graph.tensor(id);
        if !t.op.computes() {
            0
        } else if self.converts_input(id) || split_bytes(self.graph, t) > 0 {
            2
        } else {
            1
        }
    }
    /// Whether phase `phase` of node `id` has work this step: the merge phase of an attention
    /// that does not split this step has none (the pool skips it, barrier included).
    pub(crate) fn phase_works(&self, id: TensorId, phase: usize, step: Step) -> bool {
        let t = self.graph.tensor(id);
        !(t.op == Op::FlashAttn && phase == 1) || self.split_of(t, step).is_some()
    }
    /// Runs thread `ith` of `nth`'s share of phase `phase` of node `id`.
    pub(crate) fn compute(&self, id: TensorId, step: Step, phase: usize, ith: usize, nth: usize) {
        let t = self.graph.tensor(id);
        if !t.op.computes() {
            return;
        }
        if phase == 0 && self.converts_input(id) {
            // An offloaded matmul reads its F32 input as is (and converts it itself on failure).
            if self.offload.is_none() || self.offload_of(t, step).is_none() {
                self.convert_input(id, t, step, ith, nth);
            }
            return;
        }
        let ne = t.ne_for(step.n_kv);
        let unary = |op| self.unary(op, id, t, ne, step, ith, nth);
        let binary = |op| self.binary(op, id, t, ne, step, ith, nth);
        let reshape = |op| self.reshape_sum(op, id, t, ne, step, ith, nth);
        let train_rows = |op| self.train_rows(op, id, t, ne, ith, nth);
        match t.op {
            Op::Scale => unary(Unary::Scale),
            Op::Sqr => unary(Unary::Sqr),
            Op::Sqrt => unary(Unary::Sqrt),
            Op::Hadamard => unary(Unary::Hadamard),
            Op::RmsNorm => unary(Unary::RmsNorm),
            Op::LayerNorm => unary(Unary::LayerNorm),
            Op::Silu => unary(Unary::Silu),
            Op::Sigmoid => unary(Unary::Sigmoid),
            Op::Softplus => unary(Unary::Softplus),
            Op::Tanh => unary(Unary::Tanh),
            Op::Gelu => unary(Unary::Gelu),
            Op::SoftMax => unary(Unary::SoftMax),
            Op::Add => binary(Binary::Add),
            Op::Sub => binary(Binary::Sub),
            Op::Mul => binary(Binary::Mul),
            Op::Div => binary(Binary::Div),
            Op::SwiGlu => binary(Binary::SwiGlu),
            Op::GeGlu => binary(Binary::GeGlu),
            Op::Sum => reshape(Reshape::Sum),
            Op::Repeat => reshape(Reshape::Repeat),
            Op::RepeatBack => reshape(Reshape::RepeatBack),
            Op::Fill => reshape(Reshape::Fill),
            Op::RmsNormBack => train_rows(TrainRows::RmsNormBack),
            Op::SoftMaxBack => train_rows(TrainRows::SoftMaxBack),
            Op::CrossEntropy => train_rows(TrainRows::CrossEntropy),
            Op::CrossEntropyBack => train_rows(TrainRows::CrossEntropyBack),
            Op::MulMatT => self.mul_mat_t(id, t, ne, ith, nth),
            Op::RopeTable => self.rope_table(id, t, ne, step, ith, nth),
            Op::Rope => self.rope(id, t, ne, ith, nth),
            Op::GetRows => self.get_rows(id, t, ne, ith, nth),
            Op::GetRowsBack => self.get_rows_back(id, t, ne, ith, nth),
            Op::MulMat => {
                if !(self.offload.is_some() && self.offload_mul_mat(id, t, step, ith)) {
                    self.mul_mat(id, t, step, ith, nth)
                }
            }
            Op::MulMatId => self.mul_mat_id(id, t, step, ith, nth),
            Op::TopK => self.top_k(id, t, ne, ith, nth),
            Op::MoeWeights => self.moe_weights(id, t, ne, ith, nth),
            Op::MoeSum => self.moe_sum(id, t, ne, ith, nth),
            Op::SeqMean => self.seq_mean(id, t, ne, ith, nth),
            Op::Cpy => self.cpy(id, t, ne, step, ith, nth),
            Op::Concat => self.concat(id, t, ne, step, ith, nth),
            Op::Pool2dAvg => self.pool_2d_avg(id, t, ne, ith, nth),
            Op::KvWrite => self.kv_write(id, t, step, ith, nth),
            Op::ShortConv => self.short_conv(id, t, ith, nth),
            Op::GatedDeltaNet => self.gated_delta_net(id, t, ith, nth),
            Op::FlashAttn => match (phase, self.split_of(t, step)) {
                (0, None) => self.flash_attn(id, t, ne, step, ith, nth),
                (0, Some(parts)) => self.flash_attn_parts(id, t, ne, step, parts, ith, nth),
                (_, Some(parts)) => self.merge_attn_parts(id, ne, step, parts, ith, nth),
                (_, None) => {}
            },
            Op::None | Op::View => {}
        }
    }
}
