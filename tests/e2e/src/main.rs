//! `waypoint-e2e`: the demo, the cleanup, and the programs that run inside the simulated
//! pods (the TLS app, the source client, the abuse client).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use waypoint_e2e::{app, client, demo, topology};

/// Two clusters on network namespaces: the waypoint demo and end-to-end harness (root).
#[derive(Debug, Parser)]
#[command(about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Build the two clusters, show the split horizon and one request crossing them, then
    /// clean up (or keep everything running with --keep).
    Demo(demo::DemoArgs),
    /// Remove every `wp-*` network namespace and the processes still running in them.
    Cleanup,
    /// (in a pod) The pod's mTLS echo app on <pod_ip>:15008.
    Serve(app::ServeArgs),
    /// (in a pod) The source client: resolve through this node's daemon, dial, exchange.
    Client(client::ClientArgs),
    /// (in a pod) One connection a waypoint must reject.
    Abuse(client::AbuseArgs),
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new()?;
    match cli.command {
        Command::Demo(args) => demo::run(args).map(|()| ExitCode::SUCCESS),
        Command::Cleanup => {
            let removed = topology::teardown()?;
            println!(
                "removed {} namespaces, killed {} processes",
                removed.namespaces.len(),
                removed.processes.len()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve(args) => rt.block_on(app::serve(args)).map(|()| ExitCode::SUCCESS),
        Command::Client(args) => {
            let report = rt.block_on(client::run(args));
            println!("{}", serde_json::to_string(&report)?);
            Ok(if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Abuse(args) => {
            let report = rt.block_on(client::abuse(args))?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}
