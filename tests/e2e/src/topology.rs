//! The simulated world: an underlay, two clusters of two nodes, pods behind the nodes,
//! all network namespaces named `wp-*` (never the host's own interfaces or routes).
//!
//! ```text
//!  wp-underlay: bridge br0, 192.168.77.2 (etcd)
//!   ├─ u-a1 ═ eth0 wp-a1 192.168.77.11   cni0 10.244.1.1/24 ─ pods 10.244.1.10, .11
//!   ├─ u-a2 ═ eth0 wp-a2 192.168.77.12   cni0 10.244.2.1/24 ─ pod  10.244.2.10
//!   ├─ u-b1 ═ eth0 wp-b1 192.168.77.21   cni0 10.244.1.1/24 ─ pods 10.244.1.20, .21
//!   └─ u-b2 ═ eth0 wp-b2 192.168.77.22   cni0 10.244.2.1/24 ─ pods 10.244.2.20, .21
//! ```
//!
//! Both clusters use the pod CIDR 10.244.0.0/16, as two default Flannel clusters do: each
//! node routes the other node of its own cluster's /24 via that node's IP (host-gw) and
//! nothing across clusters. Pod traffic leaving the pod network is masqueraded on its node
//! (Flannel's ip-masq), so another cluster's node can answer it. The underlay's MTU is
//! 1500, the pods' links' and bridges' 1450, as with Flannel's VXLAN.
//!
//! [`Layout::standard_v6`] is the same world on IPv6: node IPs `fd00:77::11` … on a
//! dual-stack underlay (etcd stays at its IPv4 address), pods IPv6-only in the pod CIDR
//! `fd00:244::/48` of both clusters (`fd00:244:0:N::/64` per node, the same host parts),
//! masqueraded the same way.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::netns::{self, Error};

/// Prefix of every namespace the harness creates (and `cleanup` removes).
pub const PREFIX: &str = "wp-";
/// The underlay namespace: the bridge joining every node, and etcd.
pub const UNDERLAY: &str = "wp-underlay";
/// etcd's address on the underlay.
pub const ETCD_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
/// The pod CIDR of both clusters.
pub const POD_CIDR: &str = "10.244.0.0/16";
/// The IPv6 pod CIDR of both clusters (the IPv6 world).
pub const POD_CIDR_V6: &str = "fd00:244::/48";
/// The underlay's IPv6 address in `wp-underlay` (where the harness reads the daemons'
/// admin servers from).
pub const UNDERLAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 2);
/// Mesh domain of structured SNIs, and the SPIFFE trust domain.
pub const MESH_DOMAIN: &str = "mesh.local";
/// The Kubernetes namespace of every demo service.
pub const NAMESPACE: &str = "demo";
/// The service port every demo service serves.
pub const SERVICE_PORT: u16 = 9080;
/// The pods' inbound (mTLS) port.
pub const POD_PORT: u16 = 15008;
/// The waypoints' tunnel port.
pub const TUNNEL_PORT: u16 = 15443;
/// The waypoints' admin port.
pub const ADMIN_PORT: u16 = 15021;
/// The MTU of the pods' links and bridges: Flannel's VXLAN MTU, below the underlay's
/// 1500, so a connection's client side and pod side see different MTUs (the daemons run
/// with `--tunnel-mss auto`).
pub const POD_MTU: &str = "1450";

/// One simulated node.
#[derive(Clone, Debug)]
pub struct Node {
    /// `a1`, `b2`, ...
    pub name: String,
    /// `a` or `b`.
    pub cluster: String,
    /// N in the node's pod subnet 10.244.N.0/24 (fd00:244:0:N::/64).
    pub index: u8,
    /// The node IP on the underlay: what the daemon registers and other clusters dial.
    pub ip: IpAddr,
    /// The node's IPv4 address on the underlay, which reaches etcd (`ip` itself in the
    /// IPv4 world).
    pub ipv4: Ipv4Addr,
}

impl Node {
    /// The node's namespace.
    pub fn netns(&self) -> String {
        format!("{PREFIX}{}", self.name)
    }

    /// The underlay side of the node's link (in `wp-underlay`).
    pub fn uplink(&self) -> String {
        format!("u-{}", self.name)
    }

    /// `node_ip:15443`.
    pub fn tunnel_addr(&self) -> SocketAddr {
        SocketAddr::from((self.ip, TUNNEL_PORT))
    }

    /// `node_ip:15021`.
    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::from((self.ip, ADMIN_PORT))
    }

    /// The node's pod subnet.
    pub fn pod_subnet(&self) -> String {
        match self.ip {
            IpAddr::V4(_) => format!("10.244.{}.0/24", self.index),
            IpAddr::V6(_) => format!("fd00:244:0:{}::/64", self.index),
        }
    }

    /// The pods' gateway (the node's cni0 address).
    pub fn gateway(&self) -> IpAddr {
        pod_ip(self.ip.is_ipv6(), self.index, 1)
    }
}

/// The IP of host `last` in node `index`'s pod subnet, of the family asked.
fn pod_ip(v6: bool, index: u8, last: u8) -> IpAddr {
    if v6 {
        Ipv6Addr::new(0xfd00, 0x244, 0, index.into(), 0, 0, 0, last.into()).into()
    } else {
        Ipv4Addr::new(10, 244, index, last).into()
    }
}

/// The prefix length of the underlay's and the pod subnets' addresses.
fn prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv6() {
        64
    } else {
        24
    }
}

/// `ip addr add` arguments for `ip` on `dev`: without duplicate address detection for
/// IPv6, which would leave the address unusable ("tentative") for a second or two.
fn addr_add<'a>(ns: &'a str, ip: IpAddr, dev: &'a str) -> Vec<String> {
    let mut args: Vec<String> = ["-n", ns, "addr", "add"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    args.push(format!("{ip}/{}", prefix(ip)));
    args.extend(["dev".to_owned(), dev.to_owned()]);
    if ip.is_ipv6() {
        args.push("nodad".to_owned());
    }
    args
}

fn ip_owned(args: &[String]) -> Result<String, Error> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    netns::ip(&args)
}

/// One simulated pod.
#[derive(Clone, Debug)]
pub struct Pod {
    /// `svc-b-b1`, `client-a1`, ...
    pub name: String,
    /// The node it runs on.
    pub node: String,
    /// Its IP.
    pub ip: IpAddr,
    /// The service it backs (none: a pure client, not registered).
    pub service: Option<String>,
    /// Whether that service is exported to other clusters.
    pub exported: bool,
    /// Its service account: the SPIFFE ID is `spiffe://mesh.local/ns/demo/sa/<sa>`.
    pub service_account: String,
}

impl Pod {
    /// The pod's namespace.
    pub fn netns(&self) -> String {
        format!("{PREFIX}{}", self.name)
    }

    /// The node side of the pod's link (in the node's namespace; at most 15 bytes).
    pub fn hostlink(&self) -> String {
        let last = match self.ip {
            IpAddr::V4(ip) => u16::from(ip.octets()[3]),
            IpAddr::V6(ip) => ip.segments()[7],
        };
        format!("vp{last}")
    }

    /// `pod_ip:15008`.
    pub fn inbound(&self) -> SocketAddr {
        SocketAddr::from((self.ip, POD_PORT))
    }
}

/// The whole world.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Nodes of both clusters.
    pub nodes: Vec<Node>,
    /// Pods of both clusters.
    pub pods: Vec<Pod>,
}

impl Layout {
    /// Clusters a and b, two nodes each. A pods end in .10/.11, B pods in .20/.21, so an
    /// A pod dialing a B pod's IP reaches no one in its own cluster either.
    pub fn standard() -> Layout {
        Layout::of_family(false)
    }

    /// [`Layout::standard`] with IPv6 node IPs and IPv6-only pods (see the module
    /// comment).
    pub fn standard_v6() -> Layout {
        Layout::of_family(true)
    }

    fn of_family(v6: bool) -> Layout {
        let node = |name: &str, index: u8, last: u8| {
            let ipv4 = Ipv4Addr::new(192, 168, 77, last);
            Node {
                name: name.to_owned(),
                cluster: name[..1].to_owned(),
                index,
                ip: if v6 {
                    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, last.into()).into()
                } else {
                    ipv4.into()
                },
                ipv4,
            }
        };
        let pod = |service: Option<&str>, node: &str, index: u8, last: u8, exported: bool| {
            let sa = service.unwrap_or("client");
            Pod {
                name: format!("{sa}-{node}"),
                node: node.to_owned(),
                ip: pod_ip(v6, index, last),
                service: service.map(str::to_owned),
                exported,
                service_account: sa.to_owned(),
            }
        };
        Layout {
            nodes: vec![
                node("a1", 1, 11),
                node("a2", 2, 12),
                node("b1", 1, 21),
                node("b2", 2, 22),
            ],
            pods: vec![
                pod(Some("svc-a"), "a1", 1, 10, false),
                pod(None, "a1", 1, 11, false),
                pod(Some("svc-a"), "a2", 2, 10, false),
                pod(Some("svc-b"), "b1", 1, 20, true),
                pod(Some("internal"), "b1", 1, 21, false),
                pod(Some("svc-b"), "b2", 2, 20, true),
                pod(Some("internal"), "b2", 2, 21, false),
            ],
        }
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The pod called `name`.
    pub fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.iter().find(|p| p.name == name)
    }

    /// The nodes of `cluster`.
    pub fn cluster(&self, cluster: &str) -> impl Iterator<Item = &Node> + '_ {
        let cluster = cluster.to_owned();
        self.nodes.iter().filter(move |n| n.cluster == cluster)
    }

    /// The pods on `node`.
    pub fn pods_on(&self, node: &str) -> impl Iterator<Item = &Pod> + '_ {
        let node = node.to_owned();
        self.pods.iter().filter(move |p| p.node == node)
    }

    /// Builds every namespace, link, address, route and masquerade rule.
    pub fn build(&self) -> Result<(), Error> {
        let u = UNDERLAY;
        netns::ip(&["netns", "add", u])?;
        netns::ip(&["-n", u, "link", "set", "lo", "up"])?;
        netns::ip(&["-n", u, "link", "add", "br0", "type", "bridge"])?;
        netns::ip(&[
            "-n",
            u,
            "addr",
            "add",
            &format!("{ETCD_IP}/24"),
            "dev",
            "br0",
        ])?;
        ip_owned(&addr_add(u, UNDERLAY_V6.into(), "br0"))?;
        netns::ip(&["-n", u, "link", "set", "br0", "up"])?;
        for n in &self.nodes {
            self.build_node(n)?;
        }
        for p in &self.pods {
            let node = self
                .node(&p.node)
                .ok_or_else(|| Error::Enter {
                    ns: p.node.clone(),
                    source: std::io::Error::other("pod on an unknown node"),
                })?
                .clone();
            build_pod(&node, p)?;
        }
        Ok(())
    }

    fn build_node(&self, n: &Node) -> Result<(), Error> {
        let ns = n.netns();
        let ns = ns.as_str();
        netns::ip(&["netns", "add", ns])?;
        netns::ip(&["-n", ns, "link", "set", "lo", "up"])?;
        // Created inside the underlay with its peer moved straight into the node: the
        // host's namespace never holds either end.
        netns::ip(&[
            "-n",
            UNDERLAY,
            "link",
            "add",
            &n.uplink(),
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        ])?;
        netns::ip(&[
            "-n",
            UNDERLAY,
            "link",
            "set",
            &n.uplink(),
            "master",
            "br0",
            "up",
        ])?;
        ip_owned(&addr_add(ns, n.ipv4.into(), "eth0"))?;
        if n.ip.is_ipv6() {
            ip_owned(&addr_add(ns, n.ip, "eth0"))?;
        }
        netns::ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        // See `build_pod`: checksums are computed and checked in software between hosts.
        netns::software_checksums(UNDERLAY, &n.uplink(), false)?;
        netns::software_checksums(ns, "eth0", false)?;
        netns::exec(ns, "sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
        netns::exec(ns, "sysctl", &["-qw", "net.ipv6.conf.all.forwarding=1"])?;
        netns::ip(&[
            "-n", ns, "link", "add", "cni0", "mtu", POD_MTU, "type", "bridge",
        ])?;
        ip_owned(&addr_add(ns, n.gateway(), "cni0"))?;
        netns::ip(&["-n", ns, "link", "set", "cni0", "up"])?;
        // host-gw: the other nodes of this cluster own their /24s; other clusters' pod
        // subnets (the same numbers) are never routed.
        for peer in self.cluster(&n.cluster).filter(|p| p.name != n.name) {
            netns::ip(&[
                "-n",
                ns,
                "route",
                "add",
                &peer.pod_subnet(),
                "via",
                &peer.ip.to_string(),
            ])?;
        }
        let (family, cidr) = match n.ip {
            IpAddr::V4(_) => ("ip", POD_CIDR),
            IpAddr::V6(_) => ("ip6", POD_CIDR_V6),
        };
        let rules = format!(
            "table {family} wp-masq {{\n  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    {family} saddr {cidr} {family} daddr != {cidr} oifname \"eth0\" masquerade\n  }}\n}}\n"
        );
        netns::run_with_input("ip", &["netns", "exec", ns, "nft", "-f", "-"], Some(&rules))?;
        Ok(())
    }
}

fn build_pod(node: &Node, p: &Pod) -> Result<(), Error> {
    let ns = p.netns();
    let ns = ns.as_str();
    let node_ns = node.netns();
    let node_ns = node_ns.as_str();
    netns::ip(&["netns", "add", ns])?;
    netns::ip(&["-n", ns, "link", "set", "lo", "up"])?;
    netns::ip(&[
        "-n",
        node_ns,
        "link",
        "add",
        &p.hostlink(),
        "mtu",
        POD_MTU,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "mtu",
        POD_MTU,
        "netns",
        ns,
    ])?;
    netns::ip(&[
        "-n",
        node_ns,
        "link",
        "set",
        &p.hostlink(),
        "master",
        "cni0",
        "up",
    ])?;
    ip_owned(&addr_add(ns, p.ip, "eth0"))?;
    netns::ip(&["-n", ns, "link", "set", "eth0", "up"])?;
    // Every veth end checks checksums in software, and every end but the pod's own
    // completes them in software: a pod's packets reach its node's program with the
    // checksum still to be completed (CHECKSUM_PARTIAL, as a local socket's do), the
    // next hop completes it, and everything else arrives there complete
    // (CHECKSUM_NONE). Both ways the rewrite program changes a checksum are thereby
    // checked by the receiving socket, which drops a packet whose checksum is wrong.
    netns::software_checksums(node_ns, &p.hostlink(), false)?;
    netns::software_checksums(ns, "eth0", true)?;
    let family = if p.ip.is_ipv6() { "-6" } else { "-4" };
    netns::ip(&[
        family,
        "-n",
        ns,
        "route",
        "add",
        "default",
        "via",
        &node.gateway().to_string(),
    ])?;
    Ok(())
}

/// What [`teardown`] removed.
#[derive(Debug, Default)]
pub struct Removed {
    /// Namespaces deleted.
    pub namespaces: Vec<String>,
    /// Processes killed (they were still running in one of them).
    pub processes: Vec<i32>,
}

/// Kills every process still running in a `wp-*` namespace and deletes the namespaces
/// (their links go with them). Safe to call when nothing exists.
pub fn teardown() -> Result<Removed, Error> {
    use nix::{sys::signal, unistd::Pid};
    let mut removed = Removed::default();
    let ours: Vec<String> = netns::list()?
        .into_iter()
        .filter(|n| n.starts_with(PREFIX))
        .collect();
    for ns in &ours {
        let pids = netns::ip(&["netns", "pids", ns]).unwrap_or_default();
        for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // Only processes found in our own namespaces, by id.
            if signal::kill(Pid::from_raw(pid), signal::Signal::SIGKILL).is_ok() {
                removed.processes.push(pid);
            }
        }
    }
    // SIGKILL is asynchronous: give the kernel a moment so that the namespaces' last
    // users are gone before they are deleted.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while std::time::Instant::now() < deadline
        && removed.processes.iter().any(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .map(|s| !s.contains(") Z "))
                .unwrap_or(false)
        })
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for ns in ours {
        netns::ip(&["netns", "del", &ns])?;
        removed.namespaces.push(ns);
    }
    Ok(removed)
}
