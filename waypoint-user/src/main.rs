//! The `waypoint` daemon and its tools.
use clap::{Parser, Subcommand};

/// jemalloc rather than glibc's malloc. Every connection allocates its task and one
/// readiness record per socket in tokio, all aligned to 128 bytes, which glibc serves
/// from its slow path (no thread cache for aligned blocks, then a split and a
/// consolidation at free); measured (docs/PERFORMANCE.md, *Allocator: jemalloc*): a new
/// connection's setup 1.5–2 µs faster on one CPU, and 15–18 % less memory per idle
/// connection on every dataplane.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// waypoint: a per-node east-west waypoint for multi-cluster service-mesh traffic.
///
/// Every node runs one. It accepts connections on the node's tunnel port, reads the
/// cleartext TLS ClientHello (it never decrypts), routes on the SNI to a local pod's
/// :15008, and then moves the bytes in the kernel (eBPF SockHash redirect) or, without
/// eBPF, with splice(2).
#[derive(Debug, Parser)]
#[command(version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon.
    Run(Box<waypoint::config::Config>),
    /// Print what a source in a cluster dials for each endpoint of a service port (the
    /// split-horizon view), read from the registry.
    Resolve(waypoint::cli::ResolveArgs),
    /// Print the Envoy v3 configuration of a service port as a source on this node
    /// sees it: the outbound cluster (local pods direct at pod_ip:15008, other clusters'
    /// through their node's waypoint, same cluster first) with its two-level transport
    /// socket matcher, and the pod-inbound listener. JSON (a Bootstrap's static_resources).
    EnvoyConfig(Box<waypoint::cli::EnvoyConfigArgs>),
    /// Manage registry records by hand (workloads outside Kubernetes, labs).
    #[command(subcommand)]
    Registry(waypoint::cli::RegistryCommand),
    /// Turn on the node's kernel settings that the daemon's container cannot write:
    /// net.ipv4.tcp_migrate_req, so that a rolling update hands the connections queued
    /// on the old daemon's listeners to the new one. Run privileged in the host network
    /// (the DaemonSet's init container).
    PrepareNode,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    waypoint::telemetry::init();
    let runtime = tokio::runtime::Runtime::new()?;
    match cli.command {
        Command::Run(config) => runtime.block_on(waypoint::app::run(*config)),
        Command::Resolve(args) => runtime.block_on(waypoint::cli::resolve(args)),
        Command::EnvoyConfig(args) => runtime.block_on(waypoint::cli::envoy_config(*args)),
        Command::Registry(cmd) => runtime.block_on(waypoint::cli::registry(cmd)),
        Command::PrepareNode => waypoint::cli::prepare_node(),
    }
}
