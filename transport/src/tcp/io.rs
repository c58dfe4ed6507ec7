//! Reading and writing frames on a connection's halves, with errors that name the peer.

use std::io::{self, IoSlice};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use super::frame::{self, Header, FLAG_AUTH, HEADER_BYTES, NONCE_BYTES};
use crate::auth::{Key, TAG_BYTES};
use crate::data::DataError;

/// Most buffers passed to one `writev`: Linux's `IOV_MAX`.
const IOV_PER_WRITE_MAX: usize = 1024;

/// Maps an IO error on an established connection to the data plane's error.
pub(super) fn io_error(peer: &str, op: &'static str, e: io::Error) -> DataError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => DataError::PeerClosed {
            peer: peer.to_string(),
            op,
        },
        _ => DataError::Io {
            peer: peer.to_string(),
            detail: format!("{op}: {e}"),
        },
    }
}

/// Reads one frame's header, metadata (into `meta`) and tag, and checks them: the header
/// first, then (with a key) the tag. The data, if any, is left for the caller.
pub(super) async fn read_head(
    r: &mut OwnedReadHalf,
    key: Option<&Key>,
    nonce: &[u8; NONCE_BYTES],
    meta: &mut Vec<u8>,
    peer: &str,
    op: &'static str,
) -> Result<Header, DataError> {
    let mut bytes = [0u8; HEADER_BYTES];
    r.read_exact(&mut bytes)
        .await
        .map_err(|e| io_error(peer, op, e))?;
    let header = Header::check(&bytes).map_err(|e| DataError::Protocol {
        peer: peer.to_string(),
        detail: e.to_string(),
    })?;
    meta.resize(header.meta_len as usize, 0);
    r.read_exact(meta)
        .await
        .map_err(|e| io_error(peer, op, e))?;
    let mut tag = [0u8; TAG_BYTES];
    if header.has_tag() {
        r.read_exact(&mut tag)
            .await
            .map_err(|e| io_error(peer, op, e))?;
    }
    if let Some(key) = key {
        let auth = |detail: &str| DataError::Auth {
            peer: peer.to_string(),
            detail: detail.into(),
        };
        if !header.has_tag() {
            return Err(auth("frame without an HMAC tag"));
        }
        if !frame::verify(key, nonce, &bytes, meta, &tag) {
            return Err(auth("HMAC tag does not verify"));
        }
    }
    Ok(header)
}

/// Writes one frame: header (with the auth flag set when there is a key), metadata, tag,
/// then `data` (borrowed slices, sent with vectored writes).
pub(super) async fn write_frame(
    w: &mut OwnedWriteHalf,
    mut header: Header,
    meta: &[u8],
    data: &[IoSlice<'_>],
    key: Option<&Key>,
    nonce: &[u8; NONCE_BYTES],
) -> io::Result<()> {
    header.meta_len = meta.len() as u32;
    header.flags = if key.is_some() { FLAG_AUTH } else { 0 };
    let head = header.encode();
    let tag = key.map(|k| frame::sign(k, nonce, &head, meta));
    let mut bufs: Vec<IoSlice<'_>> = Vec::with_capacity(3 + data.len());
    bufs.push(IoSlice::new(&head));
    if !meta.is_empty() {
        bufs.push(IoSlice::new(meta));
    }
    if let Some(tag) = &tag {
        bufs.push(IoSlice::new(tag));
    }
    bufs.extend(
        data.iter()
            .filter(|d| !d.is_empty())
            .map(|d| IoSlice::new(d)),
    );
    write_all_vectored(w, &mut bufs).await
}

/// `write_all` over many buffers, at most [`IOV_PER_WRITE_MAX`] per system call.
pub(super) async fn write_all_vectored(
    w: &mut OwnedWriteHalf,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_PER_WRITE_MAX);
        let written = w.write_vectored(&bufs[..n]).await?;
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, written);
    }
    Ok(())
}

/// Fills every buffer of `bufs` from the stream, in order, with vectored reads.
pub(super) async fn read_exact_vectored(
    r: &mut OwnedReadHalf,
    mut bufs: &mut [io::IoSliceMut<'_>],
) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_PER_WRITE_MAX);
        match r.try_read_vectored(&mut bufs[..n]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(read) => io::IoSliceMut::advance_slices(&mut bufs, read),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => r.readable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
