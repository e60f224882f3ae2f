//! The daemon's one `Config`: every setting is a command-line flag with an environment
//! variable (`WAYPOINT_*`), documented here and shown by `--help`. The whole config is
//! logged at start.

use std::{net::SocketAddr, time::Duration};

use crate::dataplane;

/// Parses durations such as `30s`, `500ms`, `2m`, `1h`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 30s, 500ms, 2m, 1h"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!(
            "invalid duration unit in {s:?}: use ms, s, m or h"
        )),
    }
}

/// Parses byte sizes such as `4MiB`, `512KiB`, `1GiB`, or a bare number of bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 4MiB, 512KiB, 65536"))?;
    let mult = match unit {
        "" | "B" => 1,
        "KiB" | "K" => 1 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        _ => return Err(format!("invalid size unit in {s:?}: use KiB, MiB or GiB")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Settings of the `waypoint run` daemon.
#[derive(Clone, Debug, clap::Args)]
pub struct Config {
    /// Which dataplane moves the bytes of routed connections: `ebpf` (in-kernel
    /// SockHash redirect; needs CAP_BPF and CAP_NET_ADMIN), `splice` (splice(2) through
    /// pipes), `copy` (userspace copy), or `auto` (ebpf if it loads, else splice).
    #[arg(long, env = "WAYPOINT_DATAPLANE", value_enum, default_value = "auto")]
    pub dataplane: dataplane::Kind,

    /// eBPF dataplane: bytes allowed in flight inside the kernel per direction of a
    /// connection. Bounds node memory when a destination reads slowly: the sender is
    /// slowed instead.
    #[arg(long, env = "WAYPOINT_MAX_INFLIGHT", value_parser = parse_bytes, default_value = "4MiB")]
    pub max_inflight: u64,

    /// eBPF dataplane: force the send and receive buffers of spliced sockets to this size
    /// (SO_SNDBUFFORCE/SO_RCVBUFFORCE). Unset keeps the kernel's autotuning.
    #[arg(long, env = "WAYPOINT_SOCKET_BUFFER", value_parser = parse_bytes)]
    pub socket_buffer: Option<u64>,

    /// eBPF dataplane: capacity of the per-socket maps (two entries per connection).
    #[arg(long, env = "WAYPOINT_MAX_SOCKETS", default_value_t = waypoint_common::DEFAULT_MAX_SOCKETS)]
    pub max_sockets: u32,

    /// Splice dataplane: pipe capacity per direction of a connection.
    #[arg(long, env = "WAYPOINT_PIPE_SIZE", value_parser = parse_bytes, default_value = "1MiB")]
    pub pipe_size: u64,

    /// Close a connection when no byte moved in either direction for this long.
    #[arg(long, env = "WAYPOINT_IDLE_TIMEOUT", value_parser = parse_duration, default_value = "1h")]
    pub idle_timeout: Duration,

    /// Close a connection this long after it was accepted, whatever it is doing. Unset:
    /// no limit.
    #[arg(long, env = "WAYPOINT_MAX_LIFETIME", value_parser = parse_duration)]
    pub max_lifetime: Option<Duration>,

    /// Address of the admin HTTP server: /metrics (Prometheus), /healthz (liveness),
    /// /readyz (readiness). Separate from the tunnel port.
    #[arg(long, env = "WAYPOINT_ADMIN_ADDR", default_value = "127.0.0.1:15021")]
    pub admin_addr: SocketAddr,
}

impl Config {
    /// Per-connection limits derived from the config.
    pub fn limits(&self) -> dataplane::Limits {
        dataplane::Limits {
            idle_timeout: self.idle_timeout,
            max_lifetime: self.max_lifetime,
        }
    }

    /// The eBPF dataplane's settings.
    pub fn ebpf(&self) -> dataplane::ebpf::Config {
        dataplane::ebpf::Config {
            max_inflight: self.max_inflight,
            socket_buffer: self.socket_buffer.map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
            max_sockets: self.max_sockets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(parse_duration("7d").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("4MiB"), Ok(4 << 20));
        assert_eq!(parse_bytes("512KiB"), Ok(512 << 10));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert_eq!(parse_bytes("100"), Ok(100));
        assert!(parse_bytes("4MB").is_err());
        assert!(parse_bytes("99999999999999999999").is_err());
        assert!(parse_bytes("18446744073709551615GiB").is_err());
    }
}
