//! Why a graph could not be bound or run.

use core::fmt;

/// Why a graph could not be bound to memory or run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecError {
    /// A tensor's bytes fall outside the memory it is bound to.
    OutOfBounds {
        /// The tensor.
        name: heapless::String<40>,
        /// What it is bound to.
        memory: &'static str,
    },
    /// An activation has no planned slot (the plan is for another graph).
    Unplanned {
        /// The tensor.
        name: heapless::String<40>,
    },
    /// The work region is smaller than [`work_bytes`] says the graph needs.
    WorkTooSmall {
        /// Bytes needed.
        needed: usize,
    },
    /// The caller's address table has fewer entries than the graph has tensors.
    AddressTableTooSmall {
        /// Entries needed (one a tensor).
        needed: usize,
    },
    /// A row index read from a tensor (token id, expert id) is out of range.
    BadIndex {
        /// The node that read it.
        name: heapless::String<40>,
        /// The op.
        op: &'static str,
    },
    /// An MoE router produced NaN or infinity: its layer cannot pick experts.
    RouterNonFinite {
        /// The routing node (`"ffn_moe_topk-3"`: name and layer).
        name: heapless::String<40>,
    },
    /// The step writes past the end of the KV cache.
    CacheFull {
        /// The cache write node.
        name: heapless::String<40>,
    },
    /// A node produced NaN or infinity (found by the numerics check).
    NonFinite {
        /// The node (`"ffn_up-3"`: name and layer).
        name: heapless::String<40>,
        /// Its op.
        op: &'static str,
        /// Its input from the model file if it has one (the weights of a matmul, a norm's
        /// weights), else its first input.
        input: heapless::String<40>,
        /// NaN (else an infinity).
        nan: bool,
        /// Flat index of the first bad element found.
        index: u32,
    },
}

/// A node name as the model builder writes it, `"ffn_up-3"`, split into `("ffn_up", Some(3))`.
pub fn split_layer(name: &str) -> (&str, Option<u32>) {
    match name.rsplit_once('-') {
        Some((base, layer)) if !base.is_empty() => match layer.parse::<u32>() {
            Ok(il) => (base, Some(il)),
            Err(_) => (name, None),
        },
        _ => (name, None),
    }
}

impl fmt::Display for ExecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutOfBounds { name, memory } => write!(f, "tensor {name:?} lies outside its {memory}"),
            Self::Unplanned { name } => write!(f, "tensor {name:?} has no planned memory; plan this graph"),
            Self::WorkTooSmall { needed } => {
                write!(f, "work region too small: the graph needs {needed} bytes")
            }
            Self::AddressTableTooSmall { needed } => {
                write!(f, "address table too small: the graph has {needed} tensors")
            }
            Self::BadIndex { name, op } => write!(f, "{op} in {name:?} read an index outside its table"),
            Self::CacheFull { name } => write!(f, "{name:?}: the KV cache is full (raise the context size)"),
            Self::RouterNonFinite { name } => {
                let layer = split_layer(name).1.map_or(-1, i64::from);
                write!(
                    f,
                    "the MoE router of layer {layer} produced a non-finite value ({name:?}): generation \
                     stopped; the model's router weights or an earlier layer are broken \
                     (run with --check-numerics to find where)"
                )
            }
            Self::NonFinite { name, op, input, nan, index } => {
                let what = if *nan { "NaN" } else { "infinity" };
                match split_layer(name) {
                    (base, Some(il)) => write!(f, "non-finite value ({what}) in {base}, layer {il}")?,
                    (base, None) => write!(f, "non-finite value ({what}) in {base}")?,
                }
                write!(f, " (op {op}, input {input}; tensor {name}, element {index})")
            }
        }
    }
}

impl core::error::Error for ExecError {}
