//! One file per family of ops, each an `impl` block of [`Bound`](super::Bound).

pub(super) mod attention;
mod elementwise;
pub(super) mod matmul;
mod recurrent;
mod rows;
mod train;
