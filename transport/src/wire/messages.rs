//! Every control message handoff sends, who sends it, when, and what the receiver does.
//!
//! One [`Message`] enum; each variant wraps a payload struct and has a stable numeric type
//! code ([`MessageType`]) that travels in the frame header, so the payload itself carries no
//! variant tag. Codes are grouped by conversation: `0x00xx` connection, `0x01xx` bootstrap
//! server, `0x02xx` per-request peer messages. A code is never reused for another meaning;
//! changing a payload's fields is a protocol change (bump [`PROTOCOL_VERSION`]).
//!
//! Every message is validated after decoding and before encoding ([`Message::validate`]):
//! lists and strings are bounded by the limits in [`crate::wire::limits`], block lists hold no
//! duplicates, and a layout descriptor describes memory (every block of every range inside
//! its advertised length). Whether a request's blocks fit the peer's layout, and whether the
//! two layouts pair, is checked by the receiver against the layout the peer sent at connect.

use crate::codec;
use crate::layout::{KvHeads, KvLayout, KvMemory, KvRange, LayerSpan, RANGES_MAX};
use crate::tp::HeadOrder;
use crate::types::{
    BlockId, EngineId, FailureReason, Rank, RankInfo, RequestId, Role, TransferMode,
};
use crate::wire::limits::{
    ADDRESS_BYTES_MAX, AUX_BYTES_MAX, BLOCKS_PER_MESSAGE_MAX, DATA_DESCRIPTOR_BYTES_MAX,
    DETAIL_BYTES_MAX, ENGINES_MAX, ENGINE_ID_BYTES_MAX, LAYOUT_REMOTE_KEY_BYTES_MAX,
    REMOTE_KEY_BYTES_MAX, REQUEST_ID_BYTES_MAX, WORKERS_PER_ENGINE_MAX,
};
use crate::wire::WireError;
use crate::PROTOCOL_VERSION;
use std::fmt;
use std::ops::Range;

/// Declares [`Message`], [`MessageType`] and the dispatch between them from one table, so a
/// variant, its code and its codec arm cannot drift apart.
macro_rules! messages {
    ($( $(#[$meta:meta])* $variant:ident($payload:ty) = $code:literal, )+) => {
        /// A control message: what one frame carries.
        ///
        /// Built by the request, peer and bootstrap actors; turned into bytes by
        /// [`crate::wire::encode`] and back by [`crate::wire::decode`].
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub enum Message {
            $( $(#[$meta])* $variant($payload), )+
        }

        /// The type code of each [`Message`] variant, as it travels in the frame header.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        #[repr(u16)]
        pub enum MessageType {
            $(
                #[doc = concat!("[`Message::", stringify!($variant), "`], code `", stringify!($code), "`.")]
                $variant = $code,
            )+
        }

        impl MessageType {
            /// Every message type, in code order.
            pub const ALL: &'static [MessageType] = &[$(MessageType::$variant),+];

            /// The message type for a header's code, or `None` for a code this version does
            /// not know.
            pub fn from_code(code: u16) -> Option<MessageType> {
                match code {
                    $( $code => Some(MessageType::$variant), )+
                    _ => None,
                }
            }

            /// The code that travels in the frame header.
            pub fn code(self) -> u16 {
                self as u16
            }

            /// The variant's name, for logs and errors.
            pub fn name(self) -> &'static str {
                match self {
                    $( MessageType::$variant => stringify!($variant), )+
                }
            }
        }

        impl Message {
            /// This message's type.
            pub fn message_type(&self) -> MessageType {
                match self {
                    $( Message::$variant(_) => MessageType::$variant, )+
                }
            }

            /// Checks every bound and consistency rule of the payload. Run on every decoded
            /// message, and on every message before it is encoded.
            pub fn validate(&self) -> Result<(), WireError> {
                match self {
                    $( Message::$variant(m) => m.validate(), )+
                }
            }

            /// Appends the payload's encoding to `out` (the frame header is not written).
            pub(crate) fn encode_body(&self, out: &mut Vec<u8>) -> Result<(), WireError> {
                let msg_type = self.message_type();
                match self {
                    $( Message::$variant(m) => codec::encode_value(msg_type, m, out), )+
                }
            }

            /// Decodes a payload of type `msg_type`, which must consume all of `payload`.
            pub(crate) fn decode_body(
                msg_type: MessageType,
                payload: &[u8],
            ) -> Result<Message, WireError> {
                match msg_type {
                    $( MessageType::$variant => {
                        codec::decode_value::<$payload>(msg_type, payload).map(Message::$variant)
                    } )+
                }
            }
        }
    };
}

messages! {
    // ---- Connection: every control connection, peer to peer and worker to bootstrap. ----

    /// Sent by the connecting side as the first frame on every connection. The receiver runs
    /// [`check_hello`] (a version mismatch fails there, naming both versions), answers
    /// [`HelloAck`], and from then on knows the peer as `rank` at `incarnation`: a known rank
    /// with a new incarnation is a restarted peer, whose old requests are failed at once.
    Hello(Hello) = 0x0001,
    /// The accepting side's answer to [`Hello`]. The connecting side checks it with
    /// [`check_hello_ack`] and notes the peer's incarnation as the accepting side noted its
    /// own: a known rank with a new incarnation is a restarted peer, whose old requests are
    /// failed at once. (A worker registers again with the bootstrap server on every new
    /// connection to it, so a restarted server learns every live worker back.)
    HelloAck(HelloAck) = 0x0002,
    /// Sent by both sides of a peer connection every heartbeat interval. The receiver
    /// notes the time; a peer silent past the liveness deadline is lost, and every request
    /// that depends on it fails at once with `PeerLost`.
    Heartbeat(Heartbeat) = 0x0003,
    /// Sent just before closing a connection on which a malformed or unexpected frame
    /// arrived, so the peer's log names the cause too. The receiver fails every request on
    /// the connection with [`FailureReason::Protocol`] and closes it.
    ProtocolError(ProtocolError) = 0x0004,

    // ---- Bootstrap server: workers register, decode workers and routers query. ----

    /// Sent by every worker to the bootstrap server at startup, and again when the server's
    /// incarnation changes. Idempotent: the same record again is [`RegisterOk`]; a record
    /// with a newer incarnation replaces the old one (the worker restarted); anything else
    /// for a registered rank is [`RegisterConflict`].
    Register(WorkerRecord) = 0x0101,
    /// The bootstrap server's answer to an accepted [`Message::Register`]; echoes the rank
    /// and incarnation so a retried request can be matched to its answer.
    RegisterOk(RegisterOk) = 0x0102,
    /// The bootstrap server's answer to a registration that contradicts a record it holds
    /// (same rank and incarnation with other addresses, an older incarnation, or other engine
    /// sizes). The worker fails to start with this as a named error; it never retries it.
    RegisterConflict(RegisterConflict) = 0x0103,
    /// Sent to the bootstrap server by a decode worker (or a router) that needs an engine's
    /// workers and has no fresh cached answer. Answered with [`QueryReply`].
    Query(Query) = 0x0104,
    /// The bootstrap server's answer to [`Query`]. `NotReady` is retried with backoff until
    /// the bootstrap deadline; `UnknownEngine` likewise, since prefill and decode start
    /// concurrently.
    QueryReply(QueryReply) = 0x0105,
    /// Sent by `handoff bootstrap status` (or a monitor). Answered with [`StatusReply`].
    StatusRequest(StatusRequest) = 0x0106,
    /// The bootstrap server's answer to [`StatusRequest`]: every engine and what it holds.
    StatusReply(StatusReply) = 0x0107,
    /// Sent by a worker to the bootstrap server at clean shutdown. The server removes the
    /// record only if the incarnation matches (a late message from a dead incarnation must
    /// not remove its successor), and answers [`Unregistered`].
    Unregister(Unregister) = 0x0108,
    /// The bootstrap server's answer to [`Unregister`].
    Unregistered(Unregistered) = 0x0109,

    // ---- Peer: per request, between one decode rank and one prefill rank. ----

    /// Sent by a decode rank to each prefill rank it depends on, once per request, after
    /// allocating the destination blocks. The prefill rank checks the blocks against the
    /// decode rank's layout (from its hello) and pairs that layout with its own (a failure
    /// fails the request as a protocol error naming decode), attaches the info to the request's sender (which leaves `Bootstrapping`), and
    /// in push mode writes into those blocks when the engine says the KV is ready.
    TransferInfo(TransferInfo) = 0x0201,
    /// Sent by a decode rank that knows the request but cannot yet allocate its blocks
    /// (saturated). The prefill rank learns the decode side is alive and the request is
    /// queued, and keeps waiting up to its bootstrap deadline (seed 003).
    Queued(Queued) = 0x0202,
    /// Sent by either side that refuses a request (a saturated decode: `RejectedBusy`). The
    /// receiver fails the request at once with the reason given, instead of waiting out its
    /// deadline, and frees its blocks.
    Rejected(Rejected) = 0x0203,
    /// Pull mode: sent by the prefill rank when the request's KV is ready, naming the source
    /// blocks. The decode rank checks them and the pairing as prefill does for
    /// [`TransferInfo`], then reads them, then answers [`ReadDone`]. The prefill rank holds
    /// the blocks until then, or until their TTL ends (seed 002).
    Ready(Ready) = 0x0204,
    /// Push mode: sent by the prefill rank after every write into the decode rank's blocks
    /// has completed. The decode rank, once every prefill rank it depends on said `Done`,
    /// reports the request finished receiving.
    Done(Done) = 0x0205,
    /// Pull mode: sent by the decode rank after it read every block named in [`Ready`]. The
    /// prefill rank frees the blocks and reports the request finished sending.
    ReadDone(ReadDone) = 0x0206,
    /// Sent by either side, at any time, to every peer rank of a request it gives up on. The
    /// receiver fails the request with `AbortedByPeer` and frees its blocks; an abort for an
    /// unknown or finished request is ignored (aborts may cross or repeat).
    Abort(Abort) = 0x0207,
    /// Push mode: sent by a prefill rank to the decode rank that aborted (or that it
    /// aborted), once the request has ended here and no write of its into the decode
    /// rank's blocks is in flight or can start. Decode holds a failed push request's blocks
    /// until every granted prefill rank said this (or was lost): a one-sided write cannot be
    /// refused by its target, so this fence is what keeps it out of reused blocks.
    AbortAck(AbortAck) = 0x0208,
}

impl fmt::Display for MessageType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Message {
    /// The message's type code (see [`MessageType`]).
    pub fn code(&self) -> u16 {
        self.message_type().code()
    }

    /// The request a per-request peer message is about, for routing it to that request's
    /// actor; `None` for connection and bootstrap messages.
    pub fn request_id(&self) -> Option<&RequestId> {
        match self {
            Message::TransferInfo(m) => Some(&m.request_id),
            Message::Queued(m) => Some(&m.request_id),
            Message::Rejected(m) => Some(&m.request_id),
            Message::Ready(m) => Some(&m.request_id),
            Message::Done(m) => Some(&m.request_id),
            Message::ReadDone(m) => Some(&m.request_id),
            Message::Abort(m) => Some(&m.request_id),
            Message::AbortAck(m) => Some(&m.request_id),
            Message::Hello(_)
            | Message::HelloAck(_)
            | Message::Heartbeat(_)
            | Message::ProtocolError(_)
            | Message::Register(_)
            | Message::RegisterOk(_)
            | Message::RegisterConflict(_)
            | Message::Query(_)
            | Message::QueryReply(_)
            | Message::StatusRequest(_)
            | Message::StatusReply(_)
            | Message::Unregister(_)
            | Message::Unregistered(_) => None,
        }
    }
}

/// Accepts the first message of a connection: it must be a [`Hello`] in our protocol version.
///
/// The frame header's version was already checked by [`crate::wire::frame::check`]; this
/// also refuses a `Hello` whose own version field disagrees, naming both versions.
pub fn check_hello(msg: &Message) -> Result<&Hello, WireError> {
    match msg {
        Message::Hello(hello) => {
            check_version(hello.protocol_version)?;
            Ok(hello)
        }
        other => Err(WireError::UnexpectedMessage {
            expected: "Hello",
            found: other.message_type(),
        }),
    }
}

/// Accepts the answer to our [`Hello`]: it must be a [`HelloAck`] in our protocol version.
pub fn check_hello_ack(msg: &Message) -> Result<&HelloAck, WireError> {
    match msg {
        Message::HelloAck(ack) => {
            check_version(ack.protocol_version)?;
            Ok(ack)
        }
        other => Err(WireError::UnexpectedMessage {
            expected: "HelloAck",
            found: other.message_type(),
        }),
    }
}

fn check_version(theirs: u16) -> Result<(), WireError> {
    if theirs != PROTOCOL_VERSION {
        return Err(WireError::UnsupportedVersion {
            ours: PROTOCOL_VERSION,
            theirs,
        });
    }
    Ok(())
}

/// Payload of [`Message::Hello`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Hello {
    /// The sender's protocol version; [`PROTOCOL_VERSION`] for this build.
    pub protocol_version: u16,
    /// The sender's side.
    pub role: Role,
    /// The sender's engine and rank.
    pub rank: RankInfo,
    /// The sender's incarnation: a number that changes every time the worker process starts.
    pub incarnation: u64,
    /// What a peer needs to reach the sender's data plane (e.g. its UCX worker address),
    /// at most [`DATA_DESCRIPTOR_BYTES_MAX`] bytes; empty when there is nothing to say.
    /// Exchanged here so that transfers never wait on the bootstrap server.
    pub data_descriptor: Vec<u8>,
    /// The sender's KV memory as peers see it (a worker's; `None` towards the bootstrap
    /// server): exchanged once per connection, so per-request messages carry only block
    /// ids, and checked against ours when a request's transfer info or `Ready` arrives.
    pub layout: Option<LayoutDescriptor>,
    /// How long the sender waits, after it last heard from a peer, before it takes the
    /// peer as lost, in milliseconds (0: it does not say). A writer's lease with the
    /// sender ([`crate::lease::Lease`]) is counted in it.
    pub lease_ms: u64,
    /// The sender's process id, offered so that a peer on the same host can watch it (a
    /// lost writer's quarantine ends when its process exits) and, with [`Hello::copies`],
    /// copy with its memory directly ([`crate::same_host`]): a peer uses it only once the
    /// kernel shows this process holds the connection's other end. 0: not offered.
    pub pid: u32,
    /// The sender welcomes same-host copies into and out of its memory through `pid` (the
    /// kernel's cross-memory attach, CUDA IPC); `false`: same-host peers move its blocks
    /// with the data plane's own transports.
    pub copies: bool,
}

impl Hello {
    /// A `Hello` for this build's protocol version.
    pub fn new(role: Role, rank: RankInfo, incarnation: u64) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            role,
            rank,
            incarnation,
            data_descriptor: Vec::new(),
            layout: None,
            lease_ms: 0,
            pid: 0,
            copies: false,
        }
    }
}

/// Payload of [`Message::HelloAck`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct HelloAck {
    /// The acceptor's protocol version; [`PROTOCOL_VERSION`] for this build.
    pub protocol_version: u16,
    /// The acceptor's incarnation (a worker's, or the bootstrap server's).
    pub incarnation: u64,
    /// The acceptor's data descriptor, as in [`Hello::data_descriptor`].
    pub data_descriptor: Vec<u8>,
    /// The acceptor's KV memory, as in [`Hello::layout`].
    pub layout: Option<LayoutDescriptor>,
    /// The acceptor's loss timeout, as in [`Hello::lease_ms`].
    pub lease_ms: u64,
    /// The acceptor's process id, as in [`Hello::pid`].
    pub pid: u32,
    /// Whether the acceptor welcomes same-host copies, as in [`Hello::copies`].
    pub copies: bool,
}

impl HelloAck {
    /// A `HelloAck` for this build's protocol version.
    pub fn new(incarnation: u64) -> HelloAck {
        HelloAck {
            protocol_version: PROTOCOL_VERSION,
            incarnation,
            data_descriptor: Vec::new(),
            layout: None,
            lease_ms: 0,
            pid: 0,
            copies: false,
        }
    }
}

/// Payload of [`Message::Heartbeat`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Heartbeat {
    /// The sender's incarnation; a change means the peer restarted.
    pub incarnation: u64,
    /// Counts up; never repeats within one sender's process. 0: an answer to the beat
    /// named in `echo`, sent at once and not answered in turn.
    pub seq: u64,
    /// The latest `seq` the sender received from the recipient (0: none yet): proof that
    /// the sender heard the recipient at or after the time it sent that heartbeat.
    pub echo: u64,
    /// How long the sender waits, after it last heard from the recipient, before it takes
    /// the recipient as lost, in milliseconds (0: it does not say).
    pub lease_ms: u64,
}

/// Payload of [`Message::ProtocolError`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct ProtocolError {
    /// What was wrong with the peer's frame, at most [`DETAIL_BYTES_MAX`] bytes.
    pub detail: String,
}

impl ProtocolError {
    /// A `ProtocolError` whose detail is cut to [`DETAIL_BYTES_MAX`], so it always encodes.
    pub fn new(detail: impl Into<String>) -> ProtocolError {
        ProtocolError {
            detail: bounded_text(detail.into()),
        }
    }
}

/// Cuts free text to at most [`DETAIL_BYTES_MAX`] bytes, at a character boundary, marking the
/// cut with `…`. Failure texts are built from error chains of any length, and a message that
/// carries one (an abort, a rejection) must never fail to encode because of it.
pub fn bounded_text(mut text: String) -> String {
    const ELLIPSIS: &str = "…";
    if text.len() <= DETAIL_BYTES_MAX {
        return text;
    }
    let mut cut = DETAIL_BYTES_MAX - ELLIPSIS.len();
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    text.push_str(ELLIPSIS);
    text
}

/// `reason` with every free-text field cut by [`bounded_text`].
pub fn bounded_reason(reason: FailureReason) -> FailureReason {
    match reason {
        FailureReason::BootstrapUnavailable {
            address,
            last_error,
        } => FailureReason::BootstrapUnavailable {
            address: bounded_text(address),
            last_error: bounded_text(last_error),
        },
        FailureReason::TransferFailed { detail } => FailureReason::TransferFailed {
            detail: bounded_text(detail),
        },
        FailureReason::PeerLost { peer } => FailureReason::PeerLost {
            peer: bounded_text(peer),
        },
        FailureReason::AbortedByPeer { peer, cause } => FailureReason::AbortedByPeer {
            peer: bounded_text(peer),
            cause: bounded_text(cause),
        },
        FailureReason::Protocol { detail } => FailureReason::Protocol {
            detail: bounded_text(detail),
        },
        FailureReason::Internal { detail } => FailureReason::Internal {
            detail: bounded_text(detail),
        },
        FailureReason::Superseded { detail } => FailureReason::Superseded {
            detail: bounded_text(detail),
        },
        other @ (FailureReason::BootstrapTimeout
        | FailureReason::WaitingTimeout
        | FailureReason::TransferTimeout
        | FailureReason::TtlExpired
        | FailureReason::RejectedBusy
        | FailureReason::AbortedByEngine) => other,
    }
}

/// What the bootstrap server knows about one worker: payload of [`Message::Register`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct WorkerRecord {
    /// The worker's engine and rank. Ranks need not start at zero nor be dense.
    pub rank: RankInfo,
    /// The worker's side.
    pub role: Role,
    /// The worker's incarnation.
    pub incarnation: u64,
    /// Where the worker's control channel listens.
    pub control_address: String,
    /// Where the worker's data transport listens (TCP), or its name (UCX, in-process).
    pub data_address: String,
    /// Opaque data-transport details, e.g. a UCX worker address; at most
    /// [`DATA_DESCRIPTOR_BYTES_MAX`] bytes.
    pub data_descriptor: Vec<u8>,
}

/// Payload of [`Message::RegisterOk`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct RegisterOk {
    /// The registered worker's rank.
    pub rank: RankInfo,
    /// The registered incarnation.
    pub incarnation: u64,
}

/// Payload of [`Message::RegisterConflict`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct RegisterConflict {
    /// The record the bootstrap server holds for that rank, and keeps.
    pub existing: WorkerRecord,
}

/// Payload of [`Message::Query`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Query {
    /// The engine whose workers are wanted.
    pub engine_id: EngineId,
}

/// Payload of [`Message::QueryReply`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct QueryReply {
    /// The engine asked about (so a retried query can be matched to its answer).
    pub engine_id: EngineId,
    /// What the bootstrap server knows.
    pub answer: QueryAnswer,
}

/// The bootstrap server's answer about one engine.
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub enum QueryAnswer {
    /// Every rank of the engine (dp × tp × pp of them) has registered.
    Ready {
        /// One record per rank, at most [`WORKERS_PER_ENGINE_MAX`].
        workers: Vec<WorkerRecord>,
    },
    /// Some ranks have registered, not all yet.
    NotReady {
        /// The ranks registered so far.
        registered: Vec<Rank>,
        /// How many ranks the engine has (dp × tp × pp).
        expected: u32,
    },
    /// No worker of that engine has registered.
    UnknownEngine,
}

/// Payload of [`Message::StatusRequest`]: nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct StatusRequest;

/// Payload of [`Message::StatusReply`].
///
/// At most [`ENGINES_MAX`] engines; the encoded reply must also fit in one frame, which the
/// summaries (no data descriptors) allow for about 15,000 workers. A server with more leaves
/// engines out rather than fail the encode.
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct StatusReply {
    /// Every engine with at least one registered worker.
    pub engines: Vec<EngineStatus>,
}

/// One engine in a [`StatusReply`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct EngineStatus {
    /// The engine.
    pub engine_id: EngineId,
    /// The engine's side.
    pub role: Role,
    /// How many ranks the engine has (dp × tp × pp).
    pub expected: u32,
    /// The registered workers, at most [`WORKERS_PER_ENGINE_MAX`].
    pub workers: Vec<WorkerSummary>,
}

/// One registered worker in an [`EngineStatus`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct WorkerSummary {
    /// The worker's rank.
    pub rank: Rank,
    /// The worker's incarnation.
    pub incarnation: u64,
    /// Where its control channel listens.
    pub control_address: String,
    /// Where its data transport listens.
    pub data_address: String,
}

/// Payload of [`Message::Unregister`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Unregister {
    /// The worker leaving.
    pub rank: RankInfo,
    /// Its incarnation; the record is removed only if it matches.
    pub incarnation: u64,
}

/// Payload of [`Message::Unregistered`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Unregistered {
    /// Whether a record was removed (false: unknown rank, or another incarnation).
    pub removed: bool,
}

/// Which data transport a region or layout descriptor is reached through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, bincode::Encode, bincode::Decode)]
pub enum TransportKind {
    /// Both sides in one process (tests, the simulator).
    InProcess,
    /// handoff's TCP data transport.
    Tcp,
    /// UCX (RDMA, CUDA IPC, shared memory, ...).
    Ucx,
}

/// Where a peer's blocks live for the UCX data plane: one registered memory region, cut
/// into equal blocks (a one-range [`LayoutDescriptor`], see
/// [`LayoutDescriptor::single_region`]). Not itself a message field.
///
/// Block `b` occupies bytes `[base + b × block_bytes, base + (b + 1) × block_bytes)`, which
/// must lie inside `[base, base + len)`: [`RegionDescriptor::check_blocks`] refuses any block
/// that does not, so a peer cannot make us read or write outside the region it registered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionDescriptor {
    /// The data transport that reaches the region.
    pub transport: TransportKind,
    /// The transport address of the region's owner.
    pub address: String,
    /// The transport's key for remote access (e.g. a packed UCX rkey), at most
    /// [`REMOTE_KEY_BYTES_MAX`] bytes.
    pub remote_key: Vec<u8>,
    /// The region's first byte address, in the owner's address space.
    pub base: u64,
    /// The region's length in bytes; `base + len` must not overflow.
    pub len: u64,
    /// The size of one block in bytes, not zero.
    pub block_bytes: u64,
}

impl RegionDescriptor {
    /// Refuses the first block whose byte range is not inside the region, and a region that
    /// is itself malformed (zero block size, `base + len` overflowing). Overflow-safe for any
    /// field values.
    pub fn check_blocks(&self, blocks: &[BlockId]) -> Result<(), WireError> {
        self.check_shape()?;
        for &block in blocks {
            self.block_end_offset(block)?;
        }
        Ok(())
    }

    /// The absolute byte range of `block`, or the error [`RegionDescriptor::check_blocks`]
    /// would give for it.
    pub fn byte_range(&self, block: BlockId) -> Result<Range<u64>, WireError> {
        self.check_shape()?;
        let end_offset = self.block_end_offset(block)?;
        // Both sums are at most `base + len`, which check_shape proved does not overflow.
        let start = self.base + (end_offset - self.block_bytes);
        Ok(start..self.base + end_offset)
    }

    fn check_shape(&self) -> Result<(), WireError> {
        if self.block_bytes == 0 {
            return Err(WireError::Invalid {
                what: "RegionDescriptor.block_bytes",
                detail: "zero block size".into(),
            });
        }
        if self.base.checked_add(self.len).is_none() {
            return Err(WireError::Invalid {
                what: "RegionDescriptor.len",
                detail: format!("base {:#x} + len {} overflows", self.base, self.len),
            });
        }
        Ok(())
    }

    /// The offset just past `block`'s last byte, if it is inside the region.
    fn block_end_offset(&self, block: BlockId) -> Result<u64, WireError> {
        let outside = WireError::BlockOutsideRegion {
            block,
            block_bytes: self.block_bytes,
            region_len: self.len,
        };
        (u64::from(block.0) + 1)
            .checked_mul(self.block_bytes)
            .filter(|&end| end <= self.len)
            .ok_or(outside)
    }
}

/// One registered range of a worker's KV memory, as it travels in a [`LayoutDescriptor`]:
/// block `b` is `bytes` bytes at `addr + b × stride`, and every block lies inside
/// `[addr, addr + len)` (checked on arrival).
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct RangeDescriptor {
    /// Address of block 0 in the owner's address space (host pointer or `CUdeviceptr`).
    pub addr: u64,
    /// Registered length from `addr`, in bytes; `addr + len` must not overflow.
    pub len: u64,
    /// Distance between consecutive blocks; at least `bytes`.
    pub stride: u64,
    /// Bytes of each block in this range; not zero.
    pub bytes: u64,
    /// The transport's key for one-sided access to this range (e.g. a packed UCX rkey),
    /// at most [`REMOTE_KEY_BYTES_MAX`] bytes; empty for two-sided planes (TCP).
    pub remote_key: Vec<u8>,
    /// For device memory, the CUDA IPC descriptor of the allocation holding the range
    /// (handle and base, [`handoff_gpu::IPC_DESCRIPTOR_BYTES`]), which a verified peer on
    /// the same host opens to copy with the memory directly; empty: none.
    pub cuda_ipc: Vec<u8>,
}

/// A worker's KV memory as its peers see it ([`KvLayout`] plus how to reach it), carried
/// once per connection in [`Hello::layout`] / [`HelloAck::layout`].
///
/// Checked on arrival ([`Message::validate`]): at most [`RANGES_MAX`] ranges and
/// [`LAYOUT_REMOTE_KEY_BYTES_MAX`] key bytes, every block of every range inside the range's
/// advertised length, no arithmetic overflow, layers that describe a model and divide the
/// logical block. Pairing with our own layout is checked per request, when the transfer
/// info or `Ready` arrives.
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct LayoutDescriptor {
    /// The data transport that reaches the memory.
    pub transport: TransportKind,
    /// The transport address of the memory's owner (TCP: its data server), at most
    /// [`ADDRESS_BYTES_MAX`] bytes.
    pub address: String,
    /// The CUDA device holding the memory; `None` for host memory.
    pub cuda_device: Option<u32>,
    /// Blocks in every range.
    pub blocks: u32,
    /// The ranges, in logical order.
    pub ranges: Vec<RangeDescriptor>,
    /// First layer held.
    pub layers_first: u32,
    /// Layers held.
    pub layers_count: u32,
    /// Layers of the model.
    pub layers_total: u32,
    /// Tokens per block (0 = unknown).
    pub block_tokens: u32,
    /// Bytes per element (0 = unknown).
    pub dtype_bytes: u32,
    /// KV heads of the model, all TP ranks together (0 = unknown: then the next two are 0).
    pub kv_heads: u32,
    /// How each part of a range's block orders its heads: 0 head-major (HND), 1
    /// token-major (NHD), 2 a latent cache.
    pub head_order: u8,
    /// Bytes of one head for one token.
    pub head_bytes: u64,
}

/// [`LayoutDescriptor::head_order`]'s codes, in order.
const HEAD_ORDERS: [HeadOrder; 3] = [
    HeadOrder::HeadMajor,
    HeadOrder::TokenMajor,
    HeadOrder::Latent,
];

impl LayoutDescriptor {
    /// The descriptor of `layout`, reached through `transport` at `address`: each range
    /// registered exactly over its blocks, without remote keys (a one-sided plane fills
    /// [`RangeDescriptor::remote_key`], and `len` if it registered more).
    pub fn of(transport: TransportKind, address: String, layout: &KvLayout) -> LayoutDescriptor {
        let ranges = layout
            .ranges
            .iter()
            .map(|r| RangeDescriptor {
                addr: r.addr,
                len: r.extent(layout.blocks).unwrap_or(0),
                stride: r.stride as u64,
                bytes: r.bytes as u64,
                remote_key: Vec::new(),
                cuda_ipc: Vec::new(),
            })
            .collect();
        LayoutDescriptor {
            transport,
            address,
            cuda_device: match layout.memory {
                KvMemory::Host => None,
                KvMemory::Cuda { device } => Some(device),
            },
            blocks: layout.blocks,
            ranges,
            layers_first: layout.layers.first,
            layers_count: layout.layers.count,
            layers_total: layout.layers.total,
            block_tokens: layout.block_tokens,
            dtype_bytes: layout.dtype_bytes,
            kv_heads: layout.heads.map_or(0, |h| h.kv_heads),
            head_order: layout.heads.map_or(0, |h| {
                HEAD_ORDERS.iter().position(|&o| o == h.order).unwrap_or(0) as u8
            }),
            head_bytes: layout.heads.map_or(0, |h| h.head_bytes),
        }
    }

    /// The layout this describes (addresses in the owner's address space), checked: every
    /// bound of [`KvLayout::validate`], and every range's blocks inside its advertised
    /// length.
    ///
    /// # Errors
    /// [`WireError::Invalid`] naming the field.
    pub fn to_layout(&self) -> Result<KvLayout, WireError> {
        let invalid = |what, detail: String| WireError::Invalid { what, detail };
        check_count("LayoutDescriptor.ranges", self.ranges.len(), RANGES_MAX)?;
        let heads = match self.kv_heads {
            0 if self.head_order == 0 && self.head_bytes == 0 => None,
            0 => {
                return Err(invalid(
                    "LayoutDescriptor.kv_heads",
                    "head order or size without heads".into(),
                ))
            }
            kv_heads => Some(KvHeads {
                kv_heads,
                order: *HEAD_ORDERS
                    .get(usize::from(self.head_order))
                    .ok_or_else(|| {
                        invalid(
                            "LayoutDescriptor.head_order",
                            format!("{} (0 to {})", self.head_order, HEAD_ORDERS.len() - 1),
                        )
                    })?,
                head_bytes: self.head_bytes,
            }),
        };
        let mut ranges = Vec::with_capacity(self.ranges.len());
        for (i, r) in self.ranges.iter().enumerate() {
            let size = |v: u64| {
                usize::try_from(v).map_err(|_| {
                    invalid(
                        "LayoutDescriptor.ranges",
                        format!("range {i}: {v} does not fit"),
                    )
                })
            };
            ranges.push(KvRange {
                addr: r.addr,
                stride: size(r.stride)?,
                bytes: size(r.bytes)?,
            });
        }
        let layout = KvLayout {
            blocks: self.blocks,
            ranges,
            memory: self
                .cuda_device
                .map_or(KvMemory::Host, |device| KvMemory::Cuda { device }),
            layers: LayerSpan {
                first: self.layers_first,
                count: self.layers_count,
                total: self.layers_total,
            },
            block_tokens: self.block_tokens,
            dtype_bytes: self.dtype_bytes,
            heads,
        };
        layout
            .validate()
            .map_err(|e| invalid("LayoutDescriptor", e.to_string()))?;
        for (i, (r, k)) in self.ranges.iter().zip(&layout.ranges).enumerate() {
            let fits = r.addr.checked_add(r.len).is_some()
                && k.extent(layout.blocks)
                    .is_some_and(|extent| extent <= r.len);
            if !fits {
                return Err(invalid(
                    "LayoutDescriptor.ranges",
                    format!(
                        "range {i}: {} blocks at a stride of {} do not fit its {} bytes at {:#x}",
                        layout.blocks, r.stride, r.len, r.addr
                    ),
                ));
            }
        }
        Ok(layout)
    }

    /// The one region this layout is, for planes that address a single registration (the
    /// UCX plane today): `None` unless it has exactly one range of contiguous blocks.
    pub fn single_region(&self) -> Option<RegionDescriptor> {
        match self.ranges.as_slice() {
            [r] if r.stride == r.bytes => Some(RegionDescriptor {
                transport: self.transport,
                address: self.address.clone(),
                remote_key: r.remote_key.clone(),
                base: r.addr,
                len: r.len,
                block_bytes: r.bytes,
            }),
            _ => None,
        }
    }
}

/// Payload of [`Message::TransferInfo`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct TransferInfo {
    /// The request.
    pub request_id: RequestId,
    /// The decode rank sending this.
    pub decode: RankInfo,
    /// The decode rank's incarnation.
    pub incarnation: u64,
    /// Who moves the bytes.
    pub mode: TransferMode,
    /// The destination blocks, in the order of the request's KV; no duplicates, at most
    /// [`BLOCKS_PER_MESSAGE_MAX`]. They are blocks of the layout the decode rank sent in
    /// its `Hello`/`HelloAck`, checked against it on arrival.
    pub blocks: Vec<BlockId>,
}

/// Payload of [`Message::Queued`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Queued {
    /// The request waiting for decode capacity.
    pub request_id: RequestId,
}

/// Payload of [`Message::Rejected`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Rejected {
    /// The refused request.
    pub request_id: RequestId,
    /// Why (`RejectedBusy` for a saturated decode).
    pub reason: FailureReason,
}

impl Rejected {
    /// A rejection whose reason's texts are cut by [`bounded_text`], so it always encodes.
    pub fn new(request_id: RequestId, reason: FailureReason) -> Rejected {
        Rejected {
            request_id,
            reason: bounded_reason(reason),
        }
    }
}

/// Payload of [`Message::Ready`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Ready {
    /// The request.
    pub request_id: RequestId,
    /// The source blocks, in the order of the request's KV; no duplicates, at most
    /// [`BLOCKS_PER_MESSAGE_MAX`]; blocks of the prefill rank's layout (from its hello).
    pub blocks: Vec<BlockId>,
    /// The engine's per-request payload beside the KV (empty if none), at most
    /// [`AUX_BYTES_MAX`]: opaque bytes, handed to decode's engine with the request.
    pub aux: Vec<u8>,
    /// How long, at the least, prefill keeps these blocks for decode's reads from the
    /// moment it sends this (its pull TTL), in milliseconds. Decode refuses a read that
    /// finishes later than that after it sent its transfer info: by then prefill may have
    /// given the blocks back and the engine reused them.
    pub hold_ms: u64,
}

/// Payload of [`Message::Done`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Done {
    /// The request whose blocks were all written.
    pub request_id: RequestId,
    /// The engine's per-request payload beside the KV (empty if none), at most
    /// [`AUX_BYTES_MAX`]: opaque bytes, handed to decode's engine with the request.
    pub aux: Vec<u8>,
}

/// Payload of [`Message::ReadDone`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct ReadDone {
    /// The request whose blocks were all read.
    pub request_id: RequestId,
}

/// Payload of [`Message::AbortAck`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct AbortAck {
    /// The request whose writes are over.
    pub request_id: RequestId,
}

/// Payload of [`Message::Abort`].
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Abort {
    /// The request given up on.
    pub request_id: RequestId,
    /// Why the sender gave up.
    pub reason: FailureReason,
}

impl Abort {
    /// An abort whose reason's texts are cut by [`bounded_text`], so it always encodes.
    pub fn new(request_id: RequestId, reason: FailureReason) -> Abort {
        Abort {
            request_id,
            reason: bounded_reason(reason),
        }
    }
}

// ---- Validation: every bound and consistency rule, one impl per payload type. ----

/// Bounds and consistency rules of one wire type; see [`Message::validate`].
trait Validate {
    fn validate(&self) -> Result<(), WireError>;
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), WireError> {
    if len > max {
        return Err(WireError::TooLong { what, len, max });
    }
    Ok(())
}

fn check_count(what: &'static str, count: usize, max: usize) -> Result<(), WireError> {
    if count > max {
        return Err(WireError::TooMany { what, count, max });
    }
    Ok(())
}

fn check_non_empty(what: &'static str, len: usize) -> Result<(), WireError> {
    if len == 0 {
        return Err(WireError::Invalid {
            what,
            detail: "empty".into(),
        });
    }
    Ok(())
}

fn check_request_id(what: &'static str, id: &RequestId) -> Result<(), WireError> {
    check_non_empty(what, id.as_str().len())?;
    check_len(what, id.as_str().len(), REQUEST_ID_BYTES_MAX)
}

fn check_engine_id(id: &EngineId) -> Result<(), WireError> {
    check_non_empty("EngineId", id.as_str().len())?;
    check_len("EngineId", id.as_str().len(), ENGINE_ID_BYTES_MAX)
}

fn check_address(what: &'static str, address: &str) -> Result<(), WireError> {
    check_len(what, address.len(), ADDRESS_BYTES_MAX)
}

/// A block list: bounded, and no block twice (two writes into one block would corrupt it).
fn check_blocks(what: &'static str, blocks: &[BlockId]) -> Result<(), WireError> {
    check_count(what, blocks.len(), BLOCKS_PER_MESSAGE_MAX)?;
    match BlockId::first_repeat(blocks) {
        Some(block) => Err(WireError::Invalid {
            what,
            detail: format!("block {block} listed twice"),
        }),
        None => Ok(()),
    }
}

impl Validate for RankInfo {
    fn validate(&self) -> Result<(), WireError> {
        check_engine_id(&self.engine_id)?;
        // Ranks need not be below the sizes (non-sequential dp ranks, seed 001); the sizes
        // must be at least 1 and multiply to at most WORKERS_PER_ENGINE_MAX.
        let sizes = [self.dp_size, self.tp_size, self.pp_size];
        let workers = sizes.iter().try_fold(1u64, |acc, &s| {
            (s != 0).then(|| acc.saturating_mul(u64::from(s)))
        });
        match workers {
            Some(n) if n <= WORKERS_PER_ENGINE_MAX as u64 => Ok(()),
            _ => Err(WireError::Invalid {
                what: "RankInfo sizes",
                detail: format!(
                    "dp {} × tp {} × pp {} is not within 1..={WORKERS_PER_ENGINE_MAX}",
                    self.dp_size, self.tp_size, self.pp_size
                ),
            }),
        }
    }
}

impl Validate for FailureReason {
    fn validate(&self) -> Result<(), WireError> {
        let text = |t: &String| check_len("FailureReason text", t.len(), DETAIL_BYTES_MAX);
        match self {
            FailureReason::BootstrapUnavailable {
                address,
                last_error,
            } => text(address).and_then(|()| text(last_error)),
            FailureReason::AbortedByPeer { peer, cause } => text(peer).and_then(|()| text(cause)),
            FailureReason::TransferFailed { detail }
            | FailureReason::Protocol { detail }
            | FailureReason::Internal { detail }
            | FailureReason::Superseded { detail } => text(detail),
            FailureReason::PeerLost { peer } => text(peer),
            FailureReason::BootstrapTimeout
            | FailureReason::WaitingTimeout
            | FailureReason::TransferTimeout
            | FailureReason::TtlExpired
            | FailureReason::RejectedBusy
            | FailureReason::AbortedByEngine => Ok(()),
        }
    }
}

impl Validate for LayoutDescriptor {
    fn validate(&self) -> Result<(), WireError> {
        check_address("LayoutDescriptor.address", &self.address)?;
        check_count("LayoutDescriptor.ranges", self.ranges.len(), RANGES_MAX)?;
        let mut key_bytes = 0usize;
        for r in &self.ranges {
            check_len(
                "RangeDescriptor.remote_key",
                r.remote_key.len(),
                REMOTE_KEY_BYTES_MAX,
            )?;
            key_bytes = key_bytes.saturating_add(r.remote_key.len());
            if !r.cuda_ipc.is_empty() && r.cuda_ipc.len() != handoff_gpu::IPC_DESCRIPTOR_BYTES {
                return Err(WireError::Invalid {
                    what: "RangeDescriptor.cuda_ipc",
                    detail: format!(
                        "{} bytes (0 or {})",
                        r.cuda_ipc.len(),
                        handoff_gpu::IPC_DESCRIPTOR_BYTES
                    ),
                });
            }
        }
        check_len(
            "LayoutDescriptor.ranges[].remote_key",
            key_bytes,
            LAYOUT_REMOTE_KEY_BYTES_MAX,
        )?;
        self.to_layout().map(|_| ())
    }
}

impl Validate for Hello {
    fn validate(&self) -> Result<(), WireError> {
        self.rank.validate()?;
        check_len(
            "Hello.data_descriptor",
            self.data_descriptor.len(),
            DATA_DESCRIPTOR_BYTES_MAX,
        )?;
        self.layout.as_ref().map_or(Ok(()), Validate::validate)
    }
}

impl Validate for HelloAck {
    fn validate(&self) -> Result<(), WireError> {
        check_len(
            "HelloAck.data_descriptor",
            self.data_descriptor.len(),
            DATA_DESCRIPTOR_BYTES_MAX,
        )?;
        self.layout.as_ref().map_or(Ok(()), Validate::validate)
    }
}

impl Validate for Heartbeat {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

impl Validate for ProtocolError {
    fn validate(&self) -> Result<(), WireError> {
        check_len("ProtocolError.detail", self.detail.len(), DETAIL_BYTES_MAX)
    }
}

impl Validate for WorkerRecord {
    fn validate(&self) -> Result<(), WireError> {
        self.rank.validate()?;
        check_address("WorkerRecord.control_address", &self.control_address)?;
        check_address("WorkerRecord.data_address", &self.data_address)?;
        check_len(
            "WorkerRecord.data_descriptor",
            self.data_descriptor.len(),
            DATA_DESCRIPTOR_BYTES_MAX,
        )
    }
}

impl Validate for RegisterOk {
    fn validate(&self) -> Result<(), WireError> {
        self.rank.validate()
    }
}

impl Validate for RegisterConflict {
    fn validate(&self) -> Result<(), WireError> {
        self.existing.validate()
    }
}

impl Validate for Query {
    fn validate(&self) -> Result<(), WireError> {
        check_engine_id(&self.engine_id)
    }
}

impl Validate for QueryReply {
    fn validate(&self) -> Result<(), WireError> {
        check_engine_id(&self.engine_id)?;
        match &self.answer {
            QueryAnswer::Ready { workers } => {
                check_count("QueryAnswer.workers", workers.len(), WORKERS_PER_ENGINE_MAX)?;
                workers.iter().try_for_each(Validate::validate)
            }
            QueryAnswer::NotReady {
                registered,
                expected,
            } => {
                check_count(
                    "QueryAnswer.registered",
                    registered.len(),
                    WORKERS_PER_ENGINE_MAX,
                )?;
                check_count(
                    "QueryAnswer.expected",
                    *expected as usize,
                    WORKERS_PER_ENGINE_MAX,
                )
            }
            QueryAnswer::UnknownEngine => Ok(()),
        }
    }
}

impl Validate for StatusRequest {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

impl Validate for StatusReply {
    fn validate(&self) -> Result<(), WireError> {
        check_count("StatusReply.engines", self.engines.len(), ENGINES_MAX)?;
        self.engines.iter().try_for_each(|engine| {
            check_engine_id(&engine.engine_id)?;
            check_count(
                "EngineStatus.workers",
                engine.workers.len(),
                WORKERS_PER_ENGINE_MAX,
            )?;
            engine.workers.iter().try_for_each(|w| {
                check_address("WorkerSummary.control_address", &w.control_address)?;
                check_address("WorkerSummary.data_address", &w.data_address)
            })
        })
    }
}

impl Validate for Unregister {
    fn validate(&self) -> Result<(), WireError> {
        self.rank.validate()
    }
}

impl Validate for Unregistered {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

impl Validate for TransferInfo {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("TransferInfo.request_id", &self.request_id)?;
        self.decode.validate()?;
        check_blocks("TransferInfo.blocks", &self.blocks)
    }
}

impl Validate for Queued {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("Queued.request_id", &self.request_id)
    }
}

impl Validate for Rejected {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("Rejected.request_id", &self.request_id)?;
        self.reason.validate()
    }
}

impl Validate for Ready {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("Ready.request_id", &self.request_id)?;
        check_blocks("Ready.blocks", &self.blocks)?;
        check_len("Ready.aux", self.aux.len(), AUX_BYTES_MAX)
    }
}

impl Validate for Done {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("Done.request_id", &self.request_id)?;
        check_len("Done.aux", self.aux.len(), AUX_BYTES_MAX)
    }
}

impl Validate for ReadDone {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("ReadDone.request_id", &self.request_id)
    }
}

impl Validate for AbortAck {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("AbortAck.request_id", &self.request_id)
    }
}

impl Validate for Abort {
    fn validate(&self) -> Result<(), WireError> {
        check_request_id("Abort.request_id", &self.request_id)?;
        self.reason.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(len: u64, block_bytes: u64) -> RegionDescriptor {
        RegionDescriptor {
            transport: TransportKind::Tcp,
            address: "127.0.0.1:9000".into(),
            remote_key: vec![],
            base: 0x1000,
            len,
            block_bytes,
        }
    }

    #[test]
    fn codes_are_unique_and_round_trip() {
        let mut codes: Vec<u16> = MessageType::ALL.iter().map(|t| t.code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), MessageType::ALL.len());
        for &t in MessageType::ALL {
            assert_eq!(MessageType::from_code(t.code()), Some(t));
        }
        assert_eq!(MessageType::from_code(0), None);
        assert_eq!(MessageType::from_code(0xffff), None);
    }

    #[test]
    fn region_accepts_blocks_inside_and_refuses_the_first_outside() {
        let r = region(4 * 64, 64);
        assert_eq!(r.check_blocks(&[BlockId(0), BlockId(3)]), Ok(()));
        assert_eq!(
            r.check_blocks(&[BlockId(1), BlockId(4)]),
            Err(WireError::BlockOutsideRegion {
                block: BlockId(4),
                block_bytes: 64,
                region_len: 256
            })
        );
        assert_eq!(r.byte_range(BlockId(2)), Ok(0x1000 + 128..0x1000 + 192));
    }

    #[test]
    fn region_arithmetic_never_overflows() {
        let huge = region(u64::MAX - 0x1000, u64::MAX);
        assert!(matches!(
            huge.check_blocks(&[BlockId(u32::MAX)]),
            Err(WireError::BlockOutsideRegion { .. })
        ));
        let mut wraps = region(u64::MAX, 1);
        assert!(matches!(
            wraps.check_blocks(&[]),
            Err(WireError::Invalid { .. })
        ));
        wraps.len = 16;
        wraps.block_bytes = 0;
        assert!(matches!(
            wraps.check_blocks(&[BlockId(0)]),
            Err(WireError::Invalid { .. })
        ));
        let top = RegionDescriptor {
            base: u64::MAX - 8,
            ..region(8, 8)
        };
        assert_eq!(top.byte_range(BlockId(0)), Ok(u64::MAX - 8..u64::MAX));
        assert!(top.byte_range(BlockId(1)).is_err());
    }

    #[test]
    fn duplicate_blocks_are_refused() {
        assert!(check_blocks("t", &[BlockId(3), BlockId(1), BlockId(2)]).is_ok());
        assert_eq!(
            check_blocks("t", &[BlockId(3), BlockId(1), BlockId(3)]),
            Err(WireError::Invalid {
                what: "t",
                detail: "block #3 listed twice".into()
            })
        );
    }

    #[test]
    fn rank_sizes_must_be_positive_and_bounded_but_ranks_need_not_be_dense() {
        let mut rank = RankInfo::single("e");
        rank.dp_rank = 7; // beyond dp_size: allowed (non-sequential dp ranks)
        assert_eq!(rank.validate(), Ok(()));
        rank.tp_size = 0;
        assert!(rank.validate().is_err());
        rank.tp_size = u32::MAX;
        rank.dp_size = u32::MAX;
        assert!(rank.validate().is_err());
    }

    #[test]
    fn long_failure_texts_are_cut_to_fit_at_a_char_boundary() {
        let long = "é".repeat(DETAIL_BYTES_MAX); // 2 bytes each
        let abort = Abort::new(
            RequestId::new("r"),
            FailureReason::AbortedByPeer {
                peer: "p".into(),
                cause: long.clone(),
            },
        );
        assert_eq!(abort.validate(), Ok(()));
        let FailureReason::AbortedByPeer { cause, .. } = &abort.reason else {
            panic!("reason kind changed: {:?}", abort.reason);
        };
        assert!(cause.len() <= DETAIL_BYTES_MAX && cause.ends_with('…'));
        assert_eq!(ProtocolError::new(long).validate(), Ok(()));
        assert_eq!(bounded_text("short".into()), "short");
    }

    #[test]
    fn check_hello_names_both_versions() {
        let mut hello = Hello::new(Role::Decode, RankInfo::single("d"), 1);
        hello.protocol_version = PROTOCOL_VERSION + 1;
        assert_eq!(
            check_hello(&Message::Hello(hello)),
            Err(WireError::UnsupportedVersion {
                ours: PROTOCOL_VERSION,
                theirs: PROTOCOL_VERSION + 1
            })
        );
        assert_eq!(
            check_hello(&Message::StatusRequest(StatusRequest)),
            Err(WireError::UnexpectedMessage {
                expected: "Hello",
                found: MessageType::StatusRequest
            })
        );
    }
}
