//! The one place that touches bincode: payload bytes to messages and back.
//!
//! Payloads use bincode 2's standard configuration (little-endian, varint integers). Decoding
//! runs under a memory limit (bincode's `with_limit`) that is never above
//! [`FRAME_PAYLOAD_BYTES_MAX`] and shrinks with the payload (64 bytes of memory per payload
//! byte, in three size classes), so however large a length prefix a peer writes, bincode
//! refuses it before allocating past the limit, and a tiny frame cannot cost a large
//! allocation. A payload must decode
//! to exactly its own length (leftover bytes are refused), and every decoded message is
//! validated against the wire limits before it is handed out.
//!
//! bincode is pinned to 2.0.1 in the workspace: bincode 3 on crates.io is an empty release
//! that does not compile. Swapping the encoding means changing this module only.

use crate::wire::limits::FRAME_PAYLOAD_BYTES_MAX;
use crate::wire::{Message, MessageType, WireError};
use bincode::config::{self, Configuration, Limit};

/// Encoding settings: bincode's standard configuration (little-endian, varint).
const ENCODE_CONFIG: Configuration = config::standard();

/// Memory a legitimate payload may need per encoded byte, at most. The worst case among our
/// messages is a list of minimal worker records: about 130 bytes of structs from 13 bytes
/// on the wire (10×); 64 leaves room for fields added later.
const DECODE_MEMORY_PER_PAYLOAD_BYTE_MAX: usize = 64;

/// Payloads up to this length decode under [`DECODE_MEMORY_SMALL_BYTES_MAX`]. Almost every
/// control message is this small.
const PAYLOAD_SMALL_BYTES_MAX: usize = 2 * 1024;

/// Memory limit for small payloads: a 30-byte frame whose length prefix claims 16 MiB costs
/// a refusal, not a 16 MiB allocation.
const DECODE_MEMORY_SMALL_BYTES_MAX: usize = 128 * 1024;

/// Payloads up to this length decode under [`DECODE_MEMORY_MEDIUM_BYTES_MAX`].
const PAYLOAD_MEDIUM_BYTES_MAX: usize = 32 * 1024;

/// Memory limit for medium payloads.
const DECODE_MEMORY_MEDIUM_BYTES_MAX: usize = 2 * 1024 * 1024;

const _: () = assert!(
    PAYLOAD_SMALL_BYTES_MAX * DECODE_MEMORY_PER_PAYLOAD_BYTE_MAX <= DECODE_MEMORY_SMALL_BYTES_MAX
);
const _: () = assert!(
    PAYLOAD_MEDIUM_BYTES_MAX * DECODE_MEMORY_PER_PAYLOAD_BYTE_MAX <= DECODE_MEMORY_MEDIUM_BYTES_MAX
);
// Large payloads get the frame maximum, which holds the largest legitimate message (a
// 1M-block transfer needs 4 MiB of ids; a full bootstrap answer about 10 MiB).
const _: () = assert!(DECODE_MEMORY_MEDIUM_BYTES_MAX <= FRAME_PAYLOAD_BYTES_MAX);

/// The decoding configuration with a memory limit of `N` bytes: bincode refuses any length
/// prefix that would take the total allocated past `N`, before allocating.
type DecodeConfig<const N: usize> = Configuration<config::LittleEndian, config::Varint, Limit<N>>;

/// Decoding settings for each payload size class.
const DECODE_CONFIG_SMALL: DecodeConfig<DECODE_MEMORY_SMALL_BYTES_MAX> =
    config::standard().with_limit::<DECODE_MEMORY_SMALL_BYTES_MAX>();
const DECODE_CONFIG_MEDIUM: DecodeConfig<DECODE_MEMORY_MEDIUM_BYTES_MAX> =
    config::standard().with_limit::<DECODE_MEMORY_MEDIUM_BYTES_MAX>();
const DECODE_CONFIG_LARGE: DecodeConfig<FRAME_PAYLOAD_BYTES_MAX> =
    config::standard().with_limit::<FRAME_PAYLOAD_BYTES_MAX>();

/// Appends the encoding of `msg`'s payload (no header) to `out`.
///
/// Validates nothing and checks no size: [`crate::wire::encode_into`] does both.
pub fn encode_payload(msg: &Message, out: &mut Vec<u8>) -> Result<(), WireError> {
    msg.encode_body(out)
}

/// Decodes a payload of type `msg_type`, refuses leftover bytes, and validates the message.
pub fn decode_payload(msg_type: MessageType, payload: &[u8]) -> Result<Message, WireError> {
    let msg = Message::decode_body(msg_type, payload)?;
    msg.validate()?;
    Ok(msg)
}

/// Appends the encoding of one payload value to `out`.
pub(crate) fn encode_value<T: bincode::Encode>(
    msg_type: MessageType,
    value: &T,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    bincode::encode_into_std_write(value, out, ENCODE_CONFIG)
        .map(|_written| ())
        .map_err(|e| WireError::Encode {
            msg_type,
            detail: e.to_string(),
        })
}

/// Decodes one payload value that must span all of `payload`.
pub(crate) fn decode_value<T: bincode::Decode<()>>(
    msg_type: MessageType,
    payload: &[u8],
) -> Result<T, WireError> {
    let decoded = if payload.len() <= PAYLOAD_SMALL_BYTES_MAX {
        bincode::decode_from_slice::<T, _>(payload, DECODE_CONFIG_SMALL)
    } else if payload.len() <= PAYLOAD_MEDIUM_BYTES_MAX {
        bincode::decode_from_slice::<T, _>(payload, DECODE_CONFIG_MEDIUM)
    } else {
        bincode::decode_from_slice::<T, _>(payload, DECODE_CONFIG_LARGE)
    };
    let (value, used) = decoded.map_err(|e| WireError::Decode {
        msg_type,
        detail: e.to_string(),
    })?;
    if used != payload.len() {
        return Err(WireError::TrailingPayloadBytes {
            msg_type,
            extra: payload.len().saturating_sub(used),
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Heartbeat, Query};
    use crate::EngineId;

    #[test]
    fn payload_round_trips() {
        let msg = Message::Heartbeat(Heartbeat {
            incarnation: 7,
            seq: 300,
            echo: 0,
            lease_ms: 0,
        });
        let mut out = Vec::new();
        encode_payload(&msg, &mut out).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(decode_payload(MessageType::Heartbeat, &out), Ok(msg));
    }

    #[test]
    fn leftover_payload_bytes_are_refused() {
        let mut out = Vec::new();
        let msg = Message::Query(Query {
            engine_id: EngineId::new("prefill-0"),
        });
        encode_payload(&msg, &mut out).unwrap_or_else(|e| panic!("{e}"));
        out.push(0);
        assert_eq!(
            decode_payload(MessageType::Query, &out),
            Err(WireError::TrailingPayloadBytes {
                msg_type: MessageType::Query,
                extra: 1
            })
        );
    }

    #[test]
    fn a_huge_length_prefix_is_refused_by_the_limit_not_allocated() {
        // Query { engine_id }: a varint length of u64::MAX (0xfd marker + 8 bytes) then nothing.
        let mut payload = vec![0xfd];
        payload.extend_from_slice(&u64::MAX.to_le_bytes());
        let err = decode_payload(MessageType::Query, &payload);
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
}
