//! Segments that repeat bytes already delivered: every dataplane forwards each byte once.
//!
//! TCP queues a segment that starts below `rcv_nxt` but ends above it *whole* (RFC 793's
//! "partial" segment: a retransmission overtook its original, or a sender re-cut its
//! data). Readers skip the repeated head by reading from `copied_seq`, but the sockmap
//! verdict is handed the whole segment; unchecked, the eBPF dataplane would forward the
//! head twice (what issue #2 captured under veth reordering). Here a raw-socket client
//! sends such segments on purpose, so the case is exercised every run:
//!
//! - the first data segment after the hello repeats the hello's last 3 bytes (the
//!   verdict must start from the reader's `copied_seq`, not from that segment);
//! - a later one repeats 500 bytes of the segment before it.
//!
//! The verdict cuts a repeat in the kernel; one it cannot cut (longer than it cuts, or
//! no memory to pull the segment's head) goes to userspace, which drops it. `uncut`
//! makes every repeat such a one, several on one socket.
//!
//! Each test runs in a network namespace of its own (its thread's), where a firewall rule
//! keeps the kernel from resetting the raw client's connection.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    process::Command,
    sync::{mpsc, Arc},
    time::Duration,
};

use tokio::{io::AsyncReadExt as _, net::TcpListener, time::timeout};
use waypoint::dataplane::{ebpf, Dataplane, End, Kind, Limits, Outcome};
use waypoint_common::Stat;

const HELLO: usize = 64;
const SEED: u64 = 0x5e9;
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 40_000);
const BOUND: Duration = Duration::from_secs(10);

/// What the client sends after the hello, as (start, end) offsets in the stream: each
/// later segment may begin below where the one before ended.
const SEGMENTS: [(usize, usize); 3] = [
    (HELLO - 3, HELLO + 1000),
    (HELLO + 500, HELLO + 1500),
    (HELLO + 1500, HELLO + 3000),
];
const TOTAL: usize = HELLO + 3000;

/// As [`SEGMENTS`], with a repeat in every one: as many as a socket has skip records.
const REPEATING: [(usize, usize); waypoint_common::SKIPS] = [
    (HELLO - 3, HELLO + 1000),
    (HELLO + 500, HELLO + 1500),
    (HELLO + 1400, HELLO + 2000),
    (HELLO + 1990, HELLO + 3000),
];

#[test]
fn ebpf() {
    let dp = common::dataplane(Kind::Ebpf);
    run(Kind::Ebpf, dp.clone(), &SEGMENTS);
    // The kernel hands this verdict both repeats (no other test in this binary shares
    // its dataplane): it must have cut them, not relied on something else.
    assert_eq!(
        stat(&dp, Stat::Trimmed),
        2,
        "segments trimmed by the verdict"
    );
    assert_eq!(stat(&dp, Stat::PassedRepeat), 0);
}

#[test]
fn splice() {
    run(Kind::Splice, common::dataplane(Kind::Splice), &SEGMENTS);
}

#[test]
fn copy() {
    run(Kind::Copy, common::dataplane(Kind::Copy), &SEGMENTS);
}

/// An eBPF dataplane whose verdict cuts no repeat: each goes to userspace, as one the
/// kernel has no memory to cut would.
fn uncut_dataplane() -> Arc<Dataplane> {
    common::require_root();
    let dp = ebpf::Ebpf::load(ebpf::Config {
        move_after: 0,
        hooks: ebpf::Hooks {
            trim_limit: Some(0),
            ..ebpf::Hooks::default()
        },
        ..ebpf::Config::default()
    })
    .unwrap();
    assert!(dp.repeat_check(), "tests run on a kernel with BTF");
    Arc::new(Dataplane::Ebpf(Arc::new(dp)))
}

/// Every repeat goes to userspace, as one the kernel has no memory to cut would: each
/// lands in a skip record of its own, and userspace drops it.
#[test]
fn uncut() {
    let dp = uncut_dataplane();
    run(Kind::Ebpf, dp.clone(), &REPEATING);
    assert_eq!(stat(&dp, Stat::Trimmed), 0);
    assert_eq!(stat(&dp, Stat::PassedRepeat), REPEATING.len() as u64);
    assert_eq!(stat(&dp, Stat::TrimFailed), 0);
}

/// The kernel's side of an uncut repeat: TCP counts the repeat as read twice (once when
/// userspace reads it, once in its sequence numbers), so the socket's count of read
/// bytes runs ahead, and bytes that arrive later are held back until more arrive than
/// the repeats were long. A peer that sent a last few bytes and waits for its answer is
/// stuck: the stall watchdog ends the connection with resets rather than leave it hung.
#[test]
fn uncut_then_stranded() {
    let dp = uncut_dataplane();
    let limits = Limits {
        stall_after: Some(Duration::from_millis(500)),
        ..Limits::default()
    };
    in_private_netns(async {
        let (end, ended) = mpsc::channel::<()>();
        let Started {
            mut proxy,
            mut up,
            mut got,
            go,
            client,
        } = start(dp.clone(), limits, &REPEATING, Some(TAIL), ended).await;
        // Every byte of the repeating segments reaches the pod: the dataplane has read
        // them all, and counted the repeats as read, before the tail arrives.
        let mut rest = vec![0u8; TOTAL - HELLO];
        timeout(BOUND, up.read_exact(&mut rest))
            .await
            .unwrap()
            .unwrap();
        got.extend_from_slice(&rest);
        go.send(()).unwrap();
        let out = common::next_outcome(&mut proxy, BOUND).await;
        assert_eq!(out.end, End::Stranded);
        end.send(()).unwrap();
        client.join().unwrap();
        // The tail never reached the pod; what did came once and in order.
        let _ = timeout(BOUND, up.read_to_end(&mut got)).await.unwrap();
        assert_eq!(got.len(), TOTAL, "the tail reached the pod");
        assert_eq!(common::pattern_mismatch(SEED, 0, &got), None);
    });
    assert_eq!(stat(&dp, Stat::PassedRepeat), REPEATING.len() as u64);
}

/// 5 bytes the client sends after [`REPEATING`], once the pod has every byte before them.
const TAIL: (usize, usize) = (TOTAL, TOTAL + 5);

fn run(kind: Kind, dp: Arc<Dataplane>, segments: &'static [(usize, usize)]) {
    in_private_netns(exercise(kind, dp, segments));
}

/// Runs `f` in a network namespace of this thread's own, on a runtime whose threads (and
/// so every socket) live there.
fn in_private_netns<F: std::future::Future>(f: F) -> F::Output {
    common::require_root();
    private_netns();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(f)
}

/// A connection under way: the proxy, the pod's socket with what it read so far, and the
/// raw client's thread.
struct Started {
    proxy: common::Proxy,
    up: tokio::net::TcpStream,
    got: Vec<u8>,
    /// Tells the client to send its tail.
    go: mpsc::Sender<()>,
    client: std::thread::JoinHandle<()>,
}

/// A proxy with `dp` in front of a pod, and a raw client through it that sends the hello
/// and, once the pod has it (the dataplane has the sockets then), `segments`; then its
/// `tail`, if any, once told to; its FIN once `fin` says so.
async fn start(
    dp: Arc<Dataplane>,
    limits: Limits,
    segments: &'static [(usize, usize)],
    tail: Option<(usize, usize)>,
    fin: mpsc::Receiver<()>,
) -> Started {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let proxy = common::proxy(dp, upstream, HELLO, limits).await;
    let std::net::SocketAddr::V4(proxy_addr) = proxy.addr else {
        panic!("the proxy listens on IPv4")
    };
    let (go, wait) = mpsc::channel::<()>();
    let client = std::thread::spawn(move || raw_client(proxy_addr, wait, segments, tail, fin));
    let (mut up, _) = timeout(BOUND, listener.accept()).await.unwrap().unwrap();
    let mut got = vec![0u8; HELLO];
    timeout(BOUND, up.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    go.send(()).unwrap();
    Started {
        proxy,
        up,
        got,
        go,
        client,
    }
}

async fn exercise(kind: Kind, dp: Arc<Dataplane>, segments: &'static [(usize, usize)]) {
    // The client's FIN goes right after its segments.
    let (done, fin) = mpsc::channel();
    drop(done);
    let Started {
        mut proxy,
        mut up,
        mut got,
        client,
        ..
    } = start(dp, Limits::default(), segments, None, fin).await;
    timeout(BOUND, up.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    client.join().unwrap();

    assert_eq!(
        got.len(),
        TOTAL,
        "{kind:?}: every byte once, nothing repeated"
    );
    assert_eq!(
        common::pattern_mismatch(SEED, 0, &got),
        None,
        "{kind:?}: bytes in order"
    );

    drop(up);
    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: TOTAL as u64,
            upstream_to_downstream: 0,
            end: End::Closed,
        },
        "{kind:?}"
    );
}

/// One of the verdict's statistics (0 for the other dataplanes).
fn stat(dp: &Dataplane, which: Stat) -> u64 {
    match dp {
        Dataplane::Ebpf(e) => e
            .stats()
            .into_iter()
            .find(|(s, _)| *s == which)
            .map(|(_, n)| n)
            .unwrap(),
        _ => 0,
    }
}

/// Moves this thread into a new network namespace with loopback up, where the kernel
/// does not answer the raw client's peer with resets.
fn private_netns() {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    // Children inherit the namespace of the thread that spawns them.
    sh(&["ip", "link", "set", "lo", "up"]);
    sh(&["nft", "add table ip repeat"]);
    sh(&[
        "nft",
        "add chain ip repeat out { type filter hook output priority 0; }",
    ]);
    sh(&[
        "nft",
        &format!(
            "add rule ip repeat out ip saddr {} tcp sport {} tcp flags & rst == rst drop",
            CLIENT.ip(),
            CLIENT.port()
        ),
    ]);
}

fn sh(args: &[&str]) {
    let st = Command::new(args[0]).args(&args[1..]).status().unwrap();
    assert!(st.success(), "{args:?}: {st}");
}

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

/// A TCP client on a raw socket: handshake, the hello, then (at `go`) `segments`, then
/// (at `go` again) `tail` if any, and its FIN once `fin` says so (or is dropped). It never
/// acknowledges the server's data (the server sends none) or its FIN.
fn raw_client(
    server: SocketAddrV4,
    go: mpsc::Receiver<()>,
    segments: &[(usize, usize)],
    tail: Option<(usize, usize)>,
    fin: mpsc::Receiver<()>,
) {
    let raw = RawTcp::new();
    let isn: u32 = 0x1000_0000;
    raw.send(server, isn, 0, SYN, &[]);
    let server_isn = raw.recv_syn_ack(server);
    let ack = server_isn.wrapping_add(1);
    let base = isn.wrapping_add(1);
    let total = segments
        .iter()
        .chain(&tail)
        .map(|&(_, end)| end)
        .max()
        .unwrap_or(HELLO);
    let data = {
        let mut d = vec![0u8; total];
        common::pattern_fill(SEED, 0, &mut d);
        d
    };
    raw.send(server, base, ack, ACK, &[]);
    raw.send(server, base, ack, ACK | PSH, &data[..HELLO]);
    go.recv_timeout(BOUND)
        .expect("the proxy forwards the hello");
    let send = |(start, end): (usize, usize)| {
        raw.send(
            server,
            base.wrapping_add(start as u32),
            ack,
            ACK | PSH,
            &data[start..end],
        );
        // The next segment goes only once this one is acknowledged (queued, and
        // verdicted): the repeat is then of bytes already received, not a race.
        raw.recv_ack(server, base.wrapping_add(end as u32));
    };
    for &segment in segments {
        send(segment);
    }
    if let Some(tail) = tail {
        go.recv_timeout(BOUND).expect("told to send the tail");
        send(tail);
    }
    let _ = fin.recv_timeout(BOUND);
    raw.send(server, base.wrapping_add(total as u32), ack, ACK | FIN, &[]);
}

struct RawTcp {
    fd: OwnedFd,
}

impl RawTcp {
    fn new() -> RawTcp {
        // SAFETY: plain socket(2) call; the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP) };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        // SAFETY: fd is a new, valid descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let sa = sockaddr(SocketAddrV4::new(*CLIENT.ip(), 0));
        // SAFETY: sa is a valid sockaddr_in of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const sa).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        // SAFETY: tv is a valid timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const tv).cast(),
                size_of::<libc::timeval>() as u32,
            )
        };
        assert_eq!(rc, 0);
        RawTcp { fd }
    }

    fn send(&self, to: SocketAddrV4, seq: u32, ack: u32, flags: u8, payload: &[u8]) {
        let seg = segment(CLIENT, to, seq, ack, flags, payload);
        let sa = sockaddr(SocketAddrV4::new(*to.ip(), 0));
        // SAFETY: seg and sa are valid for the sizes given.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                seg.as_ptr().cast(),
                seg.len(),
                0,
                (&raw const sa).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            )
        };
        assert_eq!(
            n,
            seg.len() as isize,
            "sendto: {}",
            std::io::Error::last_os_error()
        );
    }

    /// The server's initial sequence number, from its SYN-ACK.
    fn recv_syn_ack(&self, from: SocketAddrV4) -> u32 {
        self.recv_until(from, "a SYN-ACK", |flags, seq, _| {
            (flags & (SYN | ACK) == SYN | ACK).then_some(seq)
        })
    }

    /// Waits for an acknowledgement of every byte before `seq`.
    fn recv_ack(&self, from: SocketAddrV4, seq: u32) {
        self.recv_until(from, "an ACK", |flags, _, ack| {
            // Signed distance: sequence numbers wrap.
            (flags & ACK != 0 && ack.wrapping_sub(seq) as i32 >= 0).then_some(())
        })
    }

    /// Reads segments from `from` to the client until `want(flags, seq, ack)` says yes.
    fn recv_until<T>(
        &self,
        from: SocketAddrV4,
        what: &str,
        want: impl Fn(u8, u32, u32) -> Option<T>,
    ) -> T {
        let deadline = std::time::Instant::now() + BOUND;
        let mut buf = [0u8; 2048];
        while std::time::Instant::now() < deadline {
            // SAFETY: buf is valid for writes of its length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n <= 0 {
                continue; // the receive timeout: look at the deadline again
            }
            let p = &buf[..n as usize];
            let ihl = usize::from(p[0] & 0x0f) * 4;
            let t = &p[ihl..];
            let sport = u16::from_be_bytes([t[0], t[1]]);
            let dport = u16::from_be_bytes([t[2], t[3]]);
            if sport != from.port() || dport != CLIENT.port() {
                continue;
            }
            let seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]);
            let ack = u32::from_be_bytes([t[8], t[9], t[10], t[11]]);
            if let Some(v) = want(t[13], seq, ack) {
                return v;
            }
        }
        panic!("no {what} from {from} within {BOUND:?}");
    }
}

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// A TCP segment (header without options, then `payload`) with its checksum.
fn segment(
    from: SocketAddrV4,
    to: SocketAddrV4,
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut s = Vec::with_capacity(20 + payload.len());
    s.extend_from_slice(&from.port().to_be_bytes());
    s.extend_from_slice(&to.port().to_be_bytes());
    s.extend_from_slice(&seq.to_be_bytes());
    s.extend_from_slice(&ack.to_be_bytes());
    s.push(5 << 4); // data offset: 5 words
    s.push(flags);
    s.extend_from_slice(&u16::MAX.to_be_bytes()); // window
    s.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    s.extend_from_slice(payload);

    let mut pseudo = Vec::with_capacity(12 + s.len());
    pseudo.extend_from_slice(&from.ip().octets());
    pseudo.extend_from_slice(&to.ip().octets());
    pseudo.extend_from_slice(&[0, libc::IPPROTO_TCP as u8]);
    pseudo.extend_from_slice(&(s.len() as u16).to_be_bytes());
    pseudo.extend_from_slice(&s);
    let sum = checksum(&pseudo);
    s[16..18].copy_from_slice(&sum.to_be_bytes());
    s
}

/// The Internet checksum (RFC 1071).
fn checksum(b: &[u8]) -> u16 {
    let mut sum: u32 = b
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}
