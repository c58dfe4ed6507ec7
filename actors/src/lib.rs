//! `handoff-actors`: the request lifecycle.
