//! Model-level view of a GGUF file: architecture, hyper-parameters, and the validation that a
//! file really holds a model we can run (keys, ranges, vocabulary, every tensor's shape and type).
//!
//! Everything here runs once at load. Graph builders trust what it checked.

mod arch;
mod hparams;
pub mod lora;
pub mod open;
mod validate;
pub mod vision;

use core::fmt;

pub use arch::{
    build_forward, build_vision, build_window, layer_rope, rope_factors_name, CacheRows, EmbeddingsInput,
    EncoderInputs, Forward, KvLayout, KvTypeError, KvTypes, LayerRope, StepInput, TrainedPair, VisionForward,
    VisionInputs, MODEL_BUFFER,
};
pub use arch::{position_table_side, resized_position_weights};
pub use arch::{
    Activation, Arch, ArchTraits, EmbedScale, Experts, Ffn, Gating, Positions, Supported, SwaLayers,
};
pub use hparams::{HParams, LayerMask, Pooling, MAX_LAYERS};
pub use open::{check, context_size, Checked, DEFAULT_CTX};
pub use validate::{validate_tensors, validate_vocab, TensorKind, Vocab};

use crate::gguf::{GgufError, Name};
use crate::graph::GraphError;
use crate::quant::GgmlType;

impl Arch {
    /// Mixture-of-experts architectures (llama.cpp's names) that pinfer refuses by name.
    pub const OTHER_MOE: [&'static str; 20] = [
        "mixtral",
        "deepseek",
        "deepseek2",
        "olmoe",
        "granitemoe",
        "granitehybrid",
        "qwen3next",
        "qwen3vlmoe",
        "llama4",
        "dbrx",
        "arctic",
        "grok",
        "phimoe",
        "jamba",
        "bailingmoe",
        "bailingmoe2",
        "gpt-oss",
        "ernie4_5-moe",
        "glm4moe",
        "hunyuan-moe",
    ];
}

/// Why a GGUF file is not a model pinfer can run.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ModelError {
    /// A metadata key is missing or has the wrong type (from the typed accessors).
    Metadata(GgufError),
    /// `general.architecture` names an architecture we do not run.
    UnsupportedArch {
        /// The name in the file.
        name: Name,
    },
    /// A mixture-of-experts architecture other than the ones pinfer runs (or experts in a dense
    /// architecture's file, as Mixtral's `llama` files have).
    UnsupportedMoe {
        /// The architecture name in the file.
        name: Name,
        /// Experts per layer, when the file says.
        experts: u32,
    },
    /// A hyper-parameter is outside the range we accept, or inconsistent with another.
    BadHParam {
        /// The key.
        key: Name,
        /// The value found.
        value: f64,
        /// What is wrong.
        problem: &'static str,
    },
    /// A per-layer hyper-parameter is wrong for one layer.
    BadLayerParam {
        /// The key.
        key: Name,
        /// The layer.
        layer: u32,
        /// The value found (-1: not a number).
        value: f64,
        /// What is wrong.
        problem: &'static str,
    },
    /// A key asks for math pinfer does not compute (a RoPE scaling type, a soft-cap, ...): refused
    /// at load instead of running with wrong numbers.
    Uncomputed {
        /// The key.
        key: Name,
        /// Its value, as text.
        found: Name,
        /// What pinfer computes, in words.
        computes: &'static str,
    },
    /// A key has a value pinfer cannot take (a text key, or a flag).
    BadKey {
        /// The key.
        key: Name,
        /// What the file has.
        found: Name,
        /// What is wrong, and the remedy.
        problem: &'static str,
    },
    /// A projector file (mmproj) of a family pinfer does not run.
    UnsupportedProjector {
        /// `clip.projector_type` in the file.
        name: Name,
        /// Whether llama.cpp knows the name (else the file may be broken).
        known: bool,
    },
    /// A tensor the architecture needs is absent.
    MissingTensor {
        /// The tensor's name.
        name: Name,
    },
    /// A tensor has another shape than the hyper-parameters imply.
    TensorShape {
        /// The tensor's name.
        name: Name,
        /// Shape implied by the hyper-parameters.
        expected: [u64; 4],
        /// Shape in the file.
        found: [u64; 4],
    },
    /// A tensor's type is not accepted for its role.
    TensorType {
        /// The tensor's name.
        name: Name,
        /// Its type.
        ty: GgmlType,
        /// The tensor's role, which decides the types it accepts.
        role: TensorKind,
    },
    /// Building the forward graph failed (capacity, or a shape the validation should have caught).
    Graph(GraphError),
    /// A LoRA adapter does not apply to the model's graph.
    Lora(lora::LoraError),
    /// The vocabulary metadata is inconsistent.
    Vocab {
        /// The key concerned.
        key: Name,
        /// What is wrong.
        problem: &'static str,
        /// A number that shows it (a length, an id, an index).
        value: u64,
    },
}

impl From<GraphError> for ModelError {
    fn from(e: GraphError) -> Self {
        ModelError::Graph(e)
    }
}

impl From<GgufError> for ModelError {
    fn from(e: GgufError) -> Self {
        ModelError::Metadata(e)
    }
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Metadata(e) => write!(f, "{e}"),
            Self::UnsupportedArch { name } => {
                write!(f, "architecture {name:?} is not supported (supported: {})", Supported::All)
            }
            Self::UnsupportedMoe { name, experts: 0 } => write!(
                f,
                "architecture {name:?} is a mixture-of-experts architecture pinfer does not run \
                 (mixture-of-experts support: {})",
                Supported::Moe
            ),
            Self::UnsupportedMoe { name, experts } => write!(
                f,
                "this {name:?} file has {experts} experts per layer (a Mixtral-style mixture of \
                 experts): pinfer runs {name:?} only as a dense model (mixture-of-experts support: {})",
                Supported::Moe
            ),
            Self::BadHParam { key, value, problem } => {
                write!(f, "hyper-parameter {key} = {value}: {problem}")
            }
            Self::BadLayerParam { key, layer, value, problem } => {
                write!(f, "hyper-parameter {key} of layer {layer} = {value}: {problem}")
            }
            Self::Uncomputed { key, found, computes } => write!(
                f,
                "{key} = {found} is not implemented in pinfer (it computes: {computes}); the model \
                 would give wrong numbers, so it is refused"
            ),
            Self::BadKey { key, found, problem } => write!(f, "{key} = {found:?}: {problem}"),
            Self::UnsupportedProjector { name, known } => {
                write!(f, "projector type {name:?} ")?;
                f.write_str(if *known { "is not supported" } else { "is unknown" })?;
                f.write_str(" (supported:")?;
                for p in vision::Projector::ALL {
                    write!(f, " {}", p.name())?;
                }
                f.write_str(")")
            }
            Self::MissingTensor { name } => {
                write!(f, "tensor {name:?} is missing; the file is incomplete or not this architecture")
            }
            Self::TensorShape { name, expected, found } => write!(
                f,
                "tensor {name:?} has shape {:?}, expected {:?} from the hyper-parameters",
                trim_shape(found),
                trim_shape(expected)
            ),
            Self::TensorType { name, ty, role } => {
                let accepted = role.accepted();
                write!(
                    f,
                    "tensor {name:?} has type {ty}, which pinfer does not run there (accepted: {accepted})"
                )
            }
            Self::Graph(e) => write!(f, "building the forward graph: {e}"),
            Self::Lora(e) => write!(f, "LoRA adapter: {e}"),
            Self::Vocab { key, problem, value } => write!(f, "vocabulary {key}: {problem} ({value})"),
        }
    }
}

impl core::error::Error for ModelError {}

/// A shape without its trailing 1s, for messages.
fn trim_shape(ne: &[u64; 4]) -> &[u64] {
    let mut n = 4;
    while n > 1 && ne[n - 1] == 1 {
        n -= 1;
    }
    &ne[..n]
}
