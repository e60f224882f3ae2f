//! What the kernel records of the daemon's sockets at the end of their handshake (the
//! `waypoint_established` SOCK_OPS program, see waypoint-ebpf): each socket's sequence
//! bases, timestamp offset and addresses, in its own storage (`waypoint_common::
//! Established`). The rewrite hand-over computes both sockets' sequence numbers from
//! them and `TCP_INFO`'s byte counters, instead of reading them in repair mode: 2 map
//! lookups instead of 17 socket calls (4 address lookups, 11 for repair mode and its
//! queues, 2 timestamp reads) on every new connection's path.
//!
//! The program only fills records that exist: the daemon marks each socket it dials
//! (before the connect) and each listener, whose record the kernel copies into every
//! socket it accepts. It runs for the sockets of the daemon's cgroup (v2); where that is
//! not available the hand-over reads the sockets as before.

use std::{
    fs::File,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::PathBuf,
};

use aya::{
    maps::MapData,
    programs::{links::CgroupAttachMode, SockOps},
    Ebpf as Loaded,
};
use waypoint_common::{Established, ESTABLISHED_MAP, ESTABLISHED_PROG, ESTABLISHED_SET};

use tracing::{info, warn};

use super::bpf_cmd;

/// Errors setting up the records (each leaves the hand-over on socket options).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no cgroup v2 for this process: {0}")]
    Cgroup(String),
    #[error("opening cgroup {path}: {source}")]
    OpenCgroup { path: String, source: io::Error },
    #[error("{0} missing from the eBPF object")]
    Missing(&'static str),
    #[error("the established program: {0}")]
    Program(#[from] aya::programs::ProgramError),
    #[error("the established map: {0}")]
    Map(#[from] aya::maps::MapError),
}

/// The storage the program fills, attached to this process's cgroup.
pub struct Records {
    map: MapData,
}

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;

/// The element commands' part of `union bpf_attr`.
#[repr(C)]
struct Elem {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

impl Records {
    /// Loads the program, attaches it to this process's cgroup and takes its map.
    pub fn attach(loaded: &mut Loaded) -> Result<Records, Error> {
        let (path, root) = own_cgroup()?;
        let cgroup = File::open(&path).map_err(|source| Error::OpenCgroup {
            path: path.display().to_string(),
            source,
        })?;
        let prog: &mut SockOps = loaded
            .program_mut(ESTABLISHED_PROG)
            .ok_or(Error::Missing(ESTABLISHED_PROG))?
            .try_into()?;
        prog.load()?;
        // A link (kernel 5.7+), beside whatever else is attached there (other daemons in
        // tests, other tools): links take no mode flags (`Single` passes none). It
        // lives as long as the program, which `loaded` holds.
        prog.attach(cgroup.as_fd(), CgroupAttachMode::Single)?;
        let map = loaded
            .take_map(ESTABLISHED_MAP)
            .ok_or(Error::Missing(ESTABLISHED_MAP))?;
        let aya::maps::Map::SkStorage(map) = map else {
            return Err(Error::Missing(ESTABLISHED_MAP));
        };
        if root {
            warn!(
                cgroup = %path.display(),
                "recording handshakes in the root cgroup: every TCP socket of the machine runs \
                 the program (run the daemon in a cgroup of its own, as a pod's container is)"
            );
        } else {
            info!(cgroup = %path.display(), "recording the daemon's sockets' handshakes");
        }
        Ok(Records { map })
    }

    /// Gives `socket` an empty record for the program to fill when its handshake
    /// completes: a socket about to connect, or a listener (for the sockets it accepts).
    pub fn mark(&self, socket: BorrowedFd<'_>) -> io::Result<()> {
        let mut empty = Established::default();
        self.elem(BPF_MAP_UPDATE_ELEM, socket, &mut empty)
    }

    /// `socket`'s record, if the program filled it.
    pub fn get(&self, socket: BorrowedFd<'_>) -> Option<Established> {
        let mut value = Established::default();
        self.elem(BPF_MAP_LOOKUP_ELEM, socket, &mut value).ok()?;
        (value.flags & ESTABLISHED_SET != 0).then_some(value)
    }
}

impl Records {
    /// One element command on `socket`'s record, which the kernel reads from `value`
    /// (an update) or writes into it (a lookup).
    fn elem(
        &self,
        cmd: libc::c_long,
        socket: BorrowedFd<'_>,
        value: &mut Established,
    ) -> io::Result<()> {
        let fd: libc::c_int = socket.as_raw_fd();
        let mut attr = Elem {
            map_fd: self.map.fd().as_fd().as_raw_fd() as u32,
            _pad: 0,
            key: (&raw const fd) as u64,
            value: std::ptr::from_mut(value) as u64,
            flags: 0,
        };
        // SAFETY: the element command's attributes; key and value point to an int and a
        // record of the map's sizes, alive for the call.
        unsafe { bpf_cmd::call(cmd, &mut attr) }.map(|_| ())
    }
}

/// This process's cgroup v2 directory: its path in `/proc/self/cgroup` ("0::<path>")
/// under the cgroup2 mount of `/proc/self/mountinfo` (whose root, in a container with
/// its own cgroup namespace or a bind mount, may be a part of that path); and whether
/// that is the hierarchy's root (the host's, not a namespace's: "0::/" with the mount's
/// root at "/").
fn own_cgroup() -> Result<(PathBuf, bool), Error> {
    let read = |p: &str| std::fs::read_to_string(p).map_err(|e| Error::Cgroup(format!("{p}: {e}")));
    let cgroups = read("/proc/self/cgroup")?;
    let own = cgroups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| Error::Cgroup("no unified hierarchy in /proc/self/cgroup".into()))?;
    let mounts = read("/proc/self/mountinfo")?;
    for line in mounts.lines() {
        // "<id> <parent> <dev> <root> <mount point> <options> ... - <fstype> <source> ..."
        let Some((fields, rest)) = line.split_once(" - ") else {
            continue;
        };
        if rest.split(' ').next() != Some("cgroup2") {
            continue;
        }
        let fields: Vec<&str> = fields.split(' ').collect();
        let (Some(root), Some(mount)) = (fields.get(3), fields.get(4)) else {
            continue;
        };
        let Some(relative) = own.strip_prefix(root.trim_end_matches('/')) else {
            continue;
        };
        let path = PathBuf::from(mount).join(relative.trim_start_matches('/'));
        if path.is_dir() {
            let root = own == "/" && *root == "/" && !in_cgroup_namespace();
            return Ok((path, root));
        }
    }
    Err(Error::Cgroup(format!(
        "no cgroup2 mount holds {own} (/proc/self/mountinfo)"
    )))
}

/// The initial cgroup namespace's inode (`CGROUP_NS_INIT_INO`, include/linux/proc_ns.h).
const CGROUP_NS_INIT: &str = "cgroup:[4026531835]";

/// Whether this process has a cgroup namespace other than the host's (a container's):
/// then "/" is the container's cgroup, not the hierarchy's root.
fn in_cgroup_namespace() -> bool {
    std::fs::read_link("/proc/self/ns/cgroup").is_ok_and(|ns| ns.as_os_str() != CGROUP_NS_INIT)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

    use std::{
        io::{Read as _, Write as _},
        net::{SocketAddr, TcpListener, TcpStream},
        os::fd::AsRawFd as _,
        time::{Duration, Instant},
    };

    use aya::EbpfLoader;
    use waypoint_common::{
        ESTABLISHED_TS_OFFSET, ESTABLISHED_V4, POD_PORT, SOCK_OPS_SK_OFFSET, TCP_TSOFFSET_OFFSET,
    };

    use super::*;
    use crate::dataplane::{btf::Btf, ebpf::OBJECT, rewrite, tcp_info, Socket};

    /// The program and its storage, recording every dial to `pod_port` unmarked.
    fn records(pod_port: u16) -> (Loaded, Records) {
        let btf = Btf::vmlinux().unwrap();
        let sk = btf.member_offset("bpf_sock_ops_kern", "sk").unwrap();
        let ts = btf.member_offset("tcp_sock", "tsoffset").unwrap();
        let mut loaded = EbpfLoader::new()
            .override_global(SOCK_OPS_SK_OFFSET, &sk, true)
            .override_global(TCP_TSOFFSET_OFFSET, &ts, true)
            .override_global(POD_PORT, &u32::from(pod_port), true)
            .load(OBJECT)
            .unwrap();
        let records = Records::attach(&mut loaded).unwrap();
        (loaded, records)
    }

    /// Until every byte `sock` sent is acknowledged (loopback: at once, nearly).
    fn acked(sock: &TcpStream) {
        let start = Instant::now();
        while tcp_info(sock).unwrap().tcpi_unacked != 0 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "never acknowledged"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends `n` bytes from `from`, read whole by `to`, and waits for the ACK.
    fn carry(from: &mut TcpStream, to: &mut TcpStream, n: usize) {
        from.write_all(&vec![7u8; n]).unwrap();
        let mut buf = vec![0u8; n];
        to.read_exact(&mut buf).unwrap();
        acked(from);
    }

    /// The sequence numbers, addresses and timestamp offsets computed from the records
    /// are what repair mode, `getsockname`/`getpeername` and `TCP_TIMESTAMP` read from
    /// the same sockets, after bytes went both ways on each; sockets not marked have
    /// none (unless they dial the pods' port), and a listener's own record stays empty.
    #[test]
    fn records_agree_with_the_sockets() {
        let pods = TcpListener::bind("127.0.0.1:0").unwrap();
        let other_pods = TcpListener::bind("127.0.0.1:0").unwrap();
        let (_loaded, records) = records(pods.local_addr().unwrap().port());
        for (listen_on, mark_b) in [("127.0.0.1:0", false), ("[::]:0", true)] {
            let listener = socket2::Socket::new(
                socket2::Domain::for_address(listen_on.parse().unwrap()),
                socket2::Type::STREAM,
                None,
            )
            .unwrap();
            if listen_on.starts_with('[') {
                // Dual stack: an IPv4 client is accepted as ::ffff:127.0.0.1.
                listener.set_only_v6(false).unwrap();
            }
            listener
                .bind(&listen_on.parse::<SocketAddr>().unwrap().into())
                .unwrap();
            records.mark(listener.as_fd()).unwrap();
            listener.listen(8).unwrap();
            let listener: TcpListener = listener.into();
            let port = listener.local_addr().unwrap().port();
            // Not the pods' port: needs a mark.
            let other = TcpStream::connect(other_pods.local_addr().unwrap()).unwrap();
            assert_eq!(
                records.get(other.as_fd()),
                None,
                "not marked, not to the pods"
            );

            let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let (mut a, _) = listener.accept().unwrap();
            let b =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            if mark_b {
                records.mark(b.as_fd()).unwrap();
            }
            b.connect(&pods.local_addr().unwrap().into()).unwrap();
            let mut b: TcpStream = b.into();
            let (mut pod, _) = pods.accept().unwrap();

            assert_eq!(records.get(client.as_fd()), None, "not marked");
            assert_eq!(records.get(pod.as_fd()), None, "not marked");
            assert_eq!(records.get(listener.as_fd()), None, "never established");

            carry(&mut client, &mut a, 1_000);
            carry(&mut a, &mut client, 300);
            carry(&mut b, &mut pod, 200);
            carry(&mut pod, &mut b, 50);

            let ra = records.get(a.as_fd()).expect("A's record");
            let rb = records.get(b.as_fd()).expect("B's record");
            for r in [&ra, &rb] {
                assert_eq!(
                    r.flags & ESTABLISHED_V4,
                    ESTABLISHED_V4,
                    "{listen_on}: {r:?}"
                );
                assert_eq!(r.flags & ESTABLISHED_TS_OFFSET, ESTABLISHED_TS_OFFSET);
            }
            let v4 = |r: &Established, local: bool| {
                let (ip, port) = if local {
                    (r.local_ip4, r.local_port)
                } else {
                    (r.remote_ip4, r.remote_port)
                };
                SocketAddr::from((ip.to_ne_bytes(), port))
            };
            let mapped = |s: SocketAddr| match s {
                SocketAddr::V6(s) => SocketAddr::from((s.ip().to_ipv4_mapped().unwrap(), s.port())),
                s => s,
            };
            assert_eq!(v4(&ra, true), mapped(a.local_addr().unwrap()));
            assert_eq!(v4(&ra, false), mapped(a.peer_addr().unwrap()));
            assert_eq!(v4(&rb, true), b.local_addr().unwrap());
            assert_eq!(v4(&rb, false), b.peer_addr().unwrap());

            let (ia, ib) = (tcp_info(&a).unwrap(), tcp_info(&b).unwrap());
            let seq = |base: u32, count: u64| base.wrapping_add(count as u32);
            let computed = rewrite::Seqs {
                a_snd: seq(ra.snd_base, ia.tcpi_bytes_acked),
                a_rcv: seq(ra.rcv_base, ia.tcpi_bytes_received),
                b_snd: seq(rb.snd_base, ib.tcpi_bytes_acked),
                b_rcv: seq(rb.rcv_base, ib.tcpi_bytes_received),
            };
            let (ts_a, ts_b) = (
                rewrite::ts_clock(a.as_raw_fd()).unwrap(),
                rewrite::ts_clock(b.as_raw_fd()).unwrap(),
            );
            let read = rewrite::snapshot(&Socket::Ready(a), &Socket::Ready(b))
                .unwrap()
                .unwrap();
            assert_eq!(computed, read, "{listen_on}");
            // `ts_clock` subtracts a clock read a moment after the socket's, in
            // milliseconds: one less when a millisecond ended in between.
            assert!(
                ra.ts_offset.wrapping_sub(ts_a) <= 1,
                "{ts_a} {}",
                ra.ts_offset
            );
            assert!(
                rb.ts_offset.wrapping_sub(ts_b) <= 1,
                "{ts_b} {}",
                rb.ts_offset
            );
        }
    }
}
