//! The decode path under fuzzing, shared by the `frame_decode` fuzz target (`fuzz/` at the
//! repository root) and the corpus replay test, so both run exactly the same code.

use crate::auth::Key;
use crate::wire::{decode, decode_prefix, encode, Message, WireError};

/// The key frames are checked against on the authenticated path. Fixed, so a corpus file
/// that carries a valid trailer stays valid.
pub const FUZZ_KEY: &[u8; 32] = b"handoff-fuzz-key-0123456789abcde";

/// Feeds `data` to every decode entry point, and checks that whatever decodes re-encodes to
/// a frame that decodes to the same message. Returns what [`decode`] without a key said.
///
/// Never panics on any input unless a wire invariant is broken: that panic is the bug the
/// fuzzer reports.
pub fn frame_decode(data: &[u8]) -> Result<Message, WireError> {
    let key = Key::new(FUZZ_KEY).ok();
    // Stream path: read frames off the front until one is refused or incomplete.
    let mut rest = data;
    while let Ok((msg, used)) = decode_prefix(rest, None) {
        assert_round_trips(&msg, None);
        // `used` is at least a header's length, so this loop ends.
        rest = rest.get(used..).unwrap_or_default();
    }
    if let Some(key) = key.as_ref() {
        if let Ok(msg) = decode(data, Some(key)) {
            assert_round_trips(&msg, Some(key));
        }
    }
    let result = decode(data, None);
    if let Ok(msg) = &result {
        assert_round_trips(msg, None);
        assert_round_trips(msg, key.as_ref());
    }
    result
}

fn assert_round_trips(msg: &Message, key: Option<&Key>) {
    let bytes = match encode(msg, key) {
        Ok(bytes) => bytes,
        Err(e) => panic!("a decoded message must re-encode: {e}; message: {msg:?}"),
    };
    match decode(&bytes, key) {
        Ok(again) => assert_eq!(&again, msg, "decode(encode(m)) != m"),
        Err(e) => panic!("a re-encoded message must decode: {e}; message: {msg:?}"),
    }
}

/// The other decoders a peer's bytes reach, under fuzzing (the `fuzz_decoders` target):
/// the TCP data plane's header check and every metadata decoder
/// ([`crate::tcp::frame`]), and a Noise session's opener ([`crate::noise`]) on bytes that
/// are not the session's (every one must be refused, never panic), and the walk of a peer's
/// packed UCX remote key (`ucx::rkey::check_format`). The bootstrap protocol's
/// messages are wire frames: [`frame_decode`] covers them.
///
/// Returns how many of the inputs decoded (for the corpus test to see something happen).
pub fn decoders(data: &[u8]) -> usize {
    use crate::tcp::frame::{self, Header, HEADER_BYTES};
    let mut decoded = 0;
    if let Some(head) = data.first_chunk::<HEADER_BYTES>() {
        decoded += usize::from(Header::check(head).is_ok());
    }
    decoded += usize::from(frame::decode_hello(data).is_ok());
    decoded += usize::from(frame::decode_hello_ok(data).is_ok());
    decoded += usize::from(frame::decode_error(data).is_ok());
    let mut segments = Vec::new();
    decoded += usize::from(frame::decode_op(data, &mut segments).is_ok());
    // A peer's packed UCX remote key, walked before UCX sees it.
    decoded += usize::from(crate::ucx::rkey::check_format(data).is_ok());
    if let Ok(key) = Key::new(FUZZ_KEY) {
        let session =
            crate::noise::Initiator::new(&key, crate::noise::PROLOGUE_DATA).and_then(|mut i| {
                let hello = i.hello()?;
                let (answer, theirs) =
                    crate::noise::Responder::new(&key, crate::noise::PROLOGUE_DATA)?
                        .answer(&hello)?;
                Ok((i.finish(&answer)?, theirs))
            });
        if let Ok((_, mut theirs)) = session {
            // Bytes the initiator never sealed: refused, whatever they are.
            assert!(theirs.opener.open(data).is_err(), "forged bytes opened");
        }
        let responder = crate::noise::Responder::new(&key, crate::noise::PROLOGUE_ZMTP);
        if let Ok(r) = responder {
            decoded += usize::from(r.answer(data).is_ok());
        }
    }
    decoded
}
