//! What the bootstrap test suites share.

use handoff_bootstrap::WorkerRecord;
use handoff_transport::{EngineId, RankInfo, Role};

/// A prefill worker's record: `engine`'s rank at dp `dp` and tp `tp` (each `(rank, size)`),
/// with addresses and a descriptor of its own.
pub fn record(engine: &str, dp: (u32, u32), tp: (u32, u32), incarnation: u64) -> WorkerRecord {
    let rank = RankInfo {
        engine_id: EngineId::new(engine),
        dp_rank: dp.0,
        dp_size: dp.1,
        tp_rank: tp.0,
        tp_size: tp.1,
        pp_rank: 0,
        pp_size: 1,
    };
    WorkerRecord {
        rank,
        role: Role::Prefill,
        incarnation,
        control_address: format!("tcp://10.0.{}.{}:5000", dp.0, tp.0),
        data_address: format!("10.0.{}.{}:6000", dp.0, tp.0),
        data_descriptor: vec![dp.0 as u8, tp.0 as u8],
    }
}
