//! The stall watchdog (`--stall-after`, `dataplane/stall.rs`): a connection with bytes
//! held inside the waypoint and none moving is counted once in
//! `waypoint_dataplane_stalls_total{dataplane}` and logged once; backpressure from a
//! reader that stopped is not a stall.
//!
//! Each test's dataplane counts its own stalls; the log they read is the process's, so
//! the tests run one at a time (a lock serialises them) and compare its lines before and
//! after. Needs root (eBPF).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use std::{
    io::Write as _,
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use waypoint::dataplane::{ebpf, Dataplane, End, Kind, Limits};
use waypoint_common::Stat;

const HELLO: usize = 517;
/// The stall window of these tests: checks every 500 ms.
const WINDOW: Duration = Duration::from_secs(1);
/// What the watchdog logs, once per stalled connection.
const STALL_LOG: &str = "connection stalled";

static SERIAL: Mutex<()> = Mutex::new(());

fn limits() -> Limits {
    Limits {
        stall_after: Some(WINDOW),
        ..Limits::default()
    }
}

/// Runs `test` alone, on a runtime of its own, with the warnings captured.
fn serial<F: std::future::Future<Output = ()>>(test: impl FnOnce() -> F) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    capture_warnings();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(test());
}

/// Every warning logged by the process so far.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().write_all(buf)?;
        LOG.lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_warnings() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .init();
    });
}

/// The stall lines logged so far.
fn stall_lines() -> Vec<String> {
    let log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&log)
        .lines()
        .filter(|l| l.contains(STALL_LOG))
        .map(str::to_owned)
        .collect()
}

/// Bytes queued on `sock` for reading (SIOCINQ).
fn queued(sock: &impl std::os::fd::AsRawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD (= SIOCINQ) writes one int through the pointer.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(rc, 0, "SIOCINQ: {}", std::io::Error::last_os_error());
    usize::try_from(n).unwrap()
}

/// A real stall on the eBPF dataplane: bytes that land in the downstream between the
/// drain and the SockHash insertion, with the kick after the insertion left out
/// (test-only switches), are never read by the verdict, and the client waits for an
/// answer. Counted once, within two windows, and logged once with the bytes held; a
/// few windows later still once.
#[test]
fn stranded_bytes_are_counted_once_ebpf() {
    serial(stranded_bytes);
}

async fn stranded_bytes() {
    const FIRST: usize = 1_000;
    /// Well within the downstream's receive window: the client's write returns.
    const REQUEST: usize = 20_000;
    const PAUSE: Duration = Duration::from_secs(1);
    common::require_root();
    let e = ebpf::Ebpf::load(ebpf::Config {
        move_after: 0,
        hooks: ebpf::Hooks {
            sockhash_entry_pause: Some(PAUSE),
            sockhash_entry_no_kick: true,
            ..ebpf::Hooks::default()
        },
        ..ebpf::Config::default()
    })
    .unwrap();
    let dp = Arc::new(Dataplane::Ebpf(Arc::new(e)));
    let lines_before = stall_lines().len();
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = front.local_addr().unwrap();
    let (go, started) = std::sync::mpsc::channel::<()>();
    let (end, ended) = std::sync::mpsc::channel::<()>();
    // On its own thread: the pause blocks the worker that runs the entry.
    let client = tokio::task::spawn_blocking(move || {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(&[7u8; HELLO]).unwrap();
        c.write_all(&[1u8; FIRST]).unwrap();
        // The drain is done, the insertion PAUSE away.
        started.recv().unwrap();
        c.write_all(&[2u8; REQUEST]).unwrap();
        // Waits for an answer that cannot come, until the test is done.
        ended.recv().unwrap();
    });
    let (mut downstream, _) = front.accept().await.unwrap();
    let mut hello = [0u8; HELLO];
    downstream.read_exact(&mut hello).await.unwrap();
    let waited = Instant::now();
    while queued(&downstream) < FIRST {
        assert!(waited.elapsed() < PAUSE * 10, "the first bytes arrive");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // A second descriptor of the waypoint's socket, to see the drain empty its queue.
    let probe = std::os::fd::AsFd::as_fd(&downstream)
        .try_clone_to_owned()
        .unwrap();
    let upstream = TcpStream::connect(back.local_addr().unwrap())
        .await
        .unwrap();
    let (mut server, _) = back.accept().await.unwrap();
    let forward =
        tokio::spawn(dp.forward(downstream.into(), upstream.into(), hello.to_vec(), limits()));
    while queued(&probe) != 0 {
        assert!(
            waited.elapsed() < PAUSE * 10,
            "the dataplane drains the queue"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    go.send(()).unwrap();
    // The hello and the drained bytes arrive; the request stays stranded.
    let mut got = vec![0u8; HELLO + FIRST];
    server.read_exact(&mut got).await.unwrap();
    let mut more = [0u8; 1];
    let stranded = tokio::time::timeout(PAUSE * 2, server.read(&mut more)).await;
    assert!(
        stranded.is_err(),
        "the request was forwarded: no stall to see"
    );

    let counted = Instant::now();
    while dp.stalls() == 0 {
        assert!(
            counted.elapsed() < WINDOW * 4,
            "the stall was not counted within {:?}",
            WINDOW * 4
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Three more windows: still counted once, logged once.
    tokio::time::sleep(WINDOW * 3).await;
    assert_eq!(dp.stalls(), 1, "counted once");
    let lines = stall_lines();
    assert_eq!(lines.len(), lines_before + 1, "logged once: {lines:#?}");
    let line = &lines[lines_before];
    for want in [
        &format!("d2u_held={REQUEST}") as &str,
        "u2d_held=0",
        "ebpf",
        "outq=0",
        "redirected=",
    ] {
        assert!(line.contains(want), "{want:?} missing from the log: {line}");
    }
    drop(probe);
    end.send(()).unwrap();
    client.await.unwrap();
    forward.abort();
}

/// A reader that stops while the eBPF dataplane's in-flight budget is tripped (a small
/// budget, passed bytes waiting in userspace for room at the pod): the held bytes wait
/// in the upstream's send queue, so it is backpressure, not a stall, however long it
/// lasts. Once the reader goes on, every byte arrives.
#[test]
fn backpressure_is_not_a_stall_ebpf() {
    serial(|| async {
        common::require_root();
        let e = Arc::new(
            ebpf::Ebpf::load(ebpf::Config {
                move_after: 0,
                max_inflight: 256 * 1024,
                ..ebpf::Config::default()
            })
            .unwrap(),
        );
        let budget = |e: &ebpf::Ebpf| {
            e.stats()
                .into_iter()
                .find(|(s, _)| *s == Stat::PassedBudget)
                .map_or(0, |(_, n)| n)
        };
        let tripped = budget(&e);
        backpressure(Arc::new(Dataplane::Ebpf(e.clone()))).await;
        assert!(budget(&e) > tripped, "the in-flight budget never tripped");
    });
}

/// As [`backpressure_is_not_a_stall_ebpf`], through the splice dataplane.
#[test]
fn backpressure_is_not_a_stall_splice() {
    serial(|| backpressure(common::dataplane(Kind::Splice)));
}

/// As [`backpressure_is_not_a_stall_ebpf`], through the copy dataplane.
#[test]
fn backpressure_is_not_a_stall_copy() {
    serial(|| backpressure(common::dataplane(Kind::Copy)));
}

/// The client streams; the server reads a little, stops for four windows, then reads
/// the rest. Nothing is counted or logged as a stall, and every byte arrives.
async fn backpressure(dp: Arc<Dataplane>) {
    /// More than every buffer on the way holds, the destination's forced send buffer
    /// included (`--bulk-send-buffer`, doubled by the kernel).
    const TOTAL: u64 = 128 << 20;
    const READ_FIRST: usize = 4 << 20;
    const SEED: u64 = 33;
    let lines_before = stall_lines().len();
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(dp.clone(), server.local_addr().unwrap(), HELLO, limits()).await;
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client.write_all(&[7u8; HELLO]).await.unwrap();
    let (mut pod, _) = server.accept().await.unwrap();
    // The hello through first: the connection is in place (on eBPF, in the SockHash with
    // its credit published) before the stream starts, so the budget is what stops it.
    let mut hello = [0u8; HELLO];
    pod.read_exact(&mut hello).await.unwrap();
    let (mut client_r, mut client_w) = client.into_split();
    let writer = tokio::spawn(async move {
        let mut buf = vec![0u8; 256 * 1024];
        let mut at = 0;
        while at < TOTAL {
            let n = buf.len().min(usize::try_from(TOTAL - at).unwrap());
            common::pattern_fill(SEED, at, &mut buf[..n]);
            client_w.write_all(&buf[..n]).await.unwrap();
            at += n as u64;
        }
        client_w.shutdown().await.unwrap();
    });
    let mut got = vec![0u8; READ_FIRST];
    pod.read_exact(&mut got).await.unwrap();
    // The reader stops; everything between it and the client fills up and goes still.
    tokio::time::sleep(WINDOW * 4).await;
    assert!(!writer.is_finished(), "the client was never held back");
    assert_eq!(dp.stalls(), 0, "backpressure counted as a stall");
    assert_eq!(
        stall_lines().len(),
        lines_before,
        "backpressure logged as a stall"
    );
    let mut rest = Vec::new();
    pod.read_to_end(&mut rest).await.unwrap();
    got.extend_from_slice(&rest);
    assert_eq!(got.len() as u64, TOTAL, "every byte arrives");
    assert_eq!(common::pattern_mismatch(SEED, 0, &got), None, "in order");
    writer.await.unwrap();
    pod.shutdown().await.unwrap();
    let mut none = Vec::new();
    client_r.read_to_end(&mut none).await.unwrap();
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(10)).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(dp.stalls(), 0, "counted as a stall at the end");
}
