//! The daemon's one `Config`: every setting is a command-line flag with an environment
//! variable (`WAYPOINT_*`), documented here and shown by `--help`. The whole config is
//! logged at start.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use crate::{dataplane, horizon, registry, router};

/// The tunnel listener's port when `--tunnel-addr` gives none.
pub const DEFAULT_TUNNEL_PORT: u16 = 15443;
/// The admin server's port when `--admin-addr` gives none.
pub const DEFAULT_ADMIN_PORT: u16 = 15021;

/// A listen address: `IP:PORT`, `[IPv6]:PORT`, or an IP alone (either family), which
/// takes `default_port`. The DaemonSet passes the node IP as the kubelet reports it, with
/// no port: `$(NODE_IP):PORT` would need brackets on an IPv6 node and none on IPv4.
fn listen_addr(s: &str, default_port: u16) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    Err(format!(
        "{s:?} is not IP, IP:PORT or [IPv6]:PORT (an IPv6 address with a port needs brackets)"
    ))
}

/// `--tunnel-addr`: see [`listen_addr`].
pub fn parse_tunnel_addr(s: &str) -> Result<SocketAddr, String> {
    listen_addr(s, DEFAULT_TUNNEL_PORT)
}

/// `--admin-addr`: see [`listen_addr`].
pub fn parse_admin_addr(s: &str) -> Result<SocketAddr, String> {
    listen_addr(s, DEFAULT_ADMIN_PORT)
}

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
        _ => Err(format!("invalid duration unit in {s:?}: use ms, s, m or h")),
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

/// The kernel caps a forced socket buffer at `INT_MAX / 2` (then doubles it).
pub const MAX_SOCKET_BUFFER: u64 = 1 << 30;

/// Parses a socket buffer size (as [`parse_bytes`]); rejects sizes the kernel cannot
/// take, which a setsockopt int would otherwise wrap into a tiny buffer.
pub fn parse_socket_buffer(s: &str) -> Result<u64, String> {
    let n = parse_bytes(s)?;
    if n > MAX_SOCKET_BUFFER {
        return Err(format!(
            "socket buffer {s:?} is too large: at most 1GiB (the kernel's limit)"
        ));
    }
    Ok(n)
}

/// `--tunnel-mss`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunnelMss {
    /// From the smallest MTU of the node's interfaces, at start.
    Auto,
    /// This many bytes.
    Bytes(u32),
}

/// The kernel's bounds on TCP_MAXSEG (`TCP_MIN_MSS`, `MAX_TCP_WINDOW`).
const MSS_RANGE: std::ops::RangeInclusive<u32> = 88..=32767;

/// Parses `--tunnel-mss`: `auto` or a number of bytes within the kernel's bounds.
pub fn parse_tunnel_mss(s: &str) -> Result<TunnelMss, String> {
    if s == "auto" {
        return Ok(TunnelMss::Auto);
    }
    match s.parse::<u32>() {
        Ok(n) if MSS_RANGE.contains(&n) => Ok(TunnelMss::Bytes(n)),
        _ => Err(format!(
            "{s:?}: expected auto or an MSS in bytes from {} to {}",
            MSS_RANGE.start(),
            MSS_RANGE.end()
        )),
    }
}

impl TunnelMss {
    /// The MSS for a listener on `addr`; `auto` reads the interfaces now. An `auto`
    /// that finds no interface gives the IPv4 minimum MTU's (576) MSS, logged.
    pub fn resolve(self, addr: SocketAddr) -> u32 {
        match self {
            TunnelMss::Bytes(n) => n,
            TunnelMss::Auto => {
                let mtus = interface_mtus();
                auto_mss(&mtus, addr.is_ipv6()).unwrap_or_else(|| {
                    tracing::warn!(
                        "--tunnel-mss auto found no interface up besides lo: advertising 536"
                    );
                    536
                })
            }
        }
    }
}

/// The node's interfaces as (name, MTU, up), from /sys/class/net (a DaemonSet's pod in
/// the host network sees the node's); what cannot be read is left out.
fn interface_mtus() -> Vec<(String, u32, bool)> {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| {
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).ok();
            let mtu = read("mtu")?.trim().parse().ok()?;
            // IFF_UP is bit 0 of the interface's flags.
            let flags = read("flags")?;
            let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).ok()?;
            Some((
                e.file_name().to_string_lossy().into_owned(),
                mtu,
                flags & 1 == 1,
            ))
        })
        .collect()
}

/// `auto`'s MSS from the interfaces' (name, MTU, up): the smallest MTU of those up, lo
/// aside, less the IP (20 or 40 bytes) and TCP (20) headers; None if there is none.
pub fn auto_mss(interfaces: &[(String, u32, bool)], ipv6: bool) -> Option<u32> {
    let headers = if ipv6 { 60 } else { 40 };
    interfaces
        .iter()
        .filter(|(name, _, up)| *up && name != "lo")
        .map(|(_, mtu, _)| *mtu)
        .min()
        .map(|mtu| {
            mtu.saturating_sub(headers)
                .clamp(*MSS_RANGE.start(), *MSS_RANGE.end())
        })
}

/// Settings of the `waypoint run` daemon.
#[derive(Clone, Debug, clap::Args)]
pub struct Config {
    /// Address of the tunnel listener: where other clusters' sources connect. On a node,
    /// the node IP (the daemon runs in the host network). `IP:PORT`, `[IPv6]:PORT`, or an
    /// IP alone (IPv4 or IPv6), which listens on port 15443.
    #[arg(long, env = "WAYPOINT_TUNNEL_ADDR", default_value = "0.0.0.0:15443", value_parser = parse_tunnel_addr)]
    pub tunnel_addr: SocketAddr,

    /// Name of this node's cluster. Only this cluster's pods are ever routed to.
    #[arg(long, env = "WAYPOINT_CLUSTER", default_value = "local")]
    pub cluster: String,

    /// Name of this node (from the downward API `spec.nodeName` in Kubernetes). Pods on
    /// this node are preferred; with --kubernetes, the Node object and the pods watched.
    #[arg(long, env = "WAYPOINT_NODE_NAME", default_value = "local")]
    pub node_name: String,

    /// The mesh domain: a routable SNI is `<port>.<svc>.<ns>.<mesh-domain>`.
    #[arg(long, env = "WAYPOINT_MESH_DOMAIN", default_value = "mesh.local")]
    pub mesh_domain: String,

    /// Where endpoints come from: `file:PATH` (a JSON document, re-read when it changes;
    /// for a single node) or `etcd:URL[,URL...]` (the shared registry, e.g.
    /// `etcd:http://10.0.0.1:2379,http://10.0.0.2:2379`; see docs/REGISTRY.md).
    /// Without it the store is empty and every connection is rejected.
    #[arg(long, env = "WAYPOINT_REGISTRY")]
    pub registry: Option<registry::Location>,

    // --etcd-ca, --etcd-cert, --etcd-key.
    #[command(flatten)]
    pub etcd: registry::etcd::TlsArgs,

    /// etcd registry: TTL of this node's lease. The daemon renews it every third of the
    /// TTL; if the node dies, its endpoints leave every cluster's view this long after.
    #[arg(long, env = "WAYPOINT_REGISTRY_LEASE_TTL", value_parser = parse_duration, default_value = "10s")]
    pub registry_lease_ttl: Duration,

    /// etcd registry: a JSON file listing this node's pods, registered under the node's
    /// lease and re-read when it changes: `{"endpoints": [{"service": "reviews",
    /// "namespace": "bookinfo", "pod_ip": "10.1.0.7", "pod_name": "reviews-1",
    /// "ports": [9080], "exported": true}]}`. Cluster, node, node IP and locality come from
    /// the flags. For nodes outside Kubernetes; in a cluster use --kubernetes instead.
    #[arg(long, env = "WAYPOINT_LOCAL_ENDPOINTS", conflicts_with = "kubernetes")]
    pub local_endpoints: Option<PathBuf>,

    /// etcd registry: register this node's pods from the Kubernetes API. Watches the Node
    /// named by --node-name (its InternalIP and topology labels), the pods on it, every
    /// Service and every EndpointSlice; a pod selected by a Service is registered with
    /// the Service's target ports, ready as in the EndpointSlices, exported when the
    /// Service is annotated `waypoint.dev/export: "true"`. The client comes from the
    /// in-cluster service account, else KUBECONFIG. Not with --local-endpoints. See
    /// docs/REGISTRY.md for the RBAC it needs.
    #[arg(long, env = "WAYPOINT_KUBERNETES")]
    pub kubernetes: bool,

    /// This node's IP as other clusters reach it: registered with this node's endpoints
    /// so that sources elsewhere can dial them through this waypoint. With --kubernetes it
    /// overrides the Node's InternalIP (which is used when this is unset). Without either,
    /// other clusters leave this node's endpoints out. Refused at start if it is an address
    /// of this host and --tunnel-addr listens on another one.
    #[arg(long, env = "WAYPOINT_NODE_IP")]
    pub node_ip: Option<IpAddr>,

    /// Locality of this node: region. Empty with --kubernetes: the Node's
    /// topology.kubernetes.io/region label.
    #[arg(long, env = "WAYPOINT_REGION", default_value = "")]
    pub region: String,

    /// Locality of this node: zone. Empty with --kubernetes: the Node's
    /// topology.kubernetes.io/zone label.
    #[arg(long, env = "WAYPOINT_ZONE", default_value = "")]
    pub zone: String,

    /// Split horizon: how sources on this node reach endpoints. `off`: dial every pod
    /// directly (flat network); `cross-cluster`: other clusters' pods through their node's
    /// waypoint; `always`: every pod not on this node through its node's waypoint.
    #[arg(
        long,
        env = "WAYPOINT_EAST_WEST_WAYPOINT",
        value_enum,
        default_value = "off"
    )]
    pub east_west_waypoint: horizon::Mode,

    /// Split horizon: the port other nodes' waypoints listen on. Default: the port of
    /// --tunnel-addr (every node runs the same configuration).
    #[arg(long, env = "WAYPOINT_TUNNEL_PORT")]
    pub tunnel_port: Option<u16>,

    /// Route to services that are not marked exported. For labs only: in production a
    /// service is reachable from other clusters only when exported.
    #[arg(long, env = "WAYPOINT_EXPORT_ALL")]
    pub export_all: bool,

    /// Which pods of this cluster a connection may go to: `node` (this node's only) or
    /// `cluster` (this node's first; other nodes' when none is ready here, or when every
    /// one here failed to connect, within --connect-attempts).
    #[arg(
        long,
        env = "WAYPOINT_ROUTE_SCOPE",
        value_enum,
        default_value = "cluster"
    )]
    pub route_scope: router::Scope,

    /// The pods' inbound port: the only port the waypoint dials.
    #[arg(long, env = "WAYPOINT_POD_PORT", default_value_t = 15008)]
    pub pod_port: u16,

    /// Deadline for a client to send its whole ClientHello, from its handshake. (The
    /// kernel hands over a connection once its first bytes are in, TCP_DEFER_ACCEPT, or
    /// after 1 s of silence, which counts in the deadline: a deadline under 1 s gives a
    /// silent client 1 s.)
    #[arg(long, env = "WAYPOINT_HELLO_TIMEOUT", value_parser = parse_duration, default_value = "5s")]
    pub hello_timeout: Duration,

    /// Largest ClientHello accepted (Envoy's tls_inspector allows 64 KiB too).
    #[arg(long, env = "WAYPOINT_MAX_HELLO_BYTES", value_parser = parse_bytes, default_value = "64KiB")]
    pub max_hello_bytes: u64,

    /// Deadline for one connect to a pod. Above 1 s, TCP's first retransmission of a
    /// lost SYN (RFC 6298's initial timeout), so that one lost SYN or SYN-ACK is not a
    /// failed attempt.
    #[arg(long, env = "WAYPOINT_CONNECT_TIMEOUT", value_parser = parse_duration, default_value = "2s")]
    pub connect_timeout: Duration,

    /// Connect attempts per connection, each to a different pod: this node's pods first,
    /// then (--route-scope cluster) the other nodes'.
    #[arg(long, env = "WAYPOINT_CONNECT_ATTEMPTS", default_value_t = 3)]
    pub connect_attempts: u32,

    /// Open connections (routed and pending) beyond which new ones are refused.
    #[arg(long, env = "WAYPOINT_MAX_CONNECTIONS", default_value_t = 100_000)]
    pub max_connections: usize,

    /// Tunnel workers: threads that each accept on their own listener on the tunnel
    /// address (SO_REUSEPORT: the kernel spreads new connections over them) and run their
    /// connections on a single-threaded runtime, so that a connection stays on the thread
    /// that accepted it. 0: one per CPU this process may run on. At most 1024.
    #[arg(long, env = "WAYPOINT_WORKERS", value_parser = clap::value_parser!(u16).range(..=1024), default_value_t = 0)]
    pub workers: u16,

    /// Pin the tunnel workers to CPUs: worker i runs only on the i-th CPU this process may
    /// run on, and its listener takes the connections whose SYN that CPU handled
    /// (SO_INCOMING_CPU, which SO_REUSEPORT honours since Linux 6.1). A connection then
    /// stays on the CPU where its packets arrive, which pays most where NIC queues (RSS)
    /// spread connections over the CPUs. Off by default: a pinned worker cannot move off
    /// a CPU that other work keeps busy.
    #[arg(long, env = "WAYPOINT_PIN_WORKERS")]
    pub pin_workers: bool,

    /// Move a closing tunnel listener's queued connections (completed by the kernel, or
    /// waiting for their first bytes under TCP_DEFER_ACCEPT) to another listener of its
    /// SO_REUSEPORT group, such as the next daemon's in a rolling update, instead of
    /// resetting them (Linux 5.14 and later). Two ways, both at start: a reuseport eBPF
    /// program that sends them to the newest daemon's listeners, once each (needs
    /// CAP_BPF), and `net.ipv4.tcp_migrate_req` turned on (for the whole network
    /// namespace), under which the kernel's hash picks among every listener still
    /// open. Where either cannot be had (no CAP_BPF, a read-only /proc/sys, an older
    /// kernel) the daemon warns and runs on. `=false` does neither.
    #[arg(
        long,
        env = "WAYPOINT_MIGRATE_REQUESTS",
        num_args = 0..=1,
        require_equals = true,
        default_value = "true",
        default_missing_value = "true",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub migrate_requests: bool,

    /// The largest MSS the tunnel listener advertises to clients (TCP_MAXSEG): a number
    /// of bytes (88 to 32767), or `auto`: the smallest MTU of the node's interfaces that
    /// are up, lo aside, at start, less 40 bytes of IPv4 and TCP headers (60 on an IPv6
    /// tunnel address). Unset, the route decides, as for any socket. The rewrite splice
    /// needs a connection's two sides to advertise one MSS: where the pods' links carry
    /// smaller packets than the node's (Flannel's VXLAN: 1450 against 1500), `auto` makes
    /// the client's side advertise what the pod's side does, and the connection
    /// qualifies.
    #[arg(long, env = "WAYPOINT_TUNNEL_MSS", value_parser = parse_tunnel_mss)]
    pub tunnel_mss: Option<TunnelMss>,

    /// Connections still sending their hello beyond which new ones are refused.
    #[arg(long, env = "WAYPOINT_MAX_PENDING_HANDSHAKES", default_value_t = 4096)]
    pub max_pending_handshakes: usize,

    /// Where in bpffs a rewriting daemon pins its program's links and map, so that its
    /// rewritten connections outlive it: the next daemon, whichever dataplane it runs,
    /// finds them there and adopts them (it looks at its start, before it dials anything,
    /// and every 500 ms). Without a writable bpffs there (bpffs also refuses names with a
    /// dot), the daemon rewrites all the same, and its rewritten connections end with it.
    #[arg(long, env = "WAYPOINT_PIN_DIR", default_value = crate::dataplane::pins::DEFAULT_DIR)]
    pub pin_dir: std::path::PathBuf,

    /// On SIGTERM, how long established connections may drain before they are closed.
    #[arg(long, env = "WAYPOINT_DRAIN_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub drain_timeout: Duration,

    /// Which dataplane moves the bytes of routed connections: `ebpf` (in-kernel
    /// SockHash redirect; needs CAP_BPF and CAP_NET_ADMIN, and CAP_PERFMON for its check
    /// of repeated bytes), `splice` (splice(2) through pipes), `copy` (userspace copy),
    /// or `auto`: the fastest path the kernel carries, per connection the rewrite splice
    /// where it qualifies, else the SockHash redirect. A dataplane named runs or fails the
    /// start; `auto` probes the kernel by loading the programs: ebpf with the rewrite
    /// splice (unless --rewrite-splice=false), else ebpf without it (the kernel refused
    /// the program, or no CAP_NET_RAW), else splice; and runs splice on a kernel without
    /// the 2023 sockmap fixes (before 6.4, and 6.1 before 6.1.32), where a named ebpf runs
    /// with a warning. The choice and the refusal behind it are logged, shown in /readyz
    /// and exported as waypoint_dataplane{dataplane,reason}.
    #[arg(long, env = "WAYPOINT_DATAPLANE", value_enum, default_value = "auto")]
    pub dataplane: dataplane::Kind,

    /// eBPF dataplane: bytes allowed in flight inside the kernel per direction of a
    /// connection. Bounds node memory when a destination reads slowly: the sender is
    /// slowed instead.
    #[arg(long, env = "WAYPOINT_MAX_INFLIGHT", value_parser = parse_bytes, default_value = "4MiB")]
    pub max_inflight: u64,

    /// eBPF dataplane: force the send and receive buffers of redirected sockets to this size
    /// (SO_SNDBUFFORCE/SO_RCVBUFFORCE), at most 1GiB. Unset keeps the kernel's autotuning.
    #[arg(long, env = "WAYPOINT_SOCKET_BUFFER", value_parser = parse_socket_buffer)]
    pub socket_buffer: Option<u64>,

    /// eBPF dataplane: cap on the send buffer forced on a destination socket
    /// (SO_SNDBUFFORCE) when its direction fills the in-flight budget while the
    /// destination drains fast. The kernel's redirect worker waits a whole timer tick
    /// (4 ms at HZ=250) whenever the destination's send buffer is half full, so the buffer
    /// is sized to 8 ticks of the measured drain, up to this cap. Slow readers and
    /// request/response connections keep autotuned buffers. 0 never forces a buffer; at
    /// most 1GiB.
    #[arg(long, env = "WAYPOINT_BULK_SEND_BUFFER", value_parser = parse_socket_buffer, default_value = "16MiB")]
    pub bulk_send_buffer: u64,

    /// eBPF dataplane: capacity of the per-socket maps and of the rewrite map (two
    /// entries per connection).
    /// The flow records take 72 bytes per entry, allocated up front and mapped into the
    /// daemon, where they count in its RSS (18 MiB at the default). At least 2.
    #[arg(long, env = "WAYPOINT_MAX_SOCKETS", value_parser = clap::value_parser!(u32).range(2..), default_value_t = waypoint_common::DEFAULT_MAX_SOCKETS)]
    pub max_sockets: u32,

    /// eBPF dataplane: copy each connection in userspace until both directions together
    /// have carried this many bytes, then move it into the kernel. A socket in the
    /// SockHash costs about 20 µs to set up and tear down, more than a short connection
    /// gains. 0 moves every connection into the kernel at once. Also accepted as
    /// `--splice-after`.
    #[arg(long, alias = "splice-after", env = "WAYPOINT_MOVE_AFTER", value_parser = parse_bytes, default_value = "16KiB")]
    pub move_after: u64,

    /// eBPF dataplane: splice each connection by rewriting its packets' headers in a TC
    /// program on every interface of the node (also those added later), so that client
    /// and pod hold one TCP conversation and the waypoint's sockets carry no byte.
    /// Connections whose two sides negotiated different TCP options or MSS, with one end
    /// on this node and the other elsewhere, or over IPv6, take the SockHash. Needs
    /// CAP_NET_ADMIN (TCP_REPAIR, TC) and CAP_NET_RAW (resets), and Linux 5.12+ (the
    /// program's atomics). Unset: on with --dataplane auto (which falls back to ebpf
    /// without it where the kernel or the capabilities refuse it), off with --dataplane
    /// ebpf. `--rewrite-splice` alone is `true`; `=true` with --dataplane ebpf fails the
    /// start where it cannot load; `=false` turns it off for auto too.
    #[arg(
        long,
        env = "WAYPOINT_REWRITE_SPLICE",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub rewrite_splice: Option<bool>,

    /// Splice dataplane: pipe capacity per direction of a connection.
    #[arg(long, env = "WAYPOINT_PIPE_SIZE", value_parser = parse_bytes, default_value = "1MiB")]
    pub pipe_size: u64,

    /// Close a connection when no byte moved in either direction for this long: with a
    /// FIN to both sides, or a reset to both if bytes are still on the way between them
    /// (a peer that stopped reading).
    #[arg(long, env = "WAYPOINT_IDLE_TIMEOUT", value_parser = parse_duration, default_value = "1h")]
    pub idle_timeout: Duration,

    /// Close a connection this long after it was accepted, whatever it is doing (a reset
    /// to both sides if bytes are on the way, as for --idle-timeout). Unset: no limit.
    #[arg(long, env = "WAYPOINT_MAX_LIFETIME", value_parser = parse_duration)]
    pub max_lifetime: Option<Duration>,

    /// Park a connection that moved no byte for this long (copy dataplane, and the eBPF
    /// dataplane before --move-after): its sockets leave tokio's reactor for its
    /// worker's epoll set, and its copy state is freed, until a byte or a hang-up arrives
    /// or its idle timeout or lifetime falls due. Its first byte after that pays the
    /// wake: four epoll_ctl calls and a task switch on the worker (a 64 B round trip
    /// after 300 ms idle is then as fast as nginx's on the benchmark VM). Raise it where
    /// latency matters more than memory. The copy checks on its idle cadence, so a
    /// connection parks between one and two times this after its last byte. 0 never parks.
    #[arg(long, env = "WAYPOINT_PARK_AFTER", value_parser = parse_duration, default_value = "100ms")]
    pub park_after: Duration,

    /// Count and log a stalled connection: one with bytes held inside the waypoint (its
    /// one side's TCP received them, the other side's has not taken them) towards a side
    /// that waits on nothing (an empty send queue: not a slow reader's backpressure),
    /// whose byte counts did not move for this long. Each is counted once in
    /// waypoint_dataplane_stalls_total{dataplane} and logged once at warn with both
    /// sockets' state. Checked at the idle checks, so it is seen between one and two times
    /// this after its bytes stopped. In the SockHash, a stalled connection whose kernel
    /// count of read bytes ran ahead (a repeat the verdict could not cut) is reset on both
    /// sides (end="stranded"): nothing else would hand its bytes on. Does not apply to
    /// connections rewritten by --rewrite-splice (the daemon's sockets carry no byte). 0
    /// never checks.
    #[arg(long, env = "WAYPOINT_STALL_AFTER", value_parser = parse_duration, default_value = "10s")]
    pub stall_after: Duration,

    /// Address of the admin HTTP server: /metrics (Prometheus), /healthz (liveness),
    /// /readyz (readiness). Separate from the tunnel port. `IP:PORT`, `[IPv6]:PORT`, or an
    /// IP alone, which listens on port 15021.
    #[arg(long, env = "WAYPOINT_ADMIN_ADDR", default_value = "127.0.0.1:15021", value_parser = parse_admin_addr)]
    pub admin_addr: SocketAddr,
}

impl Config {
    /// The capabilities this configuration's paths use, as Kubernetes names them (no
    /// `CAP_`): what a deployment grants, no more.
    ///
    /// - The eBPF dataplane (`ebpf`, and `auto` to get it): `BPF` (maps and programs),
    ///   `NET_ADMIN` (a networking program type and a socket map need it besides `BPF`;
    ///   also SO_SNDBUFFORCE for `--bulk-send-buffer` and `--socket-buffer`) and
    ///   `PERFMON` (the verdict's `bpf_probe_read_kernel` for the repeat check; without
    ///   it the daemon warns and runs without the check).
    /// - The rewrite splice (`auto`'s default, or `--rewrite-splice`) adds `NET_RAW`: it
    ///   resets a rewritten connection's ends from a raw socket (its TCP_REPAIR and TC
    ///   programs are `NET_ADMIN`'s).
    /// - `splice` and `copy` need none.
    pub fn capabilities(&self) -> std::collections::BTreeSet<&'static str> {
        let mut caps = std::collections::BTreeSet::new();
        if matches!(
            self.dataplane,
            dataplane::Kind::Ebpf | dataplane::Kind::Auto
        ) {
            caps.extend(["BPF", "NET_ADMIN", "PERFMON"]);
            if self.rewrite_splice() {
                caps.insert("NET_RAW");
            }
        }
        caps
    }

    /// Whether the eBPF dataplane loads the rewrite splice: as `--rewrite-splice` says,
    /// else only under `--dataplane auto`.
    pub fn rewrite_splice(&self) -> bool {
        self.rewrite_splice
            .unwrap_or(self.dataplane == dataplane::Kind::Auto)
    }

    /// Per-connection limits derived from the config.
    pub fn limits(&self) -> dataplane::Limits {
        dataplane::Limits {
            idle_timeout: self.idle_timeout,
            max_lifetime: self.max_lifetime,
            park_after: Some(self.park_after).filter(|p| !p.is_zero()),
            stall_after: Some(self.stall_after).filter(|s| !s.is_zero()),
        }
    }

    /// The split-horizon viewer this node is.
    pub fn viewer(&self) -> horizon::Viewer {
        horizon::Viewer {
            cluster: self.cluster.clone(),
            node: self.node_name.clone(),
            region: self.region.clone(),
            zone: self.zone.clone(),
            mode: self.east_west_waypoint,
            mesh_domain: self.mesh_domain.clone(),
            tunnel_port: self.tunnel_port.unwrap_or(self.tunnel_addr.port()),
            pod_port: self.pod_port,
        }
    }

    /// Who this node is, for the records it registers.
    pub fn identity(&self) -> registry::etcd::NodeIdentity {
        registry::etcd::NodeIdentity {
            cluster: self.cluster.clone(),
            node: self.node_name.clone(),
            node_ip: self.node_ip,
            region: self.region.clone(),
            zone: self.zone.clone(),
        }
    }

    /// The router's settings.
    pub fn router(&self) -> router::Config {
        router::Config {
            mesh_domain: self.mesh_domain.clone(),
            pod_port: self.pod_port,
            hello_timeout: self.hello_timeout,
            max_hello_bytes: usize::try_from(self.max_hello_bytes).unwrap_or(usize::MAX),
            connect_timeout: self.connect_timeout,
            connect_attempts: self.connect_attempts,
            max_connections: self.max_connections,
            max_pending_handshakes: self.max_pending_handshakes,
            policy: router::Policy {
                cluster: self.cluster.clone(),
                node: self.node_name.clone(),
                scope: self.route_scope,
                export_all: self.export_all,
            },
            limits: self.limits(),
        }
    }

    /// The eBPF dataplane's settings.
    pub fn ebpf(&self) -> dataplane::ebpf::Config {
        dataplane::ebpf::Config {
            max_inflight: self.max_inflight,
            socket_buffer: self
                .socket_buffer
                .map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
            bulk_send_buffer: usize::try_from(self.bulk_send_buffer).unwrap_or(usize::MAX),
            max_sockets: self.max_sockets,
            move_after: self.move_after,
            rewrite_splice: self.rewrite_splice(),
            pod_port: Some(self.pod_port),
            pin_dir: self.pin_dir.clone(),
            ..dataplane::ebpf::Config::default()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn tunnel_mss_is_auto_or_within_the_kernels_bounds() {
        assert_eq!(parse_tunnel_mss("auto"), Ok(TunnelMss::Auto));
        assert_eq!(parse_tunnel_mss("1410"), Ok(TunnelMss::Bytes(1410)));
        for bad in ["87", "32768", "0", "-1", "1410B", "Auto", ""] {
            let e = parse_tunnel_mss(bad).unwrap_err();
            assert!(
                e.contains("expected auto or an MSS in bytes from 88 to 32767"),
                "{e}"
            );
        }
    }

    #[test]
    fn auto_mss_is_the_smallest_mtu_up_less_the_headers() {
        let i = |name: &str, mtu, up| (name.to_owned(), mtu, up);
        // A Flannel node: VXLAN and the pods' bridge at 1450.
        let flannel = [
            i("lo", 65536, true),
            i("eth0", 1500, true),
            i("flannel.1", 1450, true),
            i("cni0", 1450, true),
            i("docker0", 1280, false),
        ];
        assert_eq!(auto_mss(&flannel, false), Some(1410));
        assert_eq!(auto_mss(&flannel, true), Some(1390));
        assert_eq!(auto_mss(&[i("lo", 65536, true)], false), None);
        assert_eq!(auto_mss(&[i("tiny", 100, true)], false), Some(88));
    }

    #[test]
    fn listen_addresses_take_an_ip_alone_of_either_family() {
        let tunnel = |s: &str| parse_tunnel_addr(s);
        assert_eq!(tunnel("192.0.2.1"), Ok("192.0.2.1:15443".parse().unwrap()));
        assert_eq!(tunnel("192.0.2.1:9"), Ok("192.0.2.1:9".parse().unwrap()));
        assert_eq!(
            tunnel("2001:db8::1"),
            Ok("[2001:db8::1]:15443".parse().unwrap())
        );
        assert_eq!(
            tunnel("[2001:db8::1]:9"),
            Ok("[2001:db8::1]:9".parse().unwrap())
        );
        assert_eq!(parse_admin_addr("::"), Ok("[::]:15021".parse().unwrap()));
        for bad in ["", "node-1", "192.0.2.1:99999", "2001:db8::1:15443x"] {
            let err = tunnel(bad).unwrap_err();
            assert!(err.contains("needs brackets"), "{bad}: {err}");
        }
    }

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

    #[test]
    fn workers_are_bounded() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            config: Config,
        }
        let parse = |n: &str| Args::try_parse_from(["waypoint", "--workers", n]);
        assert_eq!(parse("1024").unwrap().config.workers, 1024);
        assert_eq!(parse("0").unwrap().config.workers, 0);
        let Err(e) = parse("1025") else {
            panic!("--workers 1025 accepted");
        };
        assert!(e.to_string().contains("1024"), "{e}");
        assert!(parse("-1").is_err());
    }

    /// `--move-after` is the flag; `--splice-after` stays an alias, so manifests that
    /// name it keep working.
    #[test]
    fn move_after_takes_its_old_name_too() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            config: Config,
        }
        let parse = |flag: &str| Args::try_parse_from(["waypoint", flag, "1MiB"]).unwrap();
        assert_eq!(parse("--move-after").config.move_after, 1 << 20);
        assert_eq!(parse("--splice-after").config.move_after, 1 << 20);
    }

    /// The rewrite splice is `auto`'s unless turned off, and a named `ebpf`'s only when
    /// asked for; its capability follows.
    #[test]
    fn the_rewrite_splice_is_autos_default() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            config: Config,
        }
        let parse = |args: &[&str]| {
            let config =
                Args::try_parse_from(std::iter::once("waypoint").chain(args.iter().copied()))
                    .unwrap()
                    .config;
            (
                config.rewrite_splice(),
                config.capabilities().contains("NET_RAW"),
            )
        };
        assert_eq!(parse(&[]), (true, true));
        assert_eq!(parse(&["--rewrite-splice=false"]), (false, false));
        assert_eq!(parse(&["--dataplane", "ebpf"]), (false, false));
        assert_eq!(
            parse(&["--dataplane", "ebpf", "--rewrite-splice"]),
            (true, true)
        );
        assert_eq!(
            parse(&["--rewrite-splice", "--dataplane", "ebpf"]),
            (true, true)
        );
        assert_eq!(
            parse(&["--dataplane", "ebpf", "--rewrite-splice=true"]),
            (true, true)
        );
        // splice and copy load no program: nothing to rewrite with, no capability.
        assert!(!parse(&["--dataplane", "splice"]).1);
        let bad = Args::try_parse_from(["waypoint", "--rewrite-splice=maybe"]);
        assert!(bad.is_err());
    }

    #[test]
    fn socket_buffers_are_bounded() {
        assert_eq!(parse_socket_buffer("16MiB"), Ok(16 << 20));
        assert_eq!(parse_socket_buffer("1GiB"), Ok(1 << 30));
        let Err(err) = parse_socket_buffer("4GiB") else {
            panic!("4GiB accepted as a socket buffer");
        };
        assert!(err.contains("too large"), "{err}");
        assert!(parse_socket_buffer("1MB").is_err());
    }
}
