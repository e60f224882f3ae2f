//! Wires a task together: checks, settings, servers, the run, and the files it writes.

use std::{net::IpAddr, path::Path, process::Command, time::Duration};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use crate::{
    chart,
    cli::{Cli, Compare, Figure, Scale, Soak, Task},
    hello, report,
    routers::Kind,
    scale,
    servers::Servers,
    soak,
    suite::{self, Settings},
    sys,
};

/// Runs the task; Ok(false) when it ran but its check failed.
pub fn run(cli: Cli) -> anyhow::Result<bool> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!("waypoint-bench needs root (eBPF dataplane, RLIMIT_NOFILE, CPU pinning); run it with sudo");
    }
    match cli.task {
        Task::Compare(c) => compare(c).map(|()| true),
        Task::Scale(s) => scale_check(s),
        Task::Soak(s) => soak_run(s),
        Task::ScaleServer { ip, sink_ip, port } => {
            scale::worker::server(ip, sink_ip, port).map(|()| true)
        }
        Task::ScaleClient {
            target,
            source,
            count,
            timeout,
        } => scale::worker::client(source, target, count, Duration::from_secs(timeout))
            .map(|()| true),
    }
}

/// A temporary directory for configs and logs, removed on drop unless kept for a failure.
struct Work(std::path::PathBuf);

impl Work {
    fn new() -> anyhow::Result<Work> {
        let dir = std::env::temp_dir().join(format!("waypoint-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Work(dir))
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| {
            let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
            s.push_str(&String::from_utf8_lossy(&o.stderr));
            s.lines().next().unwrap_or_default().trim().to_owned()
        })
        .unwrap_or_else(|e| format!("{program}: {e}"))
}

fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_default();
    let cpus = sys::online_cpus();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1048576.0);
    let date = command_line("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]);
    let nginx = command_line("nginx", &["-v"]);
    let haproxy = command_line("haproxy", &["-v"]);
    let calibrated = sys::calibrate();
    let speed = match &calibrated {
        Ok(c) => format!(
            "; speed: getppid {:.0} ns, pinned pipe round trip {:.1} µs",
            c.syscall_ns, c.pipe_round_trip_us
        ),
        Err(e) => format!("; speed not measured ({e})"),
    };
    let calibration = calibrated.ok();
    json!({
        "summary": format!("{cpus} × {model}, {mem_gib:.0} GiB, kernel {kernel}{speed}"),
        "syscall_ns": calibration.map(|c| c.syscall_ns),
        "pipe_round_trip_us": calibration.map(|c| c.pipe_round_trip_us),
        "date": date, "cpus": cpus, "cpu_model": model, "kernel": kernel, "mem_gib": mem_gib,
        "nginx": nginx, "haproxy": haproxy,
    })
}

fn check_waypoint(path: &Path) -> anyhow::Result<()> {
    if !path.exists() {
        bail!(
            "no waypoint binary at {}: build it with `cargo build --release -p waypoint-user --bin waypoint` or pass --waypoint",
            path.display()
        );
    }
    Ok(())
}

fn compare(c: Compare) -> anyhow::Result<()> {
    let cpus = sys::online_cpus();
    let kinds = match &c.only {
        None => Kind::ALL.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| Kind::parse(n).with_context(|| format!("unknown router {n:?}")))
            .collect::<anyhow::Result<Vec<_>>>()?,
    };
    if kinds.iter().any(|k| k.is_waypoint()) {
        check_waypoint(&c.common.daemon.waypoint)?;
    }
    let quick = c.quick;
    let work = Work::new()?;
    // The client and server ends of every idle connection live in this process and a
    // router holds two sockets per connection: the file limit caps the memory figure's
    // connection count (a container without CAP_SYS_RESOURCE cannot raise the hard limit).
    let wanted_idle = c.idle_conns.unwrap_or(if quick { 1_000 } else { 10_000 });
    let nofile = sys::raise_nofile((2 * wanted_idle + 16_384) as u64)?;
    let idle_conns = wanted_idle.min((nofile as usize).saturating_sub(300) / 2);
    if idle_conns < wanted_idle {
        eprintln!(
            "note: RLIMIT_NOFILE is {nofile} and cannot be raised here: the memory figure uses {idle_conns} idle connections instead of {wanted_idle}"
        );
    }
    let settings = Settings {
        quick,
        reps: c.reps.unwrap_or(if quick { 1 } else { 3 }).max(1),
        warmup: Duration::from_millis(if quick { 300 } else { 500 }),
        duration: Duration::from_secs_f64(c.seconds.unwrap_or(if quick { 1.0 } else { 3.0 })),
        bulk_conns: vec![1, 8, 64],
        pings_warmup: if quick { 500 } else { 2_000 },
        pings: if quick { 3_000 } else { 20_000 },
        setups: if quick { 300 } else { 3_000 },
        wakes: if quick { 10 } else { 30 },
        wake_pause: Duration::from_millis(300),
        churn_openers: vec![16, 64],
        churn_duration: Duration::from_secs_f64(if quick { 1.0 } else { 3.0 }),
        idle_conns,
        nofile,
        kinds,
        waypoint_bin: c.common.daemon.waypoint.clone(),
        work: work.0.clone(),
        pin_cpu: c.pin_cpu.unwrap_or(cpus - 1).min(cpus - 1),
        figures: c.figures.clone().unwrap_or_else(|| Figure::ALL.to_vec()),
    };
    let servers = Servers::start(
        &[IpAddr::from([127, 0, 1, 1])],
        IpAddr::from([127, 0, 2, 1]),
        0,
        hello::len(),
    )?;
    let fonts = chart::init_font();
    let machine = machine();
    eprintln!(
        "waypoint-bench compare: {} on {}; routers {:?}; configs in {}",
        if quick { "quick" } else { "full" },
        machine["summary"].as_str().unwrap_or_default(),
        settings.kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
        work.0.display()
    );
    let out = c.common.out.clone();
    let run = suite::run(settings, &servers)?;
    servers.shutdown();

    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let md = report::markdown(&run, &machine);
    let doc = report::json(&run, &machine);
    let md_path = out.join("report.md");
    let json_path = out.join("results.json");
    std::fs::write(&md_path, &md).with_context(|| format!("writing {}", md_path.display()))?;
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    println!("{md}");
    println!(
        "- report: {}\n- raw figures: {}",
        md_path.display(),
        json_path.display()
    );
    match fonts {
        Ok(()) => {
            let figs = report::figures(&run);
            for r in chart::draw_all(&run, &figs, &out) {
                match r {
                    Ok(p) => println!("- chart: {}", p.display()),
                    Err(e) => println!("- chart failed: {e}"),
                }
            }
        }
        Err(e) => println!("- no charts: {e}"),
    }
    if !report::busy(&run).is_empty() {
        println!("\n**The machine was busy during this run: re-run on a quiet machine before quoting these figures.**");
    }
    Ok(())
}

fn scale_check(s: Scale) -> anyhow::Result<bool> {
    check_waypoint(&s.common.daemon.waypoint)?;
    let kind = Kind::parse(&s.dataplane)
        .filter(|k| k.is_waypoint())
        .with_context(|| {
            format!(
                "--dataplane {:?}: use ebpf, ebpf-rewrite, auto, splice or copy",
                s.dataplane
            )
        })?;
    let work = Work::new()?;
    let settings = scale::Settings {
        connections: s.connections,
        kind,
        deadline: s.deadline(),
        waypoint_bin: s.common.daemon.waypoint.clone(),
        work: work.0.clone(),
    };
    let (md, doc, ok) = scale::run(&settings)?;
    let out = &s.common.out;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let md_path = out.join("scale.md");
    let json_path = out.join("scale.json");
    std::fs::write(&md_path, &md)?;
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)?)?;
    println!(
        "{md}\n- written to {} and {}",
        md_path.display(),
        json_path.display()
    );
    Ok(ok)
}

fn soak_run(s: Soak) -> anyhow::Result<bool> {
    check_waypoint(&s.daemon.waypoint)?;
    let modes = parse_modes(&s.modes, "--modes")?;
    let kinds = s
        .dataplanes
        .iter()
        .map(|d| {
            // `name` or `name:mode+mode`: a dataplane's own modes.
            let (name, own) = d.split_once(':').unwrap_or((d, ""));
            let kind = Kind::parse(name)
                .filter(|k| k.is_waypoint())
                .with_context(|| {
                    format!("--dataplanes {d:?}: use ebpf, ebpf-rewrite, auto, splice or copy")
                })?;
            let modes = if own.is_empty() {
                modes.clone()
            } else {
                let own: Vec<String> = own.split('+').map(str::to_owned).collect();
                parse_modes(&own, &format!("--dataplanes {d:?}"))?
            };
            Ok((kind, modes))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if s.parallel == 0 || s.seconds.is_nan() || s.seconds <= 0.0 {
        bail!("--parallel and --seconds must be above 0");
    }
    let work = Work::new()?;
    let seed = s.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    soak::run(&soak::Settings {
        kinds,
        duration: Duration::from_secs_f64(s.seconds),
        parallel: s.parallel,
        busy: s.busy,
        deadline: Duration::from_secs(s.deadline),
        seed,
        replay: s.replay,
        netem: s.netem.clone(),
        waypoint_bin: s.daemon.waypoint.clone(),
        work: work.0.clone(),
    })
}

fn parse_modes(names: &[String], what: &str) -> anyhow::Result<Vec<soak::Mode>> {
    let modes = names
        .iter()
        .map(|m| {
            soak::Mode::parse(m).with_context(|| format!("{what}: mode {m:?}: use tls or raw"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if modes.is_empty() {
        bail!("{what}: no mode");
    }
    Ok(modes)
}
