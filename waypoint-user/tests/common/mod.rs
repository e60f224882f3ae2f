//! Test harness: a router stand-in that accepts on one port, dials an upstream and hands
//! both sockets to a dataplane, so tests can drive real TCP through each dataplane.
#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]

pub mod daemon;
pub mod hello;

use std::{net::SocketAddr, sync::Arc, sync::OnceLock};

use tokio::sync::{mpsc, Semaphore};
use waypoint::dataplane::{
    copy::UserspaceCopy, ebpf, splice::Splice, Dataplane, Kind, Limits, Outcome,
};

/// The eBPF dataplane is loaded once per test binary: loading is ~60 ms and every test
/// may share the maps (each connection has its own entries).
pub fn ebpf() -> Arc<Dataplane> {
    static DP: OnceLock<Arc<Dataplane>> = OnceLock::new();
    DP.get_or_init(|| {
        require_root();
        // Every connection enters the SockHash at once, so that these tests exercise the
        // kernel path from the first byte; `tests/dataplane_handover.rs` covers the move
        // from the copy into the kernel (`move_after`).
        let dp = ebpf::Ebpf::load(ebpf::Config {
            move_after: 0,
            ..ebpf::Config::default()
        })
        .expect("eBPF dataplane must load: tests run as root on a sockmap kernel");
        assert!(
            dp.repeat_check(),
            "the verdict's repeat check must be on: tests run on a kernel with BTF"
        );
        Arc::new(Dataplane::Ebpf(Arc::new(dp)))
    })
    .clone()
}

/// What the daemon's `--dataplane auto` runs on this kernel, with the daemon's defaults,
/// loaded once per test binary: the eBPF dataplane with the rewrite splice where the
/// kernel carries it (connections it refuses take the SockHash redirect), else splice.
pub fn auto() -> Arc<Dataplane> {
    static DP: OnceLock<Arc<Dataplane>> = OnceLock::new();
    DP.get_or_init(|| {
        require_root();
        let config = ebpf::Config {
            rewrite_splice: true,
            ..ebpf::Config::default()
        };
        let (dp, chosen) = waypoint::dataplane::choice::choose(Kind::Auto, config, 1 << 20)
            .expect("auto always finds a dataplane");
        eprintln!("auto: {chosen}");
        Arc::new(dp)
    })
    .clone()
}

/// Whether `dp` rewrites the connections that qualify (the rewrite splice is loaded).
pub fn rewrites(dp: &Dataplane) -> bool {
    matches!(dp, Dataplane::Ebpf(e) if e.config().rewrite_splice)
}

pub fn dataplane(kind: Kind) -> Arc<Dataplane> {
    match kind {
        Kind::Ebpf => ebpf(),
        Kind::Splice => Arc::new(Dataplane::Splice(Splice::default())),
        Kind::Copy => Arc::new(Dataplane::Copy(UserspaceCopy::new())),
        Kind::Auto => auto(),
    }
}

pub const ALL: [Kind; 3] = [Kind::Ebpf, Kind::Splice, Kind::Copy];

/// A forwarding proxy: accepts on `addr`, reads `initial_len` bytes from the downstream
/// (standing in for the ClientHello), dials `upstream`, and forwards with `dp`. Every
/// connection's outcome is sent on the returned channel.
pub struct Proxy {
    pub addr: SocketAddr,
    pub outcomes: mpsc::UnboundedReceiver<Outcome>,
}

pub async fn proxy(
    dp: Arc<Dataplane>,
    upstream: SocketAddr,
    initial_len: usize,
    limits: Limits,
) -> Proxy {
    proxy_with_gate(dp, upstream, initial_len, limits, None).await
}

/// Like [`proxy`], without showing the dataplane its sockets before their handshakes
/// ([`Dataplane::mark_listener`], [`Dataplane::mark_dial`]): the rewrite hand-over then reads them in repair mode.
pub async fn proxy_unmarked(
    dp: Arc<Dataplane>,
    upstream: SocketAddr,
    initial_len: usize,
    limits: Limits,
) -> Proxy {
    let bind = "127.0.0.1:0".parse().unwrap();
    proxy_on(bind, dp, upstream, initial_len, limits, None, false).await
}

/// Like [`proxy`], listening on `bind` instead of loopback.
pub async fn proxy_at(
    bind: SocketAddr,
    dp: Arc<Dataplane>,
    upstream: SocketAddr,
    initial_len: usize,
    limits: Limits,
) -> Proxy {
    proxy_on(bind, dp, upstream, initial_len, limits, None, true).await
}

/// Like [`proxy`], but each connection waits for a permit of the returned semaphore
/// (which starts with none) after reading the initial bytes and dialing the upstream,
/// just before handing both sockets to the dataplane. Tests use it to have something
/// (e.g. a FIN) already queued on a socket when the dataplane takes over.
pub async fn proxy_gated(
    dp: Arc<Dataplane>,
    upstream: SocketAddr,
    initial_len: usize,
    limits: Limits,
) -> (Proxy, Arc<Semaphore>) {
    let gate = Arc::new(Semaphore::new(0));
    let p = proxy_with_gate(dp, upstream, initial_len, limits, Some(gate.clone())).await;
    (p, gate)
}

async fn proxy_with_gate(
    dp: Arc<Dataplane>,
    upstream: SocketAddr,
    initial_len: usize,
    limits: Limits,
    gate: Option<Arc<Semaphore>>,
) -> Proxy {
    let bind = "127.0.0.1:0".parse().unwrap();
    proxy_on(bind, dp, upstream, initial_len, limits, gate, true).await
}

/// A TCP socket of `addr`'s family.
fn tcp_socket(addr: SocketAddr) -> tokio::net::TcpSocket {
    if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .unwrap()
}

async fn proxy_on(
    bind: SocketAddr,
    dp: Arc<Dataplane>,
    upstream: SocketAddr,
    initial_len: usize,
    limits: Limits,
    gate: Option<Arc<Semaphore>>,
    mark: bool,
) -> Proxy {
    // A deep accept queue: with tokio's default (1024) a burst of 1,000 connections
    // overflowed it, the kernel fell back to SYN cookies and reset some connections.
    let listener = {
        let sock = tcp_socket(bind);
        sock.bind(bind).unwrap();
        // As the router does: the rewrite splice then finds the accepted sockets'
        // handshake records.
        if mark {
            dp.mark_listener(std::os::fd::AsFd::as_fd(&sock));
        }
        sock.listen(4096).unwrap()
    };
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            // An accept error would silently stop the proxy and reset every connection
            // still queued: say so instead.
            let (mut down, _) = listener
                .accept()
                .await
                .unwrap_or_else(|e| panic!("proxy accept failed: {e}"));
            let dp = dp.clone();
            let tx = tx.clone();
            let gate = gate.clone();
            tokio::spawn(async move {
                let mut initial = vec![0u8; initial_len];
                if initial_len > 0 {
                    use tokio::io::AsyncReadExt as _;
                    down.read_exact(&mut initial).await.unwrap();
                }
                let up = {
                    let sock = tcp_socket(upstream);
                    if mark {
                        dp.mark_dial(std::os::fd::AsFd::as_fd(&sock), upstream.port());
                    }
                    sock.connect(upstream).await.unwrap()
                };
                up.set_nodelay(true).unwrap();
                down.set_nodelay(true).unwrap();
                if let Some(gate) = gate {
                    gate.acquire().await.unwrap().forget();
                }
                let out = dp
                    .forward(down.into(), up.into(), initial.to_vec(), limits)
                    .await
                    .unwrap_or_else(|e| panic!("{:?} forward failed: {e:?}", dp.kind()));
                let _ = tx.send(out);
            });
        }
    });
    Proxy { addr, outcomes: rx }
}

/// Deterministic test data: byte `pos` of stream `seed`, computable at any offset so
/// that a reader can check arbitrary chunks without buffering the whole stream.
pub fn pattern_fill(seed: u64, offset: u64, buf: &mut [u8]) {
    let mut k = 0;
    while k < buf.len() {
        let pos = offset + k as u64;
        let word = splitmix64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (pos / 8)).to_le_bytes();
        let start = (pos % 8) as usize;
        let n = (8 - start).min(buf.len() - k);
        buf[k..k + n].copy_from_slice(&word[start..start + n]);
        k += n;
    }
}

/// Checks `buf` against stream `seed` at `offset`: None if it matches, else the stream
/// offset of the first wrong byte.
pub fn pattern_mismatch(seed: u64, offset: u64, buf: &[u8]) -> Option<u64> {
    let mut want = vec![0u8; buf.len()];
    pattern_fill(seed, offset, &mut want);
    buf.iter()
        .zip(&want)
        .position(|(a, b)| a != b)
        .map(|i| offset + i as u64)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Waits for the next outcome, failing (instead of hanging) if none comes within `within`.
pub async fn next_outcome(proxy: &mut Proxy, within: std::time::Duration) -> Outcome {
    tokio::time::timeout(within, proxy.outcomes.recv())
        .await
        .unwrap_or_else(|_| panic!("no outcome from the proxy within {within:?}"))
        .expect("the proxy's outcome channel closed (a forwarding task panicked?)")
}

/// Tests of the eBPF dataplane need root (CAP_BPF + CAP_NET_ADMIN); CI runs them as root.
/// They must never be skipped: fail loudly instead.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests need root (eBPF); they are not skipped when run unprivileged"
    );
}

/// `TCP_FIN_WAIT2` from include/net/tcp_states.h: our FIN was sent and acknowledged.
pub const TCP_FIN_WAIT2: u8 = 5;

/// The TCP state of `sock` (TCP_INFO's tcpi_state).
pub fn tcp_state(sock: &impl std::os::fd::AsRawFd) -> u8 {
    tcp_info(sock).tcpi_state
}

/// `sock`'s TCP_INFO.
pub fn tcp_info(sock: &impl std::os::fd::AsRawFd) -> libc::tcp_info {
    // SAFETY: tcp_info is plain old data; zeroed is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the fd is an open socket; info and len are valid for writes of their sizes.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
    info
}

/// Polls until `sock` is in TCP state `state`, failing after `within`.
pub async fn wait_tcp_state(
    sock: &impl std::os::fd::AsRawFd,
    state: u8,
    within: std::time::Duration,
) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let now = tcp_state(sock);
        if now == state {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "socket still in TCP state {now}, not {state}, after {within:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Writes `total` pseudo-random bytes generated from `seed` and returns their SHA-256.
pub async fn send_random(
    mut w: impl tokio::io::AsyncWrite + Unpin,
    total: u64,
    seed: u64,
) -> [u8; 32] {
    use rand::{RngCore as _, SeedableRng as _};
    use sha2::Digest as _;
    use tokio::io::AsyncWriteExt as _;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut left = total;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill_bytes(&mut buf[..n]);
        h.update(&buf[..n]);
        w.write_all(&buf[..n]).await.unwrap();
        left -= n as u64;
    }
    w.shutdown().await.unwrap();
    h.finalize().into()
}

/// Reads to EOF and returns (bytes, SHA-256).
pub async fn recv_all(mut r: impl tokio::io::AsyncRead + Unpin) -> (u64, [u8; 32]) {
    use sha2::Digest as _;
    use tokio::io::AsyncReadExt as _;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf).await.unwrap();
        if n == 0 {
            return (total, h.finalize().into());
        }
        total += n as u64;
        h.update(&buf[..n]);
    }
}

/// Runs `f` on a thread inside the named network namespace (`/run/netns/<ns>`): sockets
/// it creates stay there.
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(path).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
    .join()
    .unwrap()
}
