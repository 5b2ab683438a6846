//! An optional hook that runs some matmuls elsewhere (the RK3588 NPU, behind the `npu` feature).
//!
//! The executor asks the hook, for every `MulMat` node on a 2-D weight matrix in model buffer 0 with
//! a contiguous F32 input and output, whether it takes the node ([`MatmulOffload::accepts`]). Every
//! thread asks, before the node runs, and must get the same answer (the answer may change only in
//! [`MatmulOffload::begin`], which runs on one thread before each graph run). If accepted, thread 0
//! alone calls [`MatmulOffload::run`] and the other threads skip the node, including the input
//! conversion of its first phase. If `run` returns `false` (the device failed), thread 0 computes the
//! whole node on the CPU itself, so no output is lost; the hook should then refuse the shape from the
//! next `begin` on. Without a hook the executor pays one `Option` check per matmul node.

/// Runs matmuls `out = W · x` for some weight matrices, keyed by where the weights are.
pub trait MatmulOffload: Sync {
    /// Called once before each graph run, on one thread, while no node runs: the place to latch
    /// state (such as shapes that failed) that [`Self::accepts`] reads.
    fn begin(&self) {}

    /// Whether [`Self::run`] will take the matmul on the weights at byte `weights` of model buffer 0
    /// (`n` rows of `k` elements) for `n_tokens` input rows. Must be a pure function of its
    /// arguments and of the state latched in [`Self::begin`]: all threads ask and must agree.
    fn accepts(&self, weights: usize, k: usize, n: usize, n_tokens: usize) -> bool;

    /// Computes `output[t·n + j] = Σ_i W[j][i] · input[t·k + i]` for the `n_tokens =
    /// input.len() / k` rows of `input`. Returns `false` if it could not (the caller then computes
    /// the node on the CPU; `output` may have been partly written).
    fn run(&self, weights: usize, k: usize, n: usize, input: &[f32], output: &mut [f32]) -> bool;
}
