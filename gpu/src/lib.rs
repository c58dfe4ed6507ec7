//! `handoff-gpu`: the GPU side of handoff.
//!
//! It probes for a CUDA driver and devices at run time (through cudarc, never linking
//! CUDA at build time), describes an engine's KV-cache layout so that a request's block
//! list becomes a list of address ranges, allocates KV caches for tests and benchmarks,
//! and names the memory kinds (host, CUDA) that transports register.
//!
//! # Layout
//! - [`MemoryKind`]: where a region's bytes live.

/// Where the bytes of a registered region live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary (or pinned) host memory.
    #[default]
    Host,
    /// CUDA device memory.
    Cuda,
}
