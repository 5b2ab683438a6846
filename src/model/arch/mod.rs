//! The architectures pinfer runs, one row each: what sets an architecture apart is written once,
//! in [`Arch::traits`], and validation, hyper-parameter reading, the graph builder and every
//! message read it. A new architecture is a new line in `archs!` (its variant and GGUF name);
//! the exhaustive matches in [`Arch::traits`] and [`build_forward`] then ask for its row and its
//! composition of blocks.

mod blocks;
mod encoder;
mod facts;
mod kv;
mod rope;
mod transformer;
mod vit;

pub use blocks::{TrainedPair, MODEL_BUFFER};
pub use facts::{
    Activation, Arch, ArchTraits, EmbedScale, Experts, Ffn, Gating, Positions, Supported, SwaLayers,
};
pub use kv::{CacheRows, EmbeddingsInput, EncoderInputs, KvLayout, KvTypeError, KvTypes};
pub use rope::{layer_rope, rope_factors_name, LayerRope};
pub use transformer::build_window;
pub use vit::{build_vision, position_table_side, resized_position_weights, VisionForward, VisionInputs};

use crate::gguf::Gguf;
use crate::graph::Graph;
use crate::model::{HParams, ModelError};
use crate::tensor::TensorId;

/// Builds the forward pass of `hp.arch` for `n_tokens` tokens with logits for `n_outputs` of them
/// (see `transformer.rs`): the builder of each architecture, chosen by an exhaustive match.
#[allow(clippy::too_many_arguments)]
pub fn build_forward<const N: usize>(
    g: &mut Graph<N>,
    gguf: &Gguf<'_>,
    hp: &HParams,
    kv: &KvLayout,
    n_tokens: usize,
    n_outputs: usize,
    adapters: &[crate::model::lora::Adapter<'_>],
    input: StepInput,
) -> Result<Forward, ModelError> {
    if input != StepInput::Tokens && hp.arch.traits().encoder {
        g.clear();
        return Err(ModelError::Graph(crate::graph::GraphError::Invalid {
            op: "forward",
            name: heapless::String::new(),
            problem: "an encoder takes token ids only",
        }));
    }
    match hp.arch {
        Arch::Llama
        | Arch::Qwen2
        | Arch::Qwen2Vl
        | Arch::Qwen3
        | Arch::Qwen3Moe
        | Arch::Qwen2Moe
        | Arch::Gemma3
        | Arch::Granite
        | Arch::SmolLm3
        | Arch::Phi3
        | Arch::Lfm2
        | Arch::Lfm2Moe
        | Arch::Qwen35
        | Arch::Gemma4
        | Arch::GemmaEmbedding => transformer::build(g, gguf, hp, kv, n_tokens, n_outputs, adapters, input),
        Arch::Bert | Arch::NomicBert | Arch::JinaBertV2 => {
            encoder::build(g, gguf, hp, kv, n_tokens, n_outputs, adapters)
        }
    }
}

/// What a step feeds the model: token ids, or embeddings (an image's, from a vision projector)
/// that attend causally or both ways within the step (Gemma 3's image tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepInput {
    /// Token ids.
    #[default]
    Tokens,
    /// Input vectors of `n_embd` values per token.
    Embeddings {
        /// Whether a token sees only the tokens before it (else the whole step too).
        causal: bool,
    },
}

/// The inputs and outputs of a built forward graph.
#[derive(Debug, Clone, Copy)]
pub struct Forward {
    /// I32 token ids `[n_tokens]` (persistent storage at `KvLayout::ids_offset`).
    pub ids: TensorId,
    /// F32 logits `[n_vocab, n_outputs]`, in the order of the output rows (an encoder's
    /// embeddings: `[n_embd or labels, n_outputs]`).
    pub logits: TensorId,
    /// Tokens the graph evaluates.
    pub n_tokens: usize,
    /// Tokens whose logits it computes (all of them when equal to `n_tokens`, else the ones the
    /// output-rows input names).
    pub n_outputs: usize,
    /// What the step feeds it.
    pub input: StepInput,
}
