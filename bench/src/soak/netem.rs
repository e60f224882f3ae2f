//! `--netem`: delay, jitter (which reorders), loss and duplication on loopback for the
//! length of a soak, with `tc qdisc ... netem` (the kernel's sch_netem): every packet of
//! the run, the rewrite program's and the daemon's own included, meets the impaired path,
//! but for resets.
//!
//! A reset is never sent again: one lost leaves the other end's socket open until its
//! idle timeout, on any path, direct TCP's included, and the soak would count that
//! connection as left open. So loopback gets a `prio` qdisc whose band 1:2 (where the
//! priomap sends every packet) holds netem, and a u32 filter sends IPv4 TCP segments with
//! RST set to band 1:1, a plain FIFO: resets go at once, unimpaired.
//!
//! Going at once, a reset overtakes the data segments still delayed before it, so it
//! arrives past `rcv_nxt`. The receiver then answers with a challenge ACK (RFC 5961),
//! and the sender's reply to that, an exact reset, ends the connection. Before Linux
//! 6.0, challenge ACKs are limited to about 1,000 a second per network namespace
//! (`net.ipv4.tcp_challenge_ack_limit`; 6.0 and later default to no limit). Past the
//! limit, the reset is dropped for good, and the 5.10 guest's soak saw 2 of 821
//! connections left open. So for the run, the limit is raised to 6.0's default, and put
//! back afterwards.

use std::process::Command;

use anyhow::{bail, Context as _};

/// The device the soak's connections cross (its pod and waypoint are on 127.0.0.0/8).
const DEV: &str = "lo";

/// netem's queue holds 1,000 packets by default: with every loopback packet delayed,
/// a soak's dozens of connections overflow it, which would add loss that the spec did
/// not ask for.
const LIMIT: &str = "100000";

/// The challenge-ACK limit (see the module's docs).
const CHALLENGE_ACK_LIMIT: &str = "/proc/sys/net/ipv4/tcp_challenge_ack_limit";

/// netem on [`DEV`] while this lives; removed on drop.
#[derive(Debug)]
pub struct Netem {
    spec: String,
    /// The challenge-ACK limit to put back, where it was raised.
    challenge_ack_limit: Option<String>,
}

impl Netem {
    /// Puts netem with `spec` (tc's netem parameters, e.g. `delay 1ms 1ms loss 1%`) on
    /// loopback for every packet but resets, replacing the root qdisc that is there.
    pub fn apply(spec: &str) -> anyhow::Result<Netem> {
        let params: Vec<&str> = spec.split_whitespace().collect();
        if params.is_empty() {
            bail!("--netem: no parameters (e.g. \"delay 1ms 1ms loss 1% duplicate 1%\")");
        }
        // Two bands, every priority mapped to the second (1:2).
        tc(&[
            "qdisc", "replace", "dev", DEV, "root", "handle", "1:", "prio", "bands", "2",
            "priomap", "1", "1", "1", "1", "1", "1", "1", "1", "1", "1", "1", "1", "1", "1", "1",
            "1",
        ])?;
        let mut netem = Netem {
            spec: spec.to_owned(),
            challenge_ack_limit: None,
        };
        // The kernel loads sch_netem on demand where it is a module.
        let mut args = vec![
            "qdisc", "add", "dev", DEV, "parent", "1:2", "handle", "20:", "netem", "limit", LIMIT,
        ];
        args.extend(&params);
        tc(&args).context("a kernel without sch_netem cannot run --netem")?;
        // IPv4 (a 20-byte header: IHL 5), TCP, RST set (the flags byte is at 20 + 13).
        tc(&[
            "filter", "add", "dev", DEV, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
            "match", "u8", "0x04", "0x04", "at", "33", "flowid", "1:1",
        ])?;
        let limit = std::fs::read_to_string(CHALLENGE_ACK_LIMIT)
            .with_context(|| format!("reading {CHALLENGE_ACK_LIMIT}"))?;
        std::fs::write(CHALLENGE_ACK_LIMIT, i32::MAX.to_string())
            .with_context(|| format!("raising {CHALLENGE_ACK_LIMIT}"))?;
        netem.challenge_ack_limit = Some(limit);
        Ok(netem)
    }

    /// The parameters, as given.
    pub fn spec(&self) -> &str {
        &self.spec
    }
}

/// Runs `tc` with `args`; its error output on failure.
fn tc(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("tc")
        .args(args)
        .output()
        .context("running tc (iproute2)")?;
    if !out.status.success() {
        bail!(
            "tc {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Drop for Netem {
    fn drop(&mut self) {
        // The root qdisc takes its bands, their netem and the filter with it.
        if let Err(e) = tc(&["qdisc", "del", "dev", DEV, "root"]) {
            eprintln!("soak: removing netem from {DEV}: {e:#}");
        }
        if let Some(limit) = &self.challenge_ack_limit {
            if let Err(e) = std::fs::write(CHALLENGE_ACK_LIMIT, limit.trim()) {
                eprintln!("soak: putting back {CHALLENGE_ACK_LIMIT}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// A spec with no parameters is refused before loopback is touched (no tc runs).
    #[test]
    fn an_empty_spec_is_refused_with_an_example() {
        for spec in ["", "   "] {
            let err = Netem::apply(spec).unwrap_err().to_string();
            assert!(err.contains("--netem: no parameters"), "{err}");
            assert!(err.contains("delay"), "the message gives an example: {err}");
        }
    }
}
