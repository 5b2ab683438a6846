//! LoRA adapters in llama.cpp's GGUF form: `general.type` = `adapter`, `adapter.type` = `lora`,
//! `adapter.lora.alpha`, `general.architecture` the base model's, and for each adapted weight `W`
//! (`[n_in, n_out]`) the tensors `W.lora_a` (`[n_in, r]`) and `W.lora_b` (`[r, n_out]`); the
//! adapted product is `W x + scale * B (A x)` with `scale = user_scale * alpha / r` (`alpha` 0 or
//! absent: `user_scale`). [`LoraAdapter::check`] reads one against its base model and refuses,
//! with the key or the tensor named, anything that would not apply.

use core::fmt;

use crate::gguf::{Gguf, GgufError, Name, TensorInfo};
use crate::model::HParams;

/// Most adapted weights one adapter holds (every projection of a 128-layer model).
pub const MAX_LORA_PAIRS: usize = 1024;

/// Why an adapter does not apply to a model.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum LoraError {
    /// A metadata key is missing or has the wrong type.
    Gguf(GgufError),
    /// The file is not a LoRA adapter (`general.type` / `adapter.type`).
    NotAnAdapter {
        /// What the file says it is.
        found: Name,
    },
    /// The adapter was made for another architecture.
    Architecture {
        /// The adapter's.
        adapter: Name,
        /// The model's.
        model: &'static str,
    },
    /// A tensor whose name ends in neither `.lora_a` nor `.lora_b`.
    NotLora {
        /// Its name.
        name: Name,
    },
    /// An `A` without its `B`, or a `B` without its `A`.
    Unpaired {
        /// The tensor present.
        name: Name,
    },
    /// The model has no weight of that name.
    NoSuchWeight {
        /// The adapted weight's name.
        name: Name,
    },
    /// The pair's shapes do not fit the weight, or `A`'s rank differs from `B`'s.
    Shape {
        /// The adapted weight's name.
        name: Name,
        /// What is wrong.
        problem: &'static str,
    },
    /// Pairs of different ranks in one adapter.
    MixedRanks {
        /// The first pair's rank.
        first: u64,
        /// The adapted weight whose rank differs.
        name: Name,
        /// Its rank.
        rank: u64,
    },
    /// More pairs than [`MAX_LORA_PAIRS`], or none.
    Count(usize),
    /// `adapter.lora.alpha` is negative or not finite.
    Alpha(f32),
    /// A tensor holds NaN or infinity.
    NonFinite {
        /// Its name.
        name: Name,
    },
    /// A weight of a type the adapter's matmuls have no kernel for.
    Type {
        /// The tensor's name.
        name: Name,
    },
    /// The model's graph does not multiply the adapted weight whole (a fused projection read in
    /// parts, an embedding table, an expert stack): pinfer cannot add the adapter's product to it.
    Unapplied {
        /// The adapted weight's name.
        name: Name,
    },
    /// More adapters than [`MAX_ADAPTERS`].
    TooMany(usize),
}

impl From<GgufError> for LoraError {
    fn from(e: GgufError) -> Self {
        Self::Gguf(e)
    }
}

impl fmt::Display for LoraError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gguf(e) => write!(f, "{e}"),
            Self::NotAnAdapter { found } => {
                write!(f, "not a LoRA adapter (general.type / adapter.type say {found:?}; need \"adapter\" / \"lora\")")
            }
            Self::Architecture { adapter, model } => {
                write!(f, "the adapter is for architecture {adapter:?}, the model is {model:?}")
            }
            Self::NotLora { name } => write!(f, "tensor {name:?} is neither a .lora_a nor a .lora_b"),
            Self::Unpaired { name } => {
                write!(f, "tensor {name:?} has no partner (.lora_a needs .lora_b and back)")
            }
            Self::NoSuchWeight { name } => {
                write!(f, "the adapter adapts {name:?}, which the model does not have")
            }
            Self::Shape { name, problem } => write!(f, "the adapter's pair for {name:?}: {problem}"),
            Self::MixedRanks { first, name, rank } => {
                write!(f, "the adapter's pair for {name:?} has rank {rank}, the others {first}")
            }
            Self::Count(n) => write!(f, "the adapter has {n} pairs (1..={MAX_LORA_PAIRS})"),
            Self::Alpha(a) => write!(f, "adapter.lora.alpha is {a}: it must be finite and not negative"),
            Self::NonFinite { name } => write!(f, "the adapter's tensor {name:?} holds NaN or infinity"),
            Self::Type { name } => {
                write!(f, "the adapter's tensor {name:?} has a type pinfer cannot multiply")
            }
            Self::Unapplied { name } => write!(
                f,
                "the adapter adapts {name:?}, which this architecture's graph does not multiply whole \
                 (a fused, embedding or expert weight): not supported"
            ),
            Self::TooMany(n) => write!(f, "{n} adapters: at most {MAX_ADAPTERS} apply at once"),
        }
    }
}

impl core::error::Error for LoraError {}

/// One adapted weight.
#[derive(Debug, Clone, Copy)]
pub struct LoraPair<'a> {
    /// The base weight's name (`blk.0.attn_q.weight`).
    pub target: &'a str,
    /// `A`, `[n_in, r]`.
    pub a: TensorInfo<'a>,
    /// `B`, `[r, n_out]`.
    pub b: TensorInfo<'a>,
}

/// An adapter checked against a model.
#[derive(Debug, Clone)]
pub struct LoraAdapter<'a> {
    /// `adapter.lora.alpha` (0 when absent).
    pub alpha: f32,
    /// The pairs' rank.
    pub rank: u64,
    /// The adapted weights, in the file's order of their `A` tensors.
    pub pairs: heapless::Vec<LoraPair<'a>, MAX_LORA_PAIRS>,
    /// Where the adapter file's tensor data starts (tensor offsets count from there).
    pub data_start: usize,
}

/// Most adapters one model runs with at once.
pub const MAX_ADAPTERS: usize = 8;

/// An adapter applied to a model: its file's bytes, its checked pairs and the factor of its
/// `B (A x)` ([`LoraAdapter::scale`] of the user's scale).
#[derive(Debug, Clone)]
pub struct Adapter<'a> {
    /// The adapter file, whole.
    pub bytes: &'a [u8],
    /// Its pairs, checked against the model.
    pub lora: LoraAdapter<'a>,
    /// The factor of `B (A x)`.
    pub scale: f32,
}

impl<'a> Adapter<'a> {
    /// The adapter file `bytes` (parsed as `gguf`) checked against the model `base` (`hp`), its
    /// weights finite, at `user_scale` (1 for `--lora`).
    pub fn new(
        bytes: &'a [u8],
        gguf: &Gguf<'a>,
        base: &Gguf<'_>,
        hp: &HParams,
        user_scale: f32,
    ) -> Result<Self, LoraError> {
        let lora = LoraAdapter::check(gguf, base, hp)?;
        let adapter = Self { bytes, scale: lora.scale(user_scale), lora };
        adapter.check_finite()?;
        Ok(adapter)
    }

    /// The bytes of one of the adapter's tensors, if they lie inside the file.
    pub fn data(&self, t: &TensorInfo<'_>) -> Option<&'a [u8]> {
        let start = self.lora.data_start.checked_add(t.offset as usize)?;
        self.bytes.get(start..start.checked_add(t.nbytes as usize)?)
    }

    /// Refuses an adapter whose weights are not all finite, naming the first bad tensor.
    pub fn check_finite(&self) -> Result<(), LoraError> {
        for p in &self.lora.pairs {
            for t in [&p.a, &p.b] {
                let bytes = self.data(t).ok_or(LoraError::Shape {
                    name: name(t.name),
                    problem: "its data lies outside the file",
                })?;
                if !crate::quant::all_finite(t.ty, bytes) {
                    return Err(LoraError::NonFinite { name: name(t.name) });
                }
            }
        }
        Ok(())
    }
}

impl<'a> LoraAdapter<'a> {
    /// Reads `adapter` as a LoRA adapter of the model `base` (with hyperparameters `hp`).
    pub fn check(adapter: &Gguf<'a>, base: &Gguf<'_>, hp: &HParams) -> Result<Self, LoraError> {
        let kind = adapter.get_str_opt("general.type")?.unwrap_or("");
        let lora = adapter.get_str_opt("adapter.type")?.unwrap_or("");
        if kind != "adapter" || lora != "lora" {
            let mut found = Name::new();
            let _ = fmt::Write::write_fmt(&mut found, format_args!("{kind} / {lora}"));
            return Err(LoraError::NotAnAdapter { found });
        }
        let arch = adapter.get_str_opt("general.architecture")?.unwrap_or("");
        if arch != hp.arch.name() {
            return Err(LoraError::Architecture { adapter: name(arch), model: hp.arch.name() });
        }
        let alpha = adapter.get_f32_opt("adapter.lora.alpha")?.unwrap_or(0.0);
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(LoraError::Alpha(alpha));
        }
        let mut pairs = heapless::Vec::new();
        let mut rank = None;
        for t in adapter.tensors() {
            let (target, is_a) = match (t.name.strip_suffix(".lora_a"), t.name.strip_suffix(".lora_b")) {
                (Some(target), _) => (target, true),
                (_, Some(target)) => (target, false),
                _ => return Err(LoraError::NotLora { name: name(t.name) }),
            };
            let mut partner = Name::new();
            let _ = fmt::Write::write_fmt(
                &mut partner,
                format_args!("{target}.lora_{}", if is_a { 'b' } else { 'a' }),
            );
            let other = adapter.tensor(&partner).ok_or(LoraError::Unpaired { name: name(t.name) })?;
            if !is_a {
                continue; // the pair is taken with its A
            }
            let (a, b) = (t, other);
            let w = base.tensor(target).ok_or(LoraError::NoSuchWeight { name: name(target) })?;
            let bad = |problem| LoraError::Shape { name: name(target), problem };
            if a.ne[2] * a.ne[3] != 1 || b.ne[2] * b.ne[3] != 1 || w.ne[2] * w.ne[3] != 1 {
                return Err(bad("2-D tensors only"));
            }
            if a.ne[0] != w.ne[0] {
                return Err(bad("lora_a's rows are not as long as the weight's"));
            }
            if b.ne[1] != w.ne[1] {
                return Err(bad("lora_b has not as many rows as the weight"));
            }
            for t in [&a, &b] {
                if crate::kernels::dot::vec_dot_type(t.ty).is_none() {
                    return Err(LoraError::Type { name: name(t.name) });
                }
            }
            if a.ne[1] != b.ne[0] || a.ne[1] == 0 {
                return Err(bad("lora_a's rank differs from lora_b's (or lora_a is not transposed)"));
            }
            let r = a.ne[1];
            match rank {
                None => rank = Some(r),
                Some(first) if first != r => {
                    return Err(LoraError::MixedRanks { first, name: name(target), rank: r })
                }
                _ => {}
            }
            if pairs.push(LoraPair { target, a, b }).is_err() {
                return Err(LoraError::Count(MAX_LORA_PAIRS + 1));
            }
        }
        let rank = rank.ok_or(LoraError::Count(0))?;
        Ok(Self { alpha, rank, pairs, data_start: adapter.data_start() })
    }

    /// The factor of `B (A x)` for a user scale (`--lora-scaled FILE SCALE`; 1 for `--lora`).
    pub fn scale(&self, user_scale: f32) -> f32 {
        if self.alpha > 0.0 {
            user_scale * self.alpha / self.rank as f32
        } else {
            user_scale
        }
    }

    /// The pair adapting weight `target`, if any.
    pub fn pair(&self, target: &str) -> Option<&LoraPair<'a>> {
        self.pairs.iter().find(|p| p.target == target)
    }
}

/// Adds `scale * B A` to a weight `w` of `n_out` rows of `n_in` (the file's layout), with `a`
/// of `r` rows of `n_in` (`lora_a`, `[n_in, r]`) and `b` of `n_out` rows of `r` (`lora_b`,
/// `[r, n_out]`): the merge `pinfer export-lora` writes. Each product is summed over the rank in
/// f32, in rank order.
pub fn add_product(w: &mut [f32], a: &[f32], b: &[f32], n_in: usize, rank: usize, scale: f32) {
    debug_assert!(w.len() % n_in == 0 && a.len() == rank * n_in && b.len() == w.len() / n_in * rank);
    for (row, b_row) in w.chunks_exact_mut(n_in).zip(b.chunks_exact(rank)) {
        for (i, x) in row.iter_mut().enumerate() {
            let mut sum = 0.0f32;
            for (k, &bk) in b_row.iter().enumerate() {
                sum += bk * a[k * n_in + i];
            }
            *x += scale * sum;
        }
    }
}

fn name(s: &str) -> Name {
    let mut n = Name::new();
    for c in s.chars() {
        if n.push(c).is_err() {
            break;
        }
    }
    n
}

/// One adapted weight's values to write: `A` (`[n_in, r]`, `n_in * r` values, rows of `n_in`)
/// and `B` (`[r, n_out]`).
#[cfg(feature = "std")]
#[derive(Debug, Clone, Copy)]
pub struct PairValues<'v> {
    /// The base weight's name.
    pub target: &'v str,
    /// `n_in`.
    pub n_in: usize,
    /// `n_out`.
    pub n_out: usize,
    /// `A`'s values.
    pub a: &'v [f32],
    /// `B`'s values.
    pub b: &'v [f32],
}

/// Writes a LoRA adapter in llama.cpp's form (F32 tensors, [`LoraAdapter::check`] reads it back)
/// for a model of architecture `arch`, rank `rank` and `alpha`.
#[cfg(feature = "std")]
pub fn write_adapter<W: std::io::Write>(
    out: W,
    arch: &str,
    rank: usize,
    alpha: f32,
    pairs: &[PairValues<'_>],
) -> std::io::Result<W> {
    use crate::gguf::write::{GgufWriter, TensorHeader};
    use crate::gguf::Value;
    use std::string::String;
    use std::vec::Vec;
    let bad = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, msg);
    let mut names: Vec<(String, String)> = Vec::with_capacity(pairs.len());
    for p in pairs {
        if p.a.len() != p.n_in * rank || p.b.len() != rank * p.n_out {
            return Err(bad(std::format!("{}: the values do not match rank {rank}", p.target)));
        }
        names.push((std::format!("{}.lora_a", p.target), std::format!("{}.lora_b", p.target)));
    }
    let mut tensors = Vec::with_capacity(2 * pairs.len());
    for (p, (a, b)) in pairs.iter().zip(&names) {
        let header = |name, ne0: usize, ne1: usize| TensorHeader {
            name,
            ty: crate::quant::GgmlType::F32,
            n_dims: 2,
            ne: [ne0 as u64, ne1 as u64, 1, 1],
        };
        tensors.push(header(a.as_str(), p.n_in, rank));
        tensors.push(header(b.as_str(), rank, p.n_out));
    }
    let metadata = [
        ("general.architecture", Value::String(arch.as_bytes())),
        ("general.type", Value::String(b"adapter")),
        ("adapter.type", Value::String(b"lora")),
        ("adapter.lora.alpha", Value::F32(alpha)),
    ];
    let mut w = GgufWriter::start(out, &metadata, &tensors)?;
    for p in pairs {
        w.write_tensor_data(bytemuck::cast_slice(p.a))?;
        w.write_tensor_data(bytemuck::cast_slice(p.b))?;
    }
    Ok(w.finish()?.0)
}
