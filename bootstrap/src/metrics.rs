//! The bootstrap server's Prometheus metrics, served at `handoff bootstrap
//! --metrics-listen HOST:PORT` (`GET /metrics`) by
//! `handoff_transport::exposition::serve_metrics`. Recording is an atomic add.
//!
//! | family | type | labels | what |
//! | --- | --- | --- | --- |
//! | `handoff_bootstrap_registrations_total` | counter | `outcome` | registrations by outcome |
//! | `handoff_bootstrap_lookups_total` | counter | `outcome` | lookups by outcome |

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// One bootstrap server's metrics (module docs).
pub struct BootstrapMetrics {
    registry: Registry,
    registrations: Family<OutcomeLabel, Counter>,
    lookups: Family<OutcomeLabel, Counter>,
}

impl std::fmt::Debug for BootstrapMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BootstrapMetrics")
    }
}

impl BootstrapMetrics {
    /// Every family registered, all at zero.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("handoff");
        let registrations = Family::default();
        registry.register(
            "bootstrap_registrations",
            "Bootstrap server: worker registrations, by outcome",
            registrations.clone(),
        );
        let lookups = Family::default();
        registry.register(
            "bootstrap_lookups",
            "Bootstrap server: lookups, by outcome",
            lookups.clone(),
        );
        Arc::new(Self {
            registry,
            registrations,
            lookups,
        })
    }

    /// Everything, in the Prometheus text format (0.0.4).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a `String` cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }

    /// A registration ended as `outcome`.
    pub(crate) fn registration(&self, outcome: &'static str) {
        self.registrations
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// A lookup ended as `outcome`.
    pub(crate) fn lookup(&self, outcome: &'static str) {
        self.lookups.get_or_create(&OutcomeLabel { outcome }).inc();
    }
}

impl handoff_transport::exposition::Exposition for BootstrapMetrics {
    fn encode(&self) -> String {
        BootstrapMetrics::encode(self)
    }
}
