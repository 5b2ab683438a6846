//! x86_64 AVX2 + FMA + F16C kernels, twins of `packed` and `reference`.
//!
//! Each public `unsafe fn` is the dispatch entry (the caller checked the CPU features); the work is
//! done by private `#[target_feature]` functions, where the arithmetic intrinsics are safe and only
//! raw-pointer loads and stores need `unsafe`.
//!
//! One file per concept, as in `neon`: `matmul`, `elementwise`, `flash_attn`.

mod elementwise;
mod f16_gemm;
mod f16_tile;
mod flash_attn;
mod matmul;

pub use elementwise::*;
pub use f16_gemm::*;
pub use f16_tile::*;
pub use flash_attn::*;
pub use matmul::*;

#[cfg(test)]
mod tests {
    use super::elementwise::expf8;
    use super::flash_attn::libm_expf8;
    use core::arch::x86_64::*;

    fn avx2() -> bool {
        super::super::KernelPath::Avx2.is_available()
    }

    /// Both exp twins, 8 lanes at a time, against their scalar originals for `xs`.
    fn check_exps(xs: &[f32]) {
        for c in xs.chunks(8) {
            let mut x = [0f32; 8];
            x[..c.len()].copy_from_slice(c);
            let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
            // SAFETY: the CPU has AVX2, FMA and F16C (checked by the caller); 8-element arrays.
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr());
                _mm256_storeu_ps(a.as_mut_ptr(), libm_expf8(v));
                _mm256_storeu_ps(b.as_mut_ptr(), expf8(v));
            }
            for i in 0..8 {
                let (wa, wb) = (libm::expf(x[i]), super::super::reference::ggml_expf(x[i]));
                let same = |g: f32, w: f32| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                assert!(same(a[i], wa), "libm expf({:e}) = {:e}, vector {:e}", x[i], wa, a[i]);
                assert!(same(b[i], wb), "ggml expf({:e}) = {:e}, vector {:e}", x[i], wb, b[i]);
            }
        }
    }

    #[test]
    fn vector_exps_are_bit_identical_on_samples() {
        if !avx2() {
            return;
        }
        check_exps(&[0.0, -0.0, 1e-30, -1e-30, 6.1e-5, -6.1e-5, 0.3465, 0.3466, 1.0397, 1.0398]);
        check_exps(&[87.33, 88.72, 88.7228, 88.723, 89.0, -87.33, -87.34, -100.0, -103.97, -103.98, -104.0]);
        check_exps(&[150.0, 192.0, 193.0, -150.0, -192.0, -193.0, 1e30, -1e30, f32::MAX, f32::MIN]);
        check_exps(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::from_bits(1)]);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..1 << 17 {
            let mut xs = [0f32; 16];
            for pair in xs.chunks_exact_mut(2) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Any bit pattern, and a dense sweep of the range that matters.
                pair[0] = f32::from_bits(state as u32);
                pair[1] = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 240.0;
            }
            check_exps(&xs);
        }
    }

    /// Every f32: `cargo test --release --lib x86::tests::vector_exps_are_bit_identical_everywhere --
    /// --ignored` (a few minutes).
    #[test]
    #[ignore]
    fn vector_exps_are_bit_identical_everywhere() {
        if !avx2() {
            return;
        }
        for hi in 0..1u32 << 28 {
            let xs: [f32; 16] = core::array::from_fn(|lo| f32::from_bits((hi << 4) | lo as u32));
            check_exps(&xs);
        }
    }
}
