#!/usr/bin/env bash
# One-command setup for a fresh Debian 12 machine, as root.
#
# Installs every apt package and tool that building, testing, the demo and the benchmarks
# need, and links Debian's rustc-web as a rustup toolchain so the eBPF crate can be built
# with `-Z build-std=core` (rustup's toolchains here ship no rust-src).
# Idempotent: a second run only checks and returns in seconds.
set -euo pipefail

log() { printf '[setup] %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  echo "setup.sh must run as root (it installs packages); try: sudo $0" >&2
  exit 1
fi

APT_PACKAGES=(
  # eBPF toolchain: Debian's rustc-web carries the core sources build-std needs, and its
  # LLVM major (22) must match the one bpf-linker is built against.
  rustc-web cargo-web rust-web-src llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev
  bpftool
  # Tests and demo: a real etcd, network namespaces, a TLS client to record hellos.
  etcd-server etcd-client iproute2 openssl procps
  # Two-cluster e2e and demo: nft for the nodes' pod masquerade (Flannel's ip-masq); curl
  # for exploring the admin endpoints of a kept demo.
  nftables curl
  # e2e: veths that check checksums in software (the rewrite program's are then checked).
  ethtool
  # Benchmark peers; the charts' font (cargo xtask bench draws PNGs with it); perf for
  # profiling the dataplanes under load (docs/PERFORMANCE.md).
  nginx libnginx-mod-stream haproxy fonts-dejavu-core linux-perf
  # Build helpers.
  pkg-config build-essential protobuf-compiler libprotobuf-dev
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing apt packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Installing nginx/etcd must not leave services running that collide with tests.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
  rm -f /usr/sbin/policy-rc.d
else
  log "apt packages present"
fi

# bpf-linker, built against LLVM 22 (the LLVM that rustc-web uses).
BPF_LINKER_VERSION=0.13.0
if ! command -v bpf-linker >/dev/null || ! bpf-linker --version 2>/dev/null | grep -q "$BPF_LINKER_VERSION"; then
  log "building bpf-linker $BPF_LINKER_VERSION against LLVM 22 (about a minute)"
  PATH=/usr/lib/llvm-22/bin:$PATH \
    LLVM_SYS_221_PREFIX=/usr/lib/llvm-22 LLVM_PREFIX=/usr/lib/llvm-22 \
    cargo install bpf-linker --version "$BPF_LINKER_VERSION" --locked \
      --no-default-features --features llvm-22
else
  log "bpf-linker present"
fi

# Debian's rustc as a rustup toolchain named `debian-web`: aya-build runs
# `rustup run debian-web cargo`, whose sysroot then holds lib/rustlib/src/rust/library.
TC_DIR=/opt/waypoint/toolchain-debian-web
if ! rustup toolchain list | grep -q '^debian-web'; then
  log "linking Debian rustc-web as rustup toolchain debian-web"
  mkdir -p "$TC_DIR/bin"
  ln -sf /usr/bin/rustc "$TC_DIR/bin/rustc"
  ln -sf /usr/bin/cargo "$TC_DIR/bin/cargo"
  ln -sfn /usr/lib "$TC_DIR/lib"
  rustup toolchain link debian-web "$TC_DIR"
else
  log "rustup toolchain debian-web present"
fi

# cargo-fuzz for the bounded fuzz run in the test suite (runs on the rustup nightly
# toolchain that the machine image carries).
if ! command -v cargo-fuzz >/dev/null; then
  log "installing cargo-fuzz"
  cargo install cargo-fuzz --version 0.13.2 --locked
else
  log "cargo-fuzz present"
fi
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  log "WARNING: no rustup nightly toolchain: the fuzz run in 'cargo xtask test' will fail"
fi

# bpffs is only needed for pinning; mounting it is harmless and the DaemonSet does the same.
if ! mountpoint -q /sys/fs/bpf 2>/dev/null; then
  mount -t bpf bpf /sys/fs/bpf 2>/dev/null || log "could not mount bpffs (not needed unless pinning)"
fi

log "done"
