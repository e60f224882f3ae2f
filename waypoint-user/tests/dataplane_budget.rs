//! The eBPF dataplane's budget path under stress: a tiny in-flight limit makes the verdict
//! pass segments to userspace over and over (both directions at once, readers that
//! pause), and every byte is checked at its offset. On a mismatch the test says what
//! happened to the stream (which offset the wrong bytes belong to: lost, duplicated or
//! reordered), not just that the hashes differ.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use std::{sync::Arc, time::Duration};

use rand::{Rng as _, SeedableRng as _};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use waypoint::dataplane::{ebpf, Dataplane, Limits};

const HELLO: usize = 517;

fn rounds() -> usize {
    std::env::var("WAYPOINT_STRESS_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6)
}

fn bytes_per_round() -> u64 {
    std::env::var("WAYPOINT_STRESS_MIB")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(32)
        << 20
}

async fn send(mut w: impl tokio::io::AsyncWrite + Unpin, seed: u64, total: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xfeed);
    let mut buf = vec![0u8; 256 * 1024];
    let mut off = 0u64;
    while off < total {
        let n = (rng.random_range(1..=buf.len()) as u64).min(total - off) as usize;
        common::pattern_fill(seed, off, &mut buf[..n]);
        w.write_all(&buf[..n]).await.unwrap();
        off += n as u64;
    }
    w.shutdown().await.unwrap();
}

/// Where the `probe` bytes (found at stream offset `at` instead of the expected ones)
/// really come from, searched within 8 MiB on both sides.
fn locate(seed: u64, at: u64, probe: &[u8]) -> Option<i64> {
    let lo = at.saturating_sub(8 << 20);
    let hi = at + (8 << 20);
    let mut want = vec![0u8; (hi - lo) as usize + probe.len()];
    common::pattern_fill(seed, lo, &mut want);
    want.windows(probe.len())
        .position(|w| w == probe)
        .map(|p| (lo + p as u64) as i64 - at as i64)
}

/// Says where the first wrong byte is and where the bytes found there belong.
fn describe(what: &str, seed: u64, bad: u64, (off, n): (u64, usize), wrong: &[u8]) -> String {
    let probe = &wrong[..wrong.len().min(64)];
    let from = (probe.len() >= 16)
        .then(|| locate(seed, bad, probe))
        .flatten();
    format!(
        "{what} {seed}: first wrong byte at offset {bad} (read chunk {off}+{n}); \
         the bytes there belong at offset {from:?} relative to it"
    )
}

/// Reads to EOF, checking every byte; pauses now and then so the budget trips.
async fn check(
    mut r: impl tokio::io::AsyncRead + Unpin,
    seed: u64,
    total: u64,
) -> Result<(), String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xbeef);
    let mut buf = vec![0u8; 256 * 1024];
    let mut got: Vec<u8> = Vec::new();
    let mut off = 0u64;
    loop {
        let want = rng.random_range(1..=buf.len());
        let n = r.read(&mut buf[..want]).await.unwrap();
        if n == 0 {
            break;
        }
        if let Some(bad) = common::pattern_mismatch(seed, off, &buf[..n]) {
            // Collect a little more to describe it.
            got.extend_from_slice(&buf[(bad - off) as usize..n]);
            while got.len() < 64 {
                let m = r.read(&mut buf).await.unwrap();
                if m == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..m]);
            }
            return Err(describe("stream", seed, bad, (off, n), &got));
        }
        off += n as u64;
        if rng.random_ratio(1, 200) {
            tokio::time::sleep(Duration::from_millis(rng.random_range(1..5))).await;
        }
    }
    if off != total {
        return Err(format!("stream {seed}: {off} of {total} bytes arrived"));
    }
    Ok(())
}

/// A network namespace joined to this one by a veth pair: the proxy's sockets then
/// receive through veth's NAPI (GRO, softirq on any CPU) as on a node, not through
/// loopback's in-sender delivery. Removed on drop.
struct Veth {
    ns: String,
}

const HOST_IP: &str = "10.231.0.1";
const NS_IP: &str = "10.231.0.2";

impl Veth {
    fn new() -> Veth {
        let ns = format!("wpbudget{}", std::process::id());
        let ip = |args: &[&str]| {
            let st = std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap();
            assert!(st.success(), "ip {args:?}");
        };
        let host_if = format!("wpb{}", std::process::id() % 100_000);
        ip(&["netns", "add", &ns]);
        let v = Veth { ns: ns.clone() };
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["addr", "add", &format!("{HOST_IP}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{NS_IP}/30"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        v
    }

    /// Runs `f` on a thread inside the namespace: sockets it creates stay there.
    fn within<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        common::in_netns(&self.ns, f)
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it ours.
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
    }
}

fn budget_dataplane(max_inflight: u64) -> Arc<Dataplane> {
    Arc::new(Dataplane::Ebpf(Arc::new(
        ebpf::Ebpf::load(ebpf::Config {
            max_inflight,
            move_after: 0,
            ..ebpf::Config::default()
        })
        .unwrap(),
    )))
}

/// Over loopback, with a 64 KiB in-flight limit: nearly every segment takes the
/// userspace path.
/// Checks what arrives and writes it back, as a TLS echo server does.
async fn echo_back(
    mut r: impl tokio::io::AsyncRead + Unpin,
    mut w: impl tokio::io::AsyncWrite + Unpin,
    seed: u64,
    total: u64,
) -> Result<(), String> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xec40);
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64;
    loop {
        let want = rng.random_range(1..=buf.len());
        let n = r.read(&mut buf[..want]).await.unwrap();
        if n == 0 {
            break;
        }
        if let Some(bad) = common::pattern_mismatch(seed, off, &buf[..n]) {
            let wrong = &buf[(bad - off) as usize..n];
            return Err(describe("echo of stream", seed, bad, (off, n), wrong));
        }
        off += n as u64;
        w.write_all(&buf[..n]).await.unwrap();
    }
    w.shutdown().await.unwrap();
    if off != total {
        return Err(format!(
            "echo of stream {seed}: {off} of {total} bytes arrived"
        ));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_budget_keeps_every_byte_in_order() {
    common::require_root();
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    stress(
        budget_dataplane(64 * 1024),
        server,
        "127.0.0.1:0".parse().unwrap(),
        None,
    )
    .await;
}

/// Client and server in another namespace, across veth, with the default in-flight
/// limit: mostly redirected, with budget trips and resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_trips_across_veth_keep_every_byte_in_order() {
    common::require_root();
    let veth = Arc::new(Veth::new());
    let server = veth.within(|| {
        let l = std::net::TcpListener::bind((NS_IP, 0)).unwrap();
        l.set_nonblocking(true).unwrap();
        l
    });
    let server = TcpListener::from_std(server).unwrap();
    let inflight = std::env::var("WAYPOINT_STRESS_INFLIGHT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4 << 20);
    stress(
        budget_dataplane(inflight),
        server,
        format!("{HOST_IP}:0").parse().unwrap(),
        Some(veth),
    )
    .await;
}

async fn stress(
    dp: Arc<Dataplane>,
    server: TcpListener,
    bind: std::net::SocketAddr,
    veth: Option<Arc<Veth>>,
) {
    let total = bytes_per_round();
    let echo = std::env::var_os("WAYPOINT_STRESS_ECHO").is_some();
    let mut proxy = common::proxy_at(
        bind,
        dp.clone(),
        server.local_addr().unwrap(),
        HELLO,
        Limits::default(),
    )
    .await;
    let mut failures = Vec::new();
    for round in 0..rounds() as u64 {
        let (a, b) = (2 * round + 1, 2 * round + 2);
        let addr = proxy.addr;
        let veth = veth.clone();
        let client = tokio::spawn(async move {
            let mut c = match veth {
                Some(v) => {
                    let s = v.within(move || std::net::TcpStream::connect(addr).unwrap());
                    s.set_nonblocking(true).unwrap();
                    TcpStream::from_std(s).unwrap()
                }
                None => TcpStream::connect(addr).await.unwrap(),
            };
            c.write_all(&[7u8; HELLO]).await.unwrap();
            let (r, w) = c.into_split();
            let expect = if echo { a } else { b };
            let (_, res) = tokio::join!(send(w, a, total), check(r, expect, total));
            res
        });
        let (s, _) = server.accept().await.unwrap();
        let (mut r, w) = s.into_split();
        let mut hello = vec![0u8; HELLO];
        r.read_exact(&mut hello).await.unwrap();
        let up = if echo {
            echo_back(r, w, a, total).await
        } else {
            tokio::join!(send(w, b, total), check(r, a, total)).1
        };
        let down = client.await.unwrap();
        let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
        for res in [up, down] {
            if let Err(e) = res {
                eprintln!("round {round}: {e}; outcome {outcome:?}");
                failures.push(e);
            }
        }
    }
    if let Dataplane::Ebpf(e) = &*dp {
        eprintln!("stats: {:?}", e.stats());
    }
    assert!(
        failures.is_empty(),
        "{} corrupted streams: {failures:#?}",
        failures.len()
    );
}
