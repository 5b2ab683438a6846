//! Activation quantization for the packed matmuls.

use core::arch::aarch64::*;

use super::*;
use crate::kernels::packed::{ActBlock, BLOCK};
use crate::kernels::reference::quantize_act_ref;

// ---------------------------------------------------------------------------------------------
// Activation quantization

/// Activation quantization; the same bytes as `reference::quantize_act_ref`.
pub fn quantize_act(x: &[f32], out: &mut [ActBlock]) {
    debug_assert_eq!(x.len(), out.len() * BLOCK);
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { quantize_act_neon(x, out) }
}

#[target_feature(enable = "neon")]
fn quantize_act_neon(x: &[f32], out: &mut [ActBlock]) {
    let zero = vdupq_n_f32(0.0);
    for (x, b) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let v: [float32x4_t; 8] = core::array::from_fn(|i| ld_f32x4(&x[4 * i..]));
        // max(0, |v|...) ignoring NaNs, like the reference's fold.
        let m = |a: float32x4_t, b: float32x4_t| vmaxnmq_f32(vabsq_f32(a), vabsq_f32(b));
        let m = vmaxnmq_f32(
            vmaxnmq_f32(m(v[0], v[1]), m(v[2], v[3])),
            vmaxnmq_f32(vmaxnmq_f32(m(v[4], v[5]), m(v[6], v[7])), zero),
        );
        let amax = vmaxnmvq_f32(m);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        if id == f32::INFINITY {
            // amax < 127 / f32::MAX: the products saturate, which the narrowing below would not.
            quantize_act_ref(x, core::slice::from_mut(b));
            continue;
        }
        // Round half to even, as rintf.
        let q: [int32x4_t; 8] = core::array::from_fn(|i| vcvtnq_s32_f32(vmulq_n_f32(v[i], id)));
        let h = |a: int32x4_t, b: int32x4_t| vuzp1q_s16(vreinterpretq_s16_s32(a), vreinterpretq_s16_s32(b));
        let h = [h(q[0], q[1]), h(q[2], q[3]), h(q[4], q[5]), h(q[6], q[7])];
        let sum = vaddlvq_s16(vaddq_s16(vaddq_s16(h[0], h[1]), vaddq_s16(h[2], h[3])));
        let lo = vuzp1q_s8(vreinterpretq_s8_s16(h[0]), vreinterpretq_s8_s16(h[1]));
        let hi = vuzp1q_s8(vreinterpretq_s8_s16(h[2]), vreinterpretq_s8_s16(h[3]));
        let (qlo, qhi) = b.qs.split_at_mut(16);
        // SAFETY: writes the 16 bytes of each half.
        unsafe {
            vst1q_s8(qlo.as_mut_ptr(), lo);
            vst1q_s8(qhi.as_mut_ptr(), hi);
        }
        let ds = vcombine_f32(vset_lane_f32::<1>(d * sum as f32, vdup_n_f32(d)), vdup_n_f32(0.0));
        let ds = f16_round4(ds);
        b.d = vgetq_lane_f32::<0>(ds);
        b.s = vgetq_lane_f32::<1>(ds);
    }
}
