//! `waypoint-bench`: the waypoint against direct TCP, nginx and HAProxy on loopback
//! (`compare`), and the 100k-connection scale check (`scale`). Run through
//! `cargo xtask bench`; see docs/PERFORMANCE.md for how to read the output.

mod app;
mod chart;
mod cli;
mod hello;
mod load;
mod procs;
mod report;
mod routers;
mod scale;
mod servers;
mod soak;
mod suite;
mod sys;

fn main() -> std::process::ExitCode {
    let cli = <cli::Cli as clap::Parser>::parse();
    let result = procs::install_signal_cleanup()
        .map_err(anyhow::Error::from)
        .and_then(|()| app::run(cli));
    // Whatever happened, no router outlives the benchmark.
    procs::kill_all();
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(2),
        Err(e) => {
            eprintln!("waypoint-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
