//! `--netem`: delay, jitter (which reorders), loss and duplication on loopback for the
//! length of a soak, with `tc qdisc ... netem` (the kernel's sch_netem): every packet of
//! the run, the rewrite program's and the daemon's own included, meets the impaired path.

use std::process::Command;

use anyhow::{bail, Context as _};

/// The device the soak's connections cross (its pod and waypoint are on 127.0.0.0/8).
const DEV: &str = "lo";

/// netem's queue holds 1,000 packets by default: with every loopback packet delayed,
/// a soak's dozens of connections overflow it, which would add loss that the spec did
/// not ask for.
const LIMIT: &str = "100000";

/// netem on [`DEV`] while this lives; removed on drop.
#[derive(Debug)]
pub struct Netem {
    spec: String,
}

impl Netem {
    /// Puts netem with `spec` (tc's netem parameters, e.g. `delay 1ms 1ms loss 1%`) on
    /// the root of loopback, replacing what is there.
    pub fn apply(spec: &str) -> anyhow::Result<Netem> {
        let params: Vec<&str> = spec.split_whitespace().collect();
        if params.is_empty() {
            bail!("--netem: no parameters (e.g. \"delay 1ms 1ms loss 1% duplicate 1%\")");
        }
        // The kernel loads sch_netem on demand where it is a module.
        let out = Command::new("tc")
            .args([
                "qdisc", "replace", "dev", DEV, "root", "netem", "limit", LIMIT,
            ])
            .args(&params)
            .output()
            .context("running tc (iproute2)")?;
        if !out.status.success() {
            bail!(
                "tc qdisc replace dev {DEV} root netem {spec}: {} (a kernel without \
                 sch_netem cannot run --netem)",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(Netem {
            spec: spec.to_owned(),
        })
    }

    /// The parameters, as given.
    pub fn spec(&self) -> &str {
        &self.spec
    }
}

impl Drop for Netem {
    fn drop(&mut self) {
        match Command::new("tc")
            .args(["qdisc", "del", "dev", DEV, "root"])
            .output()
        {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "soak: removing netem from {DEV} failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => eprintln!("soak: removing netem from {DEV} failed: {e}"),
        }
    }
}
