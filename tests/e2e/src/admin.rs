//! The daemon's admin API as a client sees it: a minimal HTTP/1.1 GET, the Prometheus
//! text format, and the `/v1/resolve` JSON (only the fields the harness reads).

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// Errors of admin requests.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Connecting, writing or reading failed.
    #[error("GET http://{addr}{path}: {source}")]
    Io {
        /// The server.
        addr: SocketAddr,
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The answer is not HTTP.
    #[error("GET http://{addr}{path}: malformed answer {head:?}")]
    Malformed {
        /// The server.
        addr: SocketAddr,
        /// The path.
        path: String,
        /// The start of what came back.
        head: String,
    },
    /// A status other than 200.
    #[error("GET http://{addr}{path}: status {status}: {body}")]
    Status {
        /// The server.
        addr: SocketAddr,
        /// The path.
        path: String,
        /// The status.
        status: u16,
        /// The body.
        body: String,
    },
    /// The body is not the expected JSON.
    #[error("GET http://{addr}{path}: {source}")]
    Json {
        /// The server.
        addr: SocketAddr,
        /// The path.
        path: String,
        /// The cause.
        source: serde_json::Error,
    },
}

/// `GET path` on `addr`; returns the status and the body.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, String), Error> {
    let io = |source| Error::Io {
        addr,
        path: path.to_owned(),
        source,
    };
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(io)?;
    let text = String::from_utf8_lossy(&raw);
    let malformed = || Error::Malformed {
        addr,
        path: path.to_owned(),
        head: text.chars().take(80).collect(),
    };
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(malformed)?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(malformed)?;
    Ok((status, body.to_owned()))
}

/// `GET path`, requiring 200.
pub fn get_ok(addr: SocketAddr, path: &str) -> Result<String, Error> {
    let (status, body) = get(addr, path, Duration::from_secs(2))?;
    if status != 200 {
        return Err(Error::Status {
            addr,
            path: path.to_owned(),
            status,
            body: body.trim().to_owned(),
        });
    }
    Ok(body)
}

/// Samples of a Prometheus text exposition, keyed by `name{labels}` as printed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics(pub BTreeMap<String, f64>);

impl Metrics {
    /// Parses the text format (comments skipped).
    pub fn parse(text: &str) -> Metrics {
        Metrics(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| {
                    let (k, v) = l.rsplit_once(' ')?;
                    Some((k.to_owned(), v.parse().ok()?))
                })
                .collect(),
        )
    }

    /// The sample `key` (`name` or `name{label="v"}`), 0 when absent.
    pub fn get(&self, key: &str) -> f64 {
        self.0.get(key).copied().unwrap_or(0.0)
    }

    /// Connections the router opened (routed to a pod).
    pub fn opened(&self) -> f64 {
        self.get("waypoint_connections_opened_total")
    }

    /// Connections rejected for `reason`.
    pub fn rejected(&self, reason: &str) -> f64 {
        self.get(&format!(
            "waypoint_connections_rejected_total{{reason=\"{reason}\"}}"
        ))
    }

    /// Every rejection, whatever the reason.
    pub fn rejected_all(&self) -> f64 {
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with("waypoint_connections_rejected_total"))
            .map(|(_, v)| v)
            .sum()
    }

    /// Bytes forwarded by closed connections, both directions.
    pub fn bytes(&self) -> f64 {
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with("waypoint_bytes_total"))
            .map(|(_, v)| v)
            .sum()
    }

    /// Whether any router counter differs from `before` (opened, rejected, bytes).
    pub fn router_moved(&self, before: &Metrics) -> bool {
        self.opened() != before.opened()
            || self.rejected_all() != before.rejected_all()
            || self.bytes() != before.bytes()
    }
}

/// One target of a split-horizon view.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Target {
    /// Where to connect.
    pub address: SocketAddr,
    /// The SNI to send.
    pub sni: String,
    /// Whether `address` is a node's waypoint.
    pub waypoint: bool,
    /// 0 first.
    pub priority: u32,
    /// The endpoint's cluster.
    pub cluster: String,
    /// The endpoint's node.
    pub node: String,
    /// The pod.
    pub pod: String,
    /// The pod's IP.
    pub pod_ip: IpAddr,
}

/// The split-horizon view of a service port (`/v1/resolve`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct View {
    /// Best priority first.
    pub endpoints: Vec<Target>,
}

/// `/v1/resolve?service=<svc>.<ns>:<port>` on the daemon at `admin`.
pub fn resolve(admin: SocketAddr, service: &str) -> Result<View, Error> {
    let path = format!("/v1/resolve?service={}", service.replace(':', "%3A"));
    let body = get_ok(admin, &path)?;
    serde_json::from_str(&body).map_err(|source| Error::Json {
        addr: admin,
        path,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_metrics() {
        let m = Metrics::parse(
            "# HELP x y\nwaypoint_connections_opened_total 3\nwaypoint_connections_rejected_total{reason=\"not_tls\"} 2\nwaypoint_bytes_total{direction=\"a\"} 5\nwaypoint_bytes_total{direction=\"b\"} 7\n",
        );
        assert_eq!(m.opened(), 3.0);
        assert_eq!(m.rejected("not_tls"), 2.0);
        assert_eq!(m.rejected("other"), 0.0);
        assert_eq!(m.rejected_all(), 2.0);
        assert_eq!(m.bytes(), 12.0);
    }
}
