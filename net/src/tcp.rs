//! The TCP data plane: a [`DataServer`] serving this worker's region under its grants, and
//! pooled [`DataClient`]s to peers' data servers, one per peer address.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_transport::auth::Key;
use handoff_transport::data::DataError;
use handoff_transport::tcp::{BusyPoll, DataClient, DataServer, ServerConfig};
use handoff_transport::wire::messages::{LayoutDescriptor, TransportKind};
use handoff_transport::{RankInfo, Region};

use super::data::{DataPlane, GrantTable, PlaneTransfer};
use handoff_actors::link::{TransferError, TransferFuture};

/// Longest a connection to a peer's data server may take to open.
pub const DATA_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Data-server addresses this worker keeps a client for. Past it, the oldest is dropped
/// (its connections close; a later transfer reconnects).
pub const DATA_CLIENTS_MAX: usize = 1024;

/// Moves blocks over TCP.
pub struct TcpDataPlane {
    server: DataServer,
    address: String,
    region: Arc<Region>,
    me: RankInfo,
    key: Option<Key>,
    grants: Arc<GrantTable>,
    clients: Arc<Mutex<BTreeMap<String, DataClient>>>,
    /// How long the server and the clients wait for bytes spinning before they sleep.
    busy_poll: BusyPoll,
}

impl TcpDataPlane {
    /// Binds the data server (`HOST:PORT`, port 0 picks one) over `region`.
    /// `advertise_host` is the host peers dial, when it differs from the bound one.
    pub async fn bind(
        listen: &str,
        advertise_host: Option<&str>,
        region: Arc<Region>,
        me: RankInfo,
        key: Option<Key>,
    ) -> Result<TcpDataPlane, DataError> {
        Self::bind_with(listen, advertise_host, region, me, key, BusyPoll::default()).await
    }

    /// [`TcpDataPlane::bind`] whose server and clients busy-poll for bytes as `busy_poll`
    /// says before they sleep ([`EngineOptions::tcp_busy_poll`](crate::EngineOptions));
    /// `bind` takes [`BusyPoll::default`].
    pub async fn bind_with(
        listen: &str,
        advertise_host: Option<&str>,
        region: Arc<Region>,
        me: RankInfo,
        key: Option<Key>,
        busy_poll: BusyPoll,
    ) -> Result<TcpDataPlane, DataError> {
        let listen = listen.strip_prefix("tcp://").unwrap_or(listen);
        let grants = Arc::new(GrantTable::default());
        let config = ServerConfig {
            busy_poll: busy_poll.server,
            ..ServerConfig::default()
        };
        let server = DataServer::bind_with(
            listen,
            region.clone(),
            grants.clone(),
            me.clone(),
            key.clone(),
            config,
        )
        .await?;
        let local = server.local_addr();
        let host = match (advertise_host, local.ip()) {
            (Some(host), _) => host.to_string(),
            (None, ip) if ip.is_unspecified() => {
                // Registering 127.0.0.1 would send peers on other hosts to themselves.
                return Err(DataError::Bind {
                    addr: listen.to_string(),
                    detail: "listening on every interface needs an advertised host".into(),
                });
            }
            (None, ip) => ip.to_string(),
        };
        let address = format!("{host}:{}", local.port());
        Ok(TcpDataPlane {
            server,
            address,
            region,
            me,
            key,
            grants,
            clients: Arc::default(),
            busy_poll,
        })
    }

    /// The data server (for its statistics).
    pub fn server(&self) -> &DataServer {
        &self.server
    }

    fn transfer(&self, t: PlaneTransfer<'_>, write: bool) -> TransferFuture {
        let PlaneTransfer {
            id,
            peer,
            peer_layout,
            src,
            dst,
            slices,
            deadline,
            lease,
            ..
        } = t;
        if peer_layout.transport != TransportKind::Tcp {
            let refused = TransferError::WrongTransport {
                peer: peer.clone(),
                offered: format!("{:?}", peer_layout.transport),
                ours: "TCP",
            };
            return Box::pin(async move { Err(refused) });
        }
        let (id, addr, local) = (id.clone(), peer_layout.address.clone(), self.region.clone());
        let peer = peer.to_string();
        let (clients, me, key) = (self.clients.clone(), self.me.clone(), self.key.clone());
        let busy_poll = self.busy_poll.client;
        Box::pin(async move {
            let until = tokio::time::Instant::from_std(deadline);
            let client =
                tokio::time::timeout_at(until, client_for(&clients, &addr, me, key, busy_poll))
                    .await
                    .map_err(|_| TransferError::ConnectTimeout {
                        address: addr.clone(),
                    })??;
            let result = if write {
                client
                    .write_slices(&id, &local, &src, &dst, &slices, deadline)
                    .await
            } else {
                client
                    .read_slices(&id, &local, &src, &dst, &slices, deadline)
                    .await
            };
            if result.is_err() {
                // A broken peer: the next transfer dials afresh.
                clients
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&addr);
            }
            // The peer's server applied every operation while its grant held, but a write
            // seen done only after our lease with it ended (we were stopped, or cut off,
            // past its loss timeout) may be one it has failed since: not done.
            match (write, lease) {
                (true, Some(lease)) => {
                    Ok(lease.confirm(result, &peer, std::time::Instant::now())?)
                }
                _ => Ok(result?),
            }
        })
    }
}

async fn client_for(
    clients: &Mutex<BTreeMap<String, DataClient>>,
    addr: &str,
    me: RankInfo,
    key: Option<Key>,
    busy_poll: Duration,
) -> Result<DataClient, DataError> {
    if let Some(c) = clients.lock().unwrap_or_else(|e| e.into_inner()).get(addr) {
        return Ok(c.clone());
    }
    let client = DataClient::connect_with(addr, me, key, DATA_CONNECT_TIMEOUT, busy_poll).await?;
    let mut map = clients.lock().unwrap_or_else(|e| e.into_inner());
    if map.len() >= DATA_CLIENTS_MAX {
        if let Some(first) = map.keys().next().cloned() {
            map.remove(&first);
        }
    }
    map.insert(addr.to_string(), client.clone());
    Ok(client)
}

impl DataPlane for TcpDataPlane {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn descriptor(&self) -> LayoutDescriptor {
        // Two-sided: peers name logical blocks and our server maps them onto our ranges,
        // so no remote keys; the ranges tell peers how our blocks are laid out.
        LayoutDescriptor::of(
            TransportKind::Tcp,
            self.address.clone(),
            self.region.layout(),
        )
    }

    fn address(&self) -> String {
        self.address.clone()
    }

    fn grants(&self) -> &Arc<GrantTable> {
        &self.grants
    }

    fn write(&self, t: PlaneTransfer<'_>) -> TransferFuture {
        self.transfer(t, true)
    }

    fn read(&self, t: PlaneTransfer<'_>) -> TransferFuture {
        self.transfer(t, false)
    }
}
