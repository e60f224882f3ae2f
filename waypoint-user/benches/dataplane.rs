//! Dataplane benchmark: direct TCP vs the eBPF, splice and copy dataplanes, side by side
//! in one run on loopback.
//!
//! Run as root (the eBPF variants load programs):
//! `cargo bench -p waypoint-user --bench dataplane -- [--quick] [--json PATH] [--only a,b]`
//!
//! Per dataplane it measures bulk throughput (1 and 8 streams, client → proxy → discarding
//! sink), ping-pong latency (64-byte round trips through an echo server) and CPU cost.
//! CPU cost is machine-wide (/proc/stat), because the eBPF path does its work in softirq
//! and kworkers that no per-process figure would show.
//!
//! The proxy runs on its own 2-worker tokio runtime; the load generator and the servers
//! are plain threads with blocking sockets, so the proxy never competes with them for its
//! runtime's workers (only for the 2 CPUs, like a real node would).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark")]

// A bench's root is a crate root, so a plain `mod x;` would look for benches/x.rs,
// beside the other benches; this bench's modules live in benches/dataplane/.
#[path = "dataplane/bulk.rs"]
mod bulk;
#[path = "dataplane/client.rs"]
mod client;
#[path = "dataplane/cpu.rs"]
mod cpu;
#[path = "dataplane/latency.rs"]
mod latency;
#[path = "dataplane/proxy.rs"]
mod proxy;
#[path = "dataplane/servers.rs"]
mod servers;
#[path = "dataplane/settings.rs"]
mod settings;
#[path = "dataplane/summary.rs"]
mod summary;
#[path = "dataplane/variant.rs"]
mod variant;

use std::{
    sync::{atomic::Ordering::Relaxed, Arc},
    thread,
    time::{Duration, Instant},
};

use serde_json::json;
use waypoint::dataplane::{copy::UserspaceCopy, ebpf, splice::Splice, Dataplane, Limits};

use bulk::{bulk, BulkSample};
use cpu::{clock_ticks, loadavg, CpuStat};
use latency::{after_idle, ping_pong, PingSample, IDLE_PAUSE, WAKES};
use proxy::{start_proxy, ProxyCounters};
use servers::{start_echo, start_sink};
use settings::settings;
use summary::{cell, pct, spread, summary_json};
use variant::{stats_line, Variant};

/// Size of the fixed first message, standing in for a TLS ClientHello.
const HELLO_LEN: usize = 517;
/// Size of the servers' answer to the hello, standing in for the start of a ServerHello.
/// Clients wait for it before sending more (as TLS does), unless `--eager`.
const REPLY_LEN: usize = 128;
/// Ping-pong message size.
const PING_LEN: usize = 64;
/// Write and read chunk of the bulk client and sink.
const CHUNK: usize = 256 * 1024;
/// Name of the proxy runtime's threads, used to find their CPU time in /proc/self/task.
const PROXY_THREAD: &str = "wp-proxy";
/// Upper bound for any teardown wait: a stuck dataplane must not hang the benchmark.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(30);

fn main() {
    let s = settings();
    let hz = clock_ticks();

    // A busy machine makes every figure meaningless; say so up front.
    let (load1, load_text) = loadavg();
    let idle_probe = {
        let a = CpuStat::read();
        thread::sleep(Duration::from_secs(1));
        let d = CpuStat::read().delta(&a);
        pct(d.idle + d.iowait, d.total())
    };
    let cpus = thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# waypoint dataplane benchmark ({} mode)\n",
        if s.quick { "quick" } else { "full" }
    );
    println!("- CPUs: {cpus}; loadavg before: {load_text}; idle over 1 s before: {idle_probe:.0}%");
    if load1 > 0.5 || idle_probe < 90.0 {
        println!(
            "- **WARNING: the machine looks busy (1-min load {load1:.2}, idle {idle_probe:.0}%); figures will be noisy.**"
        );
    }
    println!(
        "- bulk: {} s per run after {} ms warm-up; ping-pong: {} round trips of {PING_LEN} B after {}; {} run(s) per figure, median (min–max)",
        s.duration.as_secs_f64(),
        s.warmup.as_millis(),
        s.pings,
        s.pings_warmup,
        s.reps
    );
    println!(
        "- each connection: {HELLO_LEN}-byte hello, server answers {REPLY_LEN} bytes; bulk clients {}",
        if s.eager {
            "stream right after the hello (--eager)"
        } else {
            "wait for the answer before streaming (as TLS does)"
        }
    );
    println!();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(PROXY_THREAD)
        .enable_all()
        .build()
        .expect("proxy runtime");
    let sink = start_sink();
    let echo = start_echo();

    let ebpf_dp = |config: ebpf::Config| {
        let dp = ebpf::Ebpf::load(config)
            .expect("loading the eBPF dataplane (run as root on a sockmap kernel)");
        Some(Arc::new(Dataplane::Ebpf(Arc::new(dp))))
    };
    let candidates = [
        "direct",
        "ebpf",
        "ebpf-16m",
        "ebpf-inflight16m",
        "ebpf-both16m",
        "splice",
        "copy",
        "copy-nopark",
    ];
    let wanted = |name: &str| s.only.as_ref().is_none_or(|o| o.iter().any(|w| w == name));
    let mut variants: Vec<Variant> = Vec::new();
    for name in candidates {
        if !wanted(name) {
            continue;
        }
        let dp: Option<Arc<Dataplane>> = match name {
            "direct" => None,
            "ebpf" => ebpf_dp(ebpf::Config::default()),
            "ebpf-16m" => ebpf_dp(ebpf::Config {
                socket_buffer: Some(16 << 20),
                ..Default::default()
            }),
            "ebpf-inflight16m" => ebpf_dp(ebpf::Config {
                max_inflight: 16 << 20,
                ..Default::default()
            }),
            "ebpf-both16m" => ebpf_dp(ebpf::Config {
                socket_buffer: Some(16 << 20),
                max_inflight: 16 << 20,
                ..Default::default()
            }),
            "splice" => Some(Arc::new(Dataplane::Splice(Splice::default()))),
            "copy" | "copy-nopark" => Some(Arc::new(Dataplane::Copy(UserspaceCopy::new()))),
            _ => unreachable!("listed above"),
        };
        let limits = Limits {
            park_after: if name.ends_with("-nopark") {
                None
            } else {
                Limits::default().park_after
            },
            ..Limits::default()
        };
        let counters = Arc::new(ProxyCounters::default());
        let (bulk_addr, echo_addr) = match &dp {
            None => (sink.addr, echo),
            Some(dp) => (
                start_proxy(&rt, dp.clone(), sink.addr, counters.clone(), limits),
                start_proxy(&rt, dp.clone(), echo, counters.clone(), limits),
            ),
        };
        variants.push(Variant {
            name,
            dp,
            bulk_addr,
            echo_addr,
            counters,
            bulk: [Vec::new(), Vec::new()],
            ping: Vec::new(),
            wake: Vec::new(),
        });
    }

    // Repetition-major order: each round measures every variant once, so a burst of
    // background load hits one run of several variants, not all runs of one.
    let started = Instant::now();
    for rep in 1..=s.reps {
        for v in &mut variants {
            for (slot, streams) in [(0, 1), (1, 8)] {
                let sample = bulk(v, &sink, streams, &s, hz);
                eprintln!(
                    "[rep {rep}] {:<16} bulk x{streams}: {:6.2} Gbit/s, machine {:.2} CPU s/GB (idle {:.0}%), process {:.2}, proxy threads {:.2}",
                    v.name,
                    sample.gbps(),
                    sample.cpu_s_per_gb(),
                    sample.idle_pct(),
                    sample.process_cpu_s_per_gb(),
                    sample.proxy_cpu_s_per_gb(),
                );
                if let Some(d) = &sample.ebpf {
                    eprintln!("{:>26} {}", "", stats_line(d));
                }
                v.bulk[slot].push(sample);
            }
            let p = ping_pong(v, &s);
            eprintln!(
                "[rep {rep}] {:<16} ping-pong: p50 {:.1} µs, p99 {:.1} µs, max {:.0} µs",
                v.name, p.p50_us, p.p99_us, p.max_us
            );
            if let Some(d) = &p.ebpf {
                eprintln!("{:>26} {}", "", stats_line(d));
            }
            v.ping.push(p);
            let w = after_idle(v);
            eprintln!(
                "[rep {rep}] {:<16} after {} ms idle: p50 {w:.1} µs ({WAKES} round trips)",
                v.name,
                IDLE_PAUSE.as_millis()
            );
            v.wake.push(w);
        }
    }
    let (load1_after, load_after) = loadavg();

    // Results.
    println!("| dataplane | 1-stream Gbit/s | 8-stream Gbit/s | p50 µs | p99 µs | after {} ms idle, p50 µs | CPU s/GB 1-stream | CPU s/GB 8-stream |", IDLE_PAUSE.as_millis());
    println!("|---|---|---|---|---|---|---|---|");
    for v in &variants {
        let g = |i: usize| v.bulk[i].iter().map(BulkSample::gbps).collect::<Vec<_>>();
        let c = |i: usize| {
            v.bulk[i]
                .iter()
                .map(BulkSample::cpu_s_per_gb)
                .collect::<Vec<_>>()
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            v.name,
            cell(g(0), 1),
            cell(g(1), 1),
            cell(v.ping.iter().map(|p| p.p50_us).collect(), 0),
            cell(v.ping.iter().map(|p| p.p99_us).collect(), 0),
            cell(v.wake.clone(), 0),
            cell(c(0), 2),
            cell(c(1), 2),
        );
    }
    println!();
    println!("Details (medians, 1-stream / 8-stream): process CPU s/GB includes the load generator and servers; proxy-thread CPU s/GB is the proxy runtime's threads only (excludes softirq and kworkers); idle is machine-wide.\n");
    println!("| dataplane | process CPU s/GB | proxy-thread CPU s/GB | idle % | eBPF segments redirected % |");
    println!("|---|---|---|---|---|");
    for v in &variants {
        let m = |i: usize, f: fn(&BulkSample) -> f64| spread(v.bulk[i].iter().map(f).collect()).0;
        let redirected = |i: usize| {
            let (mut r, mut t) = (0u64, 0u64);
            for d in v.bulk[i].iter().filter_map(|b| b.ebpf.as_ref()) {
                for (l, n) in d {
                    t += n;
                    if *l == "redirected" {
                        r += n;
                    }
                }
            }
            if v.bulk[i].iter().any(|b| b.ebpf.is_some()) {
                format!("{:.1}", pct(r, t))
            } else {
                "–".to_owned()
            }
        };
        println!(
            "| {} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} / {:.0} | {} / {} |",
            v.name,
            m(0, BulkSample::process_cpu_s_per_gb),
            m(1, BulkSample::process_cpu_s_per_gb),
            m(0, BulkSample::proxy_cpu_s_per_gb),
            m(1, BulkSample::proxy_cpu_s_per_gb),
            m(0, BulkSample::idle_pct),
            m(1, BulkSample::idle_pct),
            redirected(0),
            redirected(1),
        );
    }
    println!();
    println!(
        "- loadavg after: {load_after}; wall time {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let mut unclean = false;
    for v in &variants {
        let (n, e) = (
            v.counters.not_closed.load(Relaxed),
            v.counters.errors.load(Relaxed),
        );
        if n + e > 0 {
            unclean = true;
            println!(
                "- **{}: {n} connection(s) did not end Closed, {e} failed**",
                v.name
            );
        }
    }
    if !unclean {
        println!("- every proxied connection ended Closed");
    }
    if load1_after > 2.0 {
        println!("- **WARNING: load rose during the run (other work on the machine?)**");
    }

    if let Some(path) = &s.json {
        let doc = json!({
            "mode": if s.quick { "quick" } else { "full" },
            "cpus": cpus,
            "clock_ticks_per_s": hz,
            "loadavg_before": load_text,
            "idle_pct_before": idle_probe,
            "loadavg_after": load_after,
            "settings": {
                "reps": s.reps,
                "bulk_secs": s.duration.as_secs_f64(),
                "bulk_warmup_secs": s.warmup.as_secs_f64(),
                "pings": s.pings,
                "pings_warmup": s.pings_warmup,
                "hello_bytes": HELLO_LEN,
                "reply_bytes": REPLY_LEN,
                "eager": s.eager,
                "ping_bytes": PING_LEN,
                "chunk_bytes": CHUNK,
            },
            "variants": variants.iter().map(|v| json!({
                "name": v.name,
                "bulk_1_stream": {
                    "gbit_per_s": summary_json(v.bulk[0].iter().map(BulkSample::gbps).collect()),
                    "machine_cpu_s_per_gb": summary_json(v.bulk[0].iter().map(BulkSample::cpu_s_per_gb).collect()),
                    "runs": v.bulk[0].iter().map(BulkSample::json).collect::<Vec<_>>(),
                },
                "bulk_8_streams": {
                    "gbit_per_s": summary_json(v.bulk[1].iter().map(BulkSample::gbps).collect()),
                    "machine_cpu_s_per_gb": summary_json(v.bulk[1].iter().map(BulkSample::cpu_s_per_gb).collect()),
                    "runs": v.bulk[1].iter().map(BulkSample::json).collect::<Vec<_>>(),
                },
                "ping_pong": {
                    "p50_us": summary_json(v.ping.iter().map(|p| p.p50_us).collect()),
                    "p99_us": summary_json(v.ping.iter().map(|p| p.p99_us).collect()),
                    "runs": v.ping.iter().map(PingSample::json).collect::<Vec<_>>(),
                },
                "after_idle_p50_us": summary_json(v.wake.clone()),
                "connections_not_closed": v.counters.not_closed.load(Relaxed),
                "connections_failed": v.counters.errors.load(Relaxed),
            })).collect::<Vec<_>>(),
        });
        std::fs::write(
            path,
            serde_json::to_string_pretty(&doc).expect("serialize results"),
        )
        .expect("write --json file");
        println!("- raw figures written to {path}");
    }
}
