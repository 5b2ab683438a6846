//! Checks that a file's vocabulary and tensors are what its architecture needs.

use core::fmt::Write;

use super::hparams::arch_key;
use super::{HParams, ModelError, Positions};
use crate::gguf::{name_of, Gguf, Name, Value, ValueType};
use crate::quant::GgmlType;

/// Largest vocabulary accepted.
const MAX_VOCAB: usize = 1 << 21;

/// What a tensor is used for, which decides the types it may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    /// Matrix of a matrix product (or the embedding table, read by rows).
    Weight,
    /// Norm weights: elementwise, kept in float.
    Norm,
    /// Bias vectors: elementwise, kept in float.
    Bias,
    /// MoE router: kept in float and on the CPU (a quantized router gave NaN routing elsewhere).
    Router,
    /// A convolution's taps: f32, as the convolution reads them.
    Taps,
}

impl TensorKind {
    /// The types a tensor of this kind may have: weights any type with a dot product
    /// ([`GgmlType::traits`]); norms, biases and routers stay in float.
    fn types(self) -> fn(GgmlType) -> bool {
        match self {
            TensorKind::Weight => |ty| ty.traits().vec_dot.is_some(),
            TensorKind::Norm | TensorKind::Bias | TensorKind::Router => {
                |ty| matches!(ty, GgmlType::F32 | GgmlType::F16)
            }
            TensorKind::Taps => |ty| ty == GgmlType::F32,
        }
    }

    /// Whether a tensor of this kind may have type `ty`.
    pub fn accepts(self, ty: GgmlType) -> bool {
        self.types()(ty)
    }

    /// The types it accepts, for messages.
    pub fn accepted(self) -> crate::quant::TypeList {
        crate::quant::TypeList(self.types())
    }
}

/// The validated vocabulary summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vocab<'a> {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE), `llama` (SentencePiece) or `gemma4`
    /// (SentencePiece-style BPE).
    pub model: &'a str,
    /// `tokenizer.ggml.pre` (BPE pre-tokenizer), if given.
    pub pre: Option<&'a str>,
    /// Number of tokens.
    pub n_vocab: u32,
    /// Number of BPE merges (0 for SentencePiece).
    pub n_merges: u32,
}

fn vocab_err(key: &str, problem: &'static str, value: u64) -> ModelError {
    ModelError::Vocab { key: name_of(key), problem, value }
}

/// Checks the tokenizer metadata: model kind, token list, scores and types of the same length,
/// merges, byte tokens, and that every special-token id (given or defaulted) is in the vocabulary.
/// Works on vocabulary-only files.
pub fn validate_vocab<'a>(g: &Gguf<'a>) -> Result<Vocab<'a>, ModelError> {
    let model = g.get_str("tokenizer.ggml.model")?;
    if !matches!(model, "gpt2" | "llama" | "gemma4" | "bert") {
        return Err(vocab_err(
            "tokenizer.ggml.model",
            "tokenizer kind not supported (gpt2, llama, gemma4 and bert are)",
            0,
        ));
    }
    let tokens = g.get_array("tokenizer.ggml.tokens", ValueType::String)?;
    let n = tokens.len();
    if n == 0 || n > MAX_VOCAB {
        return Err(vocab_err("tokenizer.ggml.tokens", "vocabulary size out of range", n as u64));
    }
    if let Some(scores) = g.get_array_opt("tokenizer.ggml.scores", ValueType::F32)? {
        if scores.len() != n {
            return Err(vocab_err(
                "tokenizer.ggml.scores",
                "length differs from the token list",
                scores.len() as u64,
            ));
        }
    }
    if let Some(types) = g.get_array_opt("tokenizer.ggml.token_type", ValueType::I32)? {
        if types.len() != n {
            return Err(vocab_err(
                "tokenizer.ggml.token_type",
                "length differs from the token list",
                types.len() as u64,
            ));
        }
        for (i, (ty, text)) in types.iter().zip(tokens.iter()).enumerate() {
            let ty = ty.as_integer().unwrap_or(-1);
            if !(0..=6).contains(&ty) {
                return Err(vocab_err(
                    "tokenizer.ggml.token_type",
                    "token type outside 0..=6 at index",
                    i as u64,
                ));
            }
            // Byte tokens become raw bytes in the output: their text must be exactly <0xHH>.
            if ty == 6 && !is_byte_token(text) {
                return Err(vocab_err(
                    "tokenizer.ggml.tokens",
                    "byte token is not of the form <0xHH> at index",
                    i as u64,
                ));
            }
        }
    }
    let n_merges = match g.get_array_opt("tokenizer.ggml.merges", ValueType::String)? {
        Some(merges) => {
            for (i, m) in merges.iter().enumerate() {
                let ok = matches!(m, Value::String(b) if b.len() >= 3 && b[1..b.len() - 1].contains(&b' '));
                if !ok {
                    return Err(vocab_err(
                        "tokenizer.ggml.merges",
                        "merge is not two tokens and a space at index",
                        i as u64,
                    ));
                }
            }
            merges.len()
        }
        // (SentencePiece and WordPiece have no merges.)
        None if !matches!(model, "llama" | "bert") => {
            return Err(vocab_err("tokenizer.ggml.merges", "BPE vocabulary without merges", 0))
        }
        None => 0,
    };
    check_special_ids(g, model, n)?;
    Ok(Vocab {
        model,
        pre: g.get_str_opt("tokenizer.ggml.pre")?,
        n_vocab: n as u32,
        n_merges: n_merges as u32,
    })
}

fn is_byte_token(v: Value<'_>) -> bool {
    matches!(v, Value::String(b) if b.len() == 6 && b.starts_with(b"<0x") && b[5] == b'>'
        && b[3].is_ascii_hexdigit() && b[4].is_ascii_hexdigit())
}

/// Every `tokenizer.ggml.*_token_id` must name a token; SentencePiece defaults (unk 0, bos 1,
/// eos 2) are checked too when absent. `-1` / `u32::MAX` mean "none".
fn check_special_ids(g: &Gguf<'_>, model: &str, n: usize) -> Result<(), ModelError> {
    for (key, value) in g.metadata() {
        if !(key.starts_with("tokenizer.ggml.") && key.ends_with("_token_id")) {
            continue;
        }
        let id = value.as_integer().ok_or_else(|| vocab_err(key, "special token id is not an integer", 0))?;
        let none = id == -1 || id == i128::from(u32::MAX);
        if !none && !(0..n as i128).contains(&id) {
            return Err(vocab_err(key, "special token id outside the vocabulary", id as u64));
        }
    }
    if model == "llama" {
        for (key, default) in [
            ("tokenizer.ggml.unknown_token_id", 0usize),
            ("tokenizer.ggml.bos_token_id", 1),
            ("tokenizer.ggml.eos_token_id", 2),
        ] {
            if g.get(key).is_none() && default >= n {
                return Err(vocab_err(
                    key,
                    "default special token id outside the vocabulary",
                    default as u64,
                ));
            }
        }
    }
    Ok(())
}

/// Layer `i`'s V projection's name.
fn format_v(i: u32) -> Name {
    let mut n = Name::new();
    let _ = write!(n, "blk.{i}.attn_v.weight");
    n
}

/// One tensor an architecture needs.
struct Expect {
    name: Name,
    shape: [u64; 4],
    kind: TensorKind,
    required: bool,
}

fn expect(name: core::fmt::Arguments<'_>, shape: &[u64], kind: TensorKind, required: bool) -> Expect {
    let mut n = Name::new();
    let _ = n.write_fmt(name);
    let mut ne = [1u64; 4];
    ne[..shape.len()].copy_from_slice(shape);
    Expect { name: n, shape: ne, kind, required }
}

/// Checks that every tensor the architecture needs is present with the shape the
/// hyper-parameters imply and a type accepted for its role, and that the vocabulary size agrees.
pub fn validate_tensors(g: &Gguf<'_>, hp: &HParams, n_vocab: u32) -> Result<(), ModelError> {
    let vocab_key = arch_key(hp.arch, "vocab_size");
    if let Some(v) = g.get_int::<u64>(&vocab_key)? {
        if v != u64::from(n_vocab) {
            return Err(ModelError::BadHParam {
                key: vocab_key,
                value: v as f64,
                problem: "differs from the token list length",
            });
        }
    }
    let (e, v) = (u64::from(hp.n_embd), u64::from(n_vocab));
    let check = |x: Expect| -> Result<(), ModelError> {
        let Some(t) = g.tensor(&x.name) else {
            return if x.required { Err(ModelError::MissingTensor { name: x.name }) } else { Ok(()) };
        };
        if t.ne != x.shape {
            return Err(ModelError::TensorShape { name: x.name, expected: x.shape, found: t.ne });
        }
        if !x.kind.accepts(t.ty) {
            return Err(ModelError::TensorType { name: x.name, ty: t.ty, role: x.kind });
        }
        Ok(())
    };
    use TensorKind::*;
    if hp.arch.traits().encoder {
        return validate_encoder(g, hp, &check, v);
    }
    check(expect(format_args!("token_embd.weight"), &[e, v], Weight, true))?;
    check(expect(format_args!("{}", hp.arch.traits().output_norm), &[e], Norm, true))?;
    check(expect(format_args!("output.weight"), &[e, v], Weight, false))?;
    if hp.embeds() {
        // A decoder-shaped embedder's heads: Qwen3-Reranker's labels (rows of the language
        // model's head), EmbeddingGemma's dense projections (out and back to n_embd).
        let labels = g.tensor("cls.output.weight").map_or(1, |t| t.ne[1].max(1));
        check(expect(format_args!("cls.output.weight"), &[e, labels], Weight, false))?;
        check(expect(format_args!("cls.output.bias"), &[labels], Bias, false))?;
        let dense = g.tensor("dense_2.weight").map_or(e, |t| t.ne[1].max(1));
        check(expect(format_args!("dense_2.weight"), &[e, dense], Weight, false))?;
        check(expect(
            format_args!("dense_3.weight"),
            &[dense, e],
            Weight,
            g.tensor("dense_2.weight").is_some(),
        ))?;
    }
    // (Gemma 4's full-attention layers need their factors, one per pair of the head, as
    // llama.cpp requires them.)
    let full_factors = hp.arch.traits().full_layer_rope_freqs;
    let required_factors = full_factors && (0..hp.n_layer as usize).any(|il| !hp.is_sliding(il));
    let pairs = if full_factors { hp.head_dim_k / 2 } else { hp.n_rot / 2 };
    for factors in ["rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"] {
        let required = required_factors && factors == "rope_freqs.weight";
        check(expect(format_args!("{factors}"), &[u64::from(pairs)], Norm, required))?;
    }

    let p = u64::from(hp.n_embd_per_layer);
    if p > 0 {
        // Gemma 4's per-layer token embeddings and the projection of the embeddings beside them.
        let all = p * u64::from(hp.n_layer);
        check(expect(format_args!("per_layer_token_embd.weight"), &[all, v], Weight, true))?;
        check(expect(format_args!("per_layer_model_proj.weight"), &[e, all], Weight, true))?;
        check(expect(format_args!("per_layer_proj_norm.weight"), &[p], Norm, true))?;
    }
    let (fe, fs, ne) = (u64::from(hp.n_ff_expert), u64::from(hp.n_ff_shared), u64::from(hp.n_expert));
    let traits = hp.arch.traits();
    let (qk_norm, qkv_bias) = (traits.qk_norm, traits.qkv_bias);
    let check_ffn = |i: u32| -> Result<(), ModelError> {
        let f = u64::from(hp.n_ff_at(i as usize));
        let experts = hp.experts_at(i as usize);
        if let Some(x) = experts {
            check(expect(format_args!("blk.{i}.ffn_gate_inp.weight"), &[e, ne], Router, true))?;
            if x.selection_bias {
                check(expect(format_args!("blk.{i}.exp_probs_b.bias"), &[ne], Bias, true))?;
            }
            check(expect(format_args!("blk.{i}.ffn_gate_exps.weight"), &[e, fe, ne], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_up_exps.weight"), &[e, fe, ne], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_down_exps.weight"), &[fe, e, ne], Weight, true))?;
        } else if traits.fused_gate_up {
            check(expect(format_args!("blk.{i}.ffn_up.weight"), &[e, 2 * f], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_down.weight"), &[f, e], Weight, true))?;
        } else {
            check(expect(format_args!("blk.{i}.ffn_gate.weight"), &[e, f], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_up.weight"), &[e, f], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_down.weight"), &[f, e], Weight, true))?;
        }
        if experts.is_some_and(|x| x.shared_expert) {
            check(expect(format_args!("blk.{i}.ffn_gate_inp_shexp.weight"), &[e], Router, true))?;
            check(expect(format_args!("blk.{i}.ffn_gate_shexp.weight"), &[e, fs], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_up_shexp.weight"), &[e, fs], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_down_shexp.weight"), &[fs, e], Weight, true))?;
        }
        Ok(())
    };
    for i in 0..hp.n_layer {
        check(expect(format_args!("blk.{i}.attn_norm.weight"), &[e], Norm, true))?;
        check(expect(format_args!("blk.{i}.{}", traits.ffn_norm), &[e], Norm, true))?;
        check_ffn(i)?;
        if let (true, Some(d)) = (hp.recurrent.contains(i as usize), hp.delta) {
            // A gated-delta-rule block: Q, K, V in one matrix, the output gate, the convolution's
            // taps, the decay (bias, -exp(A)), the strength, the gated norm, the output.
            let (ch, vw) = (d.conv_channels() as u64, d.v_width() as u64);
            let (nv, hd) = (u64::from(d.n_v_heads), u64::from(d.head_dim));
            check(expect(format_args!("blk.{i}.attn_qkv.weight"), &[e, ch], Weight, true))?;
            check(expect(format_args!("blk.{i}.attn_gate.weight"), &[e, vw], Weight, true))?;
            check(expect(
                format_args!("blk.{i}.ssm_conv1d.weight"),
                &[u64::from(d.conv_kernel), ch],
                Taps,
                true,
            ))?;
            check(expect(format_args!("blk.{i}.ssm_dt.bias"), &[nv], Bias, true))?;
            check(expect(format_args!("blk.{i}.ssm_a"), &[nv], Taps, true))?;
            check(expect(format_args!("blk.{i}.ssm_beta.weight"), &[e, nv], Weight, true))?;
            check(expect(format_args!("blk.{i}.ssm_alpha.weight"), &[e, nv], Weight, true))?;
            check(expect(format_args!("blk.{i}.ssm_norm.weight"), &[hd], Norm, true))?;
            check(expect(format_args!("blk.{i}.ssm_out.weight"), &[vw, e], Weight, true))?;
            continue;
        }
        if hp.recurrent.contains(i as usize) {
            // A short-convolution block: B, C and X projections in one matrix, the taps per
            // channel (read as f32 by the convolution), the output projection.
            let taps = u64::from(hp.conv_kernel);
            check(expect(format_args!("blk.{i}.shortconv.in_proj.weight"), &[e, 3 * e], Weight, true))?;
            check(expect(format_args!("blk.{i}.shortconv.conv.weight"), &[taps, e], Taps, true))?;
            check(expect(format_args!("blk.{i}.shortconv.out_proj.weight"), &[e, e], Weight, true))?;
            continue;
        }
        let il = i as usize;
        let (qw, kw, vw) = (hp.q_width(il), hp.k_width(il), hp.v_width(il));
        // (Qwen3.5's Q projection carries each head's output gate after its queries.)
        let qw_out = if traits.attn_output_gate { 2 * qw } else { qw };
        let attn_out_in = u64::from(hp.n_head) * u64::from(hp.head_dim_v_at(il));
        let hd = u64::from(hp.head_dim_k_at(il));
        // KV-sharing layers (Gemma 4) need no K and V projections; Gemma 4 may reuse K as V.
        let own_kv = hp.has_own_kv(il);
        let v_required = own_kv && !traits.values_from_keys;
        let mut fused = Name::new();
        let _ = write!(fused, "blk.{i}.attn_qkv.weight");
        if g.tensor(&fused).is_some() {
            // Q, K and V in one matrix (any architecture may store them so, as llama.cpp reads).
            check(expect(format_args!("{fused}"), &[e, qw_out + kw + vw], Weight, true))?;
        } else {
            check(expect(format_args!("blk.{i}.attn_q.weight"), &[e, qw_out], Weight, true))?;
            check(expect(format_args!("blk.{i}.attn_k.weight"), &[e, kw], Weight, own_kv))?;
            check(expect(format_args!("blk.{i}.attn_v.weight"), &[e, vw], Weight, v_required))?;
            if traits.values_from_keys && own_kv && g.tensor(&name_of(&format_v(i))).is_none() && kw != vw {
                // Values from the keys' projection need the keys' width.
                return Err(ModelError::MissingTensor { name: format_v(i) });
            }
        }
        check(expect(format_args!("blk.{i}.attn_output.weight"), &[attn_out_in, e], Weight, true))?;
        if qkv_bias {
            check(expect(format_args!("blk.{i}.attn_q.bias"), &[qw], Bias, true))?;
            check(expect(format_args!("blk.{i}.attn_k.bias"), &[kw], Bias, true))?;
            check(expect(format_args!("blk.{i}.attn_v.bias"), &[vw], Bias, true))?;
        }
        if qk_norm {
            check(expect(format_args!("blk.{i}.attn_q_norm.weight"), &[hd], Norm, true))?;
            check(expect(format_args!("blk.{i}.attn_k_norm.weight"), &[hd], Norm, own_kv))?;
        }
        if traits.post_norms {
            check(expect(format_args!("blk.{i}.post_attention_norm.weight"), &[e], Norm, true))?;
            check(expect(format_args!("blk.{i}.post_ffw_norm.weight"), &[e], Norm, true))?;
        }
        if p > 0 {
            check(expect(format_args!("blk.{i}.inp_gate.weight"), &[e, p], Weight, true))?;
            check(expect(format_args!("blk.{i}.proj.weight"), &[p, e], Weight, true))?;
            check(expect(format_args!("blk.{i}.post_norm.weight"), &[e], Norm, true))?;
        }
        if traits.layer_output_scale {
            // One F32 factor, read when the graph is built.
            check(expect(format_args!("blk.{i}.layer_output_scale.weight"), &[1], Taps, false))?;
        }
    }
    Ok(())
}

/// An encoder's tensors (llama.cpp's `bert`, `nomic-bert`, `jina-bert-v2`): the embeddings of
/// tokens and token types (BERT: and positions) and their LayerNorm; per layer Q, K and V (three
/// matrices or one `attn_qkv`; biases optional), the output projection, the MLP (BERT's up and
/// down, or a gated one: gate and up as two matrices or one `ffn_up` of both; biases optional)
/// and the two LayerNorms; the classifier head's, optional.
fn validate_encoder(
    g: &Gguf<'_>,
    hp: &HParams,
    check: &dyn Fn(Expect) -> Result<(), ModelError>,
    v: u64,
) -> Result<(), ModelError> {
    use TensorKind::*;
    let traits = hp.arch.traits();
    let (e, f) = (u64::from(hp.n_embd), u64::from(hp.n_ff));
    check(expect(format_args!("token_embd.weight"), &[e, v], Weight, true))?;
    // Token types: as many rows as the file has (llama.cpp reads the first), each n_embd wide.
    let types = g.tensor("token_types.weight").map_or(1, |t| t.ne[1].max(1));
    check(expect(format_args!("token_types.weight"), &[e, types], Weight, false))?;
    let embedded = traits.positions == Positions::Embedded;
    check(expect(format_args!("position_embd.weight"), &[e, u64::from(hp.n_ctx_train)], Weight, embedded))?;
    check(expect(format_args!("token_embd_norm.weight"), &[e], Norm, true))?;
    check(expect(format_args!("token_embd_norm.bias"), &[e], Bias, true))?;
    for i in 0..hp.n_layer {
        // Norms of variants the encoder does not compute (jina-embeddings-v2-base-code's Q and
        // K LayerNorms, its second attention norm): refused rather than skipped.
        for norm in ["attn_q_norm", "attn_k_norm", "attn_norm_2"] {
            let mut name = Name::new();
            let _ = write!(name, "blk.{i}.{norm}.weight");
            if g.tensor(&name).is_some() {
                return Err(ModelError::Uncomputed {
                    key: name,
                    found: name_of("a LayerNorm"),
                    computes: "encoders without Q/K or second attention LayerNorms",
                });
            }
        }
        let il = i as usize;
        let (qw, kw, vw) = (hp.q_width(il), hp.k_width(il), hp.v_width(il));
        let mut fused = Name::new();
        let _ = write!(fused, "blk.{i}.attn_qkv.weight");
        if g.tensor(&fused).is_some() {
            check(expect(format_args!("blk.{i}.attn_qkv.weight"), &[e, qw + kw + vw], Weight, true))?;
            check(expect(format_args!("blk.{i}.attn_qkv.bias"), &[qw + kw + vw], Bias, false))?;
        } else {
            for (part, width) in [("attn_q", qw), ("attn_k", kw), ("attn_v", vw)] {
                check(expect(format_args!("blk.{i}.{part}.weight"), &[e, width], Weight, true))?;
                check(expect(format_args!("blk.{i}.{part}.bias"), &[width], Bias, false))?;
            }
        }
        check(expect(format_args!("blk.{i}.attn_output.weight"), &[qw, e], Weight, true))?;
        check(expect(format_args!("blk.{i}.attn_output.bias"), &[e], Bias, false))?;
        // (A fused gated MLP's `ffn_up` holds the gate's rows, then the up's.)
        let up = if traits.gated_encoder_ffn && traits.fused_gate_up { 2 * f } else { f };
        if traits.gated_encoder_ffn && !traits.fused_gate_up {
            check(expect(format_args!("blk.{i}.ffn_gate.weight"), &[e, f], Weight, true))?;
            check(expect(format_args!("blk.{i}.ffn_gate.bias"), &[f], Bias, false))?;
        }
        check(expect(format_args!("blk.{i}.ffn_up.weight"), &[e, up], Weight, true))?;
        check(expect(format_args!("blk.{i}.ffn_up.bias"), &[up], Bias, false))?;
        check(expect(format_args!("blk.{i}.ffn_down.weight"), &[f, e], Weight, true))?;
        check(expect(format_args!("blk.{i}.ffn_down.bias"), &[e], Bias, false))?;
        for norm in ["attn_output_norm", "layer_output_norm"] {
            check(expect(format_args!("blk.{i}.{norm}.weight"), &[e], Norm, true))?;
            check(expect(format_args!("blk.{i}.{norm}.bias"), &[e], Bias, true))?;
        }
    }
    // The classifier head of a cross-encoder: a dense layer, then as many labels as it has.
    check(expect(format_args!("cls.weight"), &[e, e], Weight, false))?;
    check(expect(format_args!("cls.bias"), &[e], Bias, false))?;
    let labels = g.tensor("cls.output.weight").map_or(1, |t| t.ne[1].max(1));
    check(expect(format_args!("cls.output.weight"), &[e, labels], Weight, false))?;
    check(expect(format_args!("cls.output.bias"), &[labels], Bias, false))?;
    Ok(())
}
