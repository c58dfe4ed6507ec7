//! Secure by default on a network (Redis's protected mode): a worker or bootstrap server
//! that listens on, or dials, an address that is not loopback refuses to start without a
//! shared secret, unless the operator opts out explicitly (`--insecure`,
//! `EngineOptions::insecure`, `insecure=True` in Python). Loopback stays frictionless.
//!
//! The secret comes from a file (`--secret-file PATH` or [`SECRET_FILE_ENV`]) or from the
//! environment ([`SECRET_ENV`]), never from a command-line value that `ps` would show.
//!
//! Also here: the host a worker listening on every interface advertises
//! ([`route_to`]: the address of the interface that reaches the bootstrap server), so that
//! peers on other hosts never get `127.0.0.1` from it.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::Path;

use handoff_transport::auth::Key;

use crate::{BootstrapError, SECRET_FILE_BYTES_MAX};

/// Environment variable naming a file that holds the shared secret.
pub const SECRET_FILE_ENV: &str = "HANDOFF_SECRET_FILE";

/// Environment variable holding the shared secret itself (at least
/// [`handoff_transport::auth::KEY_BYTES_MIN`] bytes).
pub const SECRET_ENV: &str = "HANDOFF_SECRET";

/// How to set a secret or opt out: appended to every refusal.
pub const HOW_TO_SECURE: &str = "set a shared secret (a file of at least 16 bytes: \
     --secret-file PATH or HANDOFF_SECRET_FILE=PATH; or HANDOFF_SECRET=SECRET in the \
     environment), or pass --insecure (EngineOptions::insecure, insecure=True in Python) to \
     accept unauthenticated peers on a network you trust";

/// A network-facing address without a secret and without an explicit opt-out.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("refusing to start: {what} {address} is not a loopback address and no shared secret is set; {HOW_TO_SECURE}")]
pub struct Exposed {
    /// What the address is for (`control listen`, `bootstrap server`, ...).
    pub what: String,
    /// The address.
    pub address: String,
}

/// The shared secret: `secret_file` if given, else the file [`SECRET_FILE_ENV`] names,
/// else [`SECRET_ENV`]'s value, else none. An empty variable counts as unset.
///
/// # Errors
/// [`BootstrapError::Invalid`] naming the file or variable when the secret cannot be read or
/// is too short.
pub fn resolve_key(secret_file: Option<&Path>) -> Result<Option<Key>, BootstrapError> {
    if let Some(path) = secret_file {
        return load_key(path).map(Some);
    }
    if let Some(path) = std::env::var_os(SECRET_FILE_ENV).filter(|p| !p.is_empty()) {
        return load_key(Path::new(&path)).map(Some);
    }
    match std::env::var_os(SECRET_ENV).filter(|s| !s.is_empty()) {
        Some(secret) => {
            let bytes = secret.as_encoded_bytes();
            Key::new(bytes)
                .map(Some)
                .map_err(|e| BootstrapError::Invalid {
                    detail: format!("{SECRET_ENV}: {e}"),
                })
        }
        None => Ok(None),
    }
}

/// The host of `tcp://HOST:PORT`, `HOST:PORT` or `[V6]:PORT` (brackets removed).
pub fn host_of(address: &str) -> &str {
    let hostport = address.strip_prefix("tcp://").unwrap_or(address);
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// True when `host` can only be reached from this machine: a loopback IP, `localhost`, or a
/// name every one of whose addresses is loopback. Unspecified addresses (`0.0.0.0`, `::`)
/// and names that do not resolve are not.
pub fn is_loopback_host(host: &str) -> bool {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return ip.is_loopback();
    }
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match (host, 0u16).to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

/// Refuses the first of `addresses` (each `(what, address)`) that is not loopback, unless a
/// key is set or `insecure` opts out (then a warning is logged once per exposed address).
///
/// # Errors
/// [`Exposed`] naming the address and how to set a secret.
pub fn check_exposure(
    addresses: &[(&str, &str)],
    keyed: bool,
    insecure: bool,
) -> Result<(), Exposed> {
    if keyed {
        return Ok(());
    }
    for (what, address) in addresses {
        if is_loopback_host(host_of(address)) {
            continue;
        }
        if insecure {
            tracing::warn!(
                %what, %address,
                "--insecure: accepting unauthenticated peers on a non-loopback address"
            );
            continue;
        }
        return Err(Exposed {
            what: (*what).to_string(),
            address: (*address).to_string(),
        });
    }
    Ok(())
}

/// The address of the local interface that reaches `target` (`tcp://HOST:PORT`): a UDP
/// socket is connected to it (no packet is sent) and its local address read. `None` if
/// `target` does not resolve or no route reaches it.
pub fn route_to(target: &str) -> Option<IpAddr> {
    let hostport = target.strip_prefix("tcp://").unwrap_or(target);
    let remote = hostport.to_socket_addrs().ok()?.next()?;
    let bind: SocketAddr = if remote.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(bind).ok()?;
    socket.connect(remote).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// Descriptors a process needs besides its listeners' connections (runtime, UCX, files).
pub const OPEN_FILES_SPARE: u64 = 256;

/// Raises the open-file soft limit to the hard limit, once per process, and logs both with
/// the connection limits they must cover (every ZMTP listener's
/// `handoff_transport::zmtp::CONNECTIONS_MAX`, the TCP data server's
/// `SERVER_CONNECTIONS_MAX`, the spare). A limit too low for them is logged as a warning:
/// a flood would then meet the descriptor limit before the connection bounds. Returns the
/// soft limit in force, `None` where it cannot be read.
#[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every unix
pub fn raise_open_files() -> Option<u64> {
    static RAISED: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *RAISED.get_or_init(|| {
        #[cfg(unix)]
        {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit and setrlimit only read and write the struct we pass.
            if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
                return None;
            }
            let before = lim.rlim_cur as u64;
            if lim.rlim_cur < lim.rlim_max {
                lim.rlim_cur = lim.rlim_max;
                // SAFETY: as above.
                if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
                    lim.rlim_cur = before as libc::rlim_t;
                }
            }
            let soft = lim.rlim_cur as u64;
            let needed = (2 * handoff_transport::zmtp::CONNECTIONS_MAX
                + handoff_transport::tcp::SERVER_CONNECTIONS_MAX) as u64
                + OPEN_FILES_SPARE;
            if soft < needed {
                tracing::warn!(soft, hard = lim.rlim_max as u64, needed,
                    "open-file limit below what the connection limits need: raise the hard limit (ulimit -Hn)");
            } else {
                tracing::info!(before, soft, needed, zmtp_connections_max = handoff_transport::zmtp::CONNECTIONS_MAX,
                    data_connections_max = handoff_transport::tcp::SERVER_CONNECTIONS_MAX,
                    "open-file limit raised to the hard limit");
            }
            Some(soft)
        }
        #[cfg(not(unix))]
        {
            None
        }
    })
}

/// True when `address`'s host is `0.0.0.0` or `::` (listening on every interface).
pub fn is_unspecified(address: &str) -> bool {
    host_of(address)
        .parse::<IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
}

/// Reads a shared key from `path`: at most [`SECRET_FILE_BYTES_MAX`] bytes, at least
/// [`handoff_transport::auth::KEY_BYTES_MIN`] once one trailing newline (`\n` or `\r\n`) is
/// removed; every other byte is part of the secret.
pub fn load_key(path: &Path) -> Result<Key, BootstrapError> {
    let invalid = |detail: String| BootstrapError::Invalid {
        detail: format!("secret file {}: {detail}", path.display()),
    };
    let len = std::fs::metadata(path)
        .map_err(|e| invalid(e.to_string()))?
        .len();
    if len > SECRET_FILE_BYTES_MAX {
        return Err(invalid(format!(
            "{len} bytes; a secret file holds at most {SECRET_FILE_BYTES_MAX}"
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| invalid(e.to_string()))?;
    let secret = bytes
        .strip_suffix(b"\r\n")
        .or_else(|| bytes.strip_suffix(b"\n"))
        .unwrap_or(&bytes);
    Key::new(secret).map_err(|e| invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_read_from_every_address_form() {
        assert_eq!(host_of("tcp://10.0.0.1:7400"), "10.0.0.1");
        assert_eq!(host_of("10.0.0.1:0"), "10.0.0.1");
        assert_eq!(host_of("tcp://[::1]:7400"), "::1");
        assert_eq!(host_of("[::]:0"), "::");
    }

    #[test]
    fn only_loopback_is_exempt_from_the_secret() {
        for loopback in ["127.0.0.1", "127.1.2.3", "::1", "localhost"] {
            assert!(is_loopback_host(loopback), "{loopback}");
        }
        for exposed in [
            "0.0.0.0",
            "::",
            "10.0.0.1",
            "192.168.1.1",
            "no-such-host.invalid",
        ] {
            assert!(!is_loopback_host(exposed), "{exposed}");
        }
    }

    #[test]
    fn an_exposed_address_without_a_secret_is_refused_by_name() {
        let addrs = [
            ("control listen", "tcp://127.0.0.1:0"),
            ("data listen", "0.0.0.0:0"),
        ];
        let err = check_exposure(&addrs, false, false).map_err(|e| e.to_string());
        let err = err.err().unwrap_or_default();
        assert!(err.contains("data listen 0.0.0.0:0"), "{err}");
        assert!(err.contains("HANDOFF_SECRET_FILE"), "{err}");
        assert!(err.contains("--insecure"), "{err}");
        assert_eq!(check_exposure(&addrs, true, false), Ok(()));
        assert_eq!(check_exposure(&addrs, false, true), Ok(()));
        assert_eq!(check_exposure(&addrs[..1], false, false), Ok(()));
    }

    #[test]
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every unix
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        let soft = raise_open_files();
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit only writes the struct we pass.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(lim.rlim_cur, lim.rlim_max);
        assert_eq!(soft, Some(lim.rlim_cur as u64));
    }

    #[test]
    fn the_route_to_a_loopback_server_is_loopback() {
        let ip = route_to("tcp://127.0.0.1:7400");
        assert_eq!(ip, Some(IpAddr::from([127, 0, 0, 1])));
        assert_eq!(route_to("tcp://no-such-host.invalid:1"), None);
        assert!(is_unspecified("tcp://0.0.0.0:0"));
        assert!(is_unspecified("[::]:0"));
        assert!(!is_unspecified("127.0.0.1:0"));
    }
}
