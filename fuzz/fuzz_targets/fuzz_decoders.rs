//! Arbitrary bytes through the data plane's and the Noise session's decoders (see
//! `handoff_transport::wire::fuzz::decoders`, which the corpus replay test runs too).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = handoff_transport::wire::fuzz::decoders(data);
});
