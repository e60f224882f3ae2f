//! Latency: 64-byte ping-pong round trips through the echo server, back to back and
//! after an idle pause long enough for the copy dataplane to park the connection.

use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, TcpStream as StdStream},
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};

use crate::{
    client::connect,
    settings::Settings,
    variant::{stats_delta, Variant},
    PING_LEN,
};

pub(crate) struct PingSample {
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    mean_us: f64,
    pub(crate) max_us: f64,
    pub(crate) ebpf: Option<Vec<(&'static str, u64)>>,
}

impl PingSample {
    pub(crate) fn json(&self) -> Value {
        json!({
            "p50_us": self.p50_us, "p99_us": self.p99_us,
            "mean_us": self.mean_us, "max_us": self.max_us,
            "ebpf_stats_delta": self.ebpf.as_ref().map(|d| {
                d.iter().map(|(l, n)| ((*l).to_owned(), json!(n))).collect::<serde_json::Map<_, _>>()
            }),
        })
    }
}

pub(crate) fn ping_pong(v: &Variant, s: &Settings) -> PingSample {
    let e0 = v.ebpf_stats();
    let mut c = connect(v.echo_addr, false);
    let msg = [0x42_u8; PING_LEN];
    let mut back = [0u8; PING_LEN];
    let mut rtt_ns = Vec::with_capacity(s.pings);
    for i in 0..s.pings_warmup + s.pings {
        let ns = round_trip(&mut c, &msg, &mut back);
        if i >= s.pings_warmup {
            rtt_ns.push(ns);
        }
    }
    hang_up(c, v);
    let e1 = v.ebpf_stats();

    rtt_ns.sort_unstable();
    let q = |p: f64| rtt_ns[((rtt_ns.len() - 1) as f64 * p).round() as usize] as f64 / 1e3;
    PingSample {
        p50_us: q(0.50),
        p99_us: q(0.99),
        mean_us: rtt_ns.iter().sum::<u64>() as f64 / rtt_ns.len() as f64 / 1e3,
        max_us: q(1.0),
        ebpf: stats_delta(&e0, &e1),
    }
}

/// One ping and its echo; nanoseconds.
fn round_trip(c: &mut StdStream, msg: &[u8], back: &mut [u8]) -> u64 {
    let t = Instant::now();
    c.write_all(msg).expect("ping write");
    c.read_exact(back).expect("pong read");
    t.elapsed().as_nanos() as u64
}

/// Closes a ping-pong connection cleanly and waits for the proxy to finish it.
fn hang_up(mut c: StdStream, v: &Variant) {
    let _ = c.shutdown(Shutdown::Write);
    let mut scratch = [0u8; 64];
    while let Ok(1..) = c.read(&mut scratch) {}
    drop(c);
    v.settle();
}

/// Round trips after an idle pause: long enough for the copy to park the connection
/// (`--park-after` 100 ms), so what the wake costs shows.
pub(crate) const IDLE_PAUSE: Duration = Duration::from_millis(300);
pub(crate) const WAKES: usize = 30;

/// p50 of `WAKES` 64-byte round trips on one fresh connection, each after `IDLE_PAUSE`.
pub(crate) fn after_idle(v: &Variant) -> f64 {
    let mut c = connect(v.echo_addr, false);
    let msg = [0x42_u8; PING_LEN];
    let mut back = [0u8; PING_LEN];
    let mut rtt_ns = Vec::with_capacity(WAKES);
    for _ in 0..WAKES {
        thread::sleep(IDLE_PAUSE);
        rtt_ns.push(round_trip(&mut c, &msg, &mut back));
    }
    hang_up(c, v);
    rtt_ns.sort_unstable();
    rtt_ns[rtt_ns.len() / 2] as f64 / 1e3
}
