//! `handoff`: KV-cache handoff for disaggregated LLM serving.
pub use handoff_actors as actors;
pub use handoff_gpu as gpu;
pub use handoff_sim as sim;
pub use handoff_transport as transport;
