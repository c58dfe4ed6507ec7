//! Every bound the wire protocol enforces, with the reason for its value.
//!
//! Incoming frames are checked against these on decode (a peer that breaks one gets a named
//! error); outgoing messages are checked on encode, so we never send what a peer would refuse.
//! The `const _: () = assert!(..)` lines check how the limits relate: the largest legitimate
//! message of each kind must fit in one frame.

/// Largest payload one frame may carry, in bytes. Checked on the header, before anything is
/// allocated or waited for.
///
/// The largest legitimate messages are a [`TransferInfo`](crate::wire::TransferInfo) or
/// [`Ready`](crate::wire::Ready) for a very long prompt ([`BLOCKS_PER_MESSAGE_MAX`] block ids,
/// at most 5 bytes each: about 5 MiB) and a bootstrap answer for the largest engine (about
/// 9.5 MiB, see below). 16 MiB holds both with headroom, and bounds what one connection can
/// make us buffer. It is also the memory limit given to bincode, so decoding one frame never
/// allocates more than this, whatever its length prefixes claim.
pub const FRAME_PAYLOAD_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Most block ids one message may list.
///
/// A 1M-token prompt at one token per block (SGLang's default page size) is 1M blocks; at
/// vLLM's 16 tokens per block the same bound allows 16M-token prompts.
pub const BLOCKS_PER_MESSAGE_MAX: usize = 1 << 20;

/// Largest per-request payload a prefill rank hands to decode beside the KV blocks, in
/// bytes: what an engine needs that is not KV cache (SGLang's first output token, its
/// logprobs and, for speculative decoding, one row of hidden states: a few KiB; a 16k-wide
/// hidden state in fp32 is 64 KiB). Carried in [`Ready`](crate::wire::Ready) or
/// [`Done`](crate::wire::Done); decode holds one per prefill rank until the request ends.
pub const AUX_BYTES_MAX: usize = 1 << 20;

/// Longest request id, in bytes. Engines use UUIDs or `chatcmpl-<uuid>` (under 100 bytes);
/// routers that prefix or concatenate ids stay well under this.
pub const REQUEST_ID_BYTES_MAX: usize = 512;

/// Longest engine id, in bytes. Engine ids are names or UUIDs.
pub const ENGINE_ID_BYTES_MAX: usize = 256;

/// Longest address (control, data, bootstrap), in bytes. A DNS name is at most 253 bytes;
/// scheme, brackets, port and an interface suffix (`%eth0`) add a few dozen.
pub const ADDRESS_BYTES_MAX: usize = 512;

/// Largest opaque data-plane descriptor in a worker record (e.g. a UCX worker address), in
/// bytes. UCX 1.13 worker addresses are hundreds of bytes to a few KiB on hosts with many
/// devices and transports.
pub const DATA_DESCRIPTOR_BYTES_MAX: usize = 8 * 1024;

/// Largest remote key in a region descriptor (e.g. a packed UCX rkey), in bytes. Packed rkeys
/// are tens to hundreds of bytes per transport.
pub const REMOTE_KEY_BYTES_MAX: usize = 4 * 1024;

/// Most remote-key bytes one layout descriptor carries, all ranges together: 8 MiB, room
/// for 2048 ranges (1024 layers, K and V) of 4 KiB keys, while a `Hello` carrying it still
/// fits one frame beside its ranges' numbers (checked below).
pub const LAYOUT_REMOTE_KEY_BYTES_MAX: usize = 8 * 1024 * 1024;

/// A layout descriptor's numbers (at most five varints of ≤ 10 bytes, plus a key length,
/// per range), its keys and a generous 64 KiB for the rest of a `Hello` fit one frame.
const _: () = assert!(
    crate::layout::RANGES_MAX * 6 * 10 + LAYOUT_REMOTE_KEY_BYTES_MAX + (64 << 10)
        <= FRAME_PAYLOAD_BYTES_MAX
);

/// Longest free-text field (failure details, causes, peer names), in bytes: enough for an
/// error chain, small enough that a chatty peer cannot fill frames with text.
pub const DETAIL_BYTES_MAX: usize = 4 * 1024;

/// Most workers (dp × tp × pp) one engine may have, and so most records in one bootstrap
/// answer. The largest published P/D deployments run a few hundred ranks per engine.
pub const WORKERS_PER_ENGINE_MAX: usize = 1024;

/// Most engines in one bootstrap status reply.
pub const ENGINES_MAX: usize = 1024;

/// Largest encoding of an integer length prefix or `u64` under bincode's varint encoding.
const VARINT_U64_BYTES_MAX: usize = 9;

/// Largest encoding of a `u32` under bincode's varint encoding.
const VARINT_U32_BYTES_MAX: usize = 5;

/// Largest encoding of a [`RankInfo`](crate::RankInfo): engine id and six `u32`.
const RANK_INFO_ENCODED_BYTES_MAX: usize =
    VARINT_U64_BYTES_MAX + ENGINE_ID_BYTES_MAX + 6 * VARINT_U32_BYTES_MAX;

/// Largest encoding of a [`WorkerRecord`](crate::wire::WorkerRecord): rank, role,
/// incarnation, two addresses and the data descriptor.
pub(crate) const WORKER_RECORD_ENCODED_BYTES_MAX: usize = RANK_INFO_ENCODED_BYTES_MAX
    + VARINT_U32_BYTES_MAX
    + VARINT_U64_BYTES_MAX
    + 2 * (VARINT_U64_BYTES_MAX + ADDRESS_BYTES_MAX)
    + VARINT_U64_BYTES_MAX
    + DATA_DESCRIPTOR_BYTES_MAX;

/// Largest encoding of everything in a `TransferInfo` or `Ready` besides its block list: a
/// generous bound on the request id, rank, region descriptor and small fields.
const TRANSFER_FIXED_ENCODED_BYTES_MAX: usize = 64 * 1024;

// A bootstrap answer listing every worker of the largest engine fits in one frame.
const _: () = assert!(
    WORKERS_PER_ENGINE_MAX * WORKER_RECORD_ENCODED_BYTES_MAX + 1024 <= FRAME_PAYLOAD_BYTES_MAX
);
// A transfer message listing the most blocks, with the largest payload, fits in one frame.
const _: () = assert!(
    BLOCKS_PER_MESSAGE_MAX * VARINT_U32_BYTES_MAX
        + AUX_BYTES_MAX
        + VARINT_U64_BYTES_MAX
        + TRANSFER_FIXED_ENCODED_BYTES_MAX
        <= FRAME_PAYLOAD_BYTES_MAX
);
const _: () = assert!(
    REQUEST_ID_BYTES_MAX
        + RANK_INFO_ENCODED_BYTES_MAX
        + ADDRESS_BYTES_MAX
        + REMOTE_KEY_BYTES_MAX
        + 16 * VARINT_U64_BYTES_MAX
        <= TRANSFER_FIXED_ENCODED_BYTES_MAX
);
// The header's u32 length field can announce every legal payload.
const _: () = assert!(FRAME_PAYLOAD_BYTES_MAX <= u32::MAX as usize);
