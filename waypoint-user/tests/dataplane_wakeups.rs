//! A redirected connection does not wake the daemon's thread for bytes the kernel forwards.
//!
//! The kernel wakes a redirected socket's readers after every segment, also one the verdict
//! redirected away; a connection left in tokio's reactor woke its worker thread about
//! once per request and once per response. Here the proxy runs on a thread of its own
//! (a single-threaded runtime, as a tunnel worker), and the test counts that thread's
//! voluntary context switches over a request/response exchange.
//! Needs root (CI is root); never skipped.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use waypoint::dataplane::{Dataplane, Limits};
use waypoint_common::Stat;

const HELLO: usize = 517;
const ROUNDS: u64 = 2_000;
const MESSAGE: usize = 64;

/// Voluntary context switches of thread `tid` of this process so far.
fn wakeups(tid: libc::pid_t) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .expect("the kernel reports context switches")
        .trim()
        .parse()
        .unwrap()
}

fn redirected(dp: &Dataplane) -> u64 {
    let Dataplane::Ebpf(e) = dp else {
        unreachable!("an eBPF dataplane")
    };
    e.stats()
        .into_iter()
        .find(|(s, _)| *s == Stat::Redirected)
        .map_or(0, |(_, n)| n)
}

/// One 64-byte message to the echo pod and back.
async fn round(client: &mut TcpStream, i: u64) {
    let msg = [(i % 251) as u8; MESSAGE];
    client.write_all(&msg).await.unwrap();
    let mut got = [0u8; MESSAGE];
    client.read_exact(&mut got).await.unwrap();
    assert_eq!(got, msg, "round {i} came back intact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_response_does_not_wake_the_proxy_thread() {
    let dp = common::ebpf();
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = server.local_addr().unwrap();

    // The proxy on a thread of its own, running until `stop` is dropped.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let proxy_dp = dp.clone();
    let proxy_thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let proxy = common::proxy(proxy_dp, upstream, HELLO, Limits::default()).await;
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            ready_tx.send((proxy.addr, tid)).unwrap();
            let _ = stop_rx.await;
            drop(proxy);
        });
    });
    let (addr, tid) = tokio::task::spawn_blocking(move || ready_rx.recv().unwrap())
        .await
        .unwrap();

    let mut client = TcpStream::connect(addr).await.unwrap();
    client.set_nodelay(true).unwrap();
    client.write_all(&[7u8; HELLO]).await.unwrap();
    let (mut pod, _) = server.accept().await.unwrap();
    pod.set_nodelay(true).unwrap();
    let mut hello = [0u8; HELLO];
    pod.read_exact(&mut hello).await.unwrap();
    assert_eq!(hello, [7u8; HELLO]);

    // The echo pod.
    let echo = tokio::spawn(async move {
        let mut buf = [0u8; MESSAGE];
        for _ in 0..ROUNDS + 100 {
            pod.read_exact(&mut buf).await.unwrap();
            pod.write_all(&buf).await.unwrap();
        }
        pod
    });
    // Warm-up: the connection is in the kernel path from its first byte (the harness
    // loads the dataplane with move_after 0); these round trips fault in the rest.
    for i in 0..100 {
        round(&mut client, i).await;
    }

    let (wakes_before, redirected_before) = (wakeups(tid), redirected(&dp));
    let started = std::time::Instant::now();
    for i in 0..ROUNDS {
        round(&mut client, i).await;
    }
    let took = started.elapsed();
    let (busy_wakes, forwarded) = (
        wakeups(tid) - wakes_before,
        redirected(&dp) - redirected_before,
    );
    // The thread's own timers wake it as often with no traffic at all, and a machine
    // under load stretches the round trips over more of them: the same time again,
    // idle, is the baseline.
    let idle_before = wakeups(tid);
    tokio::time::sleep(took).await;
    let idle_wakes = wakeups(tid) - idle_before;
    let wakes = busy_wakes.saturating_sub(idle_wakes);
    println!(
        "{ROUNDS} round trips in {took:?}: proxy thread woke {busy_wakes} times ({idle_wakes} \
         in as long idle), {forwarded} segments redirected"
    );

    // What the test measures: every message went through the kernel.
    assert!(
        forwarded >= 2 * ROUNDS,
        "the verdict redirected {forwarded} segments for {ROUNDS} round trips"
    );
    // Woken per segment, this thread wakes about twice per round trip (3,816 times
    // here); kept out of the reactor, not at all beyond its timers.
    assert!(
        wakes < ROUNDS / 20,
        "the proxy thread woke {wakes} times over {ROUNDS} round trips the kernel forwarded"
    );

    drop(client);
    let _ = echo.await;
    drop(stop_tx);
    proxy_thread.join().unwrap();
}
