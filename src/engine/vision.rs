//! The engine's vision model kind: a projector file (mmproj) planned for its input size, bound to
//! caller memory, turning an image's normalised pixels into the language model's embeddings. It
//! runs on the engine's parts (a [`GraphSlot`], the planner, [`Bound`] and a [`Runner`]): the
//! inputs (unfolded patches, patch positions) in a persistent region, then the activations and
//! the kernels' work area.

use core::ops::DerefMut;

use super::{EngineError, GraphSlot, Parallel, Runner, MAX_PACKED};
use crate::arena::{Arena, Region, ARENA_ALIGN};
use crate::build_config::GRAPH_CAPACITY;
use crate::exec::{work_bytes, MatmulOffload, PackedEntry, Step};
use crate::gguf::Gguf;
use crate::graph::plan::plan;
use crate::graph::Graph;
use crate::model::vision::{check_projector, Merge, PatchPositions, VisionParams};
use crate::model::{build_vision, resized_position_weights, VisionForward, VisionInputs};

/// A projector's matrices repacked for the packed kernels (those its graph multiplies by, of a
/// type they take, as a language model's): the same for every image size, so a projector file
/// repacks once ([`VisionPlanned::repack`]) and every [`VisionEngine::encode_packed`] reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisionPacking {
    entries: heapless::Vec<PackedEntry, MAX_PACKED>,
    bytes: usize,
}

impl VisionPacking {
    /// Bytes of the repacked planes (of a buffer aligned to [`ARENA_ALIGN`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The matrices repacked.
    pub fn entries(&self) -> &[PackedEntry] {
        &self.entries
    }
}

/// The memory a projector takes beside its language model, planned at its largest input: the
/// file (mapped, read in place), its repacked matrices, and the encoder's caller memory (inputs,
/// activations, work) and graph slot. Bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VisionMemory {
    /// The projector file, mapped.
    pub mapped: usize,
    /// Its matrices repacked for the packed kernels.
    pub repacked: usize,
    /// The encoder's inputs, activations and work at the largest input.
    pub arena: usize,
    /// The encoder's graph slot (graph and plan).
    pub graphs: usize,
    /// The largest input (width, height in pixels) it is planned for.
    pub input: (usize, usize),
}

impl VisionMemory {
    /// All of it.
    pub fn total(&self) -> usize {
        self.mapped + self.repacked + self.arena + self.graphs
    }
}

/// A projector planned for images of one size (the family's square, or the largest dynamic
/// one), its graph in `slot`.
pub struct VisionPlanned<'m, S> {
    bytes: &'m [u8],
    gguf: Gguf<'m>,
    vp: VisionParams,
    slot: S,
    fwd: VisionForward,
    inputs: VisionInputs,
    /// Persistent inputs, activations, work: bytes each (multiples of [`ARENA_ALIGN`]).
    layout: (usize, usize, usize),
    /// The planned image size.
    size: (usize, usize),
    /// Learned positions resized to the grid: the table's side (0: not resized).
    table_side: usize,
}

impl<'m, S: DerefMut<Target = GraphSlot>> VisionPlanned<'m, S> {
    /// Checks the projector in `bytes` (the whole mmproj file) and plans it for inputs of
    /// `width` x `height` pixels, building its graph in `slot`.
    pub fn new(bytes: &'m [u8], mut slot: S, width: usize, height: usize) -> Result<Self, EngineError> {
        let gguf = Gguf::parse(bytes).map_err(EngineError::Gguf)?;
        let vp = check_projector(&gguf)?;
        let p = vp.patch_size as usize;
        let n = (width / p.max(1)) * (height / p.max(1));
        // (validate_vision_tensors checked the table is a square.)
        let table_side = match vp.traits().positions {
            PatchPositions::LearnedResized => gguf
                .tensor("v.position_embd.weight")
                .and_then(|t| crate::model::position_table_side(t.ne[1] as usize))
                .unwrap_or(0),
            _ => 0,
        };
        let (inputs, persistent) =
            VisionInputs::packed(n, 3 * p * p, table_side * table_side, ARENA_ALIGN)
                .ok_or(EngineError::Config("the image is too large for this machine's memory"))?;
        let fwd = build_vision(slot.graph.graph_mut(), &gguf, &vp, inputs, width, height)?;
        slot.plan = plan(slot.graph.graph()).map_err(EngineError::Plan)?;
        slot.fwd = None;
        let activations = slot.plan.peak_bytes.next_multiple_of(ARENA_ALIGN);
        let work = work_bytes(slot.graph.graph()).next_multiple_of(ARENA_ALIGN);
        Ok(Self {
            bytes,
            gguf,
            vp,
            slot,
            fwd,
            inputs,
            layout: (persistent, activations, work),
            size: (width, height),
            table_side,
        })
    }

    /// [`Self::new`] for the largest input the projector takes
    /// ([`VisionParams::largest_input`]): the plan its memory and NPU batches are sized by.
    pub fn largest(bytes: &'m [u8], slot: S) -> Result<Self, EngineError> {
        let gguf = Gguf::parse(bytes).map_err(EngineError::Gguf)?;
        let (w, h) = check_projector(&gguf)?.largest_input();
        Self::new(bytes, slot, w as usize, h as usize)
    }

    /// The projector's hyper-parameters.
    pub fn params(&self) -> &VisionParams {
        &self.vp
    }

    /// The encoder's graph (its matmuls are what an NPU plan looks at).
    pub fn graph(&self) -> &Graph<GRAPH_CAPACITY> {
        self.slot.graph.graph()
    }

    /// What the projector takes in memory when planned at this plan's size (see
    /// [`VisionMemory`]; [`Self::largest`] gives the projector's peak).
    pub fn memory(&self) -> Result<VisionMemory, EngineError> {
        Ok(VisionMemory {
            mapped: self.bytes.len(),
            repacked: self.packing()?.bytes,
            arena: self.bytes_needed(),
            graphs: core::mem::size_of::<GraphSlot>(),
            input: self.size,
        })
    }

    /// The parsed file.
    pub fn gguf(&self) -> &Gguf<'m> {
        &self.gguf
    }

    /// Which of the file's matrices this plan's graph reads repacked, and where their planes go.
    pub fn packing(&self) -> Result<VisionPacking, EngineError> {
        let graph = self.slot.graph.graph();
        let start = self.gguf.data_start();
        let (entries, bytes) = super::plan_packed(&self.gguf, |t| {
            let used = crate::placement::use_in(graph, start + t.offset as usize);
            crate::placement::place(t, used, true)
        })?;
        Ok(VisionPacking { entries, bytes })
    }

    /// Repacks `packing`'s matrices from the file into `buffer` (its [`VisionPacking::bytes`],
    /// aligned to [`ARENA_ALIGN`]), `jobs` spreading them over threads.
    pub fn repack(
        &self,
        packing: &VisionPacking,
        buffer: &mut [u8],
        jobs: &impl Parallel,
    ) -> Result<(), EngineError> {
        if buffer.len() < packing.bytes || buffer.as_ptr().align_offset(ARENA_ALIGN) != 0 {
            return Err(EngineError::Config("the buffer of repacked matrices is too small or misaligned"));
        }
        let (gguf, bytes) = (&self.gguf, self.bytes);
        let source = |offset| super::tensor_source(gguf, bytes, offset);
        super::repack_entries(&packing.entries, &source, buffer, jobs, &|_| {})
    }

    /// Bytes of caller memory [`VisionPlanned::bind`] needs, whatever its alignment.
    pub fn bytes_needed(&self) -> usize {
        let (a, b, c) = self.layout;
        Arena::bytes_for(a + b + c)
    }

    /// Binds the plan to `memory` (at least [`VisionPlanned::bytes_needed`] bytes).
    pub fn bind<B: DerefMut<Target = [u8]>>(
        self,
        mut memory: B,
    ) -> Result<VisionEngine<'m, S, B>, EngineError> {
        let skip = memory.as_ptr().align_offset(ARENA_ALIGN);
        let (persistent, activations, work) = self.layout;
        let mut arena = Arena::new(&mut memory);
        let inputs = arena.alloc_unzeroed(persistent, "image inputs").map_err(EngineError::Memory)?;
        let activations = arena.alloc_unzeroed(activations, "activations").map_err(EngineError::Memory)?;
        let work = arena.alloc_unzeroed(work, "work").map_err(EngineError::Memory)?;
        Ok(VisionEngine { planned: self, memory, skip, inputs, activations, work })
    }
}

/// A projector bound to memory, encoding images.
pub struct VisionEngine<'m, S, B> {
    planned: VisionPlanned<'m, S>,
    memory: B,
    skip: usize,
    inputs: Region,
    activations: Region,
    work: Region,
}

impl<'m, S: DerefMut<Target = GraphSlot>, B: DerefMut<Target = [u8]>> VisionEngine<'m, S, B> {
    /// The projector's hyper-parameters.
    pub fn params(&self) -> &VisionParams {
        &self.planned.vp
    }

    /// Embeddings an image of the planned size gives, and their width.
    pub fn output_shape(&self) -> (usize, usize) {
        (self.planned.fwd.n_tokens, self.planned.vp.n_embd_out as usize)
    }

    /// Encodes one image: `pixels` normalised, rows top to bottom, channels interleaved
    /// (`width * height * 3` values, the planned size). Returns `[n_tokens][n_embd_out]`
    /// embeddings, row after row.
    pub fn encode(
        &mut self,
        pixels: &[f32],
        width: usize,
        height: usize,
        runner: &impl Runner,
    ) -> Result<&[f32], EngineError> {
        self.encode_packed(pixels, width, height, None, None, runner)
    }

    /// [`Self::encode`] reading the matrices `packed` names from its buffer (repacked by
    /// [`VisionPlanned::repack`] for this file), the others from the file; the matmuls `offload`
    /// accepts (weights at offsets of the projector file) run there, as a language model's.
    pub fn encode_packed(
        &mut self,
        pixels: &[f32],
        width: usize,
        height: usize,
        packed: Option<(&[u8], &VisionPacking)>,
        offload: Option<&dyn MatmulOffload>,
        runner: &impl Runner,
    ) -> Result<&[f32], EngineError> {
        if let Some((buffer, packing)) = packed {
            if buffer.len() < packing.bytes || buffer.as_ptr().align_offset(ARENA_ALIGN) != 0 {
                return Err(EngineError::Config(
                    "the buffer of repacked matrices is too small or misaligned",
                ));
            }
        }
        if (width, height) != self.planned.size || pixels.len() != width * height * 3 {
            return Err(EngineError::Config("the image is not of the size the projector was planned for"));
        }
        let p = self.planned.vp.patch_size as usize;
        let (gx, gy) = self.planned.fwd.grid;
        let inputs = self.planned.inputs;
        let arena_start = self.inputs.offset;
        let arena_len = self.work.offset + self.work.len - arena_start;
        let at = |r: Region| Region { offset: r.offset - arena_start, len: r.len };
        let (activations, work) = (at(self.activations), at(self.work));
        let arena = &mut self.memory[self.skip..][arena_start..arena_start + arena_len];
        {
            let n = gx * gy;
            let (patches, rest) = arena[..self.inputs.len].split_at_mut(inputs.positions_offset);
            let patches: &mut [f32] = bytemuck::cast_slice_mut(&mut patches[..3 * p * p * n * 4]);
            let (positions, rest) = rest.split_at_mut(inputs.spans_offset - inputs.positions_offset);
            let positions: &mut [i32] = bytemuck::cast_slice_mut(&mut positions[..4 * n * 4]);
            let (spans, restore) = rest.split_at_mut(inputs.restore_offset - inputs.spans_offset);
            let spans: &mut [i32] = bytemuck::cast_slice_mut(&mut spans[..4 * n * 4]);
            let (restore, weights) = restore.split_at_mut(inputs.pos_weights_offset - inputs.restore_offset);
            let restore: &mut [i32] = bytemuck::cast_slice_mut(&mut restore[..n * 4]);
            let side = self.planned.table_side;
            if side > 0 {
                let weights: &mut [f32] = bytemuck::cast_slice_mut(&mut weights[..side * side * n * 4]);
                resized_position_weights(side, gx, gy, weights);
            }
            let vp = &self.planned.vp;
            let learned = vp.traits().positions != PatchPositions::Rope2d;
            let s = if vp.traits().merge == Merge::SpatialMlp { vp.n_merge as usize } else { 1 };
            // Every row's patch, unfolded as the convolution's taps (channel, then row, then
            // column); its position; its spans of keys; where its merged token goes.
            self.planned.fwd.patch_order(vp, |slot| {
                let (row, px, py) = (slot.row, slot.x, slot.y);
                let out = &mut patches[row * 3 * p * p..][..3 * p * p];
                for c in 0..3 {
                    for ky in 0..p {
                        let src = ((py * p + ky) * width + px * p) * 3;
                        for kx in 0..p {
                            out[(c * p + ky) * p + kx] = pixels[src + kx * 3 + c];
                        }
                    }
                }
                if learned {
                    positions[row] = (py * gx + px) as i32;
                } else {
                    positions[2 * row..][..2].copy_from_slice(&[0, py as i32]);
                    positions[2 * (n + row)..][..2].copy_from_slice(&[0, px as i32]);
                }
                spans[2 * row..][..2].copy_from_slice(&[0, n as i32]);
                spans[2 * (n + row)..][..2].copy_from_slice(&[slot.window.0 as i32, slot.window.1 as i32]);
                if px % s == 0 && py % s == 0 {
                    restore[(py / s) * (gx / s) + px / s] = (row / (s * s)) as i32;
                }
            });
        }
        let slot = &mut *self.planned.slot;
        let buffers: [&[u8]; 1] = [self.planned.bytes];
        // An encoder has no one-token twin: its f16 matmuls take the GEMM.
        let mut bound = slot.graph.bind(&slot.plan, &buffers, arena, activations, work)?.with_f16_gemm(true);
        if let Some((buffer, packing)) = packed {
            bound = bound.with_packed(buffer, &packing.entries);
        }
        if let Some(hook) = offload {
            bound = bound.with_offload(hook);
        }
        runner.run(&mut bound, Step { n_past: 0, n_kv: gx * gy })?;
        let out = self.planned.fwd.embeddings;
        let len = self.planned.fwd.n_tokens * self.planned.vp.n_embd_out as usize;
        let offset = self.skip
            + self.activations.offset
            + slot.plan.offset(out).ok_or(EngineError::Config("the projector's output has no place"))?;
        let bytes = self
            .memory
            .get(offset..offset + len * 4)
            .ok_or(EngineError::Config("the projector's output is outside its memory"))?;
        let values: &[f32] = bytemuck::try_cast_slice(bytes)
            .map_err(|_| EngineError::Config("the projector's output is misaligned"))?;
        if values.iter().any(|v| !v.is_finite()) {
            return Err(EngineError::NonFiniteLogits);
        }
        Ok(values)
    }
}
