//! Ops that pick or rotate rows: RoPE and its table, row lookup by id, MoE routing.

use crate::kernels;
use crate::kernels::reference as kref;
use crate::quant::dequantize_row_ref;
use crate::tensor::{Tensor, TensorId};

use crate::exec::bound::{rows, rows_of, share, BAD_INDEX, ROUTER_NON_FINITE};
use crate::exec::{Bound, Step};

impl<'a, const N: usize> Bound<'a, N> {
    /// RoPE's cosines and sines per token (its position from the places table, else `n_past + t`).
    pub(in crate::exec) fn rope_table(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        ith: usize,
        nth: usize,
    ) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            // The builder checked the factors hold at least n_rot / 2 contiguous values.
            let factors = src(1).map(|(f, tf)| self.read::<f32>(f, 0, tf.n_elements()));
            let ext_factor = t.params.f[3];
            let corr_dims = [f32::from_bits(t.params.i[1] as u32), f32::from_bits(t.params.i[2] as u32)];
            let p = kref::RopeParams {
                n_rot: ne[0],
                neox: false,
                freq_base: t.params.f[0],
                freq_scale: t.params.f[1],
                freq_factors: factors,
                yarn: (ext_factor != 0.0).then_some(kref::Yarn { ext_factor, corr_dims }),
            };
            let half = ne[0] / 2;
            for i1 in share(ne[1], ith, nth) {
                let row: &mut [f32] = self.write(id, t.row_offset(i1, 0, 0), ne[0]);
                let (cos, sin) = row.split_at_mut(half);
                let pos = match self.place(t.src[2], i1) {
                    Some(Some((_, pos))) => pos,
                    Some(None) => {
                        self.fail(id, BAD_INDEX);
                        0
                    }
                    None => step.n_past + i1,
                };
                kref::rope_table_ref(pos, &p, 0, cos, sin);
                let mscale = t.params.f[2];
                if mscale != 1.0 {
                    // ggml multiplies each cosine and sine by the attention factor.
                    cos.iter_mut().chain(sin.iter_mut()).for_each(|v| *v *= mscale);
                }
            }
        }
    }
    /// RoPE of each head row by its token's angles.
    pub(in crate::exec) fn rope(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((table, tt))) = (src(0), src(1)) else { return };
            let (n_rot, neox) = (tt.ne[0], t.params.i[1] == 1);
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                // Token i2's angles: the builder checked the table has a row per token.
                let (cos, sin) = self.read::<f32>(table, tt.row_offset(i2, 0, 0), n_rot).split_at(n_rot / 2);
                if t.params.i[2] == 1 {
                    // The inverse rotation: the same cosines, the sines negated (the builder
                    // checked n_rot / 2 fits).
                    let mut back = [0f32; crate::graph::ROPE_BACK_MAX_PAIRS];
                    let back = &mut back[..sin.len()];
                    back.iter_mut().zip(sin).for_each(|(b, &s)| *b = -s);
                    kernels::rope_rotate(path, x, out, cos, back, neox);
                    continue;
                }
                kernels::rope_rotate(path, x, out, cos, sin, neox);
            }
        }
    }
    pub(in crate::exec) fn get_rows(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((table, tt)), Some((ids, _))) = (src(0), src(1)) else { return };
            let ids: &[i32] = self.read(ids, 0, ne[1]);
            // The table may be a slice of a wider one: read ne[0] elements at each row's stride.
            let row_bytes = tt.ty.bytes_for(ne[0] as u64).unwrap_or(0) as usize;
            // A tied embedding whose repacked copy holds the file's values exactly: its rows are
            // read from that copy, the file's pages are never touched again.
            let packed = self
                .packed_weights(tt)
                .filter(|w| tt.ty.traits().rows_from_packed && w.k == ne[0] && ne[0] == tt.ne[0]);
            for i1 in share(ne[1], ith, nth) {
                let out: &mut [f32] = self.write(id, t.row_offset(i1, 0, 0), ne[0]);
                match (usize::try_from(ids[i1]).ok().filter(|&r| r < tt.ne[1]), &packed) {
                    (Some(r), Some(w)) => crate::kernels::packed::dequantize_packed_row(w, r, out),
                    (Some(r), None) => {
                        let bytes: &[u8] = self.read(table, r * tt.nb[1], row_bytes);
                        // Cannot fail: the builder accepted only dequantizable types.
                        let _ = dequantize_row_ref(tt.ty, bytes, out);
                    }
                    (None, _) => {
                        out.fill(0.0);
                        self.fail(id, BAD_INDEX);
                    }
                }
            }
        }
    }
    /// MoE routing: the k largest router probabilities of each token.
    pub(in crate::exec) fn top_k(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let Some((a, ta)) = src(0) else { return };
            let k = ne[0];
            for tok in share(ne[1], ith, nth) {
                let probs: &[f32] = self.read(a, ta.row_offset(tok, 0, 0), ta.ne[0]);
                let out: &mut [i32] = self.write(id, t.row_offset(tok, 0, 0), k);
                if !kref::top_k_ref(probs, out) {
                    self.fail(id, ROUTER_NON_FINITE);
                }
            }
        }
    }
    /// MoE expert weights, optionally normalised.
    pub(in crate::exec) fn moe_weights(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        ith: usize,
        nth: usize,
    ) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((ids, ti))) = (src(0), src(1)) else { return };
            for tok in share(ne[1], ith, nth) {
                let probs: &[f32] = self.read(a, ta.row_offset(tok, 0, 0), ta.ne[0]);
                let picked: &[i32] = self.read(ids, ti.row_offset(tok, 0, 0), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(tok, 0, 0), ne[0]);
                if !kref::moe_weights_ref(probs, picked, t.params.i[0] != 0, out) {
                    self.fail(id, BAD_INDEX);
                }
            }
        }
    }
    /// Weighted sum of the experts' outputs.
    pub(in crate::exec) fn moe_sum(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((w, tw))) = (src(0), src(1)) else { return };
            let (m, k) = (ne[0], ta.ne[1]);
            for tok in share(ne[1], ith, nth) {
                let weights: &[f32] = self.read(w, tw.row_offset(tok, 0, 0), k);
                let experts: &[f32] = self.read(a, ta.row_offset(0, tok, 0), m * k);
                let out: &mut [f32] = self.write(id, t.row_offset(tok, 0, 0), m);
                kref::moe_sum_ref(experts, weights, out);
            }
        }
    }
    /// The mean of each output's sequence's rows (see [`crate::graph::Op::SeqMean`]), summed in
    /// row order: a sequence's mean is the same in any batch.
    pub(in crate::exec) fn seq_mean(&self, id: TensorId, t: &Tensor, ne: [usize; 4], ith: usize, nth: usize) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; output
        // rows come from `share`, which gives each thread disjoint ones; a span is checked
        // against the rows before they are read.
        unsafe {
            let (Some((x, tx)), Some((tokens, _)), Some((spans, _))) = (src(0), src(1), src(2)) else {
                return;
            };
            let (m, n_tokens) = (ne[0], tx.ne[1]);
            for j in share(ne[1], ith, nth) {
                let tok = self.read::<i32>(tokens, j * 4, 1)[0];
                let span = usize::try_from(tok).ok().filter(|&tok| tok < n_tokens).map(|tok| {
                    let pair: &[i32] = self.read(spans, tok * 8, 2);
                    (usize::try_from(pair[0]).unwrap_or(usize::MAX), usize::try_from(pair[1]).unwrap_or(0))
                });
                let Some((first, n)) =
                    span.filter(|&(first, n)| n > 0 && first.saturating_add(n) <= n_tokens)
                else {
                    self.fail(id, BAD_INDEX);
                    continue;
                };
                let out: &mut [f32] = self.write(id, t.row_offset(j, 0, 0), m);
                out.fill(0.0);
                for r in first..first + n {
                    let row: &[f32] = self.read(x, tx.row_offset(r, 0, 0), m);
                    out.iter_mut().zip(row).for_each(|(o, &v)| *o += v);
                }
                let inv = 1.0 / n as f32;
                out.iter_mut().for_each(|o| *o *= inv);
            }
        }
    }
}
