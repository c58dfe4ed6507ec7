//! Arbitrary bytes through every decode entry point of the wire protocol (see
//! `handoff_transport::wire::fuzz::frame_decode`, which the corpus replay test runs too).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = handoff_transport::wire::fuzz::frame_decode(data);
});
