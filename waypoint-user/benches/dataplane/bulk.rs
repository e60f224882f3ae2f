//! Bulk throughput: streams of writes through the proxy into the discarding sink, with
//! the machine's, the process's and the proxy threads' CPU time over the measurement.

use std::{
    io::{Read as _, Write as _},
    net::Shutdown,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed},
        Arc,
    },
    thread,
    time::Instant,
};

use serde_json::{json, Value};

use crate::{
    client::{connect, wait_for},
    cpu::{process_cpu, proxy_threads_cpu, CpuStat},
    servers::Sink,
    settings::Settings,
    summary::pct,
    variant::{stats_delta, Variant},
    CHUNK,
};

pub(crate) struct BulkSample {
    bytes: u64,
    secs: f64,
    cpu: CpuStat,
    process_cpu_s: f64,
    proxy_cpu_s: f64,
    pub(crate) ebpf: Option<Vec<(&'static str, u64)>>,
    hz: f64,
}

impl BulkSample {
    pub(crate) fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / 1e9 / self.secs
    }
    fn gb(&self) -> f64 {
        self.bytes as f64 / 1e9
    }
    pub(crate) fn cpu_s_per_gb(&self) -> f64 {
        self.cpu.busy() as f64 / self.hz / self.gb()
    }
    pub(crate) fn process_cpu_s_per_gb(&self) -> f64 {
        self.process_cpu_s / self.gb()
    }
    pub(crate) fn proxy_cpu_s_per_gb(&self) -> f64 {
        self.proxy_cpu_s / self.gb()
    }
    pub(crate) fn idle_pct(&self) -> f64 {
        pct(self.cpu.idle + self.cpu.iowait, self.cpu.total())
    }
    pub(crate) fn json(&self) -> Value {
        json!({
            "bytes": self.bytes,
            "secs": self.secs,
            "gbit_per_s": self.gbps(),
            "machine_cpu_s": self.cpu.busy() as f64 / self.hz,
            "machine_cpu_s_per_gb": self.cpu_s_per_gb(),
            "machine_cpu": self.cpu.json(self.hz),
            "machine_idle_pct": self.idle_pct(),
            "process_cpu_s": self.process_cpu_s,
            "process_cpu_s_per_gb": self.process_cpu_s_per_gb(),
            "proxy_threads_cpu_s": self.proxy_cpu_s,
            "proxy_threads_cpu_s_per_gb": self.proxy_cpu_s_per_gb(),
            "ebpf_stats_delta": self.ebpf.as_ref().map(|d| {
                d.iter().map(|(l, n)| ((*l).to_owned(), json!(n))).collect::<serde_json::Map<_, _>>()
            }),
        })
    }
}

pub(crate) fn bulk(v: &Variant, sink: &Sink, streams: usize, s: &Settings, hz: f64) -> BulkSample {
    let stop = Arc::new(AtomicBool::new(false));
    let connected = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..streams)
        .map(|_| {
            let (stop, connected, addr) = (stop.clone(), connected.clone(), v.bulk_addr);
            let eager = s.eager;
            thread::spawn(move || {
                let mut c = connect(addr, eager);
                connected.fetch_add(1, Relaxed);
                let buf = vec![0x5a_u8; CHUNK];
                // Bounded: stops at the flag, or at the first error (logged below).
                while !stop.load(Relaxed) {
                    if let Err(e) = c.write_all(&buf) {
                        eprintln!("  warning: bulk client write failed: {e}");
                        return;
                    }
                }
                // Half-close and wait for the close to travel back through the proxy, so
                // the next measurement starts with nothing in flight.
                let _ = c.shutdown(Shutdown::Write);
                let mut scratch = [0u8; 1024];
                loop {
                    match c.read(&mut scratch) {
                        Ok(0) => return,
                        Ok(_) => {}
                        Err(e) => {
                            eprintln!("  warning: bulk client waiting for EOF: {e}");
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    let c = connected.clone();
    wait_for("bulk clients to connect", move || {
        c.load(Relaxed) == streams
    });
    thread::sleep(s.warmup);

    // Everything the window's figures are differences of, read at its start and end.
    let snapshot = || {
        (
            sink.bytes.load(Relaxed),
            CpuStat::read(),
            process_cpu(),
            proxy_threads_cpu(hz),
            v.ebpf_stats(),
            Instant::now(),
        )
    };
    let (b0, cpu0, p0, x0, e0, t0) = snapshot();
    thread::sleep(s.duration);
    let (b1, cpu1, p1, x1, e1, t1) = snapshot();

    stop.store(true, Relaxed);
    for c in clients {
        c.join().expect("bulk client thread");
    }
    let open = sink.open.clone();
    wait_for("sink connections to close", move || open.load(Relaxed) == 0);
    v.settle();

    BulkSample {
        bytes: b1 - b0,
        secs: (t1 - t0).as_secs_f64(),
        cpu: cpu1.delta(&cpu0),
        process_cpu_s: p1 - p0,
        proxy_cpu_s: x1 - x0,
        ebpf: stats_delta(&e0, &e1),
        hz,
    }
}
