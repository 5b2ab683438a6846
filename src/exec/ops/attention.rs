//! Attention and its KV cache: cache writes, attention in one pass or in parts (split keys and
//! their merge), the f32 tiles of a prompt and the typed kernel over a quantized cache.

use crate::exec::work::{split_bytes, split_stride, SPLIT_MIN_KEYS, SPLIT_PARTS};
use core::ops::Range;

use crate::kernels;
use crate::kernels::attn_tile;
use crate::kernels::kv_attn::{alibi_slope, Alibi, KvOps, TYPED_ROWS};
use crate::kernels::RowSoftmax;
use crate::quant::blocks::F16Le;
use crate::quant::GgmlType;
use crate::tensor::{Tensor, TensorId};

use crate::exec::bound::{share, BAD_INDEX, CACHE_FULL};
use crate::exec::{Bound, Step};

/// Keys per part at least: a part's fixed costs (its queries converted, its output written and
/// merged) stay small beside its keys (16 parts of 32 keys cost a single thread 10% more
/// instructions per token at depth 520).
pub(in crate::exec) const SPLIT_PART_KEYS: usize = 256;

/// Parts of every row when the longest sees `longest` keys: a power of two from 2 to
/// [`SPLIT_PARTS`], each part of at least [`SPLIT_PART_KEYS`] keys where it can be.
pub(in crate::exec) fn split_parts(longest: usize) -> usize {
    let parts = (longest / SPLIT_PART_KEYS).clamp(2, SPLIT_PARTS);
    1 << parts.ilog2()
}

/// Floats of the buffer a step that does not split sums a long row's parts in (64 KiB): all parts
/// of up to 4 heads of 256 values, or of one head of 1024.
pub(in crate::exec) const MERGE_FLOATS: usize = 16384;

/// The parts a row that sees `len` keys is summed in, whether or not its step splits: 0 (one pass
/// over its keys) below [`SPLIT_MIN_KEYS`], else [`split_parts`] of its own keys, each part's
/// softmax merged (`kernels::merge_attn_parts`). A row's arithmetic then depends on its keys
/// only, not on the other rows of its step: a batch of guesses (`--lookup`, `-md`) computes what
/// single tokens would, and a server's batch what each request would alone.
pub(in crate::exec) fn row_parts(len: usize) -> usize {
    if len >= SPLIT_MIN_KEYS {
        split_parts(len)
    } else {
        0
    }
}

/// Part `part` of `parts` of the keys `seen`: the one cut both a split step and a step summing a
/// long row in parts by itself use.
pub(in crate::exec) fn part_keys(seen: &Range<usize>, part: usize, parts: usize) -> Range<usize> {
    let len = seen.len();
    seen.start + len * part / parts..seen.start + len * (part + 1) / parts
}

impl<'a, const N: usize> Bound<'a, N> {
    /// How many parts attention node `t` splits each row's keys into this step, if it splits
    /// (see [`SPLIT_PARTS`]): it can (its parts fit the work region) and some row sees
    /// [`SPLIT_MIN_KEYS`] keys or more.
    pub(in crate::exec) fn split_of(&self, t: &Tensor, step: Step) -> Option<usize> {
        let bytes = split_bytes(self.graph, t);
        let k = t.src[1]?;
        if bytes == 0 || bytes > self.converted_len || (self.converted as usize) % align_of::<f32>() != 0 {
            return None;
        }
        let n_kv = self.graph.tensor(k).ne_for(step.n_kv)[1];
        let longest =
            (0..t.ne[2]).filter_map(|tok| self.visible(t, tok, n_kv, step)).map(|r| r.len()).max()?;
        (longest >= SPLIT_MIN_KEYS).then(|| split_parts(longest))
    }
    /// Rows written into the KV cache at each token's cache row.
    pub(in crate::exec) fn kv_write(&self, id: TensorId, t: &Tensor, step: Step, ith: usize, nth: usize) {
        let path = self.path;
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        // SAFETY: shapes and strides were checked by the graph builder, spans by `new`; rows
        // (or work units) come from `share`, which gives each thread disjoint ones.
        unsafe {
            let (Some((s, ts)), Some((cache, tc))) = (src(0), src(1)) else { return };
            let transposed = t.params.i[0] == 1;
            let n_tokens = ts.ne[1];
            let capacity = if transposed { tc.ne[0] } else { tc.ne[1] };
            if t.src[2].is_none() && step.n_past + n_tokens > capacity {
                if ith == 0 {
                    self.fail(id, CACHE_FULL);
                }
                return;
            }
            let _ = cache;
            for tok in share(n_tokens, ith, nth) {
                let x: &[f32] = self.read(s, ts.row_offset(tok, 0, 0), ts.ne[0]);
                let pos = match self.place(t.src[2], tok) {
                    Some(Some((first, pos))) if first + pos < capacity => first + pos,
                    Some(_) => {
                        self.fail(id, CACHE_FULL);
                        continue;
                    }
                    None => step.n_past + tok,
                };
                if !transposed && tc.ty == GgmlType::F16 && tc.nb[0] == 2 {
                    // A contiguous f16 row: one conversion kernel.
                    let out: &mut [F16Le] = self.write(id, pos * tc.nb[1], x.len());
                    kernels::f32_to_f16(path, x, out);
                    continue;
                }
                if !transposed && tc.ty != GgmlType::F32 {
                    // Another cache type: the row converted or quantized whole (the graph
                    // checked the type; its rows are whole blocks).
                    let bytes = tc.ty.bytes_for(x.len() as u64).unwrap_or(0) as usize;
                    let out: &mut [u8] = self.write(id, pos * tc.nb[1], bytes);
                    if !tc.ty.kv_writer().is_some_and(|store| store(x, out)) {
                        self.fail(id, BAD_INDEX);
                    }
                    continue;
                }
                for (e, &v) in x.iter().enumerate() {
                    let at = if transposed {
                        e * tc.nb[1] + pos * tc.nb[0]
                    } else {
                        pos * tc.nb[1] + e * tc.nb[0]
                    };
                    self.put(id, tc.ty, at, v);
                }
            }
        }
    }
    /// Attention in one pass per (token, KV head, run of query heads).
    pub(in crate::exec) fn flash_attn(
        &self,
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
            let (Some((q, tq)), Some((k, tk)), Some((v, tv))) = (src(0), src(1), src(2)) else {
                return;
            };
            let (hd, hd_v) = (tq.ne[0], tv.ne[0]);
            let n_kv = tk.ne_for(step.n_kv)[1];
            let group = tq.ne[2] / tk.ne[2];
            let (causal, window, scale) = (t.params.i[0] != 0, t.params.i[1] as usize, t.params.f[0]);
            let mut q16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
            let mut acc16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
            // A prompt's tokens over an f16 or f32 cache take the f32 tiles (as llama.cpp's
            // batches of 64 tokens or more): the tokens of a run of that many of one sequence
            // (`in_prompt_run`), so a server slot's next token beside another slot's prompt is
            // computed as it is alone. The other tokens over a cache of other types than f16
            // keys and values take the typed kernel.
            let tiles = attn_tile::prompt_takes_tiles(path, ne[2], tk.ty, tv.ty, hd, hd_v);
            let tiled = |tok: usize| tiles && self.in_prompt_run(t, tok, ne[2]);
            if tiles {
                self.flash_attn_tiles(id, t, ne, step, TileKernel::Float(path, tk.ty), tiled, ith, nth);
                // Without a table of places a causal node's tokens are one prompt run, all tiled;
                // a bidirectional node's take the typed kernel below (`in_prompt_run`).
                if t.src[3].is_none() && causal {
                    return;
                }
            }
            if (tk.ty, tv.ty) != (GgmlType::F16, GgmlType::F16) {
                match KvOps::new(path, tk.ty, tv.ty) {
                    Some(ops) => {
                        let rest = |tok: usize| !tiled(tok);
                        self.flash_attn_tiles(id, t, ne, step, TileKernel::Typed(ops), rest, ith, nth)
                    }
                    None => self.fail(id, BAD_INDEX),
                }
                return;
            }
            // Work units are (token, KV head, run of its query heads): the heads of one KV
            // head share their keys and values, up to FLASH_ROWS per kernel call; single
            // heads when that leaves too few units to share between the threads.
            let group = group.max(1);
            let n_kv_heads = ne[1] / group;
            let runs = group.div_ceil(kernels::FLASH_ROWS);
            let run = if ne[2] * n_kv_heads * runs >= 2 * nth { group.div_ceil(runs) } else { 1 };
            let runs = group.div_ceil(run);
            for u in share(ne[2] * n_kv_heads * runs, ith, nth) {
                let (tok, kv_head, c) = (u / (n_kv_heads * runs), u / runs % n_kv_heads, u % runs);
                if tiled(tok) {
                    continue;
                }
                let first = kv_head * group + c * run;
                let heads = first..(first + run).min((kv_head + 1) * group);
                let (start, end) = match self.place(t.src[3], tok) {
                    // This token's sequence: its rows from `first`, up to its position.
                    Some(Some((first, pos))) if first + pos < n_kv => {
                        let (start, end) = visible_keys(causal, window, pos, pos + 1);
                        (first + start, first + end)
                    }
                    Some(_) => {
                        self.fail(id, BAD_INDEX);
                        (0, 0)
                    }
                    None => visible_keys(causal, window, step.n_past + tok, n_kv),
                };
                let mut qs: [&[f32]; kernels::FLASH_ROWS] = [&[]; kernels::FLASH_ROWS];
                let mut outs: [&mut [f32]; kernels::FLASH_ROWS] = Default::default();
                for (i, head) in heads.clone().enumerate() {
                    qs[i] = self.read(q, tq.row_offset(tok, head, 0), hd);
                    outs[i] = self.write(id, t.row_offset(head, tok, 0), hd_v);
                }
                let n = heads.len();
                // Row j of this KV head's keys (values) is `read`'s row at base + j stride,
                // the bases hoisted out of the kernel's per-key calls.
                let kp = self.address(k).wrapping_add(tk.row_offset(0, kv_head, 0)) as *const u8;
                let vp = self.address(v).wrapping_add(tv.row_offset(0, kv_head, 0)) as *const u8;
                let (ks, vs) = (tk.nb[1], tv.nb[1]);
                let key = |j| core::slice::from_raw_parts(kp.wrapping_add(j * ks).cast::<F16Le>(), hd);
                let value = |j| core::slice::from_raw_parts(vp.wrapping_add(j * vs).cast::<F16Le>(), hd_v);
                let own = row_parts(end - start);
                if own >= 2 && own * hd_v <= MERGE_FLOATS {
                    // A long row is summed in its parts and merged, as a split step sums it (see
                    // `row_parts`): each part's keys once for the heads of a call.
                    let mut parts = [0f32; MERGE_FLOATS];
                    sum_rows_in_parts(
                        &mut parts,
                        &mut outs[..n],
                        |_| own,
                        |rows, part, o| {
                            kernels::flash_attn_rows(
                                path,
                                &qs[rows.clone()],
                                &mut q16[..rows.len() * hd],
                                part_keys(&(start..end), part, own),
                                key,
                                value,
                                scale,
                                &mut acc16[..rows.len() * hd_v],
                                o,
                            )
                        },
                    );
                    continue;
                }
                kernels::flash_attn_rows(
                    path,
                    &qs[..n],
                    &mut q16[..n * hd],
                    start..end,
                    key,
                    value,
                    scale,
                    &mut acc16[..n * hd_v],
                    &mut outs[..n],
                );
            }
        }
    }
    /// Phase 0 of a split attention (see [`SPLIT_PARTS`]): units of (token, KV head, run of its
    /// query heads, part of `parts`), each attending over its part of the token's keys into its
    /// rows' slots of the work region.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::exec) fn flash_attn_parts(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        parts: usize,
        ith: usize,
        nth: usize,
    ) {
        const ROWS: usize = if TYPED_ROWS > kernels::FLASH_ROWS { TYPED_ROWS } else { kernels::FLASH_ROWS };
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        let (Some((q, tq)), Some((k, tk)), Some((v, tv))) = (src(0), src(1), src(2)) else { return };
        let (hd, hd_v, scale) = (tq.ne[0], tv.ne[0], t.params.f[0]);
        let n_kv = tk.ne_for(step.n_kv)[1];
        let group = (tq.ne[2] / tk.ne[2]).max(1);
        let n_kv_heads = ne[1] / group;
        // An f16 cache takes the f16 kernel, any other the typed one (as `flash_attn`).
        let typed = if (tk.ty, tv.ty) == (GgmlType::F16, GgmlType::F16) {
            None
        } else {
            match KvOps::new(self.path, tk.ty, tv.ty) {
                Some(ops) => Some(ops),
                None => return self.fail(id, BAD_INDEX),
            }
        };
        let most = match typed {
            Some(ops) => match typed_rows(&ops, hd, hd_v) {
                Some(rows) => rows,
                None => return self.fail(id, BAD_INDEX),
            },
            None => kernels::FLASH_ROWS,
        };
        let run = group.min(most);
        let runs = group.div_ceil(run);
        let stride = split_stride(hd_v);
        let (kb, vb) = (
            tk.ty.bytes_for(hd as u64).unwrap_or(0) as usize,
            tv.ty.bytes_for(hd_v as u64).unwrap_or(0) as usize,
        );
        let (ks, vs) = (tk.nb[1], tv.nb[1]);
        let mut q16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
        let mut acc16 = [F16Le::from_f32(0.0); kernels::FLASH_ROWS * 1024];
        // The typed kernel's scratch, made once for all of this thread's units.
        let mut typed_scratch: Option<TypedScratch> = None;
        for u in share(ne[2] * n_kv_heads * runs * parts, ith, nth) {
            let part = u % parts;
            let (tok, kv_head, c) =
                (u / (parts * runs * n_kv_heads), u / (parts * runs) % n_kv_heads, u / parts % runs);
            let first = kv_head * group + c * run;
            let heads = first..(first + run).min((kv_head + 1) * group);
            let Some(seen) = self.visible(t, tok, n_kv, step) else { return self.fail(id, BAD_INDEX) };
            // The row's own parts (see `row_parts`): a row in one pass goes straight to its
            // output in its part 0 (the merge skips it); parts past its own are empty.
            let own = row_parts(seen.len());
            let direct = own == 0;
            if direct && part > 0 {
                continue;
            }
            let keys = match own {
                0 => seen.clone(),
                p if part < p => part_keys(&seen, part, p),
                _ => seen.start..seen.start,
            };
            let mut qs: [&[f32]; ROWS] = [&[]; ROWS];
            let mut outs: [&mut [f32]; ROWS] = Default::default();
            let mut ends: [&mut [f32]; ROWS] = Default::default();
            let n = heads.len();
            for (i, head) in heads.enumerate() {
                let slot = (tok * ne[1] + head) * SPLIT_PARTS + part;
                // SAFETY: shapes and strides were checked by the graph builder, spans by `new`;
                // the slots of rows (tok, head) at this part lie in the work region (`split_of`
                // checked its size and alignment) and belong to this unit alone, as does the
                // output row of a row in one pass.
                unsafe {
                    qs[i] = self.read(q, tq.row_offset(tok, head, 0), hd);
                    if direct {
                        outs[i] = self.write(id, t.row_offset(head, tok, 0), hd_v);
                    } else {
                        let slot = core::slice::from_raw_parts_mut(
                            self.converted.cast::<f32>().add(slot * stride),
                            stride,
                        );
                        (ends[i], outs[i]) = slot.split_at_mut(2);
                    }
                }
            }
            // (A row in one pass keeps no softmax end: the merge skips it.)
            let mut put = |i: usize, end: RowSoftmax| {
                if !direct {
                    ends[i][0] = end.max;
                    ends[i][1] = end.sum;
                }
            };
            if keys.is_empty() && !direct {
                (0..n).for_each(|i| put(i, RowSoftmax::EMPTY));
                continue;
            }
            // Row j of this KV head's keys (values) is at base + j stride.
            let kp = self.address(k).wrapping_add(tk.row_offset(0, kv_head, 0)) as *const u8;
            let vp = self.address(v).wrapping_add(tv.row_offset(0, kv_head, 0)) as *const u8;
            match typed {
                Some(ops) => {
                    // SAFETY: rows j < n_kv of the cache views, inside their checked spans.
                    let key = |j| unsafe { core::slice::from_raw_parts(kp.wrapping_add(j * ks), kb) };
                    // SAFETY: as above.
                    let value = |j| unsafe { core::slice::from_raw_parts(vp.wrapping_add(j * vs), vb) };
                    let ranges: [Range<usize>; ROWS] = core::array::from_fn(|_| keys.clone());
                    let TypedScratch { qconv, acc, vals } =
                        typed_scratch.get_or_insert_with(TypedScratch::new);
                    let (qs, ranges, outs) = (&qs[..n], &ranges[..n], &mut outs[..n]);
                    let alibi = alibi_rows(t, tok, first..first + n);
                    let alibi = alibi.as_ref().map(|b| &b[..n]);
                    let got = kernels::flash_attn_rows_typed_alibi(
                        &ops, qs, qconv, ranges, alibi, key, value, scale, acc, vals, outs,
                    );
                    (0..n).for_each(|i| put(i, got[i]));
                }
                None => {
                    // SAFETY: f16 rows j < n_kv of the cache views, inside their checked spans.
                    let key = |j| unsafe {
                        core::slice::from_raw_parts(kp.wrapping_add(j * ks).cast::<F16Le>(), hd)
                    };
                    // SAFETY: as above.
                    let value = |j| unsafe {
                        core::slice::from_raw_parts(vp.wrapping_add(j * vs).cast::<F16Le>(), hd_v)
                    };
                    let got = kernels::flash_attn_rows(
                        self.path,
                        &qs[..n],
                        &mut q16[..n * hd],
                        keys,
                        key,
                        value,
                        scale,
                        &mut acc16[..n * hd_v],
                        &mut outs[..n],
                    );
                    (0..n).for_each(|i| put(i, got[i]));
                }
            }
        }
    }
    /// Phase 1 of a split attention: each output row merged from its parts' slots (a row in one
    /// pass, see `row_parts`, has its output already).
    pub(in crate::exec) fn merge_attn_parts(
        &self,
        id: TensorId,
        ne: [usize; 4],
        step: Step,
        parts: usize,
        ith: usize,
        nth: usize,
    ) {
        let (dv, heads) = (ne[0], ne[1]);
        let stride = split_stride(dv);
        let t = self.graph.tensor(id);
        let Some(k) = t.src[1] else { return };
        let n_kv = self.graph.tensor(k).ne_for(step.n_kv)[1];
        for row in share(ne[2] * heads, ith, nth) {
            let (tok, head) = (row / heads, row % heads);
            let Some(seen) = self.visible(t, tok, n_kv, step) else { return self.fail(id, BAD_INDEX) };
            if row_parts(seen.len()) == 0 {
                continue;
            }
            // SAFETY: the row's slots lie in the work region (`split_of` checked it), written in
            // phase 0 a barrier ago and read-only now; output row (head, tok) is inside the
            // node's checked span and belongs to this thread.
            let (slots, out) = unsafe {
                let at = self.converted.cast::<f32>().add(row * SPLIT_PARTS * stride);
                (
                    core::slice::from_raw_parts(at, parts * stride),
                    self.write::<f32>(id, t.row_offset(head, tok, 0), dv),
                )
            };
            let ends: [RowSoftmax; SPLIT_PARTS] = core::array::from_fn(|c| {
                if c < parts {
                    RowSoftmax { max: slots[c * stride], sum: slots[c * stride + 1] }
                } else {
                    RowSoftmax::EMPTY
                }
            });
            kernels::merge_attn_parts(&ends[..parts], |c| &slots[c * stride + 2..(c + 1) * stride], out);
        }
    }
    /// Whether token `tok` of attention node `t` (of `n` tokens) is one of a run of
    /// [`attn_tile::TILE_MIN_TOKENS`] or more consecutive tokens of its sequence: a prompt's chunk,
    /// not a slot's next token and its guesses (never a bidirectional node's, but for one input:
    /// [`crate::op::Mask::OneInput`]). Every token of a
    /// step without a places table is of one sequence.
    fn in_prompt_run(&self, t: &Tensor, tok: usize, n: usize) -> bool {
        // (A bidirectional node's keys are the batch's, each sequence's from wherever it starts:
        // tiles aligned to the rows would cut a sequence's keys differently in another batch,
        // so its rows take the typed kernel, which runs each row key by key.)
        let least = attn_tile::TILE_MIN_TOKENS;
        if t.params.i[0] == 0 {
            // (But one input's keys, a vision encoder's image, are at the same rows every run.)
            return t.params.i[2] != 0 && n >= least;
        }
        let Some(Some((first, _))) = self.place(t.src[3], tok) else { return n >= least };
        let same = |i: usize| matches!(self.place(t.src[3], i), Some(Some((f, _))) if f == first);
        let before = (1..least.min(tok + 1)).take_while(|&d| same(tok - d)).count();
        let after = (tok + 1..n.min(tok + least)).take_while(|&i| same(i)).count();
        before + 1 + after >= least
    }
    /// The keys token `tok` of an attention node sees (its sequence's rows up to its position,
    /// within the window; a bidirectional node's, its span's rows); `None` for a bad place (the
    /// node fails).
    fn visible(&self, t: &Tensor, tok: usize, n_kv: usize, step: Step) -> Option<Range<usize>> {
        let (causal, window) = (t.params.i[0] != 0, t.params.i[1] as usize);
        match self.place(t.src[3], tok) {
            Some(Some((first, pos))) if causal && first + pos < n_kv => {
                let (start, end) = visible_keys(causal, window, pos, pos + 1);
                Some(first + start..first + end)
            }
            // A bidirectional node's table holds spans: (first row, rows); the keys are the
            // batch's own, so a symmetric window centres on the query's own row.
            Some(Some((first, n))) if !causal && n > 0 && first + n <= n_kv => match window {
                0 => Some(first..first + n),
                _ if (first..first + n).contains(&tok) => {
                    let (start, end) = visible_keys(false, window, tok - first, n);
                    Some(first + start..first + end)
                }
                _ => None,
            },
            Some(_) => None,
            None => {
                let (start, end) = visible_keys(causal, window, step.n_past + tok, n_kv);
                Some(start..end)
            }
        }
    }
    /// Attention of the tokens `computes` accepts in work units of (tokens, KV head, run of its
    /// query heads) by a kernel that takes rows with keys of their own (the typed kernel, the f32
    /// tiles): a prompt's tokens go in tiles, so every key and value row is read once per tile
    /// instead of once per token.
    #[allow(clippy::too_many_arguments)]
    fn flash_attn_tiles(
        &self,
        id: TensorId,
        t: &Tensor,
        ne: [usize; 4],
        step: Step,
        kernel: TileKernel,
        computes: impl Fn(usize) -> bool,
        ith: usize,
        nth: usize,
    ) {
        const ROWS: usize = if TYPED_ROWS > attn_tile::TILE_ROWS { TYPED_ROWS } else { attn_tile::TILE_ROWS };
        let src = |i: usize| t.src[i].map(|s| (s, self.graph.tensor(s)));
        let (Some((q, tq)), Some((k, tk)), Some((v, tv))) = (src(0), src(1), src(2)) else { return };
        let (hd, hd_v, scale, max_bias) = (tq.ne[0], tv.ne[0], t.params.f[0], t.params.f[1]);
        let n_kv = tk.ne_for(step.n_kv)[1];
        let group = (tq.ne[2] / tk.ne[2]).max(1);
        let n_kv_heads = ne[1] / group;
        // Rows per call: what the kernel's scratch holds.
        let most = match kernel {
            TileKernel::Typed(ops) => match typed_rows(&ops, hd, hd_v) {
                Some(rows) => rows,
                None => return self.fail(id, BAD_INDEX),
            },
            TileKernel::Float(..) => attn_tile::tile_rows(hd, hd_v),
        };
        let mut run = group.min(most);
        let mut tile = (most / run).max(1);
        // Enough units for every thread: smaller tiles, then single heads (decode).
        while tile > 1 && ne[2].div_ceil(tile) * n_kv_heads * group.div_ceil(run) < 2 * nth {
            tile /= 2;
        }
        if ne[2] * n_kv_heads * group.div_ceil(run) < 2 * nth {
            run = 1;
        }
        let (runs, tiles) = (group.div_ceil(run), ne[2].div_ceil(tile));
        let (kb, vb) = (
            tk.ty.bytes_for(hd as u64).unwrap_or(0) as usize,
            tv.ty.bytes_for(hd_v as u64).unwrap_or(0) as usize,
        );
        let (ks, vs) = (tk.nb[1], tv.nb[1]);
        // The kernel's scratch, made (zeroed) once for all of this thread's units: each call
        // writes what it reads of it.
        let mut typed_work: Option<TypedWork> = None;
        let mut float_scratch: Option<attn_tile::TileScratch> = None;
        // KV head outermost: a thread's consecutive units read the same keys and values, which
        // stay in its cache between them.
        for u in share(tiles * n_kv_heads * runs, ith, nth) {
            let (kv_head, tl, c) = (u / (tiles * runs), u / runs % tiles, u % runs);
            let first = kv_head * group + c * run;
            let heads = first..(first + run).min((kv_head + 1) * group);
            let tokens = tl * tile..((tl + 1) * tile).min(ne[2]);
            let mut qs: [&[f32]; ROWS] = [&[]; ROWS];
            let mut outs: [&mut [f32]; ROWS] = Default::default();
            let mut keys: [Range<usize>; ROWS] = Default::default();
            let mut alibi = [Alibi { slope: 0.0, query: 0 }; ROWS];
            let mut n = 0;
            for tok in tokens.filter(|&tok| computes(tok)) {
                let Some(range) = self.visible(t, tok, n_kv, step) else {
                    self.fail(id, BAD_INDEX);
                    return;
                };
                for head in heads.clone() {
                    // SAFETY: shapes and strides were checked by the graph builder, spans by
                    // `new`; this unit's (token, head) rows belong to this thread.
                    unsafe {
                        qs[n] = self.read(q, tq.row_offset(tok, head, 0), hd);
                        outs[n] = self.write(id, t.row_offset(head, tok, 0), hd_v);
                    }
                    keys[n] = range.clone();
                    if max_bias > 0.0 {
                        alibi[n] = Alibi { slope: alibi_slope(max_bias, ne[1], head), query: tok };
                    }
                    n += 1;
                }
            }
            // Row j of this KV head's keys (values) is at base + j stride.
            let kp = self.address(k).wrapping_add(tk.row_offset(0, kv_head, 0)) as *const u8;
            let vp = self.address(v).wrapping_add(tv.row_offset(0, kv_head, 0)) as *const u8;
            // SAFETY: rows j < n_kv of the cache views, inside their checked spans.
            let key = |j| unsafe { core::slice::from_raw_parts(kp.wrapping_add(j * ks), kb) };
            // SAFETY: as above.
            let value = |j| unsafe { core::slice::from_raw_parts(vp.wrapping_add(j * vs), vb) };
            match kernel {
                TileKernel::Typed(ops) => {
                    let work = typed_work.get_or_insert_with(TypedWork::new);
                    flash_attn_typed_rows(
                        work,
                        &ops,
                        &qs[..n],
                        &keys[..n],
                        (max_bias > 0.0).then_some(&alibi[..n]),
                        key,
                        value,
                        scale,
                        &mut outs[..n],
                    );
                }
                TileKernel::Float(path, ty) => {
                    let scratch = float_scratch.get_or_insert_with(attn_tile::TileScratch::new);
                    kernels::flash_attn_tile(
                        path,
                        ty,
                        &qs[..n],
                        &keys[..n],
                        key,
                        value,
                        scale,
                        scratch,
                        &mut outs[..n],
                    )
                }
            }
        }
    }
}

/// The ALiBi biases of query heads `heads` of token `tok` of attention node `t` (`params.f[1]`:
/// the maximum bias; 0: none): each head's slope, the token's own key row (a bidirectional
/// node's keys are its batch's rows, ALiBi's only use).
pub(in crate::exec) fn alibi_rows(
    t: &Tensor,
    tok: usize,
    heads: Range<usize>,
) -> Option<[Alibi; TYPED_ROWS]> {
    let max_bias = t.params.f[1];
    (max_bias > 0.0).then(|| {
        core::array::from_fn(|i| Alibi { slope: alibi_slope(max_bias, t.ne[1], heads.start + i), query: tok })
    })
}

/// Bytes of converted queries and floats of accumulators the typed kernel's scratch holds (rows
/// per call: as many as fit, up to `TYPED_ROWS`; at least one head of up to 1024 dimensions).
pub(in crate::exec) const TYPED_QCONV: usize = 16384;
pub(in crate::exec) const TYPED_ACC: usize = 4096;
/// Floats of widened value rows the typed kernel's scratch holds: a chunk of keys for heads of up
/// to 256 dimensions, fewer keys at a time above.
pub(in crate::exec) const TYPED_VALS: usize = kernels::kv_attn::KEY_CHUNK * 256;

/// Query rows one typed-kernel call takes: as many as its scratch holds (converted queries of
/// `dk`, accumulators of `dv`), up to `TYPED_ROWS`; `None` for a head size the cache type cannot
/// hold.
pub(in crate::exec) fn typed_rows(ops: &KvOps, dk: usize, dv: usize) -> Option<usize> {
    let qb = ops.query_bytes(dk)?;
    Some(TYPED_ROWS.min(TYPED_ACC / dv.max(1)).min(TYPED_QCONV / qb.max(1)).max(1))
}

/// The typed kernel's scratch: converted queries, accumulators, widened values.
pub(in crate::exec) struct TypedScratch {
    qconv: [u8; TYPED_QCONV],
    acc: [f32; TYPED_ACC],
    vals: [f32; TYPED_VALS],
}

impl TypedScratch {
    fn new() -> Self {
        Self { qconv: [0; TYPED_QCONV], acc: [0.0; TYPED_ACC], vals: [0.0; TYPED_VALS] }
    }
}

/// The scratch of [`flash_attn_typed_rows`]: the kernel's, and the parts of long rows. Made once
/// per node and thread (zeroing it for every unit cost prompts over a quantized cache 5%).
pub(in crate::exec) struct TypedWork {
    scratch: TypedScratch,
    parts: [f32; MERGE_FLOATS],
}

impl TypedWork {
    fn new() -> Self {
        Self { scratch: TypedScratch::new(), parts: [0.0; MERGE_FLOATS] }
    }
}

/// [`kernels::kv_attn::flash_attn_rows_typed`] for rows of a step that does not split: a row that sees
/// [`SPLIT_MIN_KEYS`] keys or more is summed in its own parts and merged, as a split step sums it
/// (see `row_parts`), so a token computes the same over a quantized cache alone and in a batch.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub(in crate::exec) fn flash_attn_typed_rows<'k>(
    work: &mut TypedWork,
    ops: &KvOps,
    qs: &[&[f32]],
    keys: &[Range<usize>],
    alibi: Option<&[Alibi]>,
    key: impl Fn(usize) -> &'k [u8],
    value: impl Fn(usize) -> &'k [u8],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    let n = qs.len().min(keys.len()).min(outs.len()).min(TYPED_ROWS);
    let Some(dv) = outs.first().map(|o| o.len()) else { return };
    let TypedWork { scratch: TypedScratch { qconv, acc, vals }, parts } = work;
    let mut typed =
        |qs: &[&[f32]], keys: &[Range<usize>], alibi: Option<&[Alibi]>, outs: &mut [&mut [f32]]| {
            kernels::flash_attn_rows_typed_alibi(
                ops, qs, qconv, keys, alibi, &key, &value, scale, acc, vals, outs,
            )
        };
    // Row r's bias, if the scores have one (gathered with the row's query below).
    let bias = |r: usize| alibi.and_then(|b| b.get(r)).copied().unwrap_or(Alibi { slope: 0.0, query: 0 });
    // Row r's parts, if it is summed in parts (as the f16 path: parts that would not fit the
    // buffer leave a row in one pass).
    let own = |r: usize| Some(row_parts(keys[r].len())).filter(|&p| p >= 2 && p * dv <= MERGE_FLOATS);
    // Rows in one pass go in one call; long rows are gathered for their parts.
    let (mut one, mut long) = (0, 0);
    let mut one_qs: [&[f32]; TYPED_ROWS] = [&[]; TYPED_ROWS];
    let mut one_keys: [Range<usize>; TYPED_ROWS] = Default::default();
    let mut one_alibi = [Alibi { slope: 0.0, query: 0 }; TYPED_ROWS];
    let mut one_outs: [&mut [f32]; TYPED_ROWS] = Default::default();
    let mut long_rows = [0usize; TYPED_ROWS];
    let mut long_outs: [&mut [f32]; TYPED_ROWS] = Default::default();
    for (r, out) in outs[..n].iter_mut().enumerate() {
        if own(r).is_none() {
            (one_qs[one], one_keys[one], one_outs[one]) = (qs[r], keys[r].clone(), &mut **out);
            one_alibi[one] = bias(r);
            one += 1;
        } else {
            (long_rows[long], long_outs[long]) = (r, &mut **out);
            long += 1;
        }
    }
    if one > 0 {
        let one_alibi = alibi.map(|_| &one_alibi[..one]);
        typed(&one_qs[..one], &one_keys[..one], one_alibi, &mut one_outs[..one]);
    }
    // Each call sums one part of the long rows it takes (a row's parts past its own are empty).
    let long_rows = &long_rows[..long];
    sum_rows_in_parts(
        parts,
        &mut long_outs[..long],
        |i| own(long_rows[i]).unwrap_or(0),
        |rows, part, o| {
            let rows = &long_rows[rows];
            let part_qs: [&[f32]; TYPED_ROWS] =
                core::array::from_fn(|i| rows.get(i).map_or(&[][..], |&r| qs[r]));
            let ranges: [Range<usize>; TYPED_ROWS] =
                core::array::from_fn(|i| match rows.get(i).and_then(|&r| own(r).map(|p| (r, p))) {
                    Some((r, p)) if part < p => part_keys(&keys[r], part, p),
                    _ => 0..0,
                });
            let part_alibi: [Alibi; TYPED_ROWS] =
                core::array::from_fn(|i| rows.get(i).map_or(bias(usize::MAX), |&r| bias(r)));
            let part_alibi = alibi.map(|_| &part_alibi[..rows.len()]);
            typed(&part_qs[..rows.len()], &ranges[..rows.len()], part_alibi, o)
        },
    );
}

/// Rows each summed in its own parts (`own(i)` of row i: 2 to [`SPLIT_PARTS`], see `row_parts`)
/// and merged, as a split step sums them: `sum_part(rows, part, outs)` sums part `part` of the
/// rows `rows` (of `outs`) into `outs`, returning their softmax ends; each call takes as many rows
/// as `buf` holds all parts of. (Callers leave a row in one pass whose parts `buf` cannot hold.)
pub(in crate::exec) fn sum_rows_in_parts<const K: usize>(
    buf: &mut [f32; MERGE_FLOATS],
    outs: &mut [&mut [f32]],
    own: impl Fn(usize) -> usize,
    mut sum_part: impl FnMut(Range<usize>, usize, &mut [&mut [f32]]) -> [RowSoftmax; K],
) {
    debug_assert!(outs.len() <= K, "more rows than a kernel call takes");
    let n = outs.len().min(K);
    let Some(dv) = outs.first().map(|o| o.len()) else { return };
    let most = (0..n).map(&own).max().unwrap_or(0).min(SPLIT_PARTS);
    debug_assert!(most * dv <= MERGE_FLOATS, "a row's parts do not fit the buffer");
    if most == 0 || most * dv > MERGE_FLOATS {
        return;
    }
    let per_call = (MERGE_FLOATS / (most * dv)).min(K);
    let mut r0 = 0;
    while r0 < n {
        let hn = per_call.min(n - r0);
        let mut ends = [[RowSoftmax::EMPTY; SPLIT_PARTS]; K];
        for part in 0..most {
            let mut o: [&mut [f32]; K] = core::array::from_fn(|_| Default::default());
            for (o, row) in o.iter_mut().zip(buf[part * hn * dv..(part + 1) * hn * dv].chunks_mut(dv)) {
                *o = row;
            }
            let got = sum_part(r0..r0 + hn, part, &mut o[..hn]);
            for (ends, got) in ends.iter_mut().zip(got).take(hn) {
                ends[part] = got;
            }
        }
        for (i, out) in outs[r0..r0 + hn].iter_mut().enumerate() {
            let part_row = |c: usize| &buf[(c * hn + i) * dv..(c * hn + i + 1) * dv];
            kernels::merge_attn_parts(&ends[i][..own(r0 + i).min(SPLIT_PARTS)], part_row, out);
        }
        r0 += hn;
    }
}

/// The kernel of [`Bound::flash_attn_tiles`]: the typed kernel (any cache types), or the f32
/// tiles of a prompt over an f16 or f32 cache.
#[derive(Clone, Copy)]
pub(in crate::exec) enum TileKernel {
    Typed(KvOps),
    Float(kernels::KernelPath, GgmlType),
}

/// Keys a query at position `pos` sees: `[start, end)` of `n_kv`.
pub(in crate::exec) fn visible_keys(causal: bool, window: usize, pos: usize, n_kv: usize) -> (usize, usize) {
    if !causal {
        // (A symmetric window: `window / 2` positions either side.)
        if window == 0 {
            return (0, n_kv);
        }
        let half = window / 2;
        return (pos.saturating_sub(half), (pos + half + 1).min(n_kv));
    }
    let end = (pos + 1).min(n_kv);
    let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
    (start, end)
}
