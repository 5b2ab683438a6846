//! The operations a graph node can perform.

/// How RoPE pairs the dimensions it rotates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent pairs `(2i, 2i+1)` (llama).
    Normal,
    /// Pairs `(i, i + n_rot/2)` (NeoX; qwen, gemma).
    Neox,
}

/// Which keys an attention query sees (an attention node's `params.i = [causal, window]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mask {
    /// Its own position and every earlier one.
    Causal,
    /// Causal, and only the last `window` positions (key `j` visible when `pos - j < window`;
    /// 0: no window).
    SlidingWindow(u32),
    /// Every key of its own sequence, before and after it (an encoder's): with a table of
    /// spans (see [`crate::graph::Graph::at_positions`]) the `n` keys from the span's first row,
    /// without one every key.
    Bidirectional,
    /// [`Mask::Bidirectional`] in a graph whose batch is always one input (a vision encoder's
    /// image): its keys sit at the same rows in every run, so its tokens take the prompt tiles
    /// (a BERT batch's sequences start at any row, and a text's numbers must not depend on it).
    OneInput,
    /// Bidirectional within `window / 2` positions either side (key `j` visible when
    /// `|pos - j| <= window / 2`; EmbeddingGemma's sliding layers, llama.cpp's symmetric SWA):
    /// with a table of spans, the query's own key row is its batch row.
    Symmetric(u32),
}

impl Mask {
    /// The window in positions (0: none).
    pub fn window(self) -> u32 {
        match self {
            Mask::Causal | Mask::Bidirectional | Mask::OneInput => 0,
            Mask::SlidingWindow(w) | Mask::Symmetric(w) => w,
        }
    }

    /// Whether a query sees no key after its own.
    pub fn causal(self) -> bool {
        match self {
            Mask::Causal | Mask::SlidingWindow(_) => true,
            Mask::Bidirectional | Mask::OneInput | Mask::Symmetric(_) => false,
        }
    }
}

/// An operation. Shapes use ggml conventions (`ne[0]` innermost); "rows" are `ne[0]`-long vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A leaf: weights, inputs, the KV cache.
    None,
    /// A view of `src[0]` (reshape, permute, transpose, slice): no computation.
    View,
    /// Rows of table `src[0]` (any type, `[k, n_rows]`) selected by I32 ids `src[1]` (`[n]`) → F32 `[k, n]`.
    GetRows,
    /// `src[0] + src[1]`, `src[1]` broadcast over `src[0]`'s rows and batches.
    Add,
    /// `src[0] * src[1]` elementwise, broadcast like `Add`.
    Mul,
    /// `src[0] - src[1]`, broadcast like `Add`.
    Sub,
    /// `src[0] / src[1]`, broadcast like `Add`.
    Div,
    /// `src[0] * params.f[0]`.
    Scale,
    /// `x * x`.
    Sqr,
    /// `sqrt(x)`.
    Sqrt,
    /// The sum of every element of `src[0]` → F32 `[1, 1, 1, 1]` (a training loss), in f64.
    Sum,
    /// `src[0]` tiled to this tensor's shape (each dimension a multiple of the source's).
    Repeat,
    /// `src[0]` summed down to this tensor's shape (each of the source's dimensions a multiple of
    /// this one's): [`Op::Repeat`]'s adjoint, the gradient of a broadcast operand.
    RepeatBack,
    /// Every element `params.f[0]`; no sources (the seed of a backward pass).
    Fill,
    /// [`Op::GetRows`]'s gradient: the output gradients `src[0]` (F32 `[k, n]`) added into the rows
    /// `src[1]` (I32 `[n]`) name, of a table of this tensor's shape (zero elsewhere; a row named
    /// twice gets both).
    GetRowsBack,
    /// RMS norm's gradient: inputs `src[0]` and output gradients `src[1]` (same shape), `eps =
    /// params.f[0]` → the input gradients.
    RmsNormBack,
    /// Softmax's gradient: the softmax's output `src[0]` and output gradients `src[1]`, the
    /// softmax's input scale `params.f[0]` → the input gradients.
    SoftMaxBack,
    /// Mean next-token cross-entropy: logits `src[0]` (F32 `[n_vocab, n]`), targets `src[1]` (I32
    /// `[n]`; a negative target is not scored) → F32 `[1]`, the mean over the scored rows (0 if none).
    CrossEntropy,
    /// [`Op::CrossEntropy`]'s gradient: logits `src[0]`, targets `src[1]`, the loss's gradient
    /// `src[2]` (F32 `[1]`) → F32 `[n_vocab, n]`.
    CrossEntropyBack,
    /// The transposed matmul of a frozen weight (any type): `src[0]` `[k, m]`, `src[1]` (F32 `[m,
    /// n]`) → F32 `[k, n]`, `out[:, j] = sum_i w[:, i] * src1[i, j]` (a matmul's input gradient).
    MulMatT,
    /// Each run of `params.i[0]` (a power of two) values of every row times the orthonormal
    /// Walsh-Hadamard matrix of that size (symmetric, its own inverse): spreads outliers before a
    /// quantized KV cache stores the values, as llama.cpp does.
    Hadamard,
    /// `x / sqrt(mean(x^2) + eps)` per row, `eps = params.f[0]`.
    RmsNorm,
    /// `(x - mean) / sqrt(var + eps)` per row, `eps = params.f[0]`.
    LayerNorm,
    /// Rotary position embedding of `src[0]` `[head_dim, n_head, n_tokens]` by the angles of table
    /// `src[1]` (a `RopeTable`, row `t` for token `t`); `params.i = [n_rot, mode (0 normal, 1 neox),
    /// inverse (1: rotated back, the gradient)]`.
    Rope,
    /// RoPE's cosines and sines: F32 `[n_rot, n_tokens]`, row `t` the `n_rot / 2` cosines then the
    /// sines of the angles at position `n_past + t` (`n_tokens` is `src[0]`'s `ne[2]`; its values
    /// are not read). `params.i = [n_rot, yarn low, yarn high]` (the YaRN ramp's ends as f32 bits),
    /// `params.f = [freq_base, freq_scale, mscale, yarn ext_factor]` (cosines and sines times
    /// mscale; ext_factor 0: no YaRN); optional
    /// `src[1]`: F32 per-pair frequency divisors (`rope_freqs`).
    RopeTable,
    /// Softmax per row of `src[0] * params.f[0]` (`[n_kv, n_tokens, n_head]`), with an optional
    /// causal mask (`params.i[0] = 1`: query `t` at position `n_past + t` sees keys `0..=n_past + t`)
    /// and sliding window `params.i[1]` (0: none; key `j` visible when `pos - j < window`).
    SoftMax,
    /// `x * sigmoid(x)`.
    Silu,
    /// `1 / (1 + exp(-x))`.
    Sigmoid,
    /// `ln(1 + exp(x))`, `x` itself above 20 (ggml's).
    Softplus,
    /// `tanh(x)` (libm's, as ggml's CPU `tanhf`).
    Tanh,
    /// GELU, tanh approximation.
    Gelu,
    /// `silu(src[0]) * src[1]`.
    SwiGlu,
    /// `gelu(src[0]) * src[1]`.
    GeGlu,
    /// `src[0]` `[k, m, b0, c0]` (weights, any type) times `src[1]` `[k, n, b1, c1]` (F32) →
    /// F32 `[m, n, b1, c1]`; `b1 % b0 == 0`, `c1 % c0 == 0` (broadcast, e.g. grouped-query attention).
    MulMat,
    /// Expert matmul: `src[0]` `[k, m, n_expert]`, `src[1]` `[k, 1 or n_used, n_tokens]` (F32), I32 ids
    /// `src[2]` `[n_used, n_tokens]` → F32 `[m, n_used, n_tokens]`.
    MulMatId,
    /// MoE routing: the `params.i[0]` largest values of each row of `src[0]` (F32 `[n, n_tokens]`,
    /// router probabilities) → their indices, I32 `[k, n_tokens]`, largest first, ties to the lower
    /// index. A non-finite value stops the run (the router of that layer is broken).
    TopK,
    /// MoE expert weights: `src[0]` (F32 `[n, n_tokens]`) at the indices `src[1]` (I32 `[k,
    /// n_tokens]`) → F32 `[k, n_tokens]`; with `params.i[0] = 1` divided by their sum.
    MoeWeights,
    /// Weighted sum of expert outputs: `src[0]` (F32 `[m, k, n_tokens]`) times weights `src[1]`
    /// (F32 `[k, n_tokens]`), summed over the k experts in order → F32 `[m, n_tokens]`.
    MoeSum,
    /// The mean of each sequence's rows (an encoder's mean pooling): rows `src[0]` (F32 `[m,
    /// n_tokens]`), for output `j` the token `src[1][j]` (I32 `[n_out]`) whose span in `src[2]`
    /// (I32 `[2, n_tokens]`: first row, rows; as attention's spans) names the rows summed in
    /// order and divided by their count → F32 `[m, n_out]`.
    SeqMean,
    /// Copy / convert `src[0]` into this tensor's type and layout (F32 ↔ F16; same element count).
    Cpy,
    /// `src[0]` and `src[1]` joined along dimension `params.i[0]`.
    Concat,
    /// Average pooling of a grid of vectors: `src[0]` (F32 `[c, w, h]`, contiguous), each output
    /// the sum of a `k` x `k` square (`params.i[0]`; rows of the square outer, columns inner, as
    /// ggml's `pool_2d` adds them) divided by `k * k` → F32 `[c, w / k, h / k]`.
    Pool2dAvg,
    /// Writes the rows of `src[0]` (`[row, n_tokens]`, F32) into cache `src[1]` at rows
    /// `n_past..n_past + n_tokens`, converting to the cache type. The node is a view of the cache,
    /// so readers of the cache that depend on it run after the write.
    KvWrite,
    /// Attention in one pass, as ggml's CPU flash attention computes it: queries `src[0]`
    /// (`[head_dim, n_tokens, n_head]`, F32), keys `src[1]` and values `src[2]` (`[head_dim, n_kv,
    /// n_kv_head]`, F16) → F32 `[head_dim_v, n_head, n_tokens]`. Each query row is rounded to F16,
    /// scores are scaled by `params.f[0]`, masked like `SoftMax` (`params.i = [causal, window]`, from a
    /// [`Mask`]), given ALiBi's bias when `params.f[1]` (its maximum bias) is positive (bidirectional
    /// nodes only), and
    /// the values are accumulated with an online softmax in an F16 accumulator.
    FlashAttn,
    /// Causal depthwise convolution with a rolling state (LFM2's short convolution; ggml's
    /// `ssm_conv` over the state and the inputs joined): inputs `src[0]` (F32 `[n_ch, n_tokens]`),
    /// taps `src[1]` (F32 `[k, n_ch]`, the last tap on the current input), states `src[2]` (F32
    /// `[(k - 1) * n_ch, n_seq]`, persistent: each channel's last `k - 1` inputs, oldest first),
    /// places `src[3]` (as [`crate::graph::Graph::at_positions`]; sequence = first cache row /
    /// `params.i[0]`). Token by token in batch order, each channel's output is
    /// `sum_j window[j] * taps[j]` over the state and the input (summed from the oldest, as ggml),
    /// then the state moves on by the input. A token at position 0 starts from a zero state.
    ShortConv,
    /// The gated delta rule (Qwen3.5's linear attention; ggml's `gated_delta_net`): queries
    /// `src[0]` and keys `src[1]` (F32 `[d, n_k_heads, n_tokens]`, L2-normalised rows), values
    /// `src[2]` (F32 `[d, n_v_heads, n_tokens]`), log-decays `src[3]` and write strengths `src[4]`
    /// (F32 `[n_v_heads, n_tokens]`), states `src[5]` (F32 `[d * d * n_v_heads, n_seq]`,
    /// persistent), places `src[6]` (sequence = first cache row / `params.i[0]`). Token by token
    /// in batch order, value head `h` (query and key head `h % n_k_heads`) decays its state `S`
    /// by `exp(g)`, writes `beta * (v - S^T k)` along `k`, and reads `S^T q / sqrt(d)` → F32
    /// `[d, n_v_heads, n_tokens]`. A token at position 0 starts from a zero state.
    GatedDeltaNet,
}

impl Op {
    /// The op's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Op::None => "none",
            Op::View => "view",
            Op::GetRows => "get_rows",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::Sub => "sub",
            Op::Div => "div",
            Op::Scale => "scale",
            Op::Sqr => "sqr",
            Op::Sqrt => "sqrt",
            Op::Sum => "sum",
            Op::Repeat => "repeat",
            Op::RepeatBack => "repeat_back",
            Op::Fill => "fill",
            Op::GetRowsBack => "get_rows_back",
            Op::RmsNormBack => "rms_norm_back",
            Op::SoftMaxBack => "soft_max_back",
            Op::CrossEntropy => "cross_entropy",
            Op::CrossEntropyBack => "cross_entropy_back",
            Op::MulMatT => "mul_mat_t",
            Op::Hadamard => "hadamard",
            Op::RmsNorm => "rms_norm",
            Op::LayerNorm => "layer_norm",
            Op::Rope => "rope",
            Op::RopeTable => "rope_table",
            Op::SoftMax => "soft_max",
            Op::Silu => "silu",
            Op::Sigmoid => "sigmoid",
            Op::Softplus => "softplus",
            Op::Tanh => "tanh",
            Op::Gelu => "gelu",
            Op::SwiGlu => "swiglu",
            Op::GeGlu => "geglu",
            Op::MulMat => "mul_mat",
            Op::MulMatId => "mul_mat_id",
            Op::TopK => "top_k",
            Op::MoeWeights => "moe_weights",
            Op::MoeSum => "moe_sum",
            Op::SeqMean => "seq_mean",
            Op::Cpy => "cpy",
            Op::Concat => "concat",
            Op::Pool2dAvg => "pool_2d_avg",
            Op::KvWrite => "kv_write",
            Op::FlashAttn => "flash_attn",
            Op::ShortConv => "short_conv",
            Op::GatedDeltaNet => "gated_delta_net",
        }
    }

    /// Whether the op computes anything (views and leaves do not).
    pub fn computes(self) -> bool {
        !matches!(self, Op::None | Op::View)
    }
}

/// Small fixed parameters of an op.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct OpParams {
    /// Integer parameters (meaning per op).
    pub i: [i32; 4],
    /// Float parameters (meaning per op).
    pub f: [f32; 4],
}
