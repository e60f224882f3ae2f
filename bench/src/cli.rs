//! The command line: `compare` (the comparison table) and `scale` (the 100k check).

use std::{path::PathBuf, time::Duration};

/// Comparative benchmark of the waypoint against direct TCP, nginx and HAProxy, on
/// loopback. Needs root (the eBPF dataplane, RLIMIT_NOFILE, CPU pinning).
#[derive(Debug, clap::Parser)]
#[command(name = "waypoint-bench")]
pub struct Cli {
    #[command(subcommand)]
    pub task: Task,
}

#[derive(Debug, clap::Subcommand)]
pub enum Task {
    /// Bulk throughput (1, 8, 64 connections), 64 B ping-pong (unpinned and pinned to one
    /// CPU), connection setup, RSS per idle connection and machine CPU per GB, for direct,
    /// the waypoint's ebpf/splice/copy dataplanes, nginx and HAProxy. Writes report.md,
    /// results.json and PNG charts to --out.
    Compare(Compare),
    /// Holds --connections concurrent connections through one waypoint, spot-checks them,
    /// reports the daemon's memory, then closes them. Bounded by --timeout.
    Scale(Scale),
    /// Thousands of mixed connections (real TLS and raw, short, ping-pong, bulk,
    /// send-then-wait, slow reader, abort) through one waypoint per dataplane, under CPU
    /// contention, every byte and every close checked. Exits 2 if any connection failed.
    Soak(Soak),
    /// (internal) An echo pod of the scale check.
    #[command(hide = true)]
    ScaleServer {
        #[arg(long)]
        ip: std::net::IpAddr,
        #[arg(long)]
        sink_ip: std::net::IpAddr,
        #[arg(long)]
        port: u16,
    },
    /// (internal) A client process of the scale check.
    #[command(hide = true)]
    ScaleClient {
        #[arg(long)]
        target: std::net::SocketAddr,
        #[arg(long)]
        source: std::net::Ipv4Addr,
        #[arg(long)]
        count: usize,
        /// Seconds.
        #[arg(long)]
        timeout: u64,
    },
}

/// The daemon under test.
#[derive(Debug, clap::Args)]
pub struct Daemon {
    /// The waypoint daemon binary (build it with
    /// `cargo build --release -p waypoint-user --bin waypoint`).
    #[arg(
        long,
        env = "WAYPOINT_BENCH_WAYPOINT",
        default_value = "target/release/waypoint"
    )]
    pub waypoint: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct Common {
    #[command(flatten)]
    pub daemon: Daemon,
    /// Where the report, JSON and charts go.
    #[arg(long, env = "WAYPOINT_BENCH_OUT", default_value = "target/bench")]
    pub out: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct Soak {
    #[command(flatten)]
    pub daemon: Daemon,
    /// Dataplanes, comma-separated: auto (the daemon's default, no dataplane flag),
    /// ebpf (the SockHash redirect alone), ebpf-rewrite (ebpf with --rewrite-splice),
    /// splice, copy. `name:mode+mode` gives a dataplane modes of its own (e.g.
    /// `ebpf-rewrite:tls`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "auto,ebpf,ebpf-rewrite,splice,copy"
    )]
    pub dataplanes: Vec<String>,
    /// How connections speak, comma-separated, mixed at random: tls (a real handshake),
    /// raw (the recorded hello with the client's bytes right behind it).
    #[arg(long, value_delimiter = ',', default_value = "tls,raw")]
    pub modes: Vec<String>,
    /// Seconds new connections are started, per dataplane.
    #[arg(long, default_value_t = 60.0)]
    pub seconds: f64,
    /// Connections open at once.
    #[arg(long, default_value_t = 24)]
    pub parallel: usize,
    /// Threads that keep CPUs busy meanwhile.
    #[arg(long, default_value_t = 1)]
    pub busy: usize,
    /// Seconds a connection may take before it counts as failed.
    #[arg(long, default_value_t = 60)]
    pub deadline: u64,
    /// The run's seed (default: from the clock); printed, so that a run can be repeated.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Every connection uses this connection seed (as a failure prints it): replays one
    /// connection's plan, many times in parallel.
    #[arg(long)]
    pub replay: Option<u64>,
    /// tc's netem parameters for loopback while the soak runs, e.g. "delay 1ms 1ms loss
    /// 1% duplicate 1%": delay, jitter (which reorders), loss and duplication on every
    /// packet of the run but resets (TCP never sends a lost one again). Needs the kernel's sch_netem (`cargo xtask kernels` runs it
    /// in Debian's kernels).
    #[arg(long)]
    pub netem: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct Compare {
    #[command(flatten)]
    pub common: Common,
    /// Short runs, one repetition, fewer connections: a smoke run in about a minute.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions of every figure (default 3, or 1 with --quick).
    #[arg(long)]
    pub reps: Option<usize>,
    /// Only these routers, comma-separated: direct, ebpf, ebpf-rewrite, splice, copy, nginx,
    /// haproxy.
    /// Ratios need direct and nginx. Also `tc-rewrite`, an experiment never run by
    /// default: packets rewritten at lo's TC ingress (bench/experiments/tcp-rewrite;
    /// needs clang and libbpf-dev; bulk, latency and wake figures only).
    #[arg(long, value_delimiter = ',')]
    pub only: Option<Vec<String>>,
    /// Idle connections held for the memory figure (default 10000, or 1000 with --quick).
    #[arg(long)]
    pub idle_conns: Option<usize>,
    /// The CPU every process is pinned to for the pinned figures (default: the last).
    #[arg(long)]
    pub pin_cpu: Option<usize>,
    /// Seconds of each bulk measurement (default 3, or 1 with --quick).
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Only these figures, comma-separated: bulk (throughput and CPU per GB), latency
    /// (ping-pong), setup (new connections), memory (idle connections), wake (round
    /// trips after 300 ms idle). For profiling one figure; the report leaves the others
    /// empty.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub figures: Option<Vec<Figure>>,
}

/// A group of figures of `compare`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Figure {
    Bulk,
    Latency,
    Setup,
    Memory,
    /// Round trips after an idle pause (what waking an idle connection costs).
    Wake,
    /// Connections per second under concurrent openers, and the resets among them.
    Churn,
}

impl Figure {
    pub const ALL: [Figure; 6] = [
        Figure::Bulk,
        Figure::Latency,
        Figure::Setup,
        Figure::Memory,
        Figure::Wake,
        Figure::Churn,
    ];
}

#[derive(Debug, clap::Args)]
pub struct Scale {
    #[command(flatten)]
    pub common: Common,
    /// Concurrent connections to hold.
    #[arg(long, default_value_t = 100_000)]
    pub connections: usize,
    /// The waypoint dataplane: auto, ebpf, ebpf-rewrite (ebpf with --rewrite-splice),
    /// splice or copy.
    #[arg(long, default_value = "ebpf")]
    pub dataplane: String,
    /// Give up opening connections after this long (seconds).
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
}

impl Scale {
    pub fn deadline(&self) -> Duration {
        Duration::from_secs(self.timeout)
    }
}
