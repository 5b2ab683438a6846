//! Portable scalar reference kernels: the twins every SIMD kernel is tested against.
//!
//! They work on slices whose lengths the graph builder already checked; `debug_assert!`s restate
//! those preconditions. Math follows ggml's CPU reference where it matters for matching llama.cpp
//! (RoPE angle recurrence, softmax order of operations, GELU's tanh form).
//!
//! One file per concept, as in `neon` and `x86`: `matmul`, `elementwise`, `flash_attn`.

mod elementwise;
mod flash_attn;
mod matmul;

pub use elementwise::*;
pub use flash_attn::*;
pub use matmul::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_masks_and_normalises() {
        let x = [1.0, 2.0, 3.0, 100.0];
        let mut out = [9.0; 4];
        soft_max_ref(&x, &mut out, 1.0, 0, 3);
        let total: f32 = out.iter().sum();
        assert!((total - 1.0).abs() < 1e-6 && out[3] == 0.0 && out[2] > out[1]);
        soft_max_ref(&x, &mut out, 1.0, 2, 2);
        assert_eq!(out, [0.0; 4], "a row with nothing visible is zeros, not NaN");
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let x: [f32; 8] = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0];
        for neox in [false, true] {
            let p = RopeParams { n_rot: 6, neox, freq_base: 10000.0, freq_scale: 1.0, freq_factors: None };
            let mut out = [0.0; 8];
            rope_ref(&x, &mut out, 0, &p);
            assert_eq!(out, x);
            rope_ref(&x, &mut out, 17, &p);
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((norm(&out) - norm(&x)).abs() < 1e-4);
            assert_eq!(out[6..], x[6..], "dimensions past n_rot are copied");
        }
    }

    #[test]
    fn activations_match_their_definitions() {
        let x = [-3.0f32, -0.5, 0.0, 0.5, 3.0];
        let mut s = [0.0; 5];
        let mut g = [0.0; 5];
        silu_ref(&x, &mut s);
        gelu_ref(&x, &mut g);
        for i in 0..5 {
            assert!((s[i] - x[i] / (1.0 + (-x[i]).exp())).abs() < 1e-6);
            let erf_gelu = 0.5 * x[i] * (1.0 + libm::erff(x[i] / core::f32::consts::SQRT_2));
            assert!((g[i] - erf_gelu).abs() < 1e-3, "tanh GELU is close to the erf form");
        }
    }
}
