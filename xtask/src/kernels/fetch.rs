//! Fetching a pinned Debian kernel package into the cache through a private apt
//! configuration, unpacking it and indexing its modules.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

use super::Kernel;
use crate::run;

/// The suites the private apt configuration reads.
const SUITES: &[&str] = &["bullseye", "bookworm", "trixie"];

/// Fetches and unpacks `k` into the cache (once), indexes its modules, and returns
/// where it is unpacked.
pub(super) fn fetch(cache: &Path, k: &Kernel) -> anyhow::Result<PathBuf> {
    let unpacked = cache.join("k").join(k.name);
    if unpacked.join(".done").exists() {
        return Ok(unpacked);
    }
    let apt = cache.join("apt");
    for d in ["lists/partial", "archives/partial"] {
        fs::create_dir_all(apt.join(d))?;
    }
    let mut sources = String::new();
    for suite in SUITES {
        let key = "signed-by=/usr/share/keyrings/debian-archive-keyring.gpg";
        let _ = writeln!(
            sources,
            "deb [{key}] http://deb.debian.org/debian {suite} main"
        );
        let _ = writeln!(
            sources,
            "deb [{key}] http://deb.debian.org/debian-security {suite}-security main"
        );
    }
    fs::write(apt.join("sources.list"), sources)?;
    let private = |c: &mut Command| {
        c.arg("-o")
            .arg(format!(
                "Dir::Etc::SourceList={}",
                apt.join("sources.list").display()
            ))
            .args(["-o", "Dir::Etc::SourceParts=/nonexistent"])
            .arg("-o")
            .arg(format!("Dir::State::Lists={}", apt.join("lists").display()))
            .arg("-o")
            .arg(format!("Dir::Cache={}", apt.display()))
            // Downloads into a root-owned directory, without the _apt sandbox user.
            .args(["-o", "APT::Sandbox::User=root"]);
    };
    let debs = cache.join("debs");
    fs::create_dir_all(&debs)?;
    let mut deb = debs.join(format!(
        "{}_{}_amd64.deb",
        k.package,
        k.version.replace(':', "%3a")
    ));
    if !deb.exists() {
        let mut update = Command::new("apt-get");
        private(&mut update);
        run(update.arg("update"))?;
        let download = |what: &str| -> anyhow::Result<bool> {
            let mut c = Command::new("apt-get");
            private(&mut c);
            c.current_dir(&debs).arg("download").arg(what);
            eprintln!("+ {c:?}");
            Ok(c.status()?.success())
        };
        if !download(&format!("{}={}", k.package, k.version))? {
            let mut names = Command::new("apt-cache");
            private(&mut names);
            let out = names.arg("pkgnames").arg(k.series.0).output()?;
            let newest = newest_of_series(&String::from_utf8_lossy(&out.stdout), k.series)
                .with_context(|| format!("no {}N{} in Debian's archive", k.series.0, k.series.1))?;
            eprintln!(
                "kernel {}: {}={} has left Debian's archive; taking {newest}, the newest of \
                 its series (update the pin in xtask/src/kernels.rs)",
                k.name, k.package, k.version
            );
            if !download(&newest)? {
                bail!("apt-get download {newest} failed");
            }
            deb = fs::read_dir(&debs)?
                .filter_map(Result::ok)
                .map(|e| e.path())
                .find(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{newest}_")))
                })
                .with_context(|| format!("{newest} downloaded, but no .deb of it"))?;
        }
    }
    if unpacked.exists() {
        fs::remove_dir_all(&unpacked)?;
    }
    fs::create_dir_all(&unpacked)?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
    let (base, release) = modules(&unpacked)?;
    run(Command::new("depmod").arg("-b").arg(&base).arg(&release))?;
    fs::write(unpacked.join(".done"), "")?;
    Ok(unpacked)
}

/// The base directory depmod and modprobe take (under which lib/modules/<release>
/// is; trixie's packages put it under usr/) and the kernel's release.
pub(super) fn modules(unpacked: &Path) -> anyhow::Result<(PathBuf, String)> {
    let base = if unpacked.join("usr/lib/modules").exists() {
        unpacked.join("usr")
    } else {
        unpacked.to_path_buf()
    };
    let release = fs::read_dir(base.join("lib/modules"))?
        .next()
        .context("a kernel package without modules")??
        .file_name()
        .to_string_lossy()
        .into_owned();
    Ok((base, release))
}

/// Of the package names `apt-cache pkgnames` listed, the one of `series` (prefix, ABI
/// number, suffix) with the highest ABI number.
fn newest_of_series(names: &str, (prefix, suffix): (&str, &str)) -> Option<String> {
    names
        .lines()
        .filter_map(|n| {
            let abi = n.trim().strip_prefix(prefix)?.strip_suffix(suffix)?;
            Some((abi.parse::<u32>().ok()?, n.trim().to_owned()))
        })
        .max()
        .map(|(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_of_a_series_is_its_highest_abi() {
        let names = "linux-image-6.1.0-57-amd64\nlinux-image-6.1.0-58-cloud-amd64\n\
                     linux-image-6.1.0-9-amd64\nlinux-image-6.1.0-58-amd64-unsigned\n\
                     linux-image-6.1.0-58-amd64\n";
        let series = ("linux-image-6.1.0-", "-amd64");
        assert_eq!(
            newest_of_series(names, series).as_deref(),
            Some("linux-image-6.1.0-58-amd64")
        );
        let trixie = ("linux-image-6.12.", "+deb13-amd64");
        let names = "linux-image-6.12.118+deb13-amd64\nlinux-image-6.12.121+deb13-amd64\n";
        assert_eq!(
            newest_of_series(names, trixie).as_deref(),
            Some("linux-image-6.12.121+deb13-amd64")
        );
        assert_eq!(newest_of_series("", series), None);
    }
}
