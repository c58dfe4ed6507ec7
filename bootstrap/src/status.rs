//! How `handoff bootstrap status` shows the registry: an aligned table, or JSON.
//!
//! `status --json` prints one JSON object of this shape (stable: fields are only ever
//! added):
//!
//! ```json
//! {
//!   "server": "tcp://127.0.0.1:7400",
//!   "engines": [
//!     {
//!       "engine_id": "prefill-0",
//!       "role": "prefill",
//!       "expected": 2,
//!       "registered": 1,
//!       "complete": false,
//!       "workers": [
//!         { "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "incarnation": 17,
//!           "control_address": "tcp://10.0.0.1:5000", "data_address": "10.0.0.1:6000" }
//!       ]
//!     }
//!   ]
//! }
//! ```
//!
//! Engines are in engine-id order, workers in (dp, tp, pp) order. `incarnation` is an
//! unsigned 64-bit integer.

use handoff_transport::wire::StatusReply;

/// The `--json` rendering of a status reply (shape in the module docs).
pub fn status_json(server: &str, reply: &StatusReply) -> serde_json::Value {
    let engines: Vec<serde_json::Value> = reply
        .engines
        .iter()
        .map(|e| {
            let workers: Vec<serde_json::Value> = e
                .workers
                .iter()
                .map(|w| {
                    serde_json::json!({
                        "dp_rank": w.rank.dp,
                        "tp_rank": w.rank.tp,
                        "pp_rank": w.rank.pp,
                        "incarnation": w.incarnation,
                        "control_address": w.control_address,
                        "data_address": w.data_address,
                    })
                })
                .collect();
            serde_json::json!({
                "engine_id": e.engine_id.as_str(),
                "role": e.role.to_string(),
                "expected": e.expected,
                "registered": e.workers.len(),
                "complete": e.workers.len() as u64 >= u64::from(e.expected),
                "workers": workers,
            })
        })
        .collect();
    serde_json::json!({ "server": server, "engines": engines })
}

/// The table rendering of a status reply: one row per worker, columns aligned, the state of
/// the worker's engine (`complete` or `k of n registered`) on each row.
pub fn render_table(reply: &StatusReply) -> String {
    if reply.engines.is_empty() {
        return "no workers registered\n".to_string();
    }
    let mut rows: Vec<[String; 7]> = vec![[
        "ENGINE".into(),
        "ROLE".into(),
        "DP/TP/PP".into(),
        "INCARNATION".into(),
        "CONTROL".into(),
        "DATA".into(),
        "STATE".into(),
    ]];
    for e in &reply.engines {
        let state = if e.workers.len() as u64 >= u64::from(e.expected) {
            "complete".to_string()
        } else {
            format!("{} of {} registered", e.workers.len(), e.expected)
        };
        for w in &e.workers {
            rows.push([
                e.engine_id.to_string(),
                e.role.to_string(),
                format!("{}/{}/{}", w.rank.dp, w.rank.tp, w.rank.pp),
                w.incarnation.to_string(),
                w.control_address.clone(),
                w.data_address.clone(),
                state.clone(),
            ]);
        }
    }
    let mut widths = [0usize; 7];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                let pad = width - cell.chars().count() + 2;
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}
