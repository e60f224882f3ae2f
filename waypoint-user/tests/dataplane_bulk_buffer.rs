//! The eBPF dataplane raises a destination's send buffer when its direction trips the
//! in-flight budget while the destination drains fast, and leaves request/response
//! connections and slow readers to autotuning.
//!
//! Why it matters: the kernel's redirect worker sleeps a whole timer tick whenever the
//! destination's send buffer is half full, so a buffer smaller than a tick of traffic
//! leaves the destination idle (docs/PERFORMANCE.md). The test reads the buffer size of
//! the very sockets the dataplane forwards on (through duplicated descriptors).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::Arc,
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{tcp::OwnedWriteHalf, TcpListener, TcpStream},
};
use waypoint::dataplane::{ebpf, Dataplane, Limits};
use waypoint_common::Stat;

const BULK_BUFFER: usize = ebpf::DEFAULT_BULK_SEND_BUFFER;
const SLOW_TOTAL: usize = 16 << 20;
const FAST_TOTAL: usize = 128 << 20;

/// Writes `total` bytes of 0x5a in the background; gives the writer back when done.
async fn bulk(mut w: OwnedWriteHalf, total: usize) -> tokio::task::JoinHandle<OwnedWriteHalf> {
    tokio::spawn(async move {
        let chunk = vec![0x5au8; 256 * 1024];
        let mut sent = 0;
        while sent < total {
            let n = chunk.len().min(total - sent);
            w.write_all(&chunk[..n]).await.unwrap();
            sent += n;
        }
        w
    })
}

/// Segments the verdict passed because the in-flight budget was spent.
fn budget_trips(dp: &Dataplane) -> u64 {
    let Dataplane::Ebpf(e) = dp else {
        unreachable!("an eBPF dataplane")
    };
    e.stats()
        .into_iter()
        .find(|(s, _)| *s == Stat::PassedBudget)
        .map(|(_, n)| n)
        .unwrap()
}

fn check_bulk(bytes: &[u8]) {
    assert!(bytes.iter().all(|&b| b == 0x5a), "corrupted bulk bytes");
}

/// A second descriptor for the same socket, to query it after the dataplane owns it.
fn dup(sock: &TcpStream) -> socket2::Socket {
    // SAFETY: dup() of an open descriptor; the new descriptor is owned by the result.
    let fd = unsafe { libc::dup(sock.as_raw_fd()) };
    assert!(fd >= 0, "dup: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just returned by dup() and nothing else owns it.
    socket2::Socket::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The kernel's autotuning ceiling for send buffers.
fn wmem_max() -> usize {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem").unwrap();
    s.split_whitespace().nth(2).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_direction_gets_a_bigger_send_buffer() {
    common::require_root();
    let autotune_max = wmem_max();
    assert!(
        2 * BULK_BUFFER > 2 * autotune_max,
        "the cap must be well above what autotuning reaches, or the test proves nothing"
    );
    let dp = Arc::new(Dataplane::Ebpf(Arc::new(
        ebpf::Ebpf::load(ebpf::Config {
            // Small, so that a paused reader trips it quickly.
            max_inflight: 256 * 1024,
            bulk_send_buffer: BULK_BUFFER,
            move_after: 0,
            ..ebpf::Config::default()
        })
        .unwrap(),
    )));
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = TcpStream::connect(front.local_addr().unwrap())
        .await
        .unwrap();
    let (downstream, _) = front.accept().await.unwrap();
    let upstream = TcpStream::connect(back.local_addr().unwrap())
        .await
        .unwrap();
    let (mut server, _) = back.accept().await.unwrap();
    let (down_probe, up_probe) = (dup(&downstream), dup(&upstream));
    let forwarder = dp.clone();
    let forward = tokio::spawn(async move {
        forwarder
            .forward(
                downstream.into(),
                upstream.into(),
                b"hello".to_vec(),
                Limits::default(),
            )
            .await
    });
    let mut hello = [0u8; 5];
    server.read_exact(&mut hello).await.unwrap();

    // Request/response: nothing ever waits in the kernel, nothing is raised.
    let mut buf = vec![0u8; 256 * 1024];
    for i in 0..200u32 {
        client.write_all(&i.to_be_bytes()).await.unwrap();
        server.read_exact(&mut buf[..4]).await.unwrap();
        assert_eq!(buf[..4], i.to_be_bytes());
        server.write_all(&buf[..4]).await.unwrap();
        client.read_exact(&mut buf[..4]).await.unwrap();
    }
    let autotuned = up_probe.send_buffer_size().unwrap();
    assert!(
        autotuned <= autotune_max,
        "upstream send buffer {autotuned} raised by request/response traffic"
    );

    // Bulk towards a slow reader (~10 MB/s): the budget trips over and over, but the
    // destination drains little per worker tick, so its buffer is left alone.
    let trips_before = budget_trips(&dp);
    let (mut client_r, client_w) = client.into_split();
    let client_w = bulk(client_w, SLOW_TOTAL).await;
    let mut received = 0usize;
    while received < SLOW_TOTAL {
        let n = server.read(&mut buf[..64 * 1024]).await.unwrap();
        assert!(n > 0, "early EOF");
        check_bulk(&buf[..n]);
        received += n;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let client_w = client_w.await.unwrap();
    let slow = up_probe.send_buffer_size().unwrap();
    let trips = budget_trips(&dp) - trips_before;
    assert!(
        trips > 0,
        "the slow reader never tripped the budget: nothing was tested"
    );
    assert!(
        slow <= autotune_max,
        "upstream send buffer {slow} raised for a slow reader"
    );

    // Bulk towards a reader that pauses until the budget trips, then reads as fast as it
    // can: the next measurement sees a fast drain.
    let trips_before = budget_trips(&dp);
    let writer = bulk(client_w, FAST_TOTAL).await;
    let waited = std::time::Instant::now();
    while budget_trips(&dp) == trips_before {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "a paused reader never tripped the budget"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut received = 0usize;
    while received < FAST_TOTAL {
        let n = server.read(&mut buf).await.unwrap();
        assert!(n > 0, "early EOF");
        check_bulk(&buf[..n]);
        received += n;
    }
    let mut client_w = writer.await.unwrap();
    client_w.shutdown().await.unwrap();
    assert_eq!(
        server.read(&mut buf).await.unwrap(),
        0,
        "bytes beyond the total"
    );
    // Sized from the measured drain (which the worker's own sleeps make uneven), so
    // only bounds are certain: above autotuning, at most the cap (the kernel stores
    // twice the size asked for).
    let fast = up_probe.send_buffer_size().unwrap();
    eprintln!("upstream send buffer: {autotuned} request/response, {slow} slow, {fast} fast");
    assert!(
        fast > autotune_max && fast <= 2 * BULK_BUFFER,
        "upstream (the bulk direction's destination) send buffer {fast} not raised \
         above {autotune_max} or above the cap"
    );
    let other = down_probe.send_buffer_size().unwrap();
    assert!(
        other <= autotune_max,
        "downstream send buffer {other} raised, but nothing bulk went that way"
    );

    server.shutdown().await.unwrap();
    let n = client_r.read(&mut buf).await.unwrap();
    assert_eq!(n, 0, "no bytes were sent upstream to downstream");
    let outcome = forward.await.unwrap().unwrap();
    assert_eq!(
        outcome.downstream_to_upstream,
        (5 + 800 + SLOW_TOTAL + FAST_TOTAL) as u64
    );
    assert_eq!(outcome.upstream_to_downstream, 800);
}
