//! Wires the daemon together: chooses the dataplane, starts the admin server, and waits
//! for termination.

use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    admin::{Admin, Readiness},
    config::Config,
    dataplane::{copy::Copy, ebpf::Ebpf, splice::Splice, Dataplane, Kind},
    metrics::Metrics,
};

/// Builds the dataplane the config asks for. `auto` falls back to splice, with the reason
/// logged, when the eBPF programs cannot be loaded or attached.
pub fn choose_dataplane(config: &Config) -> anyhow::Result<Dataplane> {
    let splice = || Splice::new(usize::try_from(config.pipe_size).unwrap_or(usize::MAX));
    let dp = match config.dataplane {
        Kind::Ebpf => Dataplane::Ebpf(
            Ebpf::load(config.ebpf()).context("--dataplane=ebpf was asked for")?,
        ),
        Kind::Splice => Dataplane::Splice(splice()),
        Kind::Copy => Dataplane::Copy(Copy),
        Kind::Auto => match Ebpf::load(config.ebpf()) {
            Ok(e) => Dataplane::Ebpf(e),
            Err(e) => {
                warn!(error = %e, "eBPF dataplane unavailable; falling back to splice");
                Dataplane::Splice(splice())
            }
        },
    };
    info!(dataplane = dp.kind().as_str(), requested = config.dataplane.as_str(), "dataplane chosen");
    Ok(dp)
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(config: Config) -> anyhow::Result<()> {
    info!(?config, "starting");
    let dataplane = Arc::new(choose_dataplane(&config)?);
    let metrics = Arc::new(Metrics::new(dataplane.clone()));
    let ready = Arc::new(Readiness::default());
    let stop = CancellationToken::new();

    let admin = Admin::bind(config.admin_addr).await?;
    let admin_task = tokio::spawn(admin.serve(metrics, ready.clone(), stop.clone()));

    // The tunnel listener and router arrive with the router; until then the daemon is
    // ready once its dataplane is chosen.
    ready.set(true);

    wait_for_signal().await?;
    info!("terminating: not ready");
    ready.set(false);
    stop.cancel();
    let _ = admin_task.await;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => info!("SIGTERM"),
        _ = int.recv() => info!("SIGINT"),
    }
    Ok(())
}
