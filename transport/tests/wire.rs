//! The wire protocol from the outside: every message round-trips, every way a peer's bytes
//! can be wrong is refused with its named error, and no input panics.

use handoff_transport::auth::Key;
use handoff_transport::wire::frame::{self, Flags, Header};
use handoff_transport::wire::limits::{
    BLOCKS_PER_MESSAGE_MAX, DATA_DESCRIPTOR_BYTES_MAX, ENGINES_MAX, FRAME_PAYLOAD_BYTES_MAX,
    REQUEST_ID_BYTES_MAX,
};
use handoff_transport::wire::{
    self, check_hello, check_hello_ack, Abort, AbortAck, Done, EngineStatus, Heartbeat, Hello,
    HelloAck, LayoutDescriptor, Message, MessageType, ProtocolError, Query, QueryAnswer,
    QueryReply, Queued, RangeDescriptor, ReadDone, Ready, RegisterConflict, RegisterOk, Rejected,
    StatusReply, StatusRequest, TransferInfo, TransportKind, Unregister, Unregistered, WireError,
    WithPeer, WorkerRecord, WorkerSummary, AUX_BYTES_MAX, HEADER_BYTES,
};
use handoff_transport::{
    BlockId, EngineId, FailureReason, Rank, RankInfo, RequestId, Role, TransferMode,
    PROTOCOL_VERSION,
};
use proptest::prelude::*;

// ---- Fixtures: one of every message. ----

fn key() -> Key {
    Key::new(b"a shared secret of 32 bytes.....").unwrap_or_else(|e| panic!("{e}"))
}

fn rank(engine: &str, tp: u32) -> RankInfo {
    RankInfo {
        tp_rank: tp,
        tp_size: 2,
        ..RankInfo::single(engine)
    }
}

fn record(engine: &str, tp: u32) -> WorkerRecord {
    WorkerRecord {
        rank: rank(engine, tp),
        role: Role::Prefill,
        incarnation: 42,
        control_address: format!("tcp://10.0.0.1:{}", 7000 + tp),
        data_address: "10.0.0.1:9000".into(),
        data_descriptor: vec![0xab; 300],
    }
}

/// Two layers of K and V halves (vLLM's per-layer tensors), 1024 blocks of 2 KiB halves.
fn layout() -> LayoutDescriptor {
    let ranges = (0..4u64)
        .map(|i| RangeDescriptor {
            addr: 0x7f00_0000_0000 + i * 1024 * 2048,
            len: 1024 * 2048,
            stride: 2048,
            bytes: 2048,
            remote_key: vec![1, 2, 3, i as u8],
            cuda_ipc: vec![],
        })
        .collect();
    LayoutDescriptor {
        transport: TransportKind::Ucx,
        address: "10.0.0.2".into(),
        cuda_device: Some(0),
        blocks: 1024,
        ranges,
        layers_first: 0,
        layers_count: 2,
        layers_total: 4,
        block_tokens: 16,
        dtype_bytes: 2,
        kv_heads: 8,
        head_order: 0,
        head_bytes: 64,
    }
}

fn hello_with_layout(layout: LayoutDescriptor) -> Hello {
    Hello {
        layout: Some(layout),
        ..Hello::new(Role::Decode, rank("decode-0", 0), 7)
    }
}

fn request() -> RequestId {
    RequestId::new("chatcmpl-123e4567-e89b-12d3-a456-426614174000")
}

fn transfer_info(blocks: Vec<BlockId>) -> TransferInfo {
    TransferInfo {
        request_id: request(),
        decode: rank("decode-0", 1),
        incarnation: 9,
        mode: TransferMode::Push,
        blocks,
    }
}

/// One message of every type, in [`MessageType::ALL`] order.
fn every_message() -> Vec<Message> {
    vec![
        Message::Hello(hello_with_layout(layout())),
        Message::HelloAck(HelloAck {
            layout: Some(layout()),
            ..HelloAck::new(8)
        }),
        Message::Heartbeat(Heartbeat {
            incarnation: 7,
            seq: 1_000_000,
            echo: 0,
            lease_ms: 0,
        }),
        Message::ProtocolError(ProtocolError {
            detail: "bad magic".into(),
        }),
        Message::Register(record("prefill-0", 1)),
        Message::RegisterOk(RegisterOk {
            rank: rank("prefill-0", 1),
            incarnation: 42,
        }),
        Message::RegisterConflict(RegisterConflict {
            existing: record("prefill-0", 1),
        }),
        Message::Query(Query {
            engine_id: EngineId::new("prefill-0"),
        }),
        Message::QueryReply(QueryReply {
            engine_id: EngineId::new("prefill-0"),
            answer: QueryAnswer::Ready {
                workers: vec![record("prefill-0", 0), record("prefill-0", 1)],
            },
        }),
        Message::StatusRequest(StatusRequest),
        Message::StatusReply(StatusReply {
            engines: vec![EngineStatus {
                engine_id: EngineId::new("prefill-0"),
                role: Role::Prefill,
                expected: 2,
                workers: vec![WorkerSummary {
                    rank: Rank {
                        dp: 0,
                        tp: 1,
                        pp: 0,
                    },
                    incarnation: 42,
                    control_address: "tcp://10.0.0.1:7001".into(),
                    data_address: "10.0.0.1:9000".into(),
                }],
            }],
        }),
        Message::Unregister(Unregister {
            rank: rank("prefill-0", 1),
            incarnation: 42,
        }),
        Message::Unregistered(Unregistered { removed: true }),
        Message::TransferInfo(transfer_info(vec![BlockId(5), BlockId(1), BlockId(1023)])),
        Message::Queued(Queued {
            request_id: request(),
        }),
        Message::Rejected(Rejected {
            request_id: request(),
            reason: FailureReason::RejectedBusy,
        }),
        Message::Ready(Ready {
            request_id: request(),
            blocks: vec![BlockId(0), BlockId(7)],
            aux: vec![],
            hold_ms: 480_000,
        }),
        Message::Done(Done {
            request_id: request(),
            aux: vec![],
        }),
        Message::ReadDone(ReadDone {
            request_id: request(),
        }),
        Message::Abort(Abort {
            request_id: request(),
            reason: FailureReason::AbortedByPeer {
                peer: "decode-0/dp0tp1pp0".into(),
                cause: "engine aborted".into(),
            },
        }),
        Message::AbortAck(AbortAck {
            request_id: request(),
        }),
    ]
}

fn encoded(msg: &Message) -> Vec<u8> {
    wire::encode(msg, None).unwrap_or_else(|e| panic!("encode {msg:?}: {e}"))
}

fn heartbeat_frame() -> Vec<u8> {
    encoded(&Message::Heartbeat(Heartbeat {
        incarnation: 1,
        seq: 2,
        echo: 0,
        lease_ms: 0,
    }))
}

/// A frame around a payload we encode ourselves, bypassing the encoder's validation, to play
/// a peer that sends what we never would.
fn raw_frame(msg_type: MessageType, payload: &[u8]) -> Vec<u8> {
    let header = Header {
        version: PROTOCOL_VERSION,
        msg_type,
        flags: Flags::NONE,
        payload_len: u32::try_from(payload.len()).unwrap_or(u32::MAX),
    };
    let mut frame = header.encode().to_vec();
    frame.extend_from_slice(payload);
    frame
}

fn raw_payload<T: bincode::Encode>(value: &T) -> Vec<u8> {
    bincode::encode_to_vec(value, bincode::config::standard()).unwrap_or_else(|e| panic!("{e}"))
}

// ---- Round trips. ----

#[test]
fn every_message_type_has_a_fixture() {
    let types: Vec<MessageType> = every_message().iter().map(Message::message_type).collect();
    assert_eq!(types, MessageType::ALL);
}

#[test]
fn every_message_round_trips_without_and_with_a_key() {
    let key = key();
    for msg in every_message() {
        for key in [None, Some(&key)] {
            let bytes = wire::encode(&msg, key).unwrap_or_else(|e| panic!("{msg:?}: {e}"));
            assert_eq!(frame::check(&bytes), Ok(bytes.len()));
            let parsed = frame::parse(&bytes).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(parsed.header.msg_type, msg.message_type());
            assert_eq!(parsed.header.flags.has_auth(), key.is_some());
            assert_eq!(wire::decode(&bytes, key), Ok(msg.clone()));
            assert_eq!(
                wire::decode_prefix(&bytes, key),
                Ok((msg.clone(), bytes.len()))
            );
        }
    }
}

#[test]
fn header_is_little_endian_in_the_documented_layout() {
    let bytes = encoded(&Message::Done(Done {
        request_id: RequestId::new("r"),
        aux: vec![],
    }));
    assert_eq!(&bytes[0..4], b"HDOF");
    assert_eq!(&bytes[4..6], &PROTOCOL_VERSION.to_le_bytes());
    assert_eq!(&bytes[6..8], &0x0205u16.to_le_bytes());
    assert_eq!(&bytes[8..12], &[0, 0, 0, 0]);
    assert_eq!(&bytes[12..16], &3u32.to_le_bytes()); // varint length 1 + "r", empty aux
    assert_eq!(&bytes[16..], &[1, b'r', 0]);
}

#[test]
fn a_stream_of_frames_is_read_one_at_a_time() {
    let mut stream = Vec::new();
    for msg in every_message() {
        wire::encode_into(&msg, None, &mut stream).unwrap_or_else(|e| panic!("{e}"));
    }
    let mut rest = &stream[..];
    let mut got = Vec::new();
    while !rest.is_empty() {
        let (msg, used) = wire::decode_prefix(rest, None).unwrap_or_else(|e| panic!("{e}"));
        got.push(msg);
        rest = &rest[used..];
    }
    assert_eq!(got, every_message());
}

#[test]
fn encode_into_leaves_the_buffer_as_it_was_on_error() {
    let mut out = b"previous frame".to_vec();
    let bad = Message::TransferInfo(transfer_info(vec![BlockId(1), BlockId(1)]));
    assert!(wire::encode_into(&bad, None, &mut out).is_err());
    assert_eq!(out, b"previous frame");
}

#[test]
fn largest_block_list_fits_in_one_frame() {
    let blocks = (0..BLOCKS_PER_MESSAGE_MAX as u32).map(BlockId).collect();
    let info = transfer_info(blocks);
    let msg = Message::TransferInfo(info);
    let bytes = encoded(&msg);
    assert!(bytes.len() <= HEADER_BYTES + FRAME_PAYLOAD_BYTES_MAX);
    assert_eq!(wire::decode(&bytes, None), Ok(msg));
}

#[test]
fn largest_bootstrap_answer_fits_in_one_frame() {
    let worker = |i: u32| WorkerRecord {
        rank: RankInfo {
            engine_id: EngineId::new("e".repeat(256)),
            dp_rank: i,
            dp_size: 1024,
            ..RankInfo::single("e")
        },
        role: Role::Prefill,
        incarnation: u64::MAX,
        control_address: "a".repeat(512),
        data_address: "b".repeat(512),
        data_descriptor: vec![0xff; DATA_DESCRIPTOR_BYTES_MAX],
    };
    let msg = Message::QueryReply(QueryReply {
        engine_id: EngineId::new("e".repeat(256)),
        answer: QueryAnswer::Ready {
            workers: (0..1024).map(worker).collect(),
        },
    });
    assert_eq!(wire::decode(&encoded(&msg), None), Ok(msg));
}

// ---- Each error, provoked. ----

#[test]
fn truncated_header_asks_for_more_on_a_stream_and_is_truncated_as_a_message() {
    let bytes = heartbeat_frame();
    assert_eq!(
        frame::check(&bytes[..10]),
        Err(WireError::Incomplete { need: HEADER_BYTES })
    );
    assert_eq!(
        wire::decode(&bytes[..10], None),
        Err(WireError::Truncated {
            have: 10,
            need: HEADER_BYTES
        })
    );
    assert_eq!(
        wire::decode(&[], None),
        Err(WireError::Truncated {
            have: 0,
            need: HEADER_BYTES
        })
    );
}

#[test]
fn truncated_payload_asks_for_more_on_a_stream_and_is_truncated_as_a_message() {
    let bytes = heartbeat_frame();
    let short = &bytes[..bytes.len() - 1];
    assert_eq!(
        wire::decode_prefix(short, None),
        Err(WireError::Incomplete { need: bytes.len() })
    );
    assert_eq!(
        wire::decode(short, None),
        Err(WireError::Truncated {
            have: bytes.len() - 1,
            need: bytes.len()
        })
    );
}

#[test]
fn wrong_magic_is_refused() {
    let mut bytes = heartbeat_frame();
    bytes[0..4].copy_from_slice(b"GET ");
    assert_eq!(
        wire::decode(&bytes, None),
        Err(WireError::BadMagic { found: *b"GET " })
    );
}

#[test]
fn wrong_version_is_refused_naming_both() {
    let mut bytes = heartbeat_frame();
    let theirs = PROTOCOL_VERSION + 1;
    bytes[4..6].copy_from_slice(&theirs.to_le_bytes());
    assert_eq!(
        wire::decode(&bytes, None),
        Err(WireError::UnsupportedVersion {
            ours: PROTOCOL_VERSION,
            theirs
        })
    );
    let err = wire::decode(&bytes, None).with_peer("10.0.0.9:7000");
    let text = err.map(|_| ()).unwrap_err_or_panic().to_string();
    let ours = PROTOCOL_VERSION.to_string();
    assert!(text.contains("10.0.0.9:7000") && text.contains('7') && text.contains(&ours));
}

#[test]
fn hello_with_another_version_is_refused_naming_both() {
    let mut hello = Hello::new(Role::Prefill, RankInfo::single("p"), 1);
    hello.protocol_version = PROTOCOL_VERSION + 1;
    let msg = wire::decode(&encoded(&Message::Hello(hello)), None);
    let msg = msg.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        check_hello(&msg),
        Err(WireError::UnsupportedVersion {
            ours: PROTOCOL_VERSION,
            theirs: PROTOCOL_VERSION + 1
        })
    );
    let first = Message::Heartbeat(Heartbeat {
        incarnation: 1,
        seq: 0,
        echo: 0,
        lease_ms: 0,
    });
    assert_eq!(
        check_hello(&first),
        Err(WireError::UnexpectedMessage {
            expected: "Hello",
            found: MessageType::Heartbeat
        })
    );
    assert!(check_hello_ack(&Message::HelloAck(HelloAck::new(3))).is_ok());
}

#[test]
fn unknown_message_type_is_refused() {
    let mut bytes = heartbeat_frame();
    bytes[6..8].copy_from_slice(&0x0777u16.to_le_bytes());
    assert_eq!(
        wire::decode(&bytes, None),
        Err(WireError::UnknownMessageType { code: 0x0777 })
    );
}

#[test]
fn unknown_flags_and_nonzero_reserved_are_refused() {
    let mut bytes = heartbeat_frame();
    bytes[8..10].copy_from_slice(&0x8000u16.to_le_bytes());
    assert_eq!(
        wire::decode(&bytes, None),
        Err(WireError::UnknownFlags { flags: 0x8000 })
    );
    let mut bytes = heartbeat_frame();
    bytes[10] = 1;
    assert_eq!(
        wire::decode(&bytes, None),
        Err(WireError::ReservedNonZero { value: 1 })
    );
}

#[test]
fn header_announcing_4_gib_is_oversized_before_the_payload_arrives() {
    let mut bytes = heartbeat_frame();
    bytes.truncate(HEADER_BYTES);
    bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    let oversized = WireError::Oversized {
        announced: u64::from(u32::MAX),
        max: FRAME_PAYLOAD_BYTES_MAX,
    };
    assert_eq!(frame::check(&bytes), Err(oversized.clone()));
    assert_eq!(wire::decode_prefix(&bytes, None), Err(oversized.clone()));
    assert_eq!(wire::decode(&bytes, None), Err(oversized));
}

#[test]
fn trailing_bytes_after_a_frame_are_refused_in_a_message() {
    let mut bytes = heartbeat_frame();
    bytes.extend_from_slice(&[0; 3]);
    assert_eq!(
        wire::decode(&bytes, None),
        Err(WireError::TrailingBytes { extra: 3 })
    );
}

#[test]
fn trailing_bytes_inside_a_payload_are_refused() {
    let mut payload = raw_payload(&Heartbeat {
        incarnation: 1,
        seq: 2,
        echo: 0,
        lease_ms: 0,
    });
    payload.push(0);
    assert_eq!(
        wire::decode(&raw_frame(MessageType::Heartbeat, &payload), None),
        Err(WireError::TrailingPayloadBytes {
            msg_type: MessageType::Heartbeat,
            extra: 1
        })
    );
}

#[test]
fn garbage_payload_is_a_decode_error_naming_the_type() {
    // Hello's role is an enum with two variants: 9 is neither. Invalid UTF-8 in a string too.
    let mut payload = vec![1]; // protocol_version = 1
    payload.push(9);
    let err = wire::decode(&raw_frame(MessageType::Hello, &payload), None);
    assert!(
        matches!(
            &err,
            Err(WireError::Decode {
                msg_type: MessageType::Hello,
                ..
            })
        ),
        "{err:?}"
    );
    let err = wire::decode(&raw_frame(MessageType::Query, &[2, 0xff, 0xfe]), None);
    assert!(
        matches!(
            &err,
            Err(WireError::Decode {
                msg_type: MessageType::Query,
                ..
            })
        ),
        "{err:?}"
    );
}

#[test]
fn frame_without_trailer_is_auth_missing_when_a_key_is_configured() {
    let bytes = heartbeat_frame();
    assert_eq!(
        wire::decode(&bytes, Some(&key())),
        Err(WireError::AuthMissing)
    );
}

#[test]
fn frame_with_a_wrong_trailer_or_key_is_auth_mismatch() {
    let msg = Message::Done(Done {
        request_id: request(),
        aux: vec![],
    });
    let bytes = wire::encode(&msg, Some(&key())).unwrap_or_else(|e| panic!("{e}"));
    let other = Key::new(b"another secret, 32 bytes long...").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        wire::decode(&bytes, Some(&other)),
        Err(WireError::AuthMismatch)
    );
    // Any flipped bit in header, payload or trailer.
    for i in [6, HEADER_BYTES + 3, bytes.len() - 1] {
        let mut altered = bytes.clone();
        altered[i] ^= 0x01;
        let got = wire::decode(&altered, Some(&key()));
        assert!(
            matches!(
                got,
                Err(WireError::AuthMismatch | WireError::UnknownMessageType { .. })
            ),
            "byte {i}: {got:?}"
        );
    }
    // A receiver without a key accepts a signed frame.
    assert_eq!(wire::decode(&bytes, None), Ok(msg));
}

#[test]
fn stripping_the_trailer_cannot_pass_as_an_unsigned_frame() {
    let bytes = wire::encode(&heartbeat_message(), Some(&key())).unwrap_or_else(|e| panic!("{e}"));
    let mut stripped = bytes[..bytes.len() - 32].to_vec();
    stripped[8] = 0; // clear the AUTH flag
    assert_eq!(
        wire::decode(&stripped, Some(&key())),
        Err(WireError::AuthMissing)
    );
}

fn heartbeat_message() -> Message {
    Message::Heartbeat(Heartbeat {
        incarnation: 3,
        seq: 4,
        echo: 0,
        lease_ms: 0,
    })
}

#[test]
fn oversized_block_list_is_refused_on_encode_and_on_decode() {
    let count = BLOCKS_PER_MESSAGE_MAX + 1;
    let info = transfer_info((0..count as u32).map(BlockId).collect());
    let too_many = WireError::TooMany {
        what: "TransferInfo.blocks",
        count,
        max: BLOCKS_PER_MESSAGE_MAX,
    };
    let msg = Message::TransferInfo(info.clone());
    assert_eq!(wire::encode(&msg, None), Err(too_many.clone()));
    let frame = raw_frame(MessageType::TransferInfo, &raw_payload(&info));
    assert_eq!(wire::decode(&frame, None), Err(too_many));
}

#[test]
fn a_layout_whose_blocks_leave_a_range_is_refused_on_decode() {
    let refused = |layout: LayoutDescriptor| {
        let frame = raw_frame(MessageType::Hello, &raw_payload(&hello_with_layout(layout)));
        match wire::decode(&frame, None) {
            Err(
                WireError::Invalid { what, .. }
                | WireError::TooMany { what, .. }
                | WireError::TooLong { what, .. },
            ) => what,
            other => panic!("accepted: {other:?}"),
        }
    };
    // The last block of range 1 ends one byte past its advertised length.
    let mut short = layout();
    short.ranges[1].len -= 1;
    assert_eq!(refused(short), "LayoutDescriptor.ranges");
    // A range near the top of the address space whose length wraps.
    let mut wraps = layout();
    wraps.ranges[0].addr = u64::MAX - 10;
    refused(wraps);
    // A stride shorter than the blocks, a stride that overflows, empty blocks.
    for (stride, bytes) in [(1024, 2048), (u64::MAX, 2048), (2048, 0)] {
        let mut bad = layout();
        bad.ranges[2].stride = stride;
        bad.ranges[2].bytes = bytes;
        assert_eq!(refused(bad), "LayoutDescriptor");
    }
    // Layers past the model, and more ranges than allowed.
    let mut layers = layout();
    layers.layers_first = 3;
    assert_eq!(refused(layers), "LayoutDescriptor");
    let mut many = layout();
    many.ranges = vec![many.ranges[0].clone(); handoff_transport::RANGES_MAX + 1];
    assert_eq!(refused(many), "LayoutDescriptor.ranges");
    let mut keys = layout();
    keys.ranges[0].remote_key = vec![0; 4097];
    assert_eq!(refused(keys), "RangeDescriptor.remote_key");
    let mut none = layout();
    none.ranges.clear();
    assert_eq!(refused(none), "LayoutDescriptor");
    // A CUDA IPC descriptor is the handle and the allocation's base, or nothing.
    for len in [
        1,
        handoff_gpu::IPC_DESCRIPTOR_BYTES - 1,
        handoff_gpu::IPC_DESCRIPTOR_BYTES + 1,
    ] {
        let mut ipc = layout();
        ipc.ranges[1].cuda_ipc = vec![7; len];
        assert_eq!(refused(ipc), "RangeDescriptor.cuda_ipc");
    }
    // Heads: an order past the known ones, an order or size without heads, a latent cache
    // of several heads, heads of zero bytes.
    let mut order = layout();
    order.head_order = 3;
    assert_eq!(refused(order), "LayoutDescriptor.head_order");
    let mut headless = layout();
    headless.kv_heads = 0;
    assert_eq!(refused(headless), "LayoutDescriptor.kv_heads");
    let mut latent = layout();
    latent.head_order = 2;
    assert_eq!(refused(latent), "LayoutDescriptor");
    let mut empty = layout();
    empty.head_bytes = 0;
    assert_eq!(refused(empty), "LayoutDescriptor");
    let mut ipc = layout();
    ipc.ranges[1].cuda_ipc = vec![7; handoff_gpu::IPC_DESCRIPTOR_BYTES];
    let frame = raw_frame(MessageType::Hello, &raw_payload(&hello_with_layout(ipc)));
    wire::decode(&frame, None).expect("a well-sized CUDA IPC descriptor");
}

#[test]
fn a_checked_layout_descriptor_is_the_layout_it_describes() {
    let layout = layout().to_layout().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(layout.blocks, 1024);
    assert_eq!(layout.block_bytes(), 4 * 2048);
    assert_eq!(
        layout.memory,
        handoff_transport::KvMemory::Cuda { device: 0 }
    );
    assert_eq!(
        layout.heads,
        Some(handoff_transport::KvHeads {
            kv_heads: 8,
            order: handoff_transport::tp::HeadOrder::HeadMajor,
            head_bytes: 64
        })
    );
    let back = LayoutDescriptor::of(TransportKind::Ucx, "10.0.0.2".into(), &layout);
    assert_eq!(
        (back.kv_heads, back.head_order, back.head_bytes),
        (8, 0, 64)
    );
    assert_eq!(back.ranges.len(), 4);
    assert_eq!(back.ranges[3].len, 1024 * 2048);
    assert!(
        back.single_region().is_none(),
        "four ranges are not one region"
    );
}

#[test]
fn duplicate_blocks_are_refused_on_decode() {
    let info = transfer_info(vec![BlockId(3), BlockId(3)]);
    let frame = raw_frame(MessageType::TransferInfo, &raw_payload(&info));
    assert!(matches!(
        wire::decode(&frame, None),
        Err(WireError::Invalid {
            what: "TransferInfo.blocks",
            ..
        })
    ));
}

#[test]
fn overlong_strings_and_oversized_lists_are_refused() {
    let long_id = Done {
        request_id: RequestId::new("x".repeat(REQUEST_ID_BYTES_MAX + 1)),
        aux: vec![],
    };
    let frame = raw_frame(MessageType::Done, &raw_payload(&long_id));
    assert_eq!(
        wire::decode(&frame, None),
        Err(WireError::TooLong {
            what: "Done.request_id",
            len: REQUEST_ID_BYTES_MAX + 1,
            max: REQUEST_ID_BYTES_MAX
        })
    );
    let mut big = record("p", 0);
    big.data_descriptor = vec![0; DATA_DESCRIPTOR_BYTES_MAX + 1];
    assert!(matches!(
        wire::encode(&Message::Register(big), None),
        Err(WireError::TooLong {
            what: "WorkerRecord.data_descriptor",
            ..
        })
    ));
    let big_aux = Done {
        request_id: RequestId::new("r"),
        aux: vec![7; AUX_BYTES_MAX + 1],
    };
    let frame = raw_frame(MessageType::Done, &raw_payload(&big_aux));
    assert_eq!(
        wire::decode(&frame, None),
        Err(WireError::TooLong {
            what: "Done.aux",
            len: AUX_BYTES_MAX + 1,
            max: AUX_BYTES_MAX
        })
    );
    assert!(matches!(
        wire::encode(&Message::Done(big_aux), None),
        Err(WireError::TooLong {
            what: "Done.aux",
            ..
        })
    ));
    let empty = Done {
        request_id: RequestId::new(""),
        aux: vec![],
    };
    let frame = raw_frame(MessageType::Done, &raw_payload(&empty));
    assert!(matches!(
        wire::decode(&frame, None),
        Err(WireError::Invalid { .. })
    ));
}

#[test]
fn status_reply_too_large_for_a_frame_is_refused_on_encode() {
    let engine = |i: usize| EngineStatus {
        engine_id: EngineId::new(format!("engine-{i}")),
        role: Role::Decode,
        expected: 20,
        workers: (0..20)
            .map(|tp| WorkerSummary {
                rank: Rank { dp: 0, tp, pp: 0 },
                incarnation: 1,
                control_address: "c".repeat(512),
                data_address: "d".repeat(512),
            })
            .collect(),
    };
    let msg = Message::StatusReply(StatusReply {
        engines: (0..ENGINES_MAX).map(engine).collect(),
    });
    let mut out = Vec::new();
    let err = wire::encode_into(&msg, None, &mut out);
    assert!(matches!(err, Err(WireError::Oversized { .. })), "{err:?}");
    assert!(out.is_empty());
}

#[test]
fn short_key_is_refused() {
    assert_eq!(
        Key::new(b"1234").map(|_| ()),
        Err(WireError::KeyTooShort { len: 4, min: 16 })
    );
}

#[test]
fn errors_name_the_peer_and_become_a_protocol_failure() {
    let err = WireError::AuthMismatch.with_peer("10.1.2.3:5555");
    assert_eq!(err.peer, "10.1.2.3:5555");
    let reason = err.failure_reason();
    assert_eq!(reason.kind(), "protocol_error");
    assert!(reason.to_string().contains("10.1.2.3:5555"));
    assert!(std::error::Error::source(&err).is_some());
}

/// `unwrap_err` without requiring `Debug` on the `Ok` side, and without `unwrap` lints.
trait UnwrapErrOrPanic<E> {
    fn unwrap_err_or_panic(self) -> E;
}

impl<E> UnwrapErrOrPanic<E> for Result<(), E> {
    fn unwrap_err_or_panic(self) -> E {
        match self {
            Ok(()) => panic!("expected an error"),
            Err(e) => e,
        }
    }
}

// ---- Properties. ----

fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>(), 0..=max).prop_map(|cs| cs.into_iter().collect())
}

fn id_text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_./:-]{1,48}"
}

fn any_request_id() -> impl Strategy<Value = RequestId> {
    id_text().prop_map(RequestId::new)
}

fn any_engine_id() -> impl Strategy<Value = EngineId> {
    id_text().prop_map(EngineId::new)
}

fn any_role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Prefill), Just(Role::Decode)]
}

fn any_rank() -> impl Strategy<Value = Rank> {
    (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(dp, tp, pp)| Rank { dp, tp, pp })
}

fn any_rank_info() -> impl Strategy<Value = RankInfo> {
    (any_engine_id(), any_rank(), 1u32..=8, 1u32..=8, 1u32..=8).prop_map(
        |(engine_id, r, dp_size, tp_size, pp_size)| RankInfo {
            engine_id,
            dp_rank: r.dp,
            dp_size,
            tp_rank: r.tp,
            tp_size,
            pp_rank: r.pp,
            pp_size,
        },
    )
}

fn any_failure_reason() -> impl Strategy<Value = FailureReason> {
    prop_oneof![
        Just(FailureReason::BootstrapTimeout),
        (text(40), text(40)).prop_map(|(address, last_error)| {
            FailureReason::BootstrapUnavailable {
                address,
                last_error,
            }
        }),
        Just(FailureReason::WaitingTimeout),
        Just(FailureReason::TransferTimeout),
        text(40).prop_map(|detail| FailureReason::TransferFailed { detail }),
        Just(FailureReason::TtlExpired),
        text(40).prop_map(|peer| FailureReason::PeerLost { peer }),
        Just(FailureReason::RejectedBusy),
        Just(FailureReason::AbortedByEngine),
        (text(40), text(40)).prop_map(|(peer, cause)| FailureReason::AbortedByPeer { peer, cause }),
        text(40).prop_map(|detail| FailureReason::Protocol { detail }),
        text(40).prop_map(|detail| FailureReason::Internal { detail }),
        text(40).prop_map(|detail| FailureReason::Superseded { detail }),
    ]
}

fn any_worker_record() -> impl Strategy<Value = WorkerRecord> {
    (
        any_rank_info(),
        any_role(),
        any::<u64>(),
        text(64),
        text(64),
        proptest::collection::vec(any::<u8>(), 0..256),
    )
        .prop_map(
            |(rank, role, incarnation, control_address, data_address, data_descriptor)| {
                WorkerRecord {
                    rank,
                    role,
                    incarnation,
                    control_address,
                    data_address,
                    data_descriptor,
                }
            },
        )
}

/// A list of distinct blocks, in any order.
fn any_blocks() -> impl Strategy<Value = Vec<BlockId>> {
    proptest::collection::btree_set(0u32..5000, 0..64)
        .prop_map(|set| set.into_iter().map(BlockId).collect::<Vec<_>>())
        .prop_shuffle()
}

/// A valid layout descriptor: 1..8 ranges (contiguous, strided or K/V-interleaved), any
/// transport, keys, layers and per-token facts.
fn any_layout() -> impl Strategy<Value = LayoutDescriptor> {
    let range = (
        0u64..(1 << 40),
        1u64..(1 << 16),
        0u64..3,
        proptest::collection::vec(any::<u8>(), 0..64),
    );
    (
        prop_oneof![
            Just(TransportKind::InProcess),
            Just(TransportKind::Tcp),
            Just(TransportKind::Ucx)
        ],
        text(40),
        proptest::option::of(0u32..8),
        1u32..5000,
        proptest::collection::vec(range, 1..8),
        (0u32..4, any::<u32>(), any::<u32>()),
    )
        .prop_map(
            |(
                transport,
                address,
                cuda_device,
                blocks,
                ranges,
                (first, block_tokens, dtype_bytes),
            )| {
                let ranges: Vec<RangeDescriptor> = ranges
                    .into_iter()
                    .map(|(addr, bytes, gap, remote_key)| {
                        let stride = bytes * (1 + gap);
                        RangeDescriptor {
                            addr,
                            len: u64::from(blocks - 1) * stride + bytes + gap,
                            stride,
                            bytes,
                            remote_key,
                            cuda_ipc: vec![],
                        }
                    })
                    .collect();
                // One layer held per range's worth: layers that divide the block.
                let count = 1;
                LayoutDescriptor {
                    transport,
                    address,
                    cuda_device,
                    blocks,
                    ranges,
                    layers_first: first,
                    layers_count: count,
                    layers_total: first + count + 1,
                    block_tokens,
                    dtype_bytes,
                    kv_heads: 0,
                    head_order: 0,
                    head_bytes: 0,
                }
            },
        )
}

fn any_query_answer() -> impl Strategy<Value = QueryAnswer> {
    prop_oneof![
        proptest::collection::vec(any_worker_record(), 0..6)
            .prop_map(|workers| QueryAnswer::Ready { workers }),
        (proptest::collection::vec(any_rank(), 0..16), 0u32..=1024).prop_map(
            |(registered, expected)| QueryAnswer::NotReady {
                registered,
                expected
            }
        ),
        Just(QueryAnswer::UnknownEngine),
    ]
}

fn any_status_reply() -> impl Strategy<Value = StatusReply> {
    let summary = (any_rank(), any::<u64>(), text(30), text(30)).prop_map(
        |(rank, incarnation, control_address, data_address)| WorkerSummary {
            rank,
            incarnation,
            control_address,
            data_address,
        },
    );
    let engine = (
        any_engine_id(),
        any_role(),
        any::<u32>(),
        proptest::collection::vec(summary, 0..5),
    )
        .prop_map(|(engine_id, role, expected, workers)| EngineStatus {
            engine_id,
            role,
            expected,
            workers,
        });
    proptest::collection::vec(engine, 0..5).prop_map(|engines| StatusReply { engines })
}

fn any_connection_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            any_role(),
            any_rank_info(),
            any::<u64>(),
            proptest::option::of(any_layout())
        )
            .prop_map(|(role, rank, inc, layout)| Message::Hello(Hello {
                layout,
                ..Hello::new(role, rank, inc)
            })),
        (
            any::<u16>(),
            any::<u64>(),
            proptest::option::of(any_layout())
        )
            .prop_map(|(protocol_version, incarnation, layout)| {
                Message::HelloAck(HelloAck {
                    protocol_version,
                    incarnation,
                    data_descriptor: vec![7; (incarnation % 40) as usize],
                    layout,
                    lease_ms: incarnation / 3,
                    pid: (incarnation % 65_536) as u32,
                    copies: incarnation % 2 == 0,
                })
            }),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
            |(incarnation, seq, echo, lease_ms)| Message::Heartbeat(Heartbeat {
                incarnation,
                seq,
                echo,
                lease_ms
            })
        ),
        text(100).prop_map(|detail| Message::ProtocolError(ProtocolError { detail })),
    ]
}

fn any_bootstrap_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        any_worker_record().prop_map(Message::Register),
        (any_rank_info(), any::<u64>()).prop_map(|(rank, incarnation)| {
            Message::RegisterOk(RegisterOk { rank, incarnation })
        }),
        any_worker_record()
            .prop_map(|existing| Message::RegisterConflict(RegisterConflict { existing })),
        any_engine_id().prop_map(|engine_id| Message::Query(Query { engine_id })),
        (any_engine_id(), any_query_answer()).prop_map(|(engine_id, answer)| {
            Message::QueryReply(QueryReply { engine_id, answer })
        }),
        Just(Message::StatusRequest(StatusRequest)),
        any_status_reply().prop_map(Message::StatusReply),
        (any_rank_info(), any::<u64>()).prop_map(|(rank, incarnation)| {
            Message::Unregister(Unregister { rank, incarnation })
        }),
        any::<bool>().prop_map(|removed| Message::Unregistered(Unregistered { removed })),
    ]
}

fn any_peer_message() -> impl Strategy<Value = Message> {
    let mode = prop_oneof![Just(TransferMode::Push), Just(TransferMode::Pull)];
    prop_oneof![
        (
            any_request_id(),
            any_rank_info(),
            any::<u64>(),
            mode,
            any_blocks()
        )
            .prop_map(|(request_id, decode, incarnation, mode, blocks)| {
                Message::TransferInfo(TransferInfo {
                    request_id,
                    decode,
                    incarnation,
                    mode,
                    blocks,
                })
            }),
        any_request_id().prop_map(|request_id| Message::Queued(Queued { request_id })),
        (any_request_id(), any_failure_reason())
            .prop_map(|(request_id, reason)| Message::Rejected(Rejected { request_id, reason })),
        (
            any_request_id(),
            any_blocks(),
            prop::collection::vec(any::<u8>(), 0..64),
            any::<u64>()
        )
            .prop_map(|(request_id, blocks, aux, hold_ms)| Message::Ready(Ready {
                request_id,
                blocks,
                aux,
                hold_ms
            })),
        (any_request_id(), prop::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(request_id, aux)| Message::Done(Done { request_id, aux })),
        any_request_id().prop_map(|request_id| Message::ReadDone(ReadDone { request_id })),
        any_request_id().prop_map(|request_id| Message::AbortAck(AbortAck { request_id })),
        (any_request_id(), any_failure_reason())
            .prop_map(|(request_id, reason)| Message::Abort(Abort { request_id, reason })),
    ]
}

fn any_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        any_connection_message(),
        any_bootstrap_message(),
        any_peer_message(),
    ]
}

/// Every decode entry point on `bytes`; whatever decodes must also validate.
fn decode_everything(bytes: &[u8], key: &Key) {
    let _ = frame::check(bytes);
    let _ = frame::parse(bytes);
    for key in [None, Some(key)] {
        if let Ok(msg) = wire::decode(bytes, key) {
            assert_eq!(msg.validate(), Ok(()));
        }
        if let Ok((msg, used)) = wire::decode_prefix(bytes, key) {
            assert!(used <= bytes.len());
            assert_eq!(msg.validate(), Ok(()));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(handoff_testkit::proptest_cases(512)))]

    #[test]
    fn encode_then_decode_is_identity(msg in any_message(), signed in any::<bool>()) {
        let key = key();
        let key = signed.then_some(&key);
        let bytes = wire::encode(&msg, key).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(frame::check(&bytes), Ok(bytes.len()));
        prop_assert_eq!(wire::decode(&bytes, key), Ok(msg.clone()));
        prop_assert_eq!(wire::decode_prefix(&bytes, key), Ok((msg, bytes.len())));
    }

    #[test]
    fn every_prefix_of_a_frame_is_incomplete_never_an_error(msg in any_message()) {
        let bytes = encoded(&msg);
        for cut in 0..bytes.len() {
            let prefix = &bytes[..cut];
            prop_assert!(
                matches!(wire::decode_prefix(prefix, None), Err(WireError::Incomplete { .. })),
                "cut at {}", cut
            );
            let truncated = matches!(
                wire::decode(prefix, None),
                Err(WireError::Truncated { .. })
            );
            prop_assert!(truncated);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_everything(&bytes, &key());
    }

    #[test]
    fn arbitrary_payloads_behind_a_valid_header_never_panic(
        code in proptest::sample::select(MessageType::ALL),
        payload in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        decode_everything(&raw_frame(code, &payload), &key());
    }

    #[test]
    fn mutated_frames_never_panic(
        msg in any_message(),
        signed in any::<bool>(),
        edits in proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let key = key();
        let mut bytes = wire::encode(&msg, signed.then_some(&key))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        decode_everything(&bytes, &key);
    }
}
