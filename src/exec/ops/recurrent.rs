//! The recurrent layers' ops: short convolution and the gated delta rule, each over its
//! per-sequence state.

use crate::kernels::reference as kref;
use crate::tensor::{Tensor, TensorId};

use crate::exec::bound::{share, BAD_INDEX};
use crate::exec::Bound;

impl<'a, const N: usize> Bound<'a, N> {
    /// Token `tok`'s (sequence, position) from places table `places`, for a recurrent state of
    /// `n_seq` sequences of `rows_per_seq` cache rows each; `None` for a place outside them.
    fn sequence_of(
        &self,
        places: TensorId,
        tok: usize,
        rows_per_seq: usize,
        n_seq: usize,
    ) -> Option<(usize, usize)> {
        let (first, pos) = self.place(Some(places), tok)??;
        let seq = first / rows_per_seq;
        (seq < n_seq).then_some((seq, pos))
    }
    /// The short convolution (see [`Op::ShortConv`]): each thread owns a share of the channels
    /// and walks the tokens in batch order, so every channel's state moves on token by token.
    pub(in crate::exec) fn short_conv(&self, id: TensorId, t: &Tensor, ith: usize, nth: usize) {
        let [Some(x), Some(taps), Some(states), Some(places), ..] = t.src else { return };
        let (tx, ts) = (self.graph.tensor(x), self.graph.tensor(states));
        let (n_ch, n_tokens) = (tx.ne[0], tx.ne[1]);
        let (k, n_seq) = (self.graph.tensor(taps).ne[0], ts.ne[1]);
        let rows_per_seq = t.params.i[0] as usize;
        let channels = share(n_ch, ith, nth);
        // SAFETY: shapes were checked by the graph builder, spans by `new`; this thread reads and
        // writes only its own channels' inputs, taps, states and outputs.
        unsafe {
            let w: &[f32] = self.read(taps, channels.start * k * 4, channels.len() * k);
            for tok in 0..n_tokens {
                let Some((seq, pos)) = self.sequence_of(places, tok, rows_per_seq, n_seq) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                let input: &[f32] = self.read(x, tok * tx.nb[1] + channels.start * 4, channels.len());
                let out: &mut [f32] = self.write(id, tok * t.nb[1] + channels.start * 4, channels.len());
                let at = seq * ts.nb[1] + channels.start * (k - 1) * 4;
                let state: &mut [f32] = self.write(states, at, channels.len() * (k - 1));
                for (c, (o, &v)) in out.iter_mut().zip(input).enumerate() {
                    let window = &mut state[c * (k - 1)..(c + 1) * (k - 1)];
                    *o = kref::short_conv_step_ref(window, &w[c * k..(c + 1) * k], v, pos == 0);
                }
            }
        }
    }
    /// The gated delta rule (see [`Op::GatedDeltaNet`]): each thread owns a share of the value
    /// heads and walks the tokens in batch order, so every head's state moves on token by token.
    pub(in crate::exec) fn gated_delta_net(&self, id: TensorId, t: &Tensor, ith: usize, nth: usize) {
        let [Some(q), Some(k), Some(v), Some(g), Some(beta), Some(states), Some(places), _] = t.src else {
            return;
        };
        let (tq, tk, tv, ts) =
            (self.graph.tensor(q), self.graph.tensor(k), self.graph.tensor(v), self.graph.tensor(states));
        let (d, n_v, n_tokens, n_k, n_seq) = (tv.ne[0], tv.ne[1], tv.ne[2], tq.ne[1], ts.ne[1]);
        let rows_per_seq = t.params.i[0] as usize;
        // SAFETY: shapes were checked by the graph builder, spans by `new`; this thread reads and
        // writes only its own heads' states and outputs, and reads inputs nothing writes.
        unsafe {
            for tok in 0..n_tokens {
                let Some((seq, pos)) = self.sequence_of(places, tok, rows_per_seq, n_seq) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                let gs: &[f32] = self.read(g, tok * n_v * 4, n_v);
                let betas: &[f32] = self.read(beta, tok * n_v * 4, n_v);
                for h in share(n_v, ith, nth) {
                    let hk = h % n_k;
                    let qh: &[f32] = self.read(q, tq.row_offset(hk, tok, 0), d);
                    let kh: &[f32] = self.read(k, tk.row_offset(hk, tok, 0), d);
                    let vh: &[f32] = self.read(v, tv.row_offset(h, tok, 0), d);
                    let state: &mut [f32] = self.write(states, seq * ts.nb[1] + h * d * d * 4, d * d);
                    let out: &mut [f32] = self.write(id, t.row_offset(h, tok, 0), d);
                    let fresh = pos == 0;
                    kref::gated_delta_step_ref(state, qh, kh, vh, gs[h], betas[h], fresh, out);
                }
            }
        }
    }
}
