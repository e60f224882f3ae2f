//! Builds the eBPF object (waypoint-ebpf) and leaves it in OUT_DIR, where the daemon
//! embeds it with `include_bytes_aligned!`. Cargo re-runs this whenever the eBPF or the
//! shared crate changes, so the daemon can never embed a stale or missing object: if the
//! eBPF build fails, the daemon build fails.
use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let manifest = std::path::PathBuf::from(
        std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?,
    );
    let root = manifest
        .parent()
        .context("waypoint-user has no parent directory")?;
    // The registry record types come from the .proto (the schema's source of truth).
    println!("cargo:rerun-if-changed=proto/registry.proto");
    prost_build::compile_protos(&["proto/registry.proto"], &["proto/"]).context(
        "compiling proto/registry.proto failed (is protoc installed? see deploy/setup.sh)",
    )?;
    let ebpf_dir = root.join("waypoint-ebpf");
    let common_dir = root.join("waypoint-common");
    println!("cargo:rerun-if-changed={}", common_dir.display());
    let ebpf_dir = ebpf_dir
        .to_str()
        .context("waypoint-ebpf path is not UTF-8")?
        .to_owned();
    // Debian's rustc-web, linked by deploy/setup.sh as rustup toolchain `debian-web`,
    // carries the core sources that `-Z build-std=core` needs (RUSTC_BOOTSTRAP=1 is set in
    // .cargo/config.toml). Override with WAYPOINT_EBPF_TOOLCHAIN.
    println!("cargo:rerun-if-env-changed=WAYPOINT_EBPF_TOOLCHAIN");
    let toolchain =
        std::env::var("WAYPOINT_EBPF_TOOLCHAIN").unwrap_or_else(|_| "debian-web".to_owned());
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "waypoint-ebpf",
            root_dir: &ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom(&toolchain),
    )
    .context("building the eBPF object failed; run ./deploy/setup.sh to install the toolchain")
}
