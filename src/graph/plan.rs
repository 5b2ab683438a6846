//! Memory planning: lifetimes of activations and greedy packing into one region.
//!
//! Each activation lives from the node that computes it to the last node that reads it (directly
//! or through views); graph outputs live to the end. Activations are placed largest first, each at
//! the lowest 64-byte-aligned offset that does not overlap a placed activation alive at the same
//! time (the greedy planner of TFLite Micro). No allocation: scratch is fixed-capacity.

use core::fmt;

use super::Graph;
use crate::tensor::{Storage, TensorId};

/// Alignment of every planned activation, in bytes (a cache line; enough for any SIMD load).
pub const ACTIVATION_ALIGN: usize = 64;

/// Offset of a tensor that is not a planned activation.
const UNPLANNED: usize = usize::MAX;

/// Where each activation goes, and how much memory that takes.
pub struct Plan<const N: usize> {
    offsets: heapless::Vec<usize, N>,
    /// Bytes the activation region needs (the peak of simultaneously live activations, packed).
    pub peak_bytes: usize,
    /// Bytes all activations would take without reuse.
    pub unshared_bytes: usize,
}

impl<const N: usize> Plan<N> {
    /// A plan for no graph (a slot to plan into later).
    pub const fn new() -> Self {
        Self { offsets: heapless::Vec::new(), peak_bytes: 0, unshared_bytes: 0 }
    }
}

impl<const N: usize> Default for Plan<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a graph could not be planned.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    /// [`Graph::build`] was not called, or found nothing to run.
    NotBuilt,
    /// The sizes add up past the address space.
    TooLarge,
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotBuilt => write!(f, "graph has no outputs: build it before planning"),
            Self::TooLarge => write!(f, "activations do not fit in the address space"),
        }
    }
}

impl core::error::Error for PlanError {}

impl<const N: usize> Plan<N> {
    /// Offset of activation `id` in the activation region, `None` for other tensors.
    pub fn offset(&self, id: TensorId) -> Option<usize> {
        self.offsets.get(id.index()).copied().filter(|&o| o != UNPLANNED)
    }
}

/// A plan that gives every activation its own space, in order (the baseline the packed plan is
/// checked against: same results, more memory).
pub fn plan_unshared<const N: usize>(g: &Graph<N>) -> Result<Plan<N>, PlanError> {
    let mut offsets = heapless::Vec::new();
    let _ = offsets.resize(g.tensors().len(), UNPLANNED);
    let mut end = 0usize;
    for &id in g.order() {
        let t = g.tensor(id);
        if t.storage == Storage::Activation {
            offsets[id.index()] = end;
            let size = padded(t.span_bytes()).ok_or(PlanError::TooLarge)?;
            end = end.checked_add(size).ok_or(PlanError::TooLarge)?;
        }
    }
    Ok(Plan { offsets, peak_bytes: end, unshared_bytes: end })
}

fn padded(bytes: usize) -> Option<usize> {
    Some(bytes.checked_add(ACTIVATION_ALIGN - 1)? & !(ACTIVATION_ALIGN - 1))
}

/// The activation a tensor's bytes belong to (following views), if any.
fn root_activation<const N: usize>(g: &Graph<N>, mut id: TensorId) -> Option<TensorId> {
    loop {
        match g.tensor(id).storage {
            Storage::Activation => return Some(id),
            Storage::View { base, .. } => id = base,
            Storage::External { .. } | Storage::Persistent { .. } => return None,
        }
    }
}

/// Plans the activations of a built graph.
pub fn plan<const N: usize>(g: &Graph<N>) -> Result<Plan<N>, PlanError> {
    let order = g.order();
    if order.is_empty() {
        return Err(PlanError::NotBuilt);
    }
    let n = g.tensors().len();
    // Lifetime of each activation as [first, last] positions in the order.
    let mut first: heapless::Vec<u32, N> = heapless::Vec::new();
    let mut last: heapless::Vec<u32, N> = heapless::Vec::new();
    let _ = first.resize(n, u32::MAX);
    let _ = last.resize(n, 0);
    for (pos, &id) in order.iter().enumerate() {
        let t = g.tensor(id);
        if t.storage == Storage::Activation {
            first[id.index()] = pos as u32;
            last[id.index()] = last[id.index()].max(pos as u32);
        }
        for src in t.src.iter().flatten() {
            if let Some(root) = root_activation(g, *src) {
                last[root.index()] = last[root.index()].max(pos as u32);
            }
        }
    }
    for &out in g.outputs() {
        if let Some(root) = root_activation(g, out) {
            last[root.index()] = order.len() as u32;
        }
    }

    // Activations, largest first (ties: earlier first, so the result is deterministic).
    let mut todo: heapless::Vec<(usize, TensorId), N> = heapless::Vec::new();
    let mut unshared = 0usize;
    for &id in order {
        let t = g.tensor(id);
        if t.storage == Storage::Activation {
            let size = padded(t.span_bytes()).ok_or(PlanError::TooLarge)?;
            unshared = unshared.checked_add(size).ok_or(PlanError::TooLarge)?;
            let _ = todo.push((size, id));
        }
    }
    todo.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));

    let mut offsets: heapless::Vec<usize, N> = heapless::Vec::new();
    let _ = offsets.resize(n, UNPLANNED);
    // Placed activations as (offset, end, id).
    let mut placed: heapless::Vec<(usize, usize, TensorId), N> = heapless::Vec::new();
    let mut live: heapless::Vec<(usize, usize), N> = heapless::Vec::new();
    let mut peak = 0usize;
    for &(size, id) in &todo {
        let (f, l) = (first[id.index()], last[id.index()]);
        live.clear();
        for &(off, end, other) in &placed {
            if first[other.index()] <= l && f <= last[other.index()] {
                let _ = live.push((off, end));
            }
        }
        live.sort_unstable();
        let mut offset = 0usize;
        for &(off, end) in &live {
            if offset.checked_add(size).ok_or(PlanError::TooLarge)? <= off {
                break;
            }
            offset = offset.max(end);
        }
        let end = offset.checked_add(size).ok_or(PlanError::TooLarge)?;
        offsets[id.index()] = offset;
        let _ = placed.push((offset, end, id));
        peak = peak.max(end);
    }
    Ok(Plan { offsets, peak_bytes: peak, unshared_bytes: unshared })
}
