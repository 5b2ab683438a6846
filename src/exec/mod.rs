//! Running a planned graph.
//!
//! [`Bound::new`] resolves where every tensor's bytes are (model buffers, arena) and checks that
//! each lies inside its memory; after that, kernels run blind. Each computing node is run by all
//! threads, each on its share of the rows ([`Bound::compute`]), with a barrier between nodes.
//! [`Bound::run`] is the single-threaded executor of the core; `pool` (std) runs the same
//! function on pinned worker threads. Nothing here allocates.
//!
//! With [`Bound::with_numerics_check`], every node's output is checked for NaN and infinity right
//! after the node (each thread its share of the rows, then one more barrier), and the run stops at
//! the first node that produced one ([`ExecError::NonFinite`]). Off, it costs one branch per node.
//!
//! - `bound.rs`: binding (addresses checked once), dispatch ([`Bound::compute`]), the numerics
//!   check, the read/write helpers;
//! - `ops/`: one file per family of ops (elementwise, rows, recurrent, train, attention, matmul);
//! - `error.rs`: [`ExecError`]; `offload.rs`: the matmul hook; `pool.rs` (std): the workers.

mod bound;
mod error;
mod offload;
mod ops;
#[cfg(feature = "std")]
pub mod pool;
mod work;

pub use bound::{share, Address, Addressed, Bound, PackedEntry, Step};
pub use error::{split_layer, ExecError};
pub use offload::MatmulOffload;
pub use work::{most_split_tokens, work_bytes};
