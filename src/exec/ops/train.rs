//! The training ops: sums and tiling, the row-wise backward ops, the cross-entropy loss, the
//! embedding gradient and the transposed matmul.

use crate::kernels;
use crate::kernels::reference as kref;
use crate::quant::dequantize_row_ref;
use crate::tensor::{Tensor, TensorId};

use crate::exec::bound::{rows, rows_of, share, BAD_INDEX};
use crate::exec::{Bound, Step};

/// The training ops that sum or tile ([`Bound::reshape_sum`]); the dispatch names each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::exec) enum Reshape {
    Sum,
    Repeat,
    RepeatBack,
    Fill,
}

/// The row-wise backward ops and the loss ([`Bound::train_rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::exec) enum TrainRows {
    RmsNormBack,
    SoftMaxBack,
    CrossEntropy,
    CrossEntropyBack,
}

impl<'a, const N: usize> Bound<'a, N> {
    /// Sum of all elements, tiling, summing back to a smaller shape, and constants (the training
    /// ops; sums in f64, in a fixed order, so a gradient does not depend on the thread count).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::exec) fn reshape_sum(
        &self,
        op: Reshape,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        ith: usize,
        nth: usize,
    ) {
        let src = t.src[0].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows come
        // from `share`, which gives each thread disjoint ones.
        unsafe {
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                match (op, src) {
                    (Reshape::Fill, _) => out.fill(t.params.f[0]),
                    (Reshape::Sum, Some((a, ta))) => {
                        let na = ta.ne_for(step.n_kv);
                        let mut total = 0f64;
                        for idx in elements_of(na) {
                            total += self.element(a, ta, idx, na) as f64;
                        }
                        out[0] = total as f32;
                    }
                    (Reshape::Repeat, Some((a, ta))) => {
                        let na = ta.ne_for(step.n_kv);
                        for (i0, o) in out.iter_mut().enumerate() {
                            *o = self.element(a, ta, [i0 % na[0], i1 % na[1], i2 % na[2], i3 % na[3]], na);
                        }
                    }
                    (Reshape::RepeatBack, Some((a, ta))) => {
                        let na = ta.ne_for(step.n_kv);
                        for (i0, o) in out.iter_mut().enumerate() {
                            let mut total = 0f64;
                            for j3 in (i3..na[3]).step_by(ne[3]) {
                                for j2 in (i2..na[2]).step_by(ne[2]) {
                                    for j1 in (i1..na[1]).step_by(ne[1]) {
                                        for j0 in (i0..na[0]).step_by(ne[0]) {
                                            total += self.element(a, ta, [j0, j1, j2, j3], na) as f64;
                                        }
                                    }
                                }
                            }
                            *o = total as f32;
                        }
                    }
                    // (The graph gives these their input.)
                    (Reshape::Sum | Reshape::Repeat | Reshape::RepeatBack, None) => {}
                }
            }
        }
    }
    /// The row-wise backward ops and the cross-entropy loss.
    pub(in crate::exec) fn train_rows(
        &self,
        op: TrainRows,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        ith: usize,
        nth: usize,
    ) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and types were checked by the graph builder, spans by `new`; rows come
        // from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((b, tb))) = (src(0), src(1)) else { return };
            if matches!(op, TrainRows::CrossEntropy | TrainRows::CrossEntropyBack) {
                let n = ta.ne[1];
                let targets: &[i32] = self.read(b, 0, n);
                let scored = targets.iter().filter(|&&v| v >= 0).count().max(1);
                let target_of = |r: usize| usize::try_from(targets[r]).ok();
                if op == TrainRows::CrossEntropy {
                    for _ in share(1, ith, nth) {
                        let mut total = 0f64;
                        for r in 0..n {
                            let logits: &[f32] = self.read(a, ta.row_offset(r, 0, 0), ta.ne[0]);
                            match target_of(r) {
                                Some(c) if c < ta.ne[0] => total += kref::cross_entropy_ref(logits, c),
                                Some(_) => self.fail(id, BAD_INDEX),
                                None => {}
                            }
                        }
                        let out: &mut [f32] = self.write(id, 0, 1);
                        out[0] = (total / scored as f64) as f32;
                    }
                    return;
                }
                let Some((d, _)) = src(2) else { return };
                let dloss: f32 = self.read::<f32>(d, 0, 1)[0];
                for r in share(n, ith, nth) {
                    let logits: &[f32] = self.read(a, ta.row_offset(r, 0, 0), ne[0]);
                    let out: &mut [f32] = self.write(id, t.row_offset(r, 0, 0), ne[0]);
                    match target_of(r) {
                        Some(c) if c < ne[0] => {
                            kref::cross_entropy_back_ref(logits, c, dloss / scored as f32, out)
                        }
                        _ => out.fill(0.0),
                    }
                }
                return;
            }
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let dy: &[f32] = self.read(b, tb.row_offset(i1, i2, i3), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                match op {
                    TrainRows::RmsNormBack => kref::rms_norm_back_ref(x, dy, out, t.params.f[0]),
                    TrainRows::SoftMaxBack => kref::soft_max_back_ref(x, dy, out, t.params.f[0]),
                    // (Run above, by rows of logits.)
                    TrainRows::CrossEntropy | TrainRows::CrossEntropyBack => {}
                }
            }
        }
    }
    /// Rows of a table picked by I32 ids (embeddings, output rows).
    /// Each thread owns a share of the table's rows: it zeroes them, then adds every gradient row
    /// whose id is one of them, in the gradient's order.
    pub(in crate::exec) fn get_rows_back(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        ith: usize,
        nth: usize,
    ) {
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes were checked by the graph builder, spans by `new`; each thread writes only
        // the rows of its share.
        unsafe {
            let (Some((d, td)), Some((ids, _))) = (src(0), src(1)) else { return };
            let n = td.ne[1];
            let ids: &[i32] = self.read(ids, 0, n);
            let mine = share(ne[1], ith, nth);
            for r in mine.clone() {
                self.write::<f32>(id, t.row_offset(r, 0, 0), ne[0]).fill(0.0);
            }
            for (j, &r) in ids.iter().enumerate() {
                match usize::try_from(r).ok().filter(|&r| r < ne[1]) {
                    Some(r) if mine.contains(&r) => {
                        let row: &[f32] = self.read(d, td.row_offset(j, 0, 0), ne[0]);
                        let out: &mut [f32] = self.write(id, t.row_offset(r, 0, 0), ne[0]);
                        out.iter_mut().zip(row).for_each(|(o, v)| *o += v);
                    }
                    Some(_) => {}
                    None => self.fail(id, BAD_INDEX),
                }
            }
        }
    }
    /// A frozen weight's transposed product (a matmul's input gradient): each thread takes a
    /// share of the output rows' values (a range of `k`), dequantizes those parts of [`T_ROWS`]
    /// weight rows at a time, and adds them to every column (in row order, as one row at a time
    /// would: the blocking only saves loads and stores of the output).
    pub(in crate::exec) fn mul_mat_t(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        ith: usize,
        nth: usize,
    ) {
        const CHUNK: usize = 256;
        const T_ROWS: usize = 8;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and types were checked by the graph builder, spans by `new`; each thread
        // writes only its own range of every output row.
        unsafe {
            let (Some((w, tw)), Some((x, tx))) = (src(0), src(1)) else { return };
            let (k, m, n) = (tw.ne[0], tw.ne[1], tx.ne[1]);
            let block = tw.ty.block_len();
            // Whole chunks of CHUNK values (a multiple of every block length), shared by thread.
            let chunks = k.div_ceil(CHUNK);
            let mine = share(chunks, ith, nth);
            for j in 0..n {
                let out: &mut [f32] = self.write(id, t.row_offset(j, 0, 0), ne[0]);
                out[mine.start * CHUNK..(mine.end * CHUNK).min(k)].fill(0.0);
            }
            let mut buf = [[0f32; CHUNK]; T_ROWS];
            for i0 in (0..m).step_by(T_ROWS) {
                let rows = T_ROWS.min(m - i0);
                for c in mine.clone() {
                    let (start, len) = (c * CHUNK, CHUNK.min(k - c * CHUNK));
                    for (r, row) in buf.iter_mut().enumerate() {
                        if r >= rows {
                            row.fill(0.0);
                            continue;
                        }
                        let offset = tw.row_offset(i0 + r, 0, 0) + start / block * tw.ty.block_bytes();
                        let bytes: &[u8] =
                            self.read(w, offset, tw.ty.bytes_for(len as u64).unwrap_or(0) as usize);
                        // Cannot fail: the builder accepted only dequantizable types.
                        let _ = dequantize_row_ref(tw.ty, bytes, &mut row[..len]);
                    }
                    for j in 0..n {
                        let mut d = [0f32; T_ROWS];
                        d[..rows].copy_from_slice(self.read::<f32>(x, tx.row_offset(j, 0, 0) + i0 * 4, rows));
                        if d.iter().all(|&v| v == 0.0) {
                            continue;
                        }
                        let out: &mut [f32] = self.write(id, t.row_offset(j, 0, 0) + start * 4, len);
                        kernels::add_scaled_rows(self.path, out, &d, &buf);
                    }
                }
            }
        }
    }
}

/// Every index of shape `ne`, innermost first.
pub(in crate::exec) fn elements_of(ne: [usize; 4]) -> impl Iterator<Item = [usize; 4]> {
    let n = ne.iter().product::<usize>();
    (0..n).map(move |i| {
        [i % ne[0], i / ne[0] % ne[1], i / (ne[0] * ne[1]) % ne[2], i / (ne[0] * ne[1] * ne[2])]
    })
}
