//! Turns a run into figures (median, min, max over the repetitions), ratios to direct and
//! to nginx, goal verdicts, a Markdown report and a JSON document.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::{
    load::Latency,
    routers::Kind,
    suite::{self, Results, Run},
};

/// Median, min and max of the finite values.
#[derive(Clone, Copy, Debug)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

pub fn spread(xs: &[f64]) -> Spread {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Spread {
            median: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
            n,
        };
    }
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Spread {
        median,
        min: v[0],
        max: v[n - 1],
        n,
    }
}

/// Extracts one figure's samples from a router's results.
type Values = Box<dyn Fn(&Results) -> Vec<f64>>;
/// Judges one router against a goal.
type Judge = Box<dyn Fn(&Run, Kind) -> Option<Verdict>>;

/// One row of the table: how to get its samples out of a router's results.
pub struct Figure {
    pub key: String,
    pub label: String,
    pub decimals: usize,
    values: Values,
}

impl Figure {
    fn new(
        key: impl Into<String>,
        label: impl Into<String>,
        decimals: usize,
        values: impl Fn(&Results) -> Vec<f64> + 'static,
    ) -> Figure {
        Figure {
            key: key.into(),
            label: label.into(),
            decimals,
            values: Box::new(values),
        }
    }

    pub fn values(&self, r: &Results) -> Vec<f64> {
        (self.values)(r)
    }
}

/// Every figure the run measured, in table order.
pub fn figures(run: &Run) -> Vec<Figure> {
    let hz = run.hz;
    let mut f = Vec::new();
    for (i, &c) in run.settings.bulk_conns.iter().enumerate() {
        f.push(Figure::new(
            format!("bulk_{c}_gbit_per_s"),
            format!("bulk, {c} conn{}, Gbit/s", if c == 1 { "" } else { "s" }),
            2,
            move |r| r.bulk[i].iter().map(|b| b.gbps()).collect(),
        ));
    }
    type Pick = fn(&Latency) -> f64;
    let quantiles: [(&str, &str, Pick); 3] = [
        ("p50", "p50", |l| l.p50),
        ("p99", "p99", |l| l.p99),
        ("p999", "p99.9", |l| l.p999),
    ];
    for (slot, pin) in [(0, "unpinned"), (1, "pinned")] {
        for (k, label, q) in quantiles {
            f.push(Figure::new(
                format!("ping_{pin}_{k}_us"),
                format!("64 B ping-pong {label}, {pin}, µs"),
                1,
                move |r| r.ping[slot].iter().map(q).collect(),
            ));
        }
    }
    for (slot, pin) in [(0, "unpinned"), (1, "pinned")] {
        for (k, label, q) in &quantiles[..2] {
            let q = *q;
            f.push(Figure::new(
                format!("setup_{pin}_{k}_us"),
                format!("connection setup {label}, {pin}, µs"),
                1,
                move |r| r.setup[slot].iter().map(|x| q(&x.latency)).collect(),
            ));
        }
        f.push(Figure::new(
            format!("setup_{pin}_conn_per_s"),
            format!("connections/s (one client), {pin}"),
            0,
            move |r| r.setup[slot].iter().map(|x| x.conn_per_s).collect(),
        ));
    }
    // Where a new connection's CPU goes, on one CPU: what the router's processes ran
    // (its end of both connections, and the kernel's work for the packets it sends),
    // and what the load generator's and servers' did.
    f.push(Figure::new(
        "setup_pinned_router_cpu_us",
        "router CPU per new connection, pinned, µs",
        1,
        |r| r.setup[1].iter().map(|x| x.router_cpu_us).collect(),
    ));
    f.push(Figure::new(
        "setup_pinned_bench_cpu_us",
        "load generator + servers CPU per new connection, pinned, µs",
        1,
        |r| r.setup[1].iter().map(|x| x.bench_cpu_us).collect(),
    ));
    let pause = run.settings.wake_pause.as_millis();
    for (k, label, q) in &quantiles[..2] {
        let q = *q;
        f.push(Figure::new(
            format!("wake_{k}_us"),
            format!("64 B round trip after {pause} ms idle {label}, unpinned, µs"),
            1,
            move |r| r.wake.iter().map(q).collect(),
        ));
    }
    for (i, &n) in run.settings.churn_openers.iter().enumerate() {
        f.push(Figure::new(
            format!("churn_{n}_conn_per_s"),
            format!("connections/s, {n} openers, unpinned"),
            0,
            move |r| r.churn[i].iter().map(|c| c.conn_per_s).collect(),
        ));
        f.push(Figure::new(
            format!("churn_{n}_resets"),
            format!("resets among them, {n} openers"),
            0,
            move |r| r.churn[i].iter().map(|c| c.resets as f64).collect(),
        ));
        f.push(Figure::new(
            format!("churn_{n}_router_cpu_us"),
            format!("router CPU per connection, {n} openers, µs"),
            1,
            move |r| r.churn[i].iter().map(|c| c.router_cpu_us).collect(),
        ));
    }
    f.push(Figure::new(
        "rss_bytes_per_idle_conn",
        format!(
            "router RSS per established idle connection, B ({} conns)",
            run.settings.idle_conns
        ),
        0,
        |r| r.memory.iter().map(suite::Memory::per_conn).collect(),
    ));
    for (i, &c) in run.settings.bulk_conns.iter().enumerate() {
        f.push(Figure::new(
            format!("cpu_s_per_gb_bulk_{c}"),
            format!(
                "machine CPU s per GB, bulk {c} conn{}",
                if c == 1 { "" } else { "s" }
            ),
            3,
            move |r| r.bulk[i].iter().map(|b| b.cpu_s_per_gb(hz)).collect(),
        ));
    }
    f
}

fn find(run: &Run, kind: Kind) -> Option<&Results> {
    run.results.iter().find(|r| r.kind == kind)
}

fn median_of(run: &Run, kind: Kind, fig: &Figure) -> f64 {
    find(run, kind).map_or(f64::NAN, |r| spread(&fig.values(r)).median)
}

fn fmt(x: f64, decimals: usize) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}")
    } else {
        "–".into()
    }
}

fn cell(s: Spread, decimals: usize) -> String {
    if s.n == 0 {
        return "–".into();
    }
    if s.n == 1 || s.min == s.max {
        return fmt(s.median, decimals);
    }
    format!(
        "{} ({}–{})",
        fmt(s.median, decimals),
        fmt(s.min, decimals),
        fmt(s.max, decimals)
    )
}

/// A goal and its verdict for one router.
pub struct Verdict {
    pub value: f64,
    pub text: String,
    pub met: bool,
}

/// A goal: what it says and how to judge a router against it.
pub struct Goal {
    pub key: &'static str,
    pub text: &'static str,
    judge: Judge,
}

impl Goal {
    pub fn judge(&self, run: &Run, kind: Kind) -> Option<Verdict> {
        (self.judge)(run, kind)
    }
}

fn fig<'a>(figs: &'a [Figure], key: &str) -> Option<&'a Figure> {
    figs.iter().find(|f| f.key == key)
}

/// A goal met when a router's median of `figure` is at most `limit`.
fn at_most(
    key: &'static str,
    text: &'static str,
    figure: &'static str,
    limit: f64,
    show: fn(f64) -> String,
) -> Goal {
    Goal {
        key,
        text,
        judge: Box::new(move |run, kind| {
            let figs = figures(run);
            let value = median_of(run, kind, fig(&figs, figure)?);
            value.is_finite().then(|| Verdict {
                value,
                text: show(value),
                met: value <= limit,
            })
        }),
    }
}

/// A goal on the ratio of a router's median of `figure` to `base`'s: met at least
/// `limit` (`higher`) or at most `limit`.
fn ratio_to(
    key: &'static str,
    text: &'static str,
    figure: String,
    base: Kind,
    limit: f64,
    higher: bool,
) -> Goal {
    Goal {
        key,
        text,
        judge: Box::new(move |run, kind| {
            let figs = figures(run);
            let f = fig(&figs, &figure)?;
            let ratio = median_of(run, kind, f) / median_of(run, base, f);
            ratio.is_finite().then(|| Verdict {
                value: ratio,
                text: format!("{ratio:.2}×"),
                met: if higher {
                    ratio >= limit
                } else {
                    ratio <= limit
                },
            })
        }),
    }
}

/// A goal on what a router adds to direct TCP's median of `figure`, in µs: at most
/// `limit`.
fn added_at_most(key: &'static str, text: &'static str, figure: &'static str, limit: f64) -> Goal {
    Goal {
        key,
        text,
        judge: Box::new(move |run, kind| {
            let figs = figures(run);
            let f = fig(&figs, figure)?;
            let added = median_of(run, kind, f) - median_of(run, Kind::Direct, f);
            added.is_finite().then(|| Verdict {
                value: added,
                text: format!("{added:+.1} µs"),
                met: added <= limit,
            })
        }),
    }
}

/// Connections/s under 16 openers at least nginx's, with no reset in any run (where the
/// run measured 16 openers).
fn churn_goal(run: &Run, key: &'static str) -> Option<Goal> {
    let i = run.settings.churn_openers.iter().position(|&n| n == 16)?;
    Some(Goal {
        key,
        text: "connections/s under 16 openers ≥ nginx's, 0 resets (in any run)",
        judge: Box::new(move |run, kind| {
            let figs = figures(run);
            let f = fig(&figs, "churn_16_conn_per_s")?;
            let ratio = median_of(run, kind, f) / median_of(run, Kind::Nginx, f);
            let most_resets = find(run, kind)?
                .churn
                .get(i)?
                .iter()
                .map(|c| c.resets)
                .max()?;
            ratio.is_finite().then(|| Verdict {
                value: ratio,
                text: format!("{ratio:.2}×, {most_resets} resets"),
                met: ratio >= 1.0 && most_resets == 0,
            })
        }),
    })
}

/// The goals; each is judged on medians.
pub fn goals(run: &Run) -> Vec<Goal> {
    let mut g = vec![
        ratio_to(
            "bulk_1_vs_direct",
            "bulk, 1 conn ≥ 0.9× direct",
            "bulk_1_gbit_per_s".into(),
            Kind::Direct,
            0.9,
            true,
        ),
        ratio_to(
            "bulk_8_vs_direct",
            "bulk, 8 conns ≥ 0.9× direct",
            "bulk_8_gbit_per_s".into(),
            Kind::Direct,
            0.9,
            true,
        ),
        added_at_most(
            "added_rtt_pinned_us",
            "added latency per round trip, pinned p50 ≤ 5 µs",
            "ping_pinned_p50_us",
            5.0,
        ),
        added_at_most(
            "added_setup_pinned_us",
            "added cost per new connection, pinned p50 ≤ 30 µs",
            "setup_pinned_p50_us",
            30.0,
        ),
        at_most(
            "router_cpu_per_setup_us",
            "(same, the router's own CPU per new connection, pinned ≤ 30 µs)",
            "setup_pinned_router_cpu_us",
            30.0,
            |us| format!("{us:.1} µs"),
        ),
        at_most(
            "rss_per_conn_bytes",
            "userspace memory per established connection ≤ 1 KiB",
            "rss_bytes_per_idle_conn",
            1024.0,
            |b| format!("{b:.0} B"),
        ),
    ];
    let cpu_key = if run.settings.bulk_conns.contains(&8) {
        "cpu_s_per_gb_bulk_8"
    } else {
        "cpu_s_per_gb_bulk_1"
    };
    g.push(ratio_to(
        "cpu_per_gb_vs_nginx",
        "machine-wide CPU per GB (bulk, 8 conns) ≤ 0.25× nginx",
        cpu_key.into(),
        Kind::Nginx,
        0.25,
        false,
    ));
    g.push(Goal {
        key: "added_cpu_per_gb_vs_nginx",
        text: "(same, router's share: CPU/GB minus direct's, ≤ 0.25× nginx's)",
        judge: Box::new(move |run, kind| {
            let figs = figures(run);
            let f = fig(&figs, cpu_key)?;
            let d = median_of(run, Kind::Direct, f);
            let (mine, nginx) = (
                median_of(run, kind, f) - d,
                median_of(run, Kind::Nginx, f) - d,
            );
            // Below direct's own cost, or nginx not above it: the difference is noise,
            // not a verdict.
            if mine <= 0.0 || nginx <= 0.0 {
                return None;
            }
            let ratio = mine / nginx;
            ratio.is_finite().then(|| Verdict {
                value: ratio,
                text: format!("{ratio:.2}×"),
                met: ratio <= 0.25,
            })
        }),
    });
    g.extend(churn_goal(run, "churn_16_vs_nginx"));
    g
}

/// The router whose figures are the daemon's default's: `auto` runs the rewrite splice
/// (with the SockHash for the connections it refuses) on a kernel with the 2023 sockmap
/// fixes, which every bench kernel has (the kernel matrix covers older ones).
pub const DEFAULT_PATH: Kind = Kind::EbpfRewrite;

/// The goals for the daemon's default (`waypoint run` with no dataplane flag), judged on
/// [`DEFAULT_PATH`]'s medians.
pub fn default_goals(run: &Run) -> Vec<Goal> {
    let mut g = vec![
        ratio_to(
            "default_bulk_8_vs_direct",
            "bulk, 8 conns ≥ 0.95× direct",
            "bulk_8_gbit_per_s".into(),
            Kind::Direct,
            0.95,
            true,
        ),
        added_at_most(
            "default_added_rtt_pinned_us",
            "added round trip, pinned p50 ≤ +3 µs",
            "ping_pinned_p50_us",
            3.0,
        ),
        added_at_most(
            "default_added_setup_pinned_us",
            "added setup, pinned p50 ≤ +20 µs",
            "setup_pinned_p50_us",
            20.0,
        ),
        at_most(
            "default_rss_per_conn_bytes",
            "≤ 512 B per idle connection",
            "rss_bytes_per_idle_conn",
            512.0,
            |b| format!("{b:.0} B"),
        ),
    ];
    g.extend(churn_goal(run, "default_churn_16_vs_nginx"));
    g
}

/// Whether the machine looked busy during the run, with the reasons.
pub fn busy(run: &Run) -> Vec<String> {
    let mut why = Vec::new();
    for p in &run.probes {
        if p.idle_pct < suite::BUSY_IDLE_PCT {
            why.push(format!(
                "before repetition {}: only {:.0}% idle while the benchmark was quiet (loadavg {}; busiest others: {})",
                p.rep,
                p.idle_pct,
                p.loadavg,
                suite::top_line(&p.top)
            ));
        }
    }
    let mut noisy = 0;
    let mut windows = 0;
    let mut worst: f64 = 0.0;
    for r in &run.results {
        for b in r.bulk.iter().flatten() {
            windows += 1;
            let share = b.foreign_s / b.secs;
            worst = worst.max(share);
            if share > suite::BUSY_FOREIGN_SHARE {
                noisy += 1;
            }
        }
    }
    if noisy > 0 {
        why.push(format!(
            "other processes used more than {:.0}% of a CPU in {noisy} of {windows} bulk windows (worst {:.0}%)",
            100.0 * suite::BUSY_FOREIGN_SHARE,
            100.0 * worst
        ));
    }
    why
}

fn kinds(run: &Run) -> Vec<Kind> {
    run.results.iter().map(|r| r.kind).collect()
}

/// The Markdown report.
pub fn markdown(run: &Run, machine: &Value) -> String {
    let s = &run.settings;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# waypoint vs nginx vs HAProxy on loopback ({} mode)\n",
        if s.quick { "quick" } else { "full" }
    );
    let _ = writeln!(
        out,
        "- machine: {}; run {}; wall time {:.0} s; loadavg after: {}",
        machine["summary"].as_str().unwrap_or_default(),
        machine["date"].as_str().unwrap_or_default(),
        run.wall_s,
        run.loadavg_after
    );
    let _ = writeln!(
        out,
        "- every connection replays a recorded rustls 0.23 ClientHello with a post-quantum key share (X25519MLKEM768, {} B) and waits for the server's 1-byte answer; nginx: `stream` + `ssl_preread`, 1 worker; HAProxy: `mode tcp`, `req.ssl_sni`, `nbthread 1`; the waypoint daemon with each dataplane; each router in a cgroup (v2) of its own, as in a pod (where the machine has none, a note on stderr says so), and running only for its own turn in each repetition; servers and load generator in the benchmark process",
        crate::hello::len()
    );
    let _ = writeln!(
        out,
        "- {} repetition(s), each figure median (min–max); bulk {} s after {} ms warm-up; ping-pong {} round trips after {}; setup {} sequential connections; wake: {} round trips, each after {} ms idle; churn: {:?} threads each opening connections (connect, hello, one byte echoed) and closing them back to back for {} s; memory: {} idle connections on a fresh router; pinned: every process on CPU {}",
        s.reps,
        s.duration.as_secs_f64(),
        s.warmup.as_millis(),
        s.pings,
        s.pings_warmup,
        s.setups,
        s.wakes,
        s.wake_pause.as_millis(),
        s.churn_openers,
        s.churn_duration.as_secs_f64(),
        s.idle_conns,
        s.pin_cpu
    );
    let _ = writeln!(
        out,
        "- ×d: ratio to direct, ×n: ratio to nginx (of the medians); CPU is machine-wide from /proc/stat (user+nice+system+irq+softirq), load generator and servers included"
    );
    let busy = busy(run);
    if busy.is_empty() {
        let _ = writeln!(out, "- the machine was quiet (idle ≥ {:.0}% before every repetition, no other process above {:.0}% of a CPU in any bulk window)", suite::BUSY_IDLE_PCT, 100.0 * suite::BUSY_FOREIGN_SHARE);
    } else {
        let _ = writeln!(
            out,
            "\n**WARNING: the machine was busy; figures are noisy and ratios unreliable:**\n"
        );
        for w in &busy {
            let _ = writeln!(out, "- {w}");
        }
    }
    out.push('\n');

    let ks = kinds(run);
    let figs = figures(run);
    let _ = write!(out, "| figure |");
    for k in &ks {
        let _ = write!(out, " {} |", k.name());
    }
    let _ = write!(out, "\n|---|");
    for _ in &ks {
        out.push_str("---|");
    }
    out.push('\n');
    for f in &figs {
        let _ = write!(out, "| {} |", f.label);
        let d = median_of(run, Kind::Direct, f);
        let n = median_of(run, Kind::Nginx, f);
        for r in &run.results {
            let sp = spread(&f.values(r));
            let mut c = cell(sp, f.decimals);
            let mut ratios = Vec::new();
            if r.kind != Kind::Direct && d.is_finite() && d != 0.0 && sp.n > 0 {
                ratios.push(format!("×{:.2} d", sp.median / d));
            }
            if r.kind != Kind::Nginx && n.is_finite() && n != 0.0 && sp.n > 0 {
                ratios.push(format!("×{:.2} n", sp.median / n));
            }
            if !ratios.is_empty() {
                let _ = write!(c, "<br>{}", ratios.join(" · "));
            }
            let _ = write!(out, " {c} |");
        }
        out.push('\n');
    }

    let _ = writeln!(out, "\n## Goals (judged on the medians)\n");
    let _ = write!(out, "| goal |");
    for k in ks.iter().filter(|k| **k != Kind::Direct) {
        let _ = write!(out, " {} |", k.name());
    }
    let _ = write!(out, "\n|---|");
    for _ in ks.iter().filter(|k| **k != Kind::Direct) {
        out.push_str("---|");
    }
    out.push('\n');
    for g in goals(run) {
        let _ = write!(out, "| {} |", g.text);
        for k in ks.iter().filter(|k| **k != Kind::Direct) {
            let c = match g.judge(run, *k) {
                Some(v) => format!("{} {}", v.text, if v.met { "✅ met" } else { "❌ missed" }),
                None => "–".into(),
            };
            let _ = write!(out, " {c} |");
        }
        out.push('\n');
    }
    out.push_str("\nThe goals are the waypoint's (ebpf, ebpf-rewrite, splice, copy); nginx and HAProxy are judged the same way for reference.\n");

    if ks.contains(&DEFAULT_PATH) {
        let _ = writeln!(
            out,
            "\n## Goals for the default (`waypoint run` with no dataplane flag: `auto`, {} here)\n",
            DEFAULT_PATH.name()
        );
        out.push_str("| goal | verdict |\n|---|---|\n");
        for g in default_goals(run) {
            let c = match g.judge(run, DEFAULT_PATH) {
                Some(v) => format!("{} {}", v.text, if v.met { "✅ met" } else { "❌ missed" }),
                None => "–".into(),
            };
            let _ = writeln!(out, "| {} | {c} |", g.text);
        }
    }

    let with_paths: Vec<_> = run.results.iter().filter(|r| !r.paths.is_empty()).collect();
    if !with_paths.is_empty() {
        let _ = writeln!(
            out,
            "\n## Paths taken\n\nThe waypoint's connections over its measured turns, by \
             the path each took and why not the faster one \
             (`waypoint_dataplane_path_total`); the share is of that router's connections.\n"
        );
        let _ = writeln!(
            out,
            "| router | path | reason | connections | share |\n|---|---|---|---|---|"
        );
        for r in with_paths {
            let total: f64 = r.paths.values().sum();
            for ((path, reason), n) in r.paths.iter().filter(|(_, n)| **n > 0.0) {
                let _ = writeln!(
                    out,
                    "| {} | {path} | {reason} | {n:.0} | {:.1} % |",
                    r.kind.name(),
                    100.0 * n / total
                );
            }
        }
        for r in run.results.iter().filter(|r| r.lingers_cut > 0.0) {
            let _ = writeln!(
                out,
                "\n{}: {:.0} ended connections lingered less than 3 s, the oldest beyond \
                 the linger limit (`waypoint_rewrite_lingers_cut_total`).",
                r.kind.name(),
                r.lingers_cut
            );
        }
    }

    let errors: Vec<String> = run
        .results
        .iter()
        .flat_map(|r| {
            r.errors
                .iter()
                .map(move |e| format!("{}: {e}", r.kind.name()))
        })
        .collect();
    if !errors.is_empty() {
        let _ = writeln!(out, "\n**Failures and partial figures:**\n");
        for e in errors {
            let _ = writeln!(out, "- {e}");
        }
    }
    out
}

fn setup_json(x: &suite::SetupRun) -> Value {
    json!({
        "latency": latency_json(&x.latency),
        "conn_per_s": x.conn_per_s,
        "router_cpu_us_per_conn": x.router_cpu_us,
        "bench_cpu_us_per_conn": x.bench_cpu_us,
    })
}

fn latency_json(l: &Latency) -> Value {
    json!({ "p50_us": l.p50, "p99_us": l.p99, "p999_us": l.p999, "samples": l.n })
}

/// Every raw sample, the summaries and the verdicts.
pub fn json(run: &Run, machine: &Value) -> Value {
    let s = &run.settings;
    let figs = figures(run);
    let goals = goals(run);
    let default_goals = default_goals(run);
    let hz = run.hz;
    json!({
        "mode": if s.quick { "quick" } else { "full" },
        "machine": machine,
        "busy": busy(run),
        "quiet_checks": run.probes.iter().map(|p| json!({
            "rep": p.rep, "idle_pct": p.idle_pct, "loadavg": p.loadavg,
            "busiest_other_processes": p.top.iter().map(|(n, c)| json!({"comm": n, "cpu_s": c})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "wall_s": run.wall_s,
        "loadavg_after": run.loadavg_after,
        "settings": {
            "reps": s.reps, "bulk_secs": s.duration.as_secs_f64(), "bulk_warmup_secs": s.warmup.as_secs_f64(),
            "bulk_conns": s.bulk_conns, "pings": s.pings, "pings_warmup": s.pings_warmup,
            "wakes": s.wakes, "wake_pause_ms": s.wake_pause.as_millis(),
            "churn_openers": s.churn_openers, "churn_secs": s.churn_duration.as_secs_f64(),
            "ping_bytes": crate::load::PING_LEN, "setups": s.setups, "idle_conns": s.idle_conns,
            "pin_cpu": s.pin_cpu, "hello": "replayed rustls 0.23 ClientHello, X25519MLKEM768 + X25519 key shares",
            "hello_bytes": crate::hello::len(),
        },
        "routers": run.results.iter().map(|r| {
            let summaries: serde_json::Map<String, Value> = figs.iter().map(|f| {
                let sp = spread(&f.values(r));
                (f.key.clone(), json!({"median": sp.median, "min": sp.min, "max": sp.max, "runs": f.values(r)}))
            }).collect();
            let verdicts: serde_json::Map<String, Value> = goals.iter().chain(
                if r.kind == DEFAULT_PATH { &default_goals[..] } else { &[] },
            ).filter_map(|g| {
                let v = g.judge(run, r.kind)?;
                Some((g.key.to_owned(), json!({"goal": g.text, "value": v.value, "met": v.met})))
            }).collect();
            json!({
                "name": r.kind.name(),
                "figures": summaries,
                "goals": verdicts,
                "raw": {
                    "bulk": s.bulk_conns.iter().zip(&r.bulk).map(|(c, runs)| json!({
                        "conns": c,
                        "runs": runs.iter().map(|b| json!({
                            "bytes": b.bytes, "secs": b.secs, "gbit_per_s": b.gbps(),
                            "machine_cpu_s_per_gb": b.cpu_s_per_gb(hz),
                            "machine_idle_pct": b.cpu.idle_pct(),
                            "softirq_s": b.cpu.softirq as f64 / hz, "system_s": b.cpu.system as f64 / hz,
                            "user_s": b.cpu.user as f64 / hz, "other_processes_cpu_s": b.foreign_s,
                        })).collect::<Vec<_>>(),
                    })).collect::<Vec<_>>(),
                    "ping_unpinned": r.ping[0].iter().map(latency_json).collect::<Vec<_>>(),
                    "ping_pinned": r.ping[1].iter().map(latency_json).collect::<Vec<_>>(),
                    "setup_unpinned": r.setup[0].iter().map(setup_json).collect::<Vec<_>>(),
                    "wake_unpinned": r.wake.iter().map(latency_json).collect::<Vec<_>>(),
                    "setup_pinned": r.setup[1].iter().map(setup_json).collect::<Vec<_>>(),
                    "churn": s.churn_openers.iter().zip(&r.churn).map(|(n, runs)| json!({
                        "openers": n,
                        "runs": runs.iter().map(|c| json!({
                            "conn_per_s": c.conn_per_s, "resets": c.resets, "failed": c.failed,
                            "router_cpu_us_per_conn": c.router_cpu_us,
                        })).collect::<Vec<_>>(),
                    })).collect::<Vec<_>>(),
                    "memory": r.memory.iter().map(|m| json!({
                        "rss_before_bytes": m.rss_before, "rss_after_bytes": m.rss_after,
                        "opened": m.opened, "wanted": m.wanted, "bytes_per_conn": m.per_conn(), "error": m.error, "parked": m.parked,
                        "heap_bytes_per_conn": m.heap_per_conn(),
                    })).collect::<Vec<_>>(),
                },
                "paths": r.paths.iter().map(|((path, reason), n)| json!({
                    "path": path, "reason": reason, "connections": n,
                })).collect::<Vec<_>>(),
                "lingers_cut": r.lingers_cut,
                "errors": r.errors,
            })
        }).collect::<Vec<_>>(),
    })
}
