//! Matmuls: input conversion (phase 0), the plain and repacked kernels, expert matmuls, and the
//! offload hook.

use core::ops::Range;

use crate::graph::Op;
use crate::kernels;
use crate::kernels::dot::{from_float_ref, vec_dot_ref};
use crate::kernels::packed::{act_row_bytes, ActBlock, PackedFormat, PackedMatrix, GROUP_ROWS};
use crate::quant::blocks::F16Le;
use crate::quant::GgmlType;
use crate::tensor::{Storage, Tensor, TensorId};

use crate::exec::bound::{rows, rows_of, share, BAD_INDEX};
use crate::exec::work::{converted_input, converted_stride};
use crate::exec::{Bound, MatmulOffload, Step};

impl<'a, const N: usize> Bound<'a, N> {
    /// Whether node `id` is a matmul whose phase 0 converts its input into the work region.
    pub(crate) fn converts_input(&self, id: TensorId) -> bool {
        let t = self.graph.tensor(id);
        t.src[0].is_some_and(|w| converted_input(t, self.graph.tensor(w)).is_some())
    }
    /// The offload hook and the weights' offset, if matmul node `t` goes to the hook this step.
    /// Every thread gets the same answer (the hook's state only changes in `begin`).
    pub(in crate::exec) fn offload_of(
        &self,
        t: &Tensor,
        step: Step,
    ) -> Option<(&'a dyn MatmulOffload, usize)> {
        let hook = self.offload?;
        let (w, x) = (self.graph.tensor(t.src[0]?), self.graph.tensor(t.src[1]?));
        let Storage::External { buffer: 0, offset } = w.storage else { return None };
        let (ne_x, ne) = (x.ne_for(step.n_kv), t.ne_for(step.n_kv));
        let (k, n, n_tokens) = (w.ne[0], w.ne[1], ne_x[1]);
        let plain = t.op == Op::MulMat
            && w.ne[2] == 1
            && w.ne[3] == 1
            && x.ty == GgmlType::F32
            && t.ty == GgmlType::F32
            && ne_x == [k, n_tokens, 1, 1]
            && ne == [n, n_tokens, 1, 1]
            && x.nb[0] == 4
            && (n_tokens == 1 || x.nb[1] == 4 * k)
            && t.nb[0] == 4
            && (n_tokens == 1 || t.nb[1] == 4 * n);
        (plain && hook.accepts(offset, k, n, n_tokens)).then_some((hook, offset))
    }
    /// Runs matmul node `id` through the offload hook if it takes it: thread 0 runs it (on the CPU
    /// alone if the hook fails), the others skip it. Returns whether the node was dealt with.
    pub(in crate::exec) fn offload_mul_mat(&self, id: TensorId, t: &Tensor, step: Step, ith: usize) -> bool {
        let Some((hook, offset)) = self.offload_of(t, step) else { return false };
        if ith != 0 {
            return true;
        }
        let (Some(w), Some(x)) = (t.src[0], t.src[1]) else { return true };
        let (k, n) = (self.graph.tensor(w).ne[0], self.graph.tensor(w).ne[1]);
        let n_tokens = self.graph.tensor(x).ne_for(step.n_kv)[1];
        // SAFETY: contiguous rows (checked in `offload_of`) inside the spans checked in `new`;
        // every other thread skips this node, so thread 0 alone reads x and writes the output.
        let done = unsafe {
            let input: &[f32] = self.read(x, 0, n_tokens * k);
            let output: &mut [f32] = self.write(id, 0, n_tokens * n);
            hook.run(offset, k, n, input, output)
        };
        if !done {
            // The device failed: this thread computes the whole node, input conversion included
            // (the other threads skipped phase 0 and wait at the barrier).
            if self.converts_input(id) {
                self.convert_input(id, t, step, 0, 1);
            }
            self.mul_mat(id, t, step, 0, 1);
        }
        true
    }
    /// The repacked form of matmul weights `w` (a 2-D tensor in model buffer 0: a whole matrix,
    /// or whole row groups of one, as the parts of a fused weight), if any.
    pub(in crate::exec) fn packed_weights(&self, w: &Tensor) -> Option<PackedMatrix<'a>> {
        let Storage::External { buffer: 0, offset } = w.storage else { return None };
        if w.ne[2] != 1 || w.ne[3] != 1 {
            return None;
        }
        // The matrix starting at or last before `offset`.
        let at = match self.packed.binary_search_by_key(&offset, |e| e.source_offset) {
            Ok(at) => at,
            Err(after) => after.checked_sub(1)?,
        };
        let entry = &self.packed[at];
        if entry.k != w.ne[0] || PackedFormat::for_type(w.ty) != Some(entry.format) {
            return None;
        }
        let matrix = entry.matrix(self.packed_buffer)?;
        if offset == entry.source_offset && entry.rows == w.ne[1] {
            return Some(matrix);
        }
        let row_bytes = usize::try_from(w.ty.bytes_for(w.ne[0] as u64)?).ok()?;
        let first_row = (offset - entry.source_offset) / row_bytes;
        let whole_groups = (offset - entry.source_offset) % row_bytes == 0
            && first_row % GROUP_ROWS == 0
            && w.ne[1] % GROUP_ROWS == 0;
        whole_groups.then(|| matrix.row_groups(first_row / GROUP_ROWS, w.ne[1] / GROUP_ROWS)).flatten()
    }
    /// The repacked form of expert weights `w` (`[k, m, n_expert]` in model buffer 0, packed as
    /// one matrix of `m * n_expert` rows), if any: expert `e` is row groups `e * m / 4..`.
    fn packed_experts(&self, w: &Tensor) -> Option<PackedMatrix<'a>> {
        let Storage::External { buffer: 0, offset } = w.storage else { return None };
        if w.ne[3] != 1 || w.ne[1] % GROUP_ROWS != 0 {
            return None;
        }
        let at = self.packed.binary_search_by_key(&offset, |e| e.source_offset).ok()?;
        let entry = &self.packed[at];
        let rows = w.ne[1].checked_mul(w.ne[2])?;
        (entry.rows == rows && entry.k == w.ne[0] && PackedFormat::for_type(w.ty) == Some(entry.format))
            .then(|| entry.matrix(self.packed_buffer))
            .flatten()
    }
    /// The repacked weights matmul node `t` (weights `w`) runs on, if any.
    pub(crate) fn packed_for(&self, t: &Tensor, w: &Tensor) -> Option<PackedMatrix<'a>> {
        match t.op {
            Op::MulMat => self.packed_weights(w),
            Op::MulMatId => self.packed_experts(w),
            _ => None,
        }
    }
    /// Phase 0 of a converting matmul: input rows to the weights' activation type, in the shared
    /// converted area at a fixed row stride (the upper-bound row length), split over the threads.
    pub(in crate::exec) fn convert_input(
        &self,
        id: TensorId,
        t: &Tensor,
        step: Step,
        ith: usize,
        nth: usize,
    ) {
        let (Some(w), Some(x)) = (t.src[0], t.src[1]) else { return };
        let (tw, tx) = (self.graph.tensor(w), self.graph.tensor(x));
        let Some(act) = converted_input(t, tw) else { return };
        let ne = tx.ne_for(step.n_kv);
        if self.f16_plan(t, tw, tw.ne_for(step.n_kv)[0], ne).is_some() {
            // The f16 blocks and the GEMM round the f32 input themselves.
            return;
        }
        let stride = converted_stride(act, tx.ne[0]);
        let packed = self.packed_for(t, tw).is_some();
        let path = self.path;
        let len =
            if packed { act_row_bytes(ne[0]) } else { act.bytes_for(ne[0] as u64).unwrap_or(0) as usize };
        for (r, (i1, i2, i3)) in rows(ne, share(rows_of(ne), ith, nth)).enumerate() {
            let flat = share(rows_of(ne), ith, nth).start + r;
            debug_assert!((flat + 1) * stride <= self.converted_len);
            // SAFETY: row (i1, i2, i3) is inside x's checked span; converted row `flat` lies in the
            // converted area (sized by `work_bytes` for every row) and belongs to this thread.
            unsafe {
                let src: &[f32] = self.read(x, tx.row_offset(i1, i2, i3), ne[0]);
                let dst = core::slice::from_raw_parts_mut(self.converted.add(flat * stride), len);
                if packed {
                    // The converted area is 64-aligned and the stride a multiple of 4.
                    match bytemuck::try_cast_slice_mut::<u8, ActBlock>(dst) {
                        Ok(blocks) => kernels::quantize_act(path, src, blocks),
                        Err(_) => self.fail(id, BAD_INDEX),
                    }
                } else {
                    from_float_ref(act, src, dst);
                }
            }
        }
    }
    /// Converted input row `(i1, i2, i3)` of a matmul whose input has effective shape `ne`.
    /// `len` bytes of it (the ggml type's row, or the `ActBlock` row for repacked weights).
    fn converted_row(
        &self,
        act: GgmlType,
        tx: &Tensor,
        ne: [usize; 4],
        i: (usize, usize, usize),
        len: usize,
    ) -> &[u8] {
        let stride = converted_stride(act, tx.ne[0]);
        debug_assert!(len <= stride);
        let flat = i.0 + ne[1] * (i.1 + ne[2] * i.2);
        // SAFETY: written in phase 0 (a barrier ago); read-only now.
        unsafe { core::slice::from_raw_parts(self.converted.add(flat * stride), len) }
    }
    /// The operands of a matmul node at this step's shapes.
    fn operands<'t>(&'t self, t: &Tensor, step: Step) -> Option<MatOperands<'t>> {
        let (w, x) = (t.src[0]?, t.src[1]?);
        let (tw, tx) = (self.graph.tensor(w), self.graph.tensor(x));
        let (ne_w, ne_x) = (tw.ne_for(step.n_kv), tx.ne_for(step.n_kv));
        Some(MatOperands { w, tw, ne_w, x, tx, ne_x, k: ne_w[0].min(ne_x[0]), act: converted_input(t, tw) })
    }
    /// One output element: weight row `wi` times input row `xi` over `op.k` elements.
    ///
    /// # Safety
    /// Indices inside the effective shapes.
    unsafe fn dot(&self, op: &MatOperands<'_>, wi: (usize, usize, usize), xi: (usize, usize, usize)) -> f32 {
        let w_len = op.tw.ty.bytes_for(op.k as u64).unwrap_or(0) as usize;
        // SAFETY: guaranteed by the caller; F32 rows are 4-byte aligned.
        unsafe {
            let w_bytes: &[u8] = self.read(op.w, op.tw.row_offset(wi.0, wi.1, wi.2), w_len);
            match op.act {
                None => {
                    let x_row: &[f32] = self.read(op.x, op.tx.row_offset(xi.0, xi.1, xi.2), op.k);
                    if matches!(op.tw.storage, Storage::External { buffer: 0, .. }) {
                        // The model file's F32 weight: ggml's scalar dot, as the goldens were made.
                        vec_dot_ref(GgmlType::F32, w_bytes, bytemuck::cast_slice(x_row))
                    } else {
                        // An adapter's weight, or two computed tensors (training): the SIMD dot.
                        kernels::dot_f32(self.path, bytemuck::cast_slice(w_bytes), x_row)
                    }
                }
                Some(act) => {
                    let len = act.bytes_for(op.ne_x[0] as u64).unwrap_or(0) as usize;
                    let x_bytes = self.converted_row(act, op.tx, op.ne_x, xi, len);
                    if (op.tw.ty, act) == (GgmlType::F16, GgmlType::F16) {
                        // f16 weights are never repacked: this is their kernel.
                        crate::kernels::dot_f16(
                            self.path,
                            bytemuck::cast_slice(w_bytes),
                            bytemuck::cast_slice(x_bytes),
                        )
                    } else {
                        vec_dot_ref(op.tw.ty, w_bytes, x_bytes)
                    }
                }
            }
        }
    }
    pub(in crate::exec) fn mul_mat(&self, id: TensorId, t: &Tensor, step: Step, ith: usize, nth: usize) {
        let Some(op) = self.operands(t, step) else { return };
        if let Some(w) = self.packed_weights(op.tw) {
            self.mul_mat_packed(id, t, &op, &w, ith, nth);
            return;
        }
        match self.f16_plan(t, op.tw, op.ne_w[0], op.ne_x) {
            Some(F16Plan::Gemm) => return self.mul_mat_f16_gemm(id, t, &op, ith, nth),
            Some(F16Plan::Blocks(block)) => return self.mul_mat_f16_blocks(id, t, &op, block, ith, nth),
            None => {}
        }
        let (ne_w, ne_x) = (op.ne_w, op.ne_x);
        let (r2, r3) = ((ne_x[2] / ne_w[2]).max(1), (ne_x[3] / ne_w[3]).max(1));
        // Threads split the weight rows, so one token (decode) still uses every thread.
        let rows_w = share(ne_w[1], ith, nth);
        for i3 in 0..ne_x[3] {
            for i2 in 0..ne_x[2] {
                for m in rows_w.clone() {
                    for n in 0..ne_x[1] {
                        // SAFETY: indices inside the checked shapes; each thread writes its own m.
                        unsafe {
                            let v = self.dot(&op, (m, i2 / r2, i3 / r3), (n, i2, i3));
                            self.write::<f32>(id, t.row_offset(n, i2, i3) + m * 4, 1)[0] = v;
                        }
                    }
                }
            }
        }
    }
    /// How matmul `t` of f16 weights `tw` (rows of `k_w`) over an input of shape `ne_x` runs when
    /// it has several tokens: the encoder's GEMM where the graph allows it
    /// ([`Bound::with_f16_gemm`]), else blocks of the one-token dot's tiles (rows short enough for
    /// one); `None` for one token or other weights. Phase 0 asks too: both take the f32 input,
    /// not its f16 conversion.
    fn f16_plan(&self, t: &Tensor, tw: &Tensor, k_w: usize, ne_x: [usize; 4]) -> Option<F16Plan> {
        if !(t.op == Op::MulMat && tw.ty == GgmlType::F16 && ne_x[1] > 1) {
            return None;
        }
        if self.f16_gemm {
            return Some(F16Plan::Gemm);
        }
        f16_block_tokens(k_w.min(ne_x[0]), kernels::f16_tile_shape(self.path).1).map(F16Plan::Blocks)
    }
    /// The encoder's matmul on f16 weights ([`kernels::f16_gemm`]): blocks of
    /// [`GEMM_BLOCK_TOKENS`] tokens, rounded to f16 and packed once per chunk of `k` (kept in L2),
    /// then each panel of this thread's weight rows widened once and run over the block's
    /// micro-panels. Between chunks the sums wait in the output, so each output is one chain of
    /// sums in `k` order whatever the blocking.
    fn mul_mat_f16_gemm(&self, id: TensorId, t: &Tensor, op: &MatOperands<'_>, ith: usize, nth: usize) {
        use kernels::f16_gemm::{GemmTile, GEMM_DEPTH, GEMM_ROWS, GEMM_TOKENS};
        const TILES: usize = GEMM_BLOCK_TOKENS / GEMM_TOKENS;
        let (ne_w, ne_x, k) = (op.ne_w, op.ne_x, op.k);
        let (r2, r3) = ((ne_x[2] / ne_w[2]).max(1), (ne_x[3] / ne_w[3]).max(1));
        let rows_w = share(ne_w[1], ith, nth);
        let mut xt = [0f32; GEMM_BLOCK_TOKENS * GEMM_DEPTH];
        let mut wp = [0f32; GEMM_ROWS * GEMM_DEPTH];
        let mut rounded = [0f32; GEMM_DEPTH];
        for i3 in 0..ne_x[3] {
            for i2 in 0..ne_x[2] {
                for n0 in (0..ne_x[1]).step_by(GEMM_BLOCK_TOKENS) {
                    let tokens = (ne_x[1] - n0).min(GEMM_BLOCK_TOKENS);
                    let tiles = tokens.div_ceil(GEMM_TOKENS);
                    for kc0 in (0..k).step_by(GEMM_DEPTH) {
                        let kc = (k - kc0).min(GEMM_DEPTH);
                        // The block's tokens, rounded, as micro-panels `[tile][kk][t]`.
                        for j in 0..tiles * GEMM_TOKENS {
                            let (tile, lane) = (j / GEMM_TOKENS, j % GEMM_TOKENS);
                            let panel = &mut xt[tile * kc * GEMM_TOKENS..(tile + 1) * kc * GEMM_TOKENS];
                            if j < tokens {
                                // SAFETY: elements kc0..kc0 + kc of input row n0 + j, inside its
                                // checked shape (k is within the row).
                                let x: &[f32] = unsafe {
                                    self.read(op.x, op.tx.row_offset(n0 + j, i2, i3) + kc0 * 4, kc)
                                };
                                kernels::round_f16_padded(self.path, x, &mut rounded[..kc]);
                            } else {
                                rounded[..kc].fill(0.0);
                            }
                            for (d, &v) in panel[lane..].iter_mut().step_by(GEMM_TOKENS).zip(&rounded[..kc]) {
                                *d = v;
                            }
                        }
                        let mut m0 = rows_w.start;
                        while m0 < rows_w.end {
                            let rows = (rows_w.end - m0).min(GEMM_ROWS);
                            let ws: [&[F16Le]; GEMM_ROWS] = core::array::from_fn(|r| {
                                let m = m0 + r.min(rows - 1);
                                // SAFETY: elements kc0..kc0 + kc of row m of this thread's rows,
                                // inside the checked shapes.
                                let bytes: &[u8] = unsafe {
                                    self.read(op.w, op.tw.row_offset(m, i2 / r2, i3 / r3) + 2 * kc0, 2 * kc)
                                };
                                bytemuck::cast_slice(bytes)
                            });
                            let mut acc = [[[0f32; GEMM_TOKENS]; GEMM_ROWS]; TILES];
                            let out_row = |j: usize| {
                                let at = t.row_offset(n0 + j, i2, i3) + m0 * 4;
                                // SAFETY: elements m0.. (this thread's rows) of output row n0 + j.
                                unsafe { self.write::<f32>(id, at, rows) }
                            };
                            if kc0 > 0 {
                                for j in 0..tokens {
                                    let sums: &mut GemmTile = &mut acc[j / GEMM_TOKENS];
                                    for (r, &v) in out_row(j).iter().enumerate() {
                                        sums[r][j % GEMM_TOKENS] = v;
                                    }
                                }
                            }
                            let packed = &xt[..tiles * kc * GEMM_TOKENS];
                            kernels::f16_gemm_panel(
                                self.path,
                                &ws[..rows],
                                packed,
                                kc,
                                &mut wp,
                                &mut acc[..tiles],
                            );
                            for j in 0..tokens {
                                let sums = &acc[j / GEMM_TOKENS];
                                for (r, d) in out_row(j).iter_mut().enumerate() {
                                    *d = sums[r][j % GEMM_TOKENS];
                                }
                            }
                            m0 += rows;
                        }
                    }
                }
            }
        }
    }
    /// Matmul on f16 weights for several tokens (an encoder's batch, a prompt): blocks of `block`
    /// tokens widened to f32 once (kept in L2), then each tile of this thread's weight rows times
    /// the block's tiles of tokens ([`kernels::dot_f16_tile`]: a register tile, each weight vector
    /// widened once per tile of tokens instead of once per token). Every element is the number
    /// [`Self::dot`] gives it (the tile's contract), so a token's outputs do not depend on the
    /// tokens beside it.
    fn mul_mat_f16_blocks(
        &self,
        id: TensorId,
        t: &Tensor,
        op: &MatOperands<'_>,
        block: usize,
        ith: usize,
        nth: usize,
    ) {
        let (ne_w, ne_x, k) = (op.ne_w, op.ne_x, op.k);
        let (r2, r3) = ((ne_x[2] / ne_w[2]).max(1), (ne_x[3] / ne_w[3]).max(1));
        let padded = k.next_multiple_of(32);
        let w_len = 2 * k;
        let (tile_rows, tile_tokens) = kernels::f16_tile_shape(self.path);
        let rows_w = share(ne_w[1], ith, nth);
        let mut widened = [0f32; F16_BLOCK_FLOATS];
        for i3 in 0..ne_x[3] {
            for i2 in 0..ne_x[2] {
                let mut n0 = 0;
                while n0 < ne_x[1] {
                    let tokens = (ne_x[1] - n0).min(block);
                    for (j, row) in widened.chunks_exact_mut(padded).take(tokens).enumerate() {
                        // SAFETY: row n0 + j of the f32 input, inside its checked shape.
                        let x: &[f32] = unsafe { self.read(op.x, op.tx.row_offset(n0 + j, i2, i3), k) };
                        kernels::round_f16_padded(self.path, x, row);
                    }
                    let mut m0 = rows_w.start;
                    while m0 < rows_w.end {
                        let rows = (rows_w.end - m0).min(tile_rows);
                        let ws: [&[F16Le]; kernels::F16_TILE_ROWS] = core::array::from_fn(|r| {
                            let m = m0 + r.min(rows - 1);
                            // SAFETY: row m of this thread's rows, inside the checked shapes.
                            let bytes: &[u8] =
                                unsafe { self.read(op.w, op.tw.row_offset(m, i2 / r2, i3 / r3), w_len) };
                            bytemuck::cast_slice(bytes)
                        });
                        let mut first = 0;
                        while first < tokens {
                            let tile = (tokens - first).min(tile_tokens);
                            let xs: [&[f32]; kernels::F16_TILE_TOKENS] = core::array::from_fn(|j| {
                                let at = (first + j.min(tile - 1)) * padded;
                                &widened[at..at + padded]
                            });
                            let mut out = [[0f32; kernels::F16_TILE_TOKENS]; kernels::F16_TILE_ROWS];
                            kernels::dot_f16_tile(self.path, &ws[..rows], &xs[..tile], &mut out);
                            for j in 0..tile {
                                let at = t.row_offset(n0 + first + j, i2, i3) + m0 * 4;
                                // SAFETY: elements m0.. (this thread's rows) of output row n0 + first + j.
                                let dst = unsafe { self.write::<f32>(id, at, rows) };
                                for (d, out) in dst.iter_mut().zip(&out) {
                                    *d = out[j];
                                }
                            }
                            first += tile;
                        }
                        m0 += rows;
                    }
                    n0 += tokens;
                }
            }
        }
    }
    /// Matmul on repacked weights: threads split the row groups; tokens go to the kernel in tiles
    /// of up to [`PACKED_TOKENS`], each reading its quantized input rows from phase 0.
    fn mul_mat_packed(
        &self,
        id: TensorId,
        t: &Tensor,
        op: &MatOperands<'_>,
        w: &PackedMatrix<'_>,
        ith: usize,
        nth: usize,
    ) {
        let Some(act) = op.act else { return };
        let ne_x = op.ne_x;
        let groups = share(w.groups(), ith, nth);
        if groups.is_empty() || op.k != w.k {
            return;
        }
        let kernel = self.matmul.of(w.format);
        // A last group the rows do not fill (see `packed`) writes into `spare` first: only its
        // real rows reach the output.
        let full = groups.start..groups.end.min(w.rows / GROUP_ROWS).max(groups.start);
        let partial = full.end..groups.end;
        let rows = GROUP_ROWS * full.start..GROUP_ROWS * full.end;
        let tail_rows = w.rows % GROUP_ROWS;
        for i3 in 0..ne_x[3] {
            for i2 in 0..ne_x[2] {
                let mut n = 0;
                while n < ne_x[1] {
                    let tile = (ne_x[1] - n).min(PACKED_TOKENS);
                    let mut acts: [&[ActBlock]; PACKED_TOKENS] = [&[]; PACKED_TOKENS];
                    let mut outs: [&mut [f32]; PACKED_TOKENS] = core::array::from_fn(|_| Default::default());
                    for j in 0..tile {
                        let bytes = self.converted_row(act, op.tx, ne_x, (n + j, i2, i3), act_row_bytes(w.k));
                        let Ok(blocks) = bytemuck::try_cast_slice::<u8, ActBlock>(bytes) else {
                            self.fail(id, BAD_INDEX);
                            return;
                        };
                        acts[j] = blocks;
                        // SAFETY: row n + j of the output, this thread's rows only (its groups).
                        outs[j] = unsafe {
                            self.write::<f32>(id, t.row_offset(n + j, i2, i3) + rows.start * 4, rows.len())
                        };
                    }
                    if !full.is_empty() {
                        kernel.run(w, full.clone(), &acts[..tile], &mut outs[..tile]);
                    }
                    if !partial.is_empty() {
                        let mut spare = [[0f32; GROUP_ROWS]; PACKED_TOKENS];
                        let mut spare_outs: [&mut [f32]; PACKED_TOKENS] =
                            core::array::from_fn(|_| Default::default());
                        for (o, s) in spare_outs.iter_mut().zip(spare.iter_mut()) {
                            *o = s;
                        }
                        kernel.run(w, partial.clone(), &acts[..tile], &mut spare_outs[..tile]);
                        for (j, s) in spare_outs[..tile].iter().enumerate() {
                            let at = t.row_offset(n + j, i2, i3) + GROUP_ROWS * partial.start * 4;
                            // SAFETY: the real rows of the last group, owned by this thread.
                            unsafe { self.write::<f32>(id, at, tail_rows) }.copy_from_slice(&s[..tail_rows]);
                        }
                    }
                    n += tile;
                }
            }
        }
    }
    pub(in crate::exec) fn mul_mat_id(&self, id: TensorId, t: &Tensor, step: Step, ith: usize, nth: usize) {
        let (Some(op), Some(ids)) = (self.operands(t, step), t.src[2]) else { return };
        if let Some(w) = self.packed_experts(op.tw) {
            self.mul_mat_id_packed(id, t, step, &op, &w, ith, nth);
            return;
        }
        let ti = self.graph.tensor(ids);
        let ne = t.ne_for(step.n_kv);
        let rows_w = share(op.tw.ne[1], ith, nth);
        for tok in 0..ne[2] {
            for u in 0..ne[1] {
                // SAFETY: ids is a contiguous I32 [n_used, n_tokens] tensor (graph checked).
                let e = unsafe { self.read::<i32>(ids, ti.row_offset(tok, 0, 0) + u * 4, 1)[0] };
                let Some(e) = usize::try_from(e).ok().filter(|&e| e < op.tw.ne[2]) else {
                    self.fail(id, BAD_INDEX);
                    continue;
                };
                let xu = if op.tx.ne[1] == 1 { 0 } else { u };
                for m in rows_w.clone() {
                    // SAFETY: indices inside the checked shapes; each thread writes its own m.
                    unsafe {
                        let v = self.dot(&op, (m, e, 0), (xu, tok, 0));
                        self.write::<f32>(id, t.row_offset(u, tok, 0) + m * 4, 1)[0] = v;
                    }
                }
            }
        }
    }
    /// Expert matmul on repacked experts, reading each selected expert's slab in place. Threads
    /// split every expert's row groups the same way; for each expert, the (token, slot) pairs
    /// routed to it go to the kernel in tiles, so a prefill batch streams each slab once.
    #[allow(clippy::too_many_arguments)]
    fn mul_mat_id_packed(
        &self,
        id: TensorId,
        t: &Tensor,
        step: Step,
        op: &MatOperands<'_>,
        w: &PackedMatrix<'_>,
        ith: usize,
        nth: usize,
    ) {
        let (Some(act), Some(ids)) = (op.act, t.src[2]) else { return };
        let ti = self.graph.tensor(ids);
        let (m, n_expert) = (op.tw.ne[1], op.tw.ne[2]);
        let per_expert = m / GROUP_ROWS;
        let local = share(per_expert, ith, nth);
        if local.is_empty() || op.k != w.k {
            return;
        }
        let ne = t.ne_for(step.n_kv);
        let (n_used, n_tokens) = (ne[1], ne[2]);
        let kernel = self.matmul.of(w.format);
        let row_bytes = act_row_bytes(w.k);
        let out_at = local.start * GROUP_ROWS * 4;
        let out_len = local.len() * GROUP_ROWS;
        // SAFETY: ids is a contiguous I32 [n_used, n_tokens] tensor (graph checked).
        let picked: &[i32] = unsafe { self.read(ids, ti.row_offset(0, 0, 0), n_used * n_tokens) };
        if picked.iter().any(|&e| usize::try_from(e).map_or(true, |e| e >= n_expert)) {
            self.fail(id, BAD_INDEX);
            return;
        }
        let run_tile = |groups: Range<usize>, acts: &[&[ActBlock]], outs: &mut [&mut [f32]]| {
            #[cfg(feature = "moe-gather-bench")]
            gathered(w, groups.clone(), |copy| kernel.run(copy, 0..groups.len(), acts, outs));
            #[cfg(not(feature = "moe-gather-bench"))]
            kernel.run(w, groups, acts, outs);
        };
        for e in 0..n_expert {
            let groups = e * per_expert + local.start..e * per_expert + local.end;
            let mut acts: [&[ActBlock]; PACKED_TOKENS] = [&[]; PACKED_TOKENS];
            let mut outs: [&mut [f32]; PACKED_TOKENS] = core::array::from_fn(|_| Default::default());
            let mut tile = 0;
            for (slot, _) in picked.iter().enumerate().filter(|&(_, &p)| p as usize == e) {
                let (u, tok) = (slot % n_used, slot / n_used);
                let xu = if op.ne_x[1] == 1 { 0 } else { u };
                let bytes = self.converted_row(act, op.tx, op.ne_x, (xu, tok, 0), row_bytes);
                let Ok(blocks) = bytemuck::try_cast_slice::<u8, ActBlock>(bytes) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                acts[tile] = blocks;
                // SAFETY: output row (u, tok), this thread's rows of it only (its row groups).
                outs[tile] = unsafe { self.write::<f32>(id, t.row_offset(u, tok, 0) + out_at, out_len) };
                tile += 1;
                if tile == PACKED_TOKENS {
                    run_tile(groups.clone(), &acts[..tile], &mut outs[..tile]);
                    tile = 0;
                }
            }
            if tile > 0 {
                run_tile(groups, &acts[..tile], &mut outs[..tile]);
            }
        }
    }
}

/// The benchmark's gather-then-matmul baseline (feature `moe-gather-bench`): a copy of row groups
/// `groups` of `w` in a per-thread scratch buffer, handed to `run` as a matrix of its own.
#[cfg(feature = "moe-gather-bench")]
fn gathered<R>(w: &PackedMatrix<'_>, groups: Range<usize>, run: impl FnOnce(&PackedMatrix<'_>) -> R) -> R {
    std::thread_local! {
        static SCRATCH: core::cell::RefCell<(std::vec::Vec<u8>, std::vec::Vec<u8>)> =
            const { core::cell::RefCell::new((std::vec::Vec::new(), std::vec::Vec::new())) };
    }
    let nb = w.k / kernels::packed::BLOCK;
    let (qg, sg) = (nb * w.format.quant_bytes(), nb * w.format.scale_bytes());
    SCRATCH.with_borrow_mut(|(q, s)| {
        q.clear();
        q.extend_from_slice(&w.quants[groups.start * qg..groups.end * qg]);
        s.clear();
        s.extend_from_slice(&w.scales[groups.start * sg..groups.end * sg]);
        let copy =
            PackedMatrix { format: w.format, rows: groups.len() * GROUP_ROWS, k: w.k, quants: q, scales: s };
        run(&copy)
    })
}

/// Most tokens (or, for `mul_mat_id`, token-expert pairs) handed to one packed-kernel call. The
/// kernels tile them further but loop over a cache-sized run of row groups outside their token
/// tiles, so a call streams its weights (an expert's slab) from memory once: with the default
/// batch, once per batch.
pub(in crate::exec) const PACKED_TOKENS: usize = 64; // `session::DEFAULT_BATCH`

/// A matmul's weights and input at one step's shapes, and the type the input was converted to.
pub(in crate::exec) struct MatOperands<'t> {
    w: TensorId,
    tw: &'t Tensor,
    ne_w: [usize; 4],
    x: TensorId,
    tx: &'t Tensor,
    ne_x: [usize; 4],
    /// Elements summed per output.
    k: usize,
    /// Type of the converted input, `None` when the F32 input is used directly.
    act: Option<GgmlType>,
}

/// How a matmul on f16 weights of several tokens runs ([`Bound::f16_plan`]).
#[derive(Clone, Copy)]
enum F16Plan {
    /// The encoder's GEMM ([`Bound::mul_mat_f16_gemm`]).
    Gemm,
    /// Blocks of this many tokens on the one-token dot's tiles ([`Bound::mul_mat_f16_blocks`]).
    Blocks(usize),
}

/// Tokens per block of the encoder's GEMM: their packed chunk (`GEMM_DEPTH` elements each,
/// 256 KiB on the stack) stays in L2 while every panel of this thread's weight rows meets it.
const GEMM_BLOCK_TOKENS: usize = 64;

/// Floats of the widened tokens of one block of [`Bound::mul_mat_f16_blocks`] (256 KiB on the
/// stack: the block stays in L2 while each weight row meets all of it).
const F16_BLOCK_FLOATS: usize = 64 * 1024;

/// Tokens of one block of an f16 matmul over rows of `k` on tiles of `tile_tokens`: as many whole
/// tiles as the block holds, else as many tokens as it holds; `None` when not even one fits (rows
/// past 16384 values take the per-token dot).
fn f16_block_tokens(k: usize, tile_tokens: usize) -> Option<usize> {
    let per_block = F16_BLOCK_FLOATS / k.next_multiple_of(32).max(32);
    match per_block / tile_tokens.max(1) {
        0 => (per_block > 0).then_some(per_block),
        tiles => Some(tiles * tile_tokens),
    }
}
