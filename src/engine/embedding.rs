//! What a front end does with an encoder's embeddings: normalise them as llama.cpp's
//! `--embd-normalize` does, and compare them (cosine similarity). In caller buffers, no
//! allocation.

/// How an embedding is normalised (llama.cpp's `--embd-normalize` values).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Normalize {
    /// `-1`: as the model gives it.
    None,
    /// `0`: divided by its largest magnitude and scaled to the int16 range (times 32760).
    MaxAbs,
    /// `1`: divided by the sum of its magnitudes.
    Taxicab,
    /// `2` (the default): divided by its Euclidean length.
    Euclidean,
    /// `p > 2`: divided by its p-norm.
    PNorm(u32),
}

impl Normalize {
    /// The kind llama.cpp's value `v` asks for (`None` below -1).
    pub fn from_value(v: i32) -> Option<Self> {
        Some(match v {
            -1 => Self::None,
            0 => Self::MaxAbs,
            1 => Self::Taxicab,
            2 => Self::Euclidean,
            p if p > 2 => Self::PNorm(p as u32),
            _ => return None,
        })
    }

    /// llama.cpp's value.
    pub fn value(self) -> i32 {
        match self {
            Self::None => -1,
            Self::MaxAbs => 0,
            Self::Taxicab => 1,
            Self::Euclidean => 2,
            Self::PNorm(p) => p as i32,
        }
    }
}

/// `out = x / norm(x)` as llama.cpp's `common_embd_normalize` computes it (the norm summed in
/// f64; a zero vector stays zero). `out` and `x` have the same length (extra values of the
/// longer are left).
pub fn normalize(x: &[f32], out: &mut [f32], how: Normalize) {
    let sum: f64 = match how {
        Normalize::None => 1.0,
        Normalize::MaxAbs => x.iter().fold(0.0f64, |m, &v| m.max(f64::from(v.abs()))) / 32760.0,
        Normalize::Euclidean => libm::sqrt(x.iter().map(|&v| f64::from(v * v)).sum::<f64>()),
        Normalize::Taxicab => x.iter().map(|&v| f64::from(v.abs())).sum::<f64>(),
        Normalize::PNorm(p) => {
            let sum: f64 = x.iter().map(|&v| libm::pow(f64::from(v.abs()), f64::from(p))).sum();
            libm::pow(sum, 1.0 / f64::from(p))
        }
    };
    let scale = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = v * scale);
}

/// The cosine similarity of two embeddings (llama.cpp's `common_embd_similarity_cos`: sums in
/// f64; 1 for two zero vectors, 0 for one).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        // (Products in f32, sums in f64, as llama.cpp.)
        ab += f64::from(x * y);
        aa += f64::from(x * x);
        bb += f64::from(y * y);
    }
    if aa == 0.0 || bb == 0.0 {
        return if aa == 0.0 && bb == 0.0 { 1.0 } else { 0.0 };
    }
    (ab / (libm::sqrt(aa) * libm::sqrt(bb))) as f32
}
