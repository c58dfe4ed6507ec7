//! Running one simulation: a fresh current-thread tokio runtime in paused (virtual) time.

use crate::config::SimConfig;
use crate::panic::{Capture, INJECTED_PANIC_TEXT};
use crate::report::{Invariant, Report, Violation};
use crate::world::World;
use crate::SimError;

/// Runs one simulation to its end (or its first violation) and reports.
///
/// Each call builds its own current-thread runtime with paused time, so simulations on
/// different threads do not share a clock, a scheduler or a seed. The wall clock is read
/// only to report how long the run took; nothing inside the simulation reads it.
pub fn simulate(cfg: &SimConfig) -> Result<Report, SimError> {
    cfg.validate()?;
    let wall = std::time::Instant::now();
    let capture = Capture::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    let cfg = cfg.clone();
    let result = rt.block_on(async move {
        let world = World::new(cfg).await?;
        Ok::<Report, SimError>(world.run().await)
    });
    drop(rt);
    let mut report = result?;
    let panics = capture.take();
    let injected = panics
        .iter()
        .filter(|p| p.contains(INJECTED_PANIC_TEXT))
        .count();
    if injected > 0 {
        report
            .injected
            .insert("panics_seen".into(), injected as u64);
    }
    for p in panics
        .into_iter()
        .filter(|p| !p.contains(INJECTED_PANIC_TEXT))
    {
        report.violations.push(Violation {
            invariant: Invariant::NoCrash,
            t_ms: report.virtual_ms,
            request: None,
            detail: format!("unexpected panic: {p}"),
            lines: Vec::new(),
        });
    }
    report.wall_ms = wall.elapsed().as_millis() as u64;
    Ok(report)
}
