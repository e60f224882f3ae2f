//! The guest's initramfs: busybox, the modules it needs to mount the host's root over
//! virtio-9p, a modprobe for the kernel's unpacked modules, and the `/init` that sets up
//! the chroot and runs the guest's script.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};

use super::fetch::modules;
use crate::{run, target_dir};

/// Modules the guest loads before it can mount the host's root, in load order.
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];

/// The workspace and the target directory where they lie under /tmp, which the guest
/// mounts a tmpfs of its own over: the guest reaches them through the host's /tmp,
/// bound under that tmpfs (a checkout in /tmp, as a CI runner's may be, then works).
pub(super) fn host_tmp_paths(root: &Path) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = Vec::new();
    for p in [root.to_path_buf(), target_dir(root)] {
        if p.starts_with("/tmp") && !paths.iter().any(|q| p.starts_with(q)) {
            paths.push(p);
        }
    }
    paths
}

/// Builds the guest's initramfs: busybox, the 9p modules (decompressed: busybox's
/// insmod takes plain ELF), and `/init`.
pub(super) fn initramfs(
    unpacked: &Path,
    dir: &Path,
    host_tmp: &[PathBuf],
) -> anyhow::Result<PathBuf> {
    let (base, release) = modules(unpacked)?;
    let tree = dir.join("initramfs");
    if tree.exists() {
        fs::remove_dir_all(&tree)?;
    }
    for d in ["bin", "dev", "proc", "sys", "root", "modules"] {
        fs::create_dir_all(tree.join(d))?;
    }
    fs::copy("/bin/busybox", tree.join("bin/busybox")).context("copying /bin/busybox")?;
    let mut order = Vec::new();
    for m in BOOT_MODULES {
        let out = Command::new("modprobe")
            .arg("-d")
            .arg(&base)
            .args(["-S", &release, "--show-depends", m])
            .output()?;
        if !out.status.success() {
            bail!(
                "modprobe --show-depends {m}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "insmod /path/to/x.ko[.xz] " or "builtin x".
            let Some(path) = line.strip_prefix("insmod ") else {
                continue;
            };
            let path = Path::new(path.trim());
            let file = path
                .file_name()
                .context("a module without a name")?
                .to_string_lossy()
                .into_owned();
            let plain = file
                .trim_end_matches(".xz")
                .trim_end_matches(".zst")
                .to_owned();
            if order.contains(&plain) {
                continue;
            }
            let target = tree.join("modules").join(&plain);
            if file.ends_with(".xz") {
                let xz = Command::new("xz").arg("-dc").arg(path).output()?;
                if !xz.status.success() {
                    bail!("xz -d {}", path.display());
                }
                fs::write(&target, xz.stdout)?;
            } else if file.ends_with(".zst") {
                let z = Command::new("zstd").arg("-dc").arg(path).output()?;
                if !z.status.success() {
                    bail!("zstd -d {}", path.display());
                }
                fs::write(&target, z.stdout)?;
            } else {
                fs::copy(path, &target)?;
            }
            order.push(plain);
        }
    }
    // The kernel loads modules on demand (a veth, a qdisc) by running /sbin/modprobe
    // in the initramfs's root, not the chroot's: this one runs the host's modprobe on
    // the kernel's unpacked modules.
    fs::create_dir_all(tree.join("sbin"))?;
    fs::write(
        tree.join("sbin/modprobe"),
        format!(
            "#!/bin/busybox sh\nexec /bin/busybox chroot /root /usr/sbin/modprobe -d {} \"$@\"\n",
            base.display()
        ),
    )?;
    run(Command::new("chmod")
        .arg("755")
        .arg(tree.join("sbin/modprobe")))?;
    let init = format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in {order}; do insmod /modules/$m || echo "WAYPOINT-GUEST insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 host /root || {{
    echo "WAYPOINT-GUEST-EXIT 100"; poweroff -f; }}
mount -t proc proc /root/proc
mount -t sysfs sys /root/sys
mount -t devtmpfs dev /root/dev
mkdir -p /root/dev/pts /root/dev/shm
mount -t devpts devpts /root/dev/pts
mount -t tmpfs shm /root/dev/shm
mkdir -p /hosttmp
mount -o bind /root/tmp /hosttmp
mount -t tmpfs tmp /root/tmp
for p in {host_tmp}; do
    mkdir -p "/root$p"
    mount -o bind "/hosttmp${{p#/tmp}}" "/root$p" || echo "WAYPOINT-GUEST bind $p failed"
done
mount -t tmpfs run /root/run
mount -t bpf bpf /root/sys/fs/bpf
mount -t cgroup2 cgroup2 /root/sys/fs/cgroup
mount -t tracefs tracefs /root/sys/kernel/tracing 2>/dev/null
hostname guest
ip link set lo up
chroot /root /bin/sh "$WAYPOINT_SCRIPT"
echo "WAYPOINT-GUEST-EXIT $?"
poweroff -f
"#,
        order = order.join(" "),
        host_tmp = host_tmp
            .iter()
            .map(|p| format!("'{}'", p.display()))
            .collect::<Vec<_>>()
            .join(" "),
    );
    fs::write(tree.join("init"), init)?;
    run(Command::new("chmod").arg("755").arg(tree.join("init")))?;
    let cpio = dir.join("initramfs.cpio");
    run(Command::new("sh").current_dir(&tree).arg("-c").arg(format!(
        "find . | busybox cpio -o -H newc > {}",
        cpio.display()
    )))?;
    Ok(cpio)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workspace_under_tmp_is_bound_into_the_guests_tmp() {
        let paths = host_tmp_paths(Path::new("/tmp/ci-clone"));
        if std::env::var_os("CARGO_TARGET_DIR").is_none() {
            assert_eq!(paths, [PathBuf::from("/tmp/ci-clone")]);
        }
        assert!(!host_tmp_paths(Path::new("/work/main"))
            .iter()
            .any(|p| p.starts_with("/work")));
    }
}
