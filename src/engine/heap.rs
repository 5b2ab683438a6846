//! std: an engine planned with its graph slots on the heap, the one way every std front end plans
//! one (the session, the NPU plan, `pinfer finetune`, the C ABI). Bare metal gives static slots to
//! [`Planned::new`] itself.

use std::vec::Vec;

use super::{graph_slots, EngineConfig, EngineError, GraphSlot, Model, Planned};
use crate::arena::ArenaExhausted;

/// `n` empty graph slots on the heap (refused, not aborted, when the heap cannot hold them).
pub fn slots(n: usize) -> Result<Vec<GraphSlot>, EngineError> {
    let mut slots = Vec::new();
    slots.try_reserve_exact(n).map_err(|_| {
        let needed = n * core::mem::size_of::<GraphSlot>();
        EngineError::Memory(ArenaExhausted { what: "the engine's graphs", needed, capacity: 0 })
    })?;
    // Each slot (about a megabyte) is made in place: built as a value it would pass through the
    // stack (`resize_with`, `push`), which overflows a default 2 MiB thread stack in some builds.
    for slot in &mut slots.spare_capacity_mut()[..n] {
        GraphSlot::init(slot);
    }
    // SAFETY: the first `n` slots were written just above.
    unsafe { slots.set_len(n) };
    Ok(slots)
}

/// Plans `model` for `config`, its graph slots in a `Vec` (refused, not aborted, when the heap
/// cannot hold them).
pub fn plan<'m>(model: Model<'m>, config: &EngineConfig) -> Result<Planned<'m, Vec<GraphSlot>>, EngineError> {
    Planned::new(model, config, slots(graph_slots(config))?)
}
