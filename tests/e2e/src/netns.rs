//! Running things in the harness's network namespaces: `ip`/`nft`/`sysctl` commands, and
//! a closure on a thread that has joined a namespace (the harness process itself stays in
//! the host's namespace, which it never changes).

use std::{
    fs::File,
    io::Write as _,
    process::{Command, Stdio},
};

use nix::sched::{setns, CloneFlags};

/// Errors of running commands and entering namespaces.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The program could not be started.
    #[error("starting `{cmd}`: {source} (is it installed? deploy/setup.sh installs iproute2, nftables and ethtool)")]
    Spawn {
        /// The command line.
        cmd: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The program failed.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Failed {
        /// The command line.
        cmd: String,
        /// How it exited.
        status: std::process::ExitStatus,
        /// What it said.
        stderr: String,
    },
    /// A thread could not join the namespace.
    #[error("entering network namespace {ns}: {source} (does it exist? `ip netns list`)")]
    Enter {
        /// The namespace.
        ns: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The closure run in the namespace panicked.
    #[error("the thread running in namespace {0} panicked")]
    Panicked(String),
}

fn render(program: &str, args: &[&str]) -> String {
    std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `program args`, feeding `stdin` if given; returns its stdout.
pub fn run_with_input(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, Error> {
    let cmd = render(program, args);
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            cmd: cmd.clone(),
            source,
        })?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes())
            .map_err(|source| Error::Spawn {
                cmd: cmd.clone(),
                source,
            })?;
    }
    let out = child.wait_with_output().map_err(|source| Error::Spawn {
        cmd: cmd.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(Error::Failed {
            cmd,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `program args`; returns its stdout.
pub fn run(program: &str, args: &[&str]) -> Result<String, Error> {
    run_with_input(program, args, None)
}

/// Runs `ip args`.
pub fn ip(args: &[&str]) -> Result<String, Error> {
    run("ip", args)
}

/// Runs `program args` inside namespace `ns` (`ip netns exec`).
pub fn exec(ns: &str, program: &str, args: &[&str]) -> Result<String, Error> {
    let mut all = vec!["netns", "exec", ns, program];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// Makes the veth end `dev` in `ns` check the TCP and IP checksums of what it receives in
/// software, as a NIC's receive path does, and, unless `offload_tx`, also complete the
/// checksums of what it sends. A veth otherwise trusts every checksum it carries, so a
/// packet whose checksum the rewrite program got wrong would be delivered all the same.
pub fn software_checksums(ns: &str, dev: &str, offload_tx: bool) -> Result<(), Error> {
    let mut args = vec!["-K", dev, "rx", "off"];
    if !offload_tx {
        args.extend(["tx", "off"]);
    }
    exec(ns, "ethtool", &args).map(drop)
}

/// Runs `f` on a thread that has joined network namespace `ns`, and returns its result.
/// Sockets `f` opens live in `ns`; the calling thread is untouched.
pub fn in_netns<T, F>(ns: &str, f: F) -> Result<T, Error>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let path = format!("/run/netns/{ns}");
    let name = ns.to_owned();
    let joined = std::thread::spawn(move || -> Result<T, Error> {
        let enter = |source| Error::Enter {
            ns: name.clone(),
            source,
        };
        let file = File::open(&path).map_err(enter)?;
        setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| enter(e.into()))?;
        Ok(f())
    })
    .join();
    joined.map_err(|_| Error::Panicked(ns.to_owned()))?
}

/// The names of the network namespaces that exist now.
pub fn list() -> Result<Vec<String>, Error> {
    Ok(ip(&["netns", "list"])?
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}
