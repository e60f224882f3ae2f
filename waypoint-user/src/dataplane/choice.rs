//! Which dataplane the daemon runs, and why.
//!
//! `--dataplane ebpf|splice|copy` names one: it runs, or the start fails with the
//! kernel's own refusal. `auto` probes the kernel by loading the programs and takes the
//! first rung that works: the eBPF dataplane as configured (with the rewrite splice
//! unless `--rewrite-splice=false`; the daemon's [`crate::config::Config::rewrite_splice`]),
//! the eBPF dataplane without the rewrite splice (the kernel refused its program, or the
//! process may not open the raw socket it resets ends from), then splice. Each
//! connection then takes the fastest path it qualifies for (see
//! `waypoint_dataplane_path_total`). What a kernel can load is probed, never read from its version; what it runs
//! correctly cannot be probed, so one rule goes by the version: on a kernel without the
//! 2023 sockmap series ([`sockmap_fixed`]) `auto` runs splice, and a named `ebpf` runs
//! with a warning. The rung and the refusal that put the daemon on it are logged once,
//! exported as `waypoint_dataplane{dataplane,reason}` and shown in `/readyz`'s body.

use std::{fmt, sync::Arc};

use aya::util::KernelVersion;
use tracing::{info, warn};

use super::{
    copy::UserspaceCopy,
    ebpf::{self, Ebpf},
    splice::Splice,
    Dataplane, Kind,
};

/// Why the daemon runs the dataplane it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// `--dataplane` named it.
    Asked,
    /// `auto`: the kernel took everything the configuration asks for.
    Probed,
    /// `auto`: the kernel refused the rewrite program (or its attachment), or the process
    /// lacks CAP_NET_RAW; the eBPF dataplane runs without the rewrite splice.
    RewriteRefused,
    /// `auto`: the kernel refused the eBPF dataplane; splice runs.
    EbpfRefused,
    /// `auto`: the kernel's sockmap lacks the fixes the SockHash redirect needs (see
    /// [`sockmap_fixed`]); splice runs.
    SockmapUnfixed,
}

impl Reason {
    /// The label used in logs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Asked => "asked",
            Reason::Probed => "probed",
            Reason::RewriteRefused => "rewrite_refused",
            Reason::EbpfRefused => "ebpf_refused",
            Reason::SockmapUnfixed => "sockmap_unfixed",
        }
    }
}

/// What was chosen, for the log, the metric and `/readyz`.
#[derive(Clone, Debug)]
pub struct Chosen {
    /// The path connections take: `ebpf-rewrite`, `ebpf`, `splice` or `copy`.
    pub path: &'static str,
    /// Why.
    pub reason: Reason,
    /// The kernel's refusal that moved `auto` down a rung, in brief.
    pub refusal: Option<String>,
}

impl fmt::Display for Chosen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dataplane {} ({})", self.path, self.reason.as_str())?;
        if let Some(r) = &self.refusal {
            write!(f, ": {r}")?;
        }
        Ok(())
    }
}

/// A dataplane that was asked for by name and could not be had.
#[derive(Debug, thiserror::Error)]
#[error("--dataplane=ebpf{} was asked for: {source}", if *.rewrite { " with --rewrite-splice" } else { "" })]
pub struct Error {
    /// Whether the rewrite splice was part of the ask.
    pub rewrite: bool,
    /// The kernel's refusal.
    #[source]
    pub source: ebpf::Error,
}

/// Builds the dataplane `kind` names (see the module documentation for `auto`).
/// `pipe_size` is splice's pipe size.
pub fn choose(
    kind: Kind,
    config: ebpf::Config,
    pipe_size: usize,
) -> Result<(Dataplane, Chosen), Error> {
    let ebpf = |e: Ebpf| {
        let path = if e.config().rewrite_splice {
            "ebpf-rewrite"
        } else {
            "ebpf"
        };
        (Dataplane::Ebpf(Arc::new(e)), path)
    };
    let asked = |(dataplane, path)| {
        (
            dataplane,
            Chosen {
                path,
                reason: Reason::Asked,
                refusal: None,
            },
        )
    };
    // Whatever runs: a killed daemon's rewrite filter (before Linux 6.6) would rewrite
    // this daemon's dials to the pods from the ports its sockets freed.
    super::orphans::remove_everywhere();
    let kernel = KernelVersion::current().ok();
    let (dataplane, chosen) = match kind {
        Kind::Ebpf => {
            if let Some(unfixed) = kernel.and_then(sockmap_unfixed) {
                warn!(%unfixed, "--dataplane=ebpf on a kernel auto would run splice on");
            }
            let rewrite = config.rewrite_splice;
            asked(ebpf(
                Ebpf::load(config).map_err(|source| Error { rewrite, source })?,
            ))
        }
        Kind::Splice => asked((Dataplane::Splice(Splice::new(pipe_size)), "splice")),
        Kind::Copy => asked((Dataplane::Copy(UserspaceCopy::new()), "copy")),
        Kind::Auto => match kernel.and_then(sockmap_unfixed) {
            Some(unfixed) => (
                Dataplane::Splice(Splice::new(pipe_size)),
                Chosen {
                    path: "splice",
                    reason: Reason::SockmapUnfixed,
                    refusal: Some(unfixed),
                },
            ),
            None => probe(config, pipe_size, ebpf),
        },
    };
    match &chosen.refusal {
        Some(refusal) => warn!(
            dataplane = chosen.path,
            reason = chosen.reason.as_str(),
            %refusal,
            "dataplane chosen below what was configured"
        ),
        None => info!(
            dataplane = chosen.path,
            reason = chosen.reason.as_str(),
            "dataplane chosen"
        ),
    }
    Ok((dataplane, chosen))
}

/// Whether a kernel's sockmap carries the 2023 series the SockHash redirect relies on
/// (`bpf, sockmap:` *Handle fin correctly*, *Incorrectly handling copied_seq*,
/// *Reschedule is now done through backlog*, *Convert schedule_work into delayed_work*,
/// *Pass skb ownership through read_skb* and three more): mainline 6.4, and 6.1 from
/// 6.1.32. Without it the kernel's redirect backlog can stall, and on Debian 11's
/// 5.10.262 the kernel matrix saw a stream of the SockHash redirect arrive reordered
/// (in one of eight guest runs) and stall for good (in two of nine), where 6.1 and 6.12
/// never did. 5.15.y took five of the eight; 6.2.y and 6.3.y ended without a release
/// that was checked here: both count as without. A version number, not a probe: a
/// missing fix loads and attaches like a present one. Distribution kernels are read by
/// their upstream version (Debian's from `uname -v`, Ubuntu's from
/// `/proc/version_signature`, as aya does).
pub fn sockmap_fixed(v: KernelVersion) -> bool {
    v >= KernelVersion::new(6, 4, 0)
        || (KernelVersion::new(6, 1, 32)..KernelVersion::new(6, 2, 0)).contains(&v)
}

/// Why `auto` leaves the SockHash redirect out on kernel `v`, if it does.
fn sockmap_unfixed(v: KernelVersion) -> Option<String> {
    (!sockmap_fixed(v)).then(|| {
        format!(
            "kernel {v} lacks the 2023 sockmap fixes (6.4, 6.1.32) that the SockHash \
             redirect needs"
        )
    })
}

/// `auto`'s ladder.
fn probe(
    config: ebpf::Config,
    pipe_size: usize,
    ebpf: impl Fn(Ebpf) -> (Dataplane, &'static str),
) -> (Dataplane, Chosen) {
    let chosen = |(dataplane, path), reason, refusal| {
        (
            dataplane,
            Chosen {
                path,
                reason,
                refusal,
            },
        )
    };
    let refused = match Ebpf::load(config.clone()) {
        Ok(e) => return chosen(ebpf(e), Reason::Probed, None),
        Err(e) => e,
    };
    if config.rewrite_splice {
        let without = ebpf::Config {
            rewrite_splice: false,
            ..config
        };
        // The whole object again: nothing of the refused load is kept (its maps and
        // programs were closed with it).
        if let Ok(e) = Ebpf::load(without) {
            return chosen(ebpf(e), Reason::RewriteRefused, Some(refused.brief()));
        }
    }
    chosen(
        (Dataplane::Splice(Splice::new(pipe_size)), "splice"),
        Reason::EbpfRefused,
        Some(refused.brief()),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn root() -> bool {
        nix::unistd::geteuid().is_root()
    }

    #[test]
    fn the_sockhash_redirect_needs_the_2023_sockmap_series() {
        let v = KernelVersion::new;
        let kernels = [
            (v(5, 10, 262), false),
            (v(5, 15, 190), false),
            (v(6, 1, 31), false),
            (v(6, 1, 32), true),
            (v(6, 1, 192), true),
            (v(6, 2, 16), false),
            (v(6, 3, 13), false),
            (v(6, 4, 0), true),
            (v(6, 12, 118), true),
            (v(6, 18, 0), true),
        ];
        for (kernel, fixed) in kernels {
            assert_eq!(sockmap_fixed(kernel), fixed, "{kernel}");
            assert_eq!(sockmap_unfixed(kernel).is_none(), fixed, "{kernel}");
        }
        assert_eq!(
            sockmap_unfixed(v(5, 10, 262)).unwrap(),
            "kernel 5.10.262 lacks the 2023 sockmap fixes (6.4, 6.1.32) that the SockHash \
             redirect needs"
        );
    }

    /// Without CAP_NET_RAW the rewrite could not reset its connections' ends (at an idle
    /// timeout, a lifetime, a drain): `auto` leaves it out and says so. Capabilities are
    /// a thread's own, so the test drops it from one thread, which then loads.
    #[test]
    fn auto_runs_the_sockhash_redirect_without_cap_net_raw() {
        assert!(root(), "the eBPF dataplane needs root");
        let config = ebpf::Config {
            rewrite_splice: true,
            ..ebpf::Config::default()
        };
        let load = |kind| {
            let config = config.clone();
            std::thread::spawn(move || {
                caps::drop(None, caps::CapSet::Effective, caps::Capability::CAP_NET_RAW).unwrap();
                choose(kind, config, 1 << 16).map(|(dp, chosen)| (dp.kind(), chosen))
            })
            .join()
            .unwrap()
        };
        let (kind, chosen) = load(Kind::Auto).unwrap();
        assert_eq!(kind, Kind::Ebpf, "{chosen}");
        assert_eq!(
            (chosen.path, chosen.reason),
            ("ebpf", Reason::RewriteRefused)
        );
        let line = chosen.to_string();
        assert!(
            line.starts_with(
                "dataplane ebpf (rewrite_refused): the rewrite splice resets ends from a raw \
                 socket, which needs CAP_NET_RAW: "
            ),
            "{line}"
        );
        // Asked for by name, it fails the start.
        let err = match load(Kind::Ebpf) {
            Err(e) => e,
            Ok((_, chosen)) => panic!("started without CAP_NET_RAW: {chosen}"),
        };
        assert!(err.to_string().contains("CAP_NET_RAW"), "{err}");
    }

    #[test]
    fn named_dataplanes_are_asked_for() {
        for (kind, path) in [(Kind::Splice, "splice"), (Kind::Copy, "copy")] {
            let (dp, chosen) = choose(kind, ebpf::Config::default(), 1 << 16).unwrap();
            assert_eq!(dp.kind(), kind);
            assert_eq!((chosen.path, chosen.reason), (path, Reason::Asked));
            assert_eq!(chosen.to_string(), format!("dataplane {path} (asked)"));
        }
    }

    /// The rung below the rewrite: the kernel's refusal of the rewrite program (a test
    /// hook here; the verifier of a kernel without the 5.12 atomics in the kernel matrix)
    /// leaves the SockHash redirect, with the refusal named.
    #[test]
    fn auto_runs_the_sockhash_redirect_when_the_rewrite_program_is_refused() {
        assert!(root(), "the eBPF dataplane needs root");
        let mut config = ebpf::Config {
            rewrite_splice: true,
            ..ebpf::Config::default()
        };
        config.hooks.refuse_rewrite = true;
        let (dp, chosen) = choose(Kind::Auto, config.clone(), 1 << 16).unwrap();
        let Dataplane::Ebpf(e) = &dp else {
            panic!("{chosen}");
        };
        assert!(!e.config().rewrite_splice);
        assert_eq!(
            (chosen.path, chosen.reason),
            ("ebpf", Reason::RewriteRefused)
        );
        let line = chosen.to_string();
        assert!(
            line.starts_with("dataplane ebpf (rewrite_refused): ")
                && line.contains("refused by a test hook"),
            "{line}"
        );
        // Asked for by name, the same refusal fails the start, and says what was asked.
        let err = match choose(Kind::Ebpf, config, 1 << 16) {
            Err(e) => e,
            Ok((_, chosen)) => panic!("started: {chosen}"),
        };
        assert!(
            err.to_string()
                .starts_with("--dataplane=ebpf with --rewrite-splice was asked for: "),
            "{err}"
        );
    }
}
