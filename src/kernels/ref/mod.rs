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
mod train;

pub use elementwise::*;
pub use flash_attn::*;
pub use matmul::*;
pub use train::*;

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast transform is the product with Sylvester's orthonormal matrix (`(-1)^popcount(i &
    /// j) / sqrt(n)`, llama.cpp's `ggml_gen_hadamard`), run by run, and applying it twice gives
    /// the input back (the rotation is its own inverse).
    #[test]
    fn hadamard_is_sylvesters_matrix_and_its_own_inverse() {
        let x: [f32; 136] = core::array::from_fn(|i| libm::sinf(i as f32 * 0.7) * (1 + i % 5) as f32);
        for n in [2usize, 4, 64, 128] {
            let mut y = [0f32; 136];
            hadamard_ref(&x, &mut y, n);
            let whole = x.len() - x.len() % n;
            for run in 0..whole / n {
                for i in 0..n {
                    let want: f64 = (0..n)
                        .map(|j| {
                            let sign = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
                            sign * f64::from(x[run * n + j])
                        })
                        .sum::<f64>()
                        / libm::sqrt(n as f64);
                    assert!((f64::from(y[run * n + i]) - want).abs() < 1e-5, "n={n} run {run} [{i}]");
                }
            }
            assert_eq!(y[whole..], x[whole..], "n={n}: the tail is copied");
            let mut back = [0f32; 136];
            hadamard_ref(&y, &mut back, n);
            for (a, b) in back.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5, "n={n}: {a} vs {b}");
            }
        }
    }

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

    /// YaRN's ramp ends (ggml_rope_yarn_corr_dims, checked by hand in f32) and its blend: pairs
    /// below the ramp keep the unscaled angle, pairs above take the scaled one.
    #[test]
    fn yarn_ramp_and_blend() {
        assert_eq!(Yarn::corr_dims(128, 32768, 1e6, 32.0, 1.0), [23.0, 40.0]);
        assert_eq!(Yarn::corr_dims(32, 64, 1e6, 32.0, 1.0), [0.0, 3.0]);
        // As ggml: only the end is clamped (to n_rot - 1), the start only to 0.
        assert_eq!(Yarn::corr_dims(16, 1 << 20, 10.0, 32.0, 1.0), [29.0, 15.0]);
        let yarn = Yarn { ext_factor: 1.0, corr_dims: [2.0, 6.0] };
        let p = |yarn| RopeParams {
            n_rot: 16,
            neox: false,
            freq_base: 100.0,
            freq_scale: 0.25,
            freq_factors: None,
            yarn,
        };
        let (plain, scaled) = (RopeParams { freq_scale: 1.0, ..p(None) }, p(None));
        let table = |p: &RopeParams<'_>| {
            let (mut c, mut s) = ([0f32; 8], [0f32; 8]);
            rope_table_ref(37, p, 0, &mut c, &mut s);
            c
        };
        let (got, unscaled, linear) = (table(&p(Some(yarn))), table(&plain), table(&scaled));
        assert_eq!(got[..3], unscaled[..3], "pairs 0..=2: extrapolated");
        assert_eq!(got[6..], linear[6..], "pairs 6..: interpolated");
        assert!(got[3..6].iter().zip(&unscaled[3..6]).all(|(g, u)| g != u), "the ramp blends");
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let x: [f32; 8] = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 3.0, 1.0];
        for neox in [false, true] {
            let p = RopeParams {
                n_rot: 6,
                neox,
                freq_base: 10000.0,
                freq_scale: 1.0,
                freq_factors: None,
                yarn: None,
            };
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
