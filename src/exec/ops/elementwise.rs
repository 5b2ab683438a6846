//! Elementwise and row-wise ops of one or two inputs: scale, norms, activations, softmax,
//! add/mul/GLUs, copies and concatenation.

use crate::kernels;
use crate::kernels::reference as kref;
use crate::tensor::{Tensor, TensorId};

use crate::exec::bound::{rows, rows_of, share};
use crate::exec::ops::attention::visible_keys;
use crate::exec::{Bound, Step};

/// The row-wise ops of one input ([`Bound::unary`]); the dispatch names each, so a new op is
/// added here and there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::exec) enum Unary {
    Scale,
    Sqr,
    Sqrt,
    Hadamard,
    RmsNorm,
    LayerNorm,
    Silu,
    Sigmoid,
    Softplus,
    Tanh,
    Gelu,
    SoftMax,
}

/// The elementwise ops of two inputs ([`Bound::binary`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::exec) enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    SwiGlu,
    GeGlu,
}

impl<'a, const N: usize> Bound<'a, N> {
    /// Row-wise ops of one input: scale, norms, activations, softmax.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::exec) fn unary(
        &self,
        op: Unary,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        ith: usize,
        nth: usize,
    ) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let Some((a, ta)) = src(0) else { return };
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                let p = t.params;
                match op {
                    Unary::Scale => out.iter_mut().zip(x).for_each(|(o, v)| *o = v * p.f[0]),
                    Unary::Sqr => out.iter_mut().zip(x).for_each(|(o, v)| *o = v * v),
                    Unary::Sqrt => out.iter_mut().zip(x).for_each(|(o, &v)| *o = libm::sqrtf(v)),
                    Unary::Hadamard => kref::hadamard_ref(x, out, p.i[0] as usize),
                    Unary::RmsNorm => kernels::rms_norm(path, x, out, p.f[0]),
                    Unary::LayerNorm => kref::layer_norm_ref(x, out, p.f[0]),
                    Unary::Silu => kernels::silu(path, x, out),
                    Unary::Sigmoid => kref::sigmoid_ref(x, out),
                    Unary::Softplus => kref::softplus_ref(x, out),
                    Unary::Tanh => out.iter_mut().zip(x).for_each(|(o, &v)| *o = libm::tanhf(v)),
                    Unary::Gelu => kernels::gelu(path, x, out),
                    Unary::SoftMax => {
                        let (start, end) =
                            visible_keys(p.i[0] != 0, p.i[1] as usize, step.n_past + i1, ne[0]);
                        kref::soft_max_ref(x, out, p.f[0], start, end);
                    }
                }
            }
        }
    }
    /// Elementwise ops of two inputs, the second broadcast: add, mul, SwiGLU, GeGLU.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::exec) fn binary(
        &self,
        op: Binary,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        ith: usize,
        nth: usize,
    ) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((a, ta)), Some((b, tb))) = (src(0), src(1)) else { return };
            let neb = tb.ne_for(step.n_kv);
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let x: &[f32] = self.read(a, ta.row_offset(i1, i2, i3), ne[0]);
                let y: &[f32] = self.read(b, tb.row_offset(i1 % neb[1], i2 % neb[2], i3 % neb[3]), neb[0]);
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                if neb[0] != ne[0] {
                    // A one-element row broadcast along the row (the graph allows only that).
                    let b = y[0];
                    match op {
                        Binary::Add => out.iter_mut().zip(x).for_each(|(o, a)| *o = a + b),
                        Binary::Sub => out.iter_mut().zip(x).for_each(|(o, a)| *o = a - b),
                        Binary::Div => out.iter_mut().zip(x).for_each(|(o, a)| *o = a / b),
                        // (The graph broadcasts no GLU; were it to, the product is what runs.)
                        Binary::Mul | Binary::SwiGlu | Binary::GeGlu => {
                            out.iter_mut().zip(x).for_each(|(o, a)| *o = a * b)
                        }
                    }
                    continue;
                }
                match op {
                    Binary::Add => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a + b),
                    Binary::Sub => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a - b),
                    Binary::Mul => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a * b),
                    Binary::Div => out.iter_mut().zip(x.iter().zip(y)).for_each(|(o, (a, b))| *o = a / b),
                    Binary::SwiGlu => kernels::swiglu(path, x, y, out),
                    Binary::GeGlu => kernels::geglu(path, x, y, out),
                }
            }
        }
    }
    /// Copy and type conversion, any strides.
    pub(in crate::exec) fn cpy(
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
            let Some((a, ta)) = src(0) else { return };
            let ne_a = ta.ne_for(step.n_kv);
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let row = t.row_offset(i1, i2, i3);
                for i0 in 0..ne[0] {
                    let v = self.element(a, ta, [i0, i1, i2, i3], ne_a);
                    self.put(id, t.ty, row + i0 * t.nb[0], v);
                }
            }
        }
    }
    /// Two tensors joined along one dimension.
    pub(in crate::exec) fn pool_2d_avg(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        ith: usize,
        nth: usize,
    ) {
        let Some(x) = t.src[0] else { return };
        let k = t.params.i[0] as usize;
        let tx = self.graph.tensor(x);
        let (c, w) = (ne[0], tx.ne[1]);
        let scale = (k * k) as f32;
        // SAFETY: shapes were checked by the graph builder (a contiguous input of k x k squares),
        // spans by `new`; output rows come from `share`, disjoint per thread.
        unsafe {
            let input: &[f32] = self.read(x, 0, tx.ne[0] * tx.ne[1] * tx.ne[2]);
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), c);
                out.fill(0.0);
                for ky in 0..k {
                    for kx in 0..k {
                        let at = ((i2 * k + ky) * w + i1 * k + kx) * c;
                        for (o, &v) in out.iter_mut().zip(&input[at..at + c]) {
                            *o += v;
                        }
                    }
                }
                for o in out.iter_mut() {
                    *o /= scale;
                }
            }
        }
    }

    pub(in crate::exec) fn concat(
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
            let (Some((a, ta)), Some((b, tb))) = (src(0), src(1)) else { return };
            let dim = t.params.i[0] as usize;
            let (ne_a, ne_b) = (ta.ne_for(step.n_kv), tb.ne_for(step.n_kv));
            for (i1, i2, i3) in rows(ne, share(rows_of(ne), ith, nth)) {
                let out: &mut [f32] = self.write(id, t.row_offset(i1, i2, i3), ne[0]);
                for (i0, o) in out.iter_mut().enumerate() {
                    let mut idx = [i0, i1, i2, i3];
                    *o = if idx[dim] < ne_a[dim] {
                        self.element(a, ta, idx, ne_a)
                    } else {
                        idx[dim] -= ne_a[dim];
                        self.element(b, tb, idx, ne_b)
                    };
                }
            }
        }
    }
}
