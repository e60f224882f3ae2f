//! Developer tasks. Run as `cargo xtask <task>`; `cargo xtask --help` lists them.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};

mod kernels;
mod kind;

#[derive(Debug, Parser)]
#[command(about = "waypoint developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Build the eBPF object into target/ebpf/waypoint (the daemon build embeds the same
    /// object through its build script; this is for inspection, e.g. with bpftool).
    BuildEbpf,
    /// Run the whole test suite: fmt check, clippy, a bounded fuzz run of the
    /// ClientHello parser, unit and integration tests (root: eBPF, real daemons), then
    /// the kernel matrix (`kernels`: Debian's 5.10, 6.1 and 6.12 under QEMU), then the
    /// soak (60 s per dataplane, TLS and raw clients). This is what CI runs.
    Test {
        /// Skip fmt and clippy.
        #[arg(long)]
        no_lint: bool,
        /// Skip the kernel matrix (about 9 minutes).
        #[arg(long)]
        no_kernels: bool,
    },
    /// Benchmarks (root). Without a subcommand: the comparison of direct TCP, the
    /// waypoint's ebpf/splice/copy dataplanes, nginx and HAProxy on loopback (bulk
    /// Gbit/s, ping-pong µs unpinned and pinned, connection setup, RSS per idle
    /// connection, machine CPU per GB), with the goals beside each figure; writes
    /// report.md, results.json and PNG charts to <target>/bench/.
    #[command(args_conflicts_with_subcommands = true)]
    Bench {
        #[command(subcommand)]
        which: Option<Bench>,
        #[command(flatten)]
        compare: CompareArgs,
    },
    /// The soak (root): thousands of mixed connections, real TLS and raw, through one
    /// waypoint per dataplane under CPU contention, every byte checked; fails on any
    /// failed connection. Options after `--` go to `waypoint-bench soak` (e.g.
    /// `-- --seconds 300 --dataplanes ebpf --replay SEED`; `-- --help` lists them).
    Soak {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The two-cluster demo (root): builds the release binaries, sets up two clusters on
    /// network namespaces with etcd and a waypoint per node, shows a request crossing
    /// them, then cleans up.
    Demo {
        /// Leave everything running to explore (`waypoint-e2e cleanup` removes it).
        #[arg(long)]
        keep: bool,
        /// The waypoints' dataplane: auto (the daemon's default), ebpf, splice or copy.
        #[arg(long, default_value = "auto")]
        dataplane: String,
    },
    /// Kubernetes end to end (needs Docker, kind and kubectl; not part of `test`): two kind
    /// clusters with the same pod subnet and Flannel, a shared etcd container, the
    /// waypoint image built (deploy/Dockerfile) and loaded, the DaemonSet of
    /// deploy/kubernetes applied; then a pod in cluster A reaches an exported service in
    /// cluster B through B's node waypoint, checked in the waypoint's metrics.
    /// Fails at once, naming what is missing, when a tool is absent.
    E2eKind {
        /// Leave the clusters and etcd running afterwards.
        #[arg(long)]
        keep: bool,
    },
    /// The dataplane and router test binaries and a short soak on Debian's kernels 5.10,
    /// 6.1 and 6.12 (root; `test` runs all three): each pinned package fetched
    /// through a private apt configuration, booted under QEMU with the host's root
    /// shared over 9p. Prints a table of kernel × test binary (passed/run) and writes it,
    /// with each binary's log, to <target>/kernels/. Fails when any kernel fails.
    Kernels(kernels::Args),
    /// Fuzz the ClientHello/SNI parser for a while (cargo-fuzz, nightly).
    Fuzz {
        /// How long, in seconds.
        #[arg(long, default_value_t = 60)]
        seconds: u32,
    },
}

/// Options of the comparison (`cargo xtask bench`).
#[derive(Debug, clap::Args)]
struct CompareArgs {
    /// Short runs, one repetition, 1,000 idle connections: a smoke run in about a minute.
    #[arg(long)]
    quick: bool,
    /// Repetitions of every figure (default 3; 1 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Only these routers, comma-separated: direct, ebpf, ebpf-rewrite, splice, copy, nginx,
    /// haproxy.
    /// Also tc-rewrite, an experiment never run by default (bench/experiments/tcp-rewrite;
    /// needs clang and libbpf-dev).
    #[arg(long)]
    only: Option<String>,
    /// Only these figures, comma-separated: bulk, latency, setup, memory, wake.
    #[arg(long)]
    figures: Option<String>,
    /// Output directory (default <target>/bench).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// 100,000 concurrent connections through the waypoint (bounded in time): every one
    /// established end to end, spot-checked, the daemon's memory at the peak, then closed.
    Scale {
        /// Concurrent connections.
        #[arg(long, default_value_t = 100_000)]
        connections: usize,
        /// Dataplane: auto (the default), ebpf, ebpf-rewrite (ebpf with --rewrite-splice),
        /// splice or copy.
        #[arg(long, default_value = "ebpf")]
        dataplane: String,
        /// Give up opening connections after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        /// Output directory (default <target>/bench).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Criterion micro-benchmark of the ClientHello/SNI parser: ns per hello for a
    /// classic, a post-quantum (X25519MLKEM768) and an OpenSSL hello.
    Sni,
    /// Direct TCP vs the ebpf, splice and copy dataplanes: Gbit/s (1 and 8 streams),
    /// ping-pong p50/p99 µs, machine-wide CPU seconds per GB.
    Dataplane {
        /// Shorter runs, for a smoke test.
        #[arg(long)]
        quick: bool,
        /// Also write the raw figures as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn root() -> anyhow::Result<PathBuf> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    Ok(manifest
        .parent()
        .context("xtask has no parent directory")?
        .to_path_buf())
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn cargo(root: &Path) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    c.current_dir(root);
    c
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let root = root()?;
    match cli.task {
        Task::BuildEbpf => build_ebpf(&root),
        Task::Test {
            no_lint,
            no_kernels,
        } => test(&root, no_lint, no_kernels),
        Task::Fuzz { seconds } => fuzz(&root, seconds),
        Task::Demo { keep, dataplane } => demo(&root, keep, &dataplane),
        Task::Soak { args } => soak(&root, &args),
        Task::Kernels(args) => kernels::kernels(&root, &args),
        Task::E2eKind { keep } => {
            // Printed and exited here rather than returned: an anyhow error would capture
            // and symbolize a backtrace under RUST_BACKTRACE=1, which takes seconds.
            if let Err(e) = kind::preflight() {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
            kind::e2e(&root, keep)
        }
        Task::Bench {
            which: None,
            compare,
        } => bench_compare(&root, &compare),
        Task::Bench {
            which:
                Some(Bench::Scale {
                    connections,
                    dataplane,
                    timeout,
                    out,
                }),
            ..
        } => {
            let (bench, waypoint) = build_bench(&root)?;
            let mut c = Command::new(bench);
            c.current_dir(&root)
                .arg("scale")
                .arg("--waypoint")
                .arg(waypoint)
                .arg("--out")
                .arg(out.unwrap_or_else(|| target_dir(&root).join("bench")))
                .args(["--connections", &connections.to_string()])
                .args(["--dataplane", &dataplane])
                .args(["--timeout", &timeout.to_string()]);
            run(&mut c)
        }
        Task::Bench {
            which: Some(Bench::Sni),
            ..
        } => run(cargo(&root).args(["bench", "-p", "waypoint-user", "--bench", "sni"])),
        Task::Bench {
            which: Some(Bench::Dataplane { quick, json }),
            ..
        } => {
            let mut c = cargo(&root);
            c.args(["bench", "-p", "waypoint-user", "--bench", "dataplane", "--"]);
            if quick {
                c.arg("--quick");
            }
            if let Some(j) = json {
                c.arg("--json").arg(j);
            }
            run(&mut c)
        }
    }
}

/// Where cargo puts build outputs (CARGO_TARGET_DIR or <root>/target).
fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if Path::new(&d).is_absolute() => PathBuf::from(d),
        Some(d) => root.join(d),
        None => root.join("target"),
    }
}

/// Builds the daemon and the benchmark (release) and returns their paths.
fn build_bench(root: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    run(cargo(root).args([
        "build",
        "--release",
        "-p",
        "waypoint-user",
        "--bin",
        "waypoint",
        "-p",
        "waypoint-bench",
        // Target selection applies across packages: name both binaries.
        "--bin",
        "waypoint-bench",
    ]))?;
    let release = target_dir(root).join("release");
    Ok((release.join("waypoint-bench"), release.join("waypoint")))
}

fn soak(root: &Path, args: &[String]) -> anyhow::Result<()> {
    let (bench, waypoint) = build_bench(root)?;
    run(Command::new(bench)
        .current_dir(root)
        .arg("soak")
        .arg("--waypoint")
        .arg(waypoint)
        .args(args))
}

fn bench_compare(root: &Path, a: &CompareArgs) -> anyhow::Result<()> {
    let (bench, waypoint) = build_bench(root)?;
    let mut c = Command::new(bench);
    c.current_dir(root)
        .arg("compare")
        .arg("--waypoint")
        .arg(waypoint)
        .arg("--out")
        .arg(
            a.out
                .clone()
                .unwrap_or_else(|| target_dir(root).join("bench")),
        );
    if a.quick {
        c.arg("--quick");
    }
    if let Some(r) = a.reps {
        c.args(["--reps", &r.to_string()]);
    }
    if let Some(o) = &a.only {
        c.args(["--only", o]);
    }
    if let Some(f) = &a.figures {
        c.args(["--figures", f]);
    }
    run(&mut c)
}

fn demo(root: &Path, keep: bool, dataplane: &str) -> anyhow::Result<()> {
    run(cargo(root).args([
        "build",
        "--release",
        "-p",
        "waypoint-user",
        "-p",
        "waypoint-e2e",
        "--bins",
    ]))?;
    let mut c = Command::new(root.join("target/release/waypoint-e2e"));
    c.args(["demo", "--dataplane", dataplane]);
    if keep {
        c.arg("--keep");
    }
    run(&mut c)
}

fn build_ebpf(root: &Path) -> anyhow::Result<()> {
    let toolchain =
        std::env::var("WAYPOINT_EBPF_TOOLCHAIN").unwrap_or_else(|_| "debian-web".to_owned());
    let target_dir = root.join("target/ebpf-build");
    run(Command::new("rustup")
        .current_dir(root)
        .args([
            "run",
            &toolchain,
            "cargo",
            "build",
            "--package",
            "waypoint-ebpf",
        ])
        .args([
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("RUSTC_BOOTSTRAP", "1")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            "--cfg=bpf_target_arch=\"x86_64\"\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf",
        ))?;
    // The splice's object and the reuseport migration's (see waypoint-ebpf/Cargo.toml).
    for name in ["waypoint", "waypoint-reuseport"] {
        let built = target_dir.join("bpfel-unknown-none/release").join(name);
        let out = root.join("target/ebpf").join(name);
        std::fs::create_dir_all(out.parent().context("no parent")?)?;
        std::fs::copy(&built, &out)
            .with_context(|| format!("copying {} to {}", built.display(), out.display()))?;
        eprintln!("eBPF object: {}", out.display());
    }
    Ok(())
}

/// A bounded cargo-fuzz run of the ClientHello/SNI parser, seeded with the recorded
/// hellos. A crash fails the run and leaves the input in fuzz/artifacts/.
fn fuzz(root: &Path, seconds: u32) -> anyhow::Result<()> {
    let corpus = root.join("fuzz/corpus/client_hello");
    std::fs::create_dir_all(&corpus)?;
    for entry in std::fs::read_dir(root.join("waypoint-user/testdata"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "bin") {
            let name = path.file_name().context("fixture without a name")?;
            std::fs::copy(&path, corpus.join(name))?;
        }
    }
    // cargo-fuzz needs a nightly compiler (sanitizers); `rustup run` because the cargo
    // running xtask may be a plain binary that does not understand `+nightly`.
    run(Command::new("rustup")
        .current_dir(root)
        .args([
            "run",
            "nightly",
            "cargo",
            "fuzz",
            "run",
            "--fuzz-dir",
            "fuzz",
            "client_hello",
        ])
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO")
        .arg(&corpus)
        .arg("--")
        .arg(format!("-max_total_time={seconds}")))
}

fn test(root: &Path, no_lint: bool, no_kernels: bool) -> anyhow::Result<()> {
    // The integration tier needs root (eBPF, network namespaces): fail loudly rather
    // than skip.
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .context("running id -u")?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!("the test suite needs root (eBPF and network namespaces); run it with sudo");
    }
    // Where the run's time goes (CI has 90 minutes), said as each step starts.
    let started = std::time::Instant::now();
    let step = |name: &str| {
        eprintln!(
            "xtask test: {:.0} s in, next: {name}",
            started.elapsed().as_secs_f64()
        );
    };
    if !no_lint {
        step("fmt, clippy");
        run(cargo(root).args(["fmt", "--all", "--", "--check"]))?;
        run(cargo(root).args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;
    }
    step("fuzz");
    fuzz(root, 60)?;
    // Release: the dataplane tests move gigabytes; debug builds make them needlessly slow.
    step("cargo test --release");
    run(cargo(root).args(["test", "--release"]))?;
    // Every kernel the docs claim, each path it is claimed for.
    if !no_kernels {
        step("kernels");
        kernels::kernels(root, &kernels::Args::for_test())?;
    }
    // The byte path proven by volume: every dataplane, real TLS and raw, under CPU
    // contention. Last, so that its closing line ("soak: N passed, N failed") closes
    // the run.
    step("soak");
    soak(
        root,
        &[
            "--seconds".to_owned(),
            SOAK_SECONDS.to_owned(),
            "--dataplanes".to_owned(),
            SOAK_DATAPLANES.to_owned(),
        ],
    )
}

/// Seconds of the soak per dataplane in `cargo xtask test`. The SockHash path's stall it
/// guards against (a repeat passed to userspace) showed 24 to 38 times in 20 s.
const SOAK_SECONDS: &str = "60";

/// The soak's dataplanes in `cargo xtask test`: the default (`auto`, no dataplane flag)
/// and all four named, each with TLS and raw clients mixed (a raw client streams right
/// behind its hello, the rewrite hand-over's hardest case).
const SOAK_DATAPLANES: &str = "auto,ebpf,ebpf-rewrite,splice,copy";
