//! pinfer: LLM inference for RK3588-class ARM boards.
//!
//! The core of this crate is `#![no_std]` and allocation-free: it works over caller-provided bytes
//! (the model file, an arena). The `std` feature (on by default) adds the std layer: mmap loading,
//! pinned worker threads and the `pinfer` CLI.
#![no_std]
#![deny(unsafe_op_in_unsafe_fn)]
// Every unsafe block says why it is sound (clippy checks it on host and aarch64).
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]
// Errors carry names and shapes by value: the core cannot box them, and they only travel on the
// (cold) error path, so their size does not matter.
#![allow(clippy::result_large_err)]

#[cfg(feature = "std")]
extern crate std;

/// Values fixed at build time by `build.rs` (graph capacity override, embedded board profiles).
pub mod build_config {
    include!(concat!(env!("OUT_DIR"), "/build_config.rs"));
}

pub mod arena;
pub mod board;
pub mod chat;
pub mod engine;
pub mod exec;
pub mod gguf;
pub mod graph;
pub mod kernels;
pub mod model;
pub mod op;
pub mod placement;
pub mod quant;
pub mod sampler;
pub mod tensor;
pub mod tokenizer;
pub mod train;

#[cfg(feature = "std")]
pub mod bundle;
#[cfg(feature = "std")]
pub mod embed;
#[cfg(feature = "std")]
pub mod generate;
#[cfg(feature = "std")]
pub mod grammar;
#[cfg(feature = "std")]
pub mod image;
#[cfg(feature = "std")]
pub mod jinja;
#[cfg(feature = "std")]
pub mod loader;
#[cfg(feature = "std")]
pub mod media;
#[cfg(feature = "npu")]
pub mod npu;
#[cfg(feature = "std")]
pub mod output_file;
#[cfg(feature = "std")]
pub mod prompt_format;
#[cfg(feature = "std")]
pub mod reasoning;
#[cfg(feature = "std")]
pub mod repack_cache;
#[cfg(feature = "std")]
pub mod session;
#[cfg(feature = "std")]
pub mod speculative;
#[cfg(feature = "std")]
pub mod store;

/// The crate version, as `pinfer --version` prints it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
