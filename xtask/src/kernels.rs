//! `cargo xtask kernels`: the dataplane and router test binaries and a short soak on
//! Debian's own kernels, under QEMU.
//!
//! Each kernel is a pinned Debian package, fetched with `apt-get download` through a
//! private apt configuration in the cache directory (the system's sources are never
//! read or changed), unpacked there, its modules indexed with `depmod`. The guest boots
//! from a busybox initramfs that loads the 9p modules, mounts the host's root over
//! virtio-9p, gives it its own /proc, /sys, /dev, /tmp, bpffs and cgroup2 (and a
//! modprobe that loads the kernel's unpacked modules), and runs a script of the test
//! binaries chrooted there. The guest writes each binary's output into the host's target
//! directory through the share, and its exit status on the console. The share is
//! read-write: what the tests write outside /tmp lands on the host.
//!
//! The guest keeps a fresh kernel's defaults (sysctls, limits): what a DaemonSet meets
//! on a stock node. QEMU runs on TCG by default (the nested KVM device of the machine
//! this was written on hangs these kernels; `--kvm` uses KVM).

mod fetch;
mod guest;
mod host;
mod initramfs;
mod report;

use std::{
    fs,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{bail, Context as _};

use crate::target_dir;

/// A kernel of the matrix: a Debian package, pinned.
struct Kernel {
    /// What `--kernel` calls it.
    name: &'static str,
    /// The package.
    package: &'static str,
    /// Its version.
    version: &'static str,
    /// The package's name around its ABI number, for when the pin has left Debian's
    /// archive (a stable point release replaces the kernel): the newest of the series
    /// is taken then, and the run says so.
    series: (&'static str, &'static str),
    /// Whether the docs claim the eBPF dataplane on it, the SockHash redirect and the
    /// rewrite splice (kernels with the 2023 sockmap fixes, 6.1.32 and 6.4; see
    /// `dataplane::choice::sockmap_fixed`). Where not, the guest runs every test of
    /// splice and copy, of `dataplane_rewrite` only the test of `auto`'s choice, and the
    /// soak on splice and copy.
    ebpf: bool,
}

/// The kernels the docs claim, oldest first.
const KERNELS: &[Kernel] = &[
    Kernel {
        name: "5.10",
        package: "linux-image-5.10.0-46-amd64",
        version: "5.10.262-1",
        series: ("linux-image-5.10.0-", "-amd64"),
        ebpf: false,
    },
    Kernel {
        name: "6.1",
        package: "linux-image-6.1.0-57-amd64",
        version: "6.1.192-3",
        series: ("linux-image-6.1.0-", "-amd64"),
        ebpf: true,
    },
    Kernel {
        name: "6.12",
        package: "linux-image-6.12.118+deb13-amd64",
        version: "6.12.118-1",
        series: ("linux-image-6.12.", "+deb13-amd64"),
        ebpf: true,
    },
];

/// The test binaries run in each guest (integration tests of waypoint-user).
const TESTS: &[&str] = &[
    "dataplane_integrity",
    "dataplane_close",
    "dataplane_rewrite",
    "router",
];

/// A test binary's arguments on a kernel: all its tests where the kernel carries every
/// path, else what the kernel is claimed for.
fn test_args(test: &str, k: &Kernel) -> &'static [&'static str] {
    match (test, k.ebpf) {
        ("dataplane_integrity", false) => &["--skip", "_ebpf"],
        ("dataplane_close", false) => &["--skip", "::ebpf"],
        ("dataplane_rewrite", false) => &[
            "--exact",
            "auto_takes_the_rewrite_splice_where_the_kernel_loads_it",
        ],
        // 5.10 has no net.ipv4.tcp_migrate_req: a restart there resets what is queued on
        // the old daemon's listeners (README, SIGTERM).
        ("router", false) => &[
            "--skip",
            "rewrite_splice",
            "--skip",
            "_with_ebpf",
            "--skip",
            "rolling_restarts_refuse_no_new_connection",
        ],
        _ => &[],
    }
}

/// The soak's dataplanes on a kernel.
fn soak_dataplanes(k: &Kernel) -> &'static str {
    if k.ebpf {
        "auto,ebpf,ebpf-rewrite,splice,copy"
    } else {
        "auto,splice,copy"
    }
}

/// Seconds of the soak per dataplane in a guest.
const SOAK_SECONDS: u32 = 20;

/// The impaired path of the guest's second soak, on loopback (tc's netem parameters):
/// 0 to 10 ms of delay (5 ms, 5 ms of jitter: packets overtake each other), 1 % lost,
/// 1 % duplicated.
const NETEM: &str = "delay 5ms 5ms loss 1% duplicate 1%";

/// Seconds of the netem soak per dataplane in a guest.
const NETEM_SOAK_SECONDS: u32 = 10;

/// The guest's soaks, in the order they run: on a clean path, then on [`NETEM`]'s.
const SOAKS: &[&str] = &["soak", "soak-netem"];

/// Options of `cargo xtask kernels`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Kernels, comma-separated: 5.10, 6.1, 6.12 (default all).
    #[arg(long, value_delimiter = ',')]
    kernel: Vec<String>,
    /// Use KVM instead of QEMU's TCG.
    #[arg(long)]
    kvm: bool,
    /// Where the packages and unpacked kernels are kept.
    #[arg(long, default_value = DEFAULT_CACHE)]
    cache: PathBuf,
    /// Leave out the soak.
    #[arg(long)]
    no_soak: bool,
    /// Boot each kernel this many times (stopping a kernel at its first failed run):
    /// for a failure seen once in many runs.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Seconds a test binary (or the soak) may run in a guest before it counts as hung:
    /// then the guest writes the process's threads' kernel stacks, its sockets (`ss
    /// -tmoi`) and the kernel's log to `<binary>.hang` beside its log, and kills it.
    #[arg(long, default_value_t = DEFAULT_HANG_AFTER)]
    hang_after: u32,
}

/// Default of `--hang-after`: ten times what the slowest binary takes in a TCG guest.
const DEFAULT_HANG_AFTER: u32 = 900;

/// The kernels `cargo xtask test` (and so CI) runs: all that the docs claim.
const TEST_KERNELS: &[&str] = &["5.10", "6.1", "6.12"];

impl Args {
    /// [`TEST_KERNELS`], with the soak, on TCG, the cache in its default place: what
    /// `cargo xtask test` runs.
    pub fn for_test() -> Args {
        Args {
            kernel: TEST_KERNELS.iter().map(|k| (*k).to_owned()).collect(),
            kvm: false,
            cache: PathBuf::from(DEFAULT_CACHE),
            no_soak: false,
            repeat: 1,
            hang_after: DEFAULT_HANG_AFTER,
        }
    }
}

/// Where the packages and unpacked kernels are kept by default.
const DEFAULT_CACHE: &str = "/var/cache/waypoint-kernels";

pub fn kernels(root: &Path, args: &Args) -> anyhow::Result<()> {
    let chosen: Vec<&Kernel> = if args.kernel.is_empty() {
        KERNELS.iter().collect()
    } else {
        args.kernel
            .iter()
            .map(|n| {
                KERNELS
                    .iter()
                    .find(|k| k.name == n)
                    .with_context(|| format!("unknown kernel {n}: 5.10, 6.1 or 6.12"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    host::packages()?;
    let binaries = host::build(root)?;
    let out = target_dir(root).join("kernels");
    let mut rows = Vec::new();
    for k in chosen {
        let unpacked = fetch::fetch(&args.cache, k)?;
        let dir = out.join(k.name);
        fs::create_dir_all(&dir)?;
        let initramfs = initramfs::initramfs(&unpacked, &dir, &initramfs::host_tmp_paths(root))?;
        let script = guest::script(root, k, &binaries, &dir, args)?;
        for run in 1..=args.repeat {
            // A run's logs replace the last run's: a kernel stops at its first failed
            // run, so what is left is that run's.
            for t in TESTS.iter().chain(SOAKS) {
                let _ = fs::remove_file(dir.join(format!("{t}.hang")));
            }
            let started = Instant::now();
            let exits = guest::boot(&unpacked, &initramfs, &script, &dir, args.kvm)?;
            let mut row = report::results(k, &dir, &exits, args.no_soak);
            if args.repeat > 1 {
                row.run = Some(run);
            }
            let ok = row.ok();
            eprintln!(
                "kernel {} run {run}/{}: guest ran {:.0} s, {}",
                k.name,
                args.repeat,
                started.elapsed().as_secs_f64(),
                if ok { "passed" } else { "failed" }
            );
            rows.push(row);
            if !ok {
                break;
            }
        }
    }
    let table = report::table(&rows);
    println!("{table}");
    fs::write(out.join("table.md"), &table)?;
    if rows.iter().any(|r| !r.ok()) {
        bail!("a kernel failed (logs in {})", out.display());
    }
    Ok(())
}
