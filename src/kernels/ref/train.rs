//! The row kernels of training's backward pass (scalar: they run once per step, not per token).

use libm::{expf, logf, sqrtf};

/// The gradient of RMS norm: with `y = x / r`, `r = sqrt(mean(x^2) + eps)`,
/// `dx = (dy - y * mean(dy * y)) / r`.
pub fn rms_norm_back_ref(x: &[f32], dy: &[f32], out: &mut [f32], eps: f32) {
    let n = x.len().max(1) as f64;
    let mean_sq = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n;
    let r = sqrtf(mean_sq as f32 + eps);
    let dot = x.iter().zip(dy).map(|(&v, &d)| f64::from(v / r) * f64::from(d)).sum::<f64>() / n;
    for ((o, &v), &d) in out.iter_mut().zip(x).zip(dy) {
        *o = (d - (v / r) * dot as f32) / r;
    }
}

/// The gradient of a softmax of `x * scale` from its output `y`: `dx = scale * y * (dy - <dy, y>)`
/// (masked entries have `y = 0`, so get 0).
pub fn soft_max_back_ref(y: &[f32], dy: &[f32], out: &mut [f32], scale: f32) {
    let dot = y.iter().zip(dy).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() as f32;
    for ((o, &a), &d) in out.iter_mut().zip(y).zip(dy) {
        *o = scale * a * (d - dot);
    }
}

/// `-log softmax(logits)[target]` in f64 (`logsumexp - logit`).
pub fn cross_entropy_ref(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&v| f64::from(expf(v - max))).sum();
    f64::from(max) + f64::from(logf(sum as f32)) - f64::from(logits[target])
}

/// The gradient of `scale * cross_entropy_ref(logits, target)`: `scale * (softmax - onehot)`.
pub fn cross_entropy_back_ref(logits: &[f32], target: usize, scale: f32, out: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&v| f64::from(expf(v - max))).sum();
    let inv = (1.0 / sum) as f32;
    for (o, &v) in out.iter_mut().zip(logits) {
        *o = scale * expf(v - max) * inv;
    }
    out[target] -= scale;
}
