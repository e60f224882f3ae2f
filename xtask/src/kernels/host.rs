//! What the runner needs on the host before any guest boots: the packages it runs
//! (QEMU, busybox, kmod) and the test, daemon and soak binaries the guests share.

use std::{
    io::BufRead as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::bail;

use super::TESTS;
use crate::{cargo, run};

/// Packages the runner needs on the host.
const HOST_PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("busybox", "busybox-static"),
    ("depmod", "kmod"),
];

/// Installs what the runner needs on the host and is missing.
pub(super) fn packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = HOST_PACKAGES
        .iter()
        .filter(|(bin, _)| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {bin} || test -x /sbin/{bin}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// The test binaries (by name) and the daemon and soak binaries, built for the host's
/// root, which the guests share.
pub(super) struct Binaries {
    pub(super) tests: Vec<(String, PathBuf)>,
    pub(super) waypoint: PathBuf,
    pub(super) bench: PathBuf,
}

pub(super) fn build(root: &Path) -> anyhow::Result<Binaries> {
    let mut c = cargo(root);
    c.args([
        "test",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
        "-p",
        "waypoint-user",
    ]);
    for t in TESTS {
        c.args(["--test", t]);
    }
    eprintln!("+ {c:?}");
    let output = c.stderr(Stdio::inherit()).output()?;
    if !output.status.success() {
        bail!("building the test binaries failed");
    }
    let mut tests = Vec::new();
    for line in output.stdout.as_slice().lines() {
        let line = line?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        let (Some(name), Some(exe)) = (msg["target"]["name"].as_str(), msg["executable"].as_str())
        else {
            continue;
        };
        if TESTS.contains(&name) {
            tests.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    if tests.len() != TESTS.len() {
        bail!("found {} of the {} test binaries", tests.len(), TESTS.len());
    }
    let (bench, waypoint) = crate::build_bench(root)?;
    Ok(Binaries {
        tests,
        waypoint,
        bench,
    })
}
