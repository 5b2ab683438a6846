//! Compute kernels: scalar reference twins (`reference`, in `ref.rs`), with SIMD variants chosen
//! at run time arriving beside them (`neon`, `x86`).

#[path = "ref.rs"]
pub mod reference;

pub mod dot;
