//! The fuzz target's decode path as a plain test: replays the hand-made seed corpus of the
//! `frame_decode` fuzz target (`fuzz/seeds/frame_decode/`) through
//! [`wire::fuzz::frame_decode`], the same function the fuzz target runs.
//!
//! Each seed here is built in code with the outcome it must have; the files are checked to
//! match (run with `HANDOFF_WRITE_SEEDS=1` to rewrite them after a deliberate format change).
//! Every other file in the folder (e.g. a crash the fuzzer found, saved as a regression) is
//! replayed too and must simply not panic.

use handoff_transport::auth::Key;
use handoff_transport::wire::frame::{Flags, Header};
use handoff_transport::wire::fuzz::{frame_decode, FUZZ_KEY};
use handoff_transport::wire::{
    self, Done, Hello, LayoutDescriptor, Message, MessageType, RangeDescriptor, TransferInfo,
    TransportKind, WireError,
};
use handoff_transport::{BlockId, RankInfo, RequestId, Role, TransferMode, PROTOCOL_VERSION};
use std::path::PathBuf;

fn seeds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/frame_decode")
}

fn encoded(msg: &Message, key: Option<&Key>) -> Vec<u8> {
    wire::encode(msg, key).unwrap_or_else(|e| panic!("{e}"))
}

fn hello() -> Message {
    Message::Hello(Hello::new(Role::Decode, RankInfo::single("decode-0"), 1))
}

/// A `Hello` with a two-range layout (K and V halves of one layer, 16 blocks of 128 bytes)
/// whose second range advertises `v_len` bytes.
fn hello_with_layout(v_len: u64) -> Hello {
    let range = |addr, len| RangeDescriptor {
        addr,
        len,
        stride: 128,
        bytes: 128,
        remote_key: vec![],
        cuda_ipc: vec![],
    };
    Hello {
        layout: Some(LayoutDescriptor {
            transport: TransportKind::Tcp,
            address: "127.0.0.1:9000".into(),
            cuda_device: None,
            blocks: 16,
            ranges: vec![range(0x1000, 16 * 128), range(0x1000 + 16 * 128, v_len)],
            layers_first: 0,
            layers_count: 1,
            layers_total: 1,
            block_tokens: 16,
            dtype_bytes: 2,
            kv_heads: 2,
            head_order: 1,
            head_bytes: 32,
        }),
        ..Hello::new(Role::Decode, RankInfo::single("decode-0"), 1)
    }
}

fn raw_hello(hello: &Hello) -> Vec<u8> {
    let payload = bincode::encode_to_vec(hello, bincode::config::standard())
        .unwrap_or_else(|e| panic!("{e}"));
    raw_frame(MessageType::Hello, &payload)
}

fn transfer_info(blocks: Vec<BlockId>) -> TransferInfo {
    TransferInfo {
        request_id: RequestId::new("req-1"),
        decode: RankInfo::single("decode-0"),
        incarnation: 1,
        mode: TransferMode::Push,
        blocks,
    }
}

fn raw_frame(msg_type: MessageType, payload: &[u8]) -> Vec<u8> {
    let header = Header {
        version: PROTOCOL_VERSION,
        msg_type,
        flags: Flags::NONE,
        payload_len: payload.len() as u32,
    };
    let mut frame = header.encode().to_vec();
    frame.extend_from_slice(payload);
    frame
}

fn raw_transfer_info(blocks: Vec<BlockId>) -> Vec<u8> {
    let payload = bincode::encode_to_vec(transfer_info(blocks), bincode::config::standard())
        .unwrap_or_else(|e| panic!("{e}"));
    raw_frame(MessageType::TransferInfo, &payload)
}

fn patched(mut bytes: Vec<u8>, at: usize, with: &[u8]) -> Vec<u8> {
    bytes[at..at + with.len()].copy_from_slice(with);
    bytes
}

type Expect = fn(&Result<Message, WireError>) -> bool;

/// Every hand-made seed: file name, bytes, and the outcome `wire::decode` must give.
fn seeds() -> Vec<(&'static str, Vec<u8>, Expect)> {
    let key = Key::new(FUZZ_KEY).unwrap_or_else(|e| panic!("{e}"));
    let ok_hello = encoded(&hello(), None);
    let done = Message::Done(Done {
        request_id: RequestId::new("req-1"),
        aux: vec![],
    });
    let transfer = Message::TransferInfo(transfer_info(vec![BlockId(2), BlockId(0)]));
    let two_frames = [encoded(&hello(), None), encoded(&done, None)].concat();
    vec![
        ("ok_hello", ok_hello.clone(), |r| {
            matches!(r, Ok(Message::Hello(_)))
        }),
        (
            "ok_hello_layout",
            encoded(&Message::Hello(hello_with_layout(16 * 128)), None),
            |r| {
                matches!(
                    r,
                    Ok(Message::Hello(Hello {
                        layout: Some(_),
                        ..
                    }))
                )
            },
        ),
        ("ok_transfer_info", encoded(&transfer, None), |r| {
            matches!(r, Ok(Message::TransferInfo(_)))
        }),
        ("ok_signed_done", encoded(&done, Some(&key)), |r| {
            matches!(r, Ok(Message::Done(_)))
        }),
        ("err_two_frames_trailing", two_frames, |r| {
            matches!(r, Err(WireError::TrailingBytes { .. }))
        }),
        ("err_empty", vec![], |r| {
            matches!(r, Err(WireError::Truncated { .. }))
        }),
        ("err_truncated_header", ok_hello[..7].to_vec(), |r| {
            matches!(r, Err(WireError::Truncated { .. }))
        }),
        (
            "err_truncated_payload",
            ok_hello[..ok_hello.len() - 2].to_vec(),
            |r| matches!(r, Err(WireError::Truncated { .. })),
        ),
        (
            "err_bad_magic",
            patched(ok_hello.clone(), 0, b"HTTP"),
            |r| matches!(r, Err(WireError::BadMagic { .. })),
        ),
        (
            "err_unsupported_version",
            patched(ok_hello.clone(), 4, &9u16.to_le_bytes()),
            |r| matches!(r, Err(WireError::UnsupportedVersion { theirs: 9, .. })),
        ),
        (
            "err_unknown_type",
            patched(ok_hello.clone(), 6, &0x0999u16.to_le_bytes()),
            |r| matches!(r, Err(WireError::UnknownMessageType { code: 0x0999 })),
        ),
        (
            "err_unknown_flags",
            patched(ok_hello.clone(), 8, &4u16.to_le_bytes()),
            |r| matches!(r, Err(WireError::UnknownFlags { .. })),
        ),
        (
            "err_reserved_nonzero",
            patched(ok_hello.clone(), 10, &1u16.to_le_bytes()),
            |r| matches!(r, Err(WireError::ReservedNonZero { .. })),
        ),
        (
            "err_oversized_4gib",
            patched(ok_hello[..16].to_vec(), 12, &u32::MAX.to_le_bytes()),
            |r| matches!(r, Err(WireError::Oversized { .. })),
        ),
        (
            "err_trailing_payload_bytes",
            raw_frame(MessageType::Heartbeat, &[1, 2, 3, 4, 5]),
            |r| matches!(r, Err(WireError::TrailingPayloadBytes { extra: 1, .. })),
        ),
        (
            "err_decode_garbage",
            raw_frame(MessageType::Hello, &[1, 7, 0xff]),
            |r| matches!(r, Err(WireError::Decode { .. })),
        ),
        (
            "err_layout_range_outside_len",
            raw_hello(&hello_with_layout(16 * 128 - 1)),
            |r| {
                matches!(
                    r,
                    Err(WireError::Invalid {
                        what: "LayoutDescriptor.ranges",
                        ..
                    })
                )
            },
        ),
        (
            "err_duplicate_blocks",
            raw_transfer_info(vec![BlockId(1), BlockId(1)]),
            |r| matches!(r, Err(WireError::Invalid { .. })),
        ),
    ]
}

#[test]
fn seed_files_match_the_seeds_built_here() {
    let dir = seeds_dir();
    let write = std::env::var_os("HANDOFF_WRITE_SEEDS").is_some();
    if write {
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    }
    for (name, bytes, _) in seeds() {
        let path = dir.join(name);
        if write {
            std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        let on_disk = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run with HANDOFF_WRITE_SEEDS=1 to write it)",
                path.display()
            )
        });
        assert_eq!(
            on_disk, bytes,
            "{name} is stale: rerun with HANDOFF_WRITE_SEEDS=1"
        );
    }
}

#[test]
fn seeds_decode_to_their_expected_outcome() {
    for (name, bytes, expect) in seeds() {
        let got = frame_decode(&bytes);
        assert!(expect(&got), "{name}: unexpected outcome {got:?}");
    }
}

#[test]
fn every_file_in_the_seed_corpus_replays_without_panic() {
    let dir = seeds_dir();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut replayed = 0;
    for entry in entries {
        let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let _ = frame_decode(&bytes);
        replayed += 1;
    }
    assert!(replayed >= seeds().len(), "only {replayed} files replayed");
}

/// The `fuzz_decoders` seeds through the same function the fuzz target runs, plus every
/// truncation and single-byte change of each: nothing panics, and the valid header seed
/// decodes.
#[test]
fn fuzz_decoders_seeds_replay_without_panicking() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/fuzz_decoders");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        if path.file_name().is_some_and(|n| n == "header") {
            assert!(handoff_transport::wire::fuzz::decoders(&bytes) >= 1);
        }
        for cut in 0..bytes.len() {
            handoff_transport::wire::fuzz::decoders(&bytes[..cut]);
        }
        for i in 0..bytes.len() {
            let mut changed = bytes.clone();
            changed[i] ^= 0xa5;
            handoff_transport::wire::fuzz::decoders(&changed);
        }
        seen += 1;
    }
    assert!(seen > 0, "no seeds in {}", dir.display());
}
