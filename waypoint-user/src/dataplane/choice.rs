//! Which dataplane the daemon runs, and why.
//!
//! `--dataplane ebpf|splice|copy` names one: it runs, or the start fails with the
//! kernel's own refusal. `auto` probes the kernel by loading the programs (never by its
//! version number) and takes the first rung that works: the eBPF dataplane as
//! configured (with the rewrite splice when `--rewrite-splice` asks for it), the eBPF
//! dataplane without the rewrite splice, then splice. The rung and the refusal that put
//! the daemon on it are logged once, exported as `waypoint_dataplane{dataplane,reason}`
//! and shown in `/readyz`'s body.

use std::{fmt, sync::Arc};

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
    /// `auto`: the kernel refused the rewrite program (or its attachment); the eBPF
    /// dataplane runs without the rewrite splice.
    RewriteRefused,
    /// `auto`: the kernel refused the eBPF dataplane; splice runs.
    EbpfRefused,
}

impl Reason {
    /// The label used in logs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Asked => "asked",
            Reason::Probed => "probed",
            Reason::RewriteRefused => "rewrite_refused",
            Reason::EbpfRefused => "ebpf_refused",
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
    let (dataplane, chosen) = match kind {
        Kind::Ebpf => asked(ebpf(Ebpf::load(config).map_err(|source| Error {
            rewrite: config.rewrite_splice,
            source,
        })?)),
        Kind::Splice => asked((Dataplane::Splice(Splice::new(pipe_size)), "splice")),
        Kind::Copy => asked((Dataplane::Copy(UserspaceCopy::new()), "copy")),
        Kind::Auto => probe(config, pipe_size, ebpf),
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
    let refused = match Ebpf::load(config) {
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
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
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
        let (dp, chosen) = choose(Kind::Auto, config, 1 << 16).unwrap();
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
