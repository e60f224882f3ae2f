//! Process-wide calls: limits, clocks, memory barriers.

use std::io;

/// `MEMBARRIER_CMD_GLOBAL` (`linux/membarrier.h`).
const MEMBARRIER_CMD_GLOBAL: libc::c_int = 1;

/// Raises RLIMIT_MEMLOCK to unlimited: kernels before 5.11 charge BPF maps to it.
pub(crate) fn raise_memlock_limit() -> io::Result<()> {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads one rlimit struct, which lives for the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const unlimited) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Raises RLIMIT_NOFILE's soft limit to the hard one, for a process that holds two
/// sockets per connection: services start at a soft limit of 1,024 open files, under a
/// hard limit that says what the operator allows (not raised: that is theirs to set).
/// Returns the soft limit now.
pub(crate) fn raise_nofile_limit() -> io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard)
}

/// RLIMIT_NOFILE's soft limit: the descriptors this process may hold.
pub(crate) fn nofile_limit() -> io::Result<u64> {
    use nix::sys::resource::{getrlimit, Resource};
    Ok(getrlimit(Resource::RLIMIT_NOFILE)?.0)
}

/// The range `connect` picks a socket's local port from
/// (`net.ipv4.ip_local_port_range`, which IPv6 uses too), first and last included.
pub(crate) fn ephemeral_ports() -> io::Result<(u16, u16)> {
    port_range(&std::fs::read_to_string(
        "/proc/sys/net/ipv4/ip_local_port_range",
    )?)
}

/// `ip_local_port_range`'s text: two ports, the first not above the second.
fn port_range(text: &str) -> io::Result<(u16, u16)> {
    let mut ports = text.split_whitespace().map(str::parse::<u16>);
    match (ports.next(), ports.next()) {
        (Some(Ok(first)), Some(Ok(last))) if first <= last => Ok((first, last)),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("ip_local_port_range reads {text:?}"),
        )),
    }
}

/// `net.ipv4.tcp_migrate_req`: whether a closing listener's queued connections move to
/// another listener of its SO_REUSEPORT group.
const MIGRATE_REQ: &str = "/proc/sys/net/ipv4/tcp_migrate_req";

/// Turns `net.ipv4.tcp_migrate_req` on in this network namespace. Returns whether it was
/// off before; NotFound on a kernel without it (before 5.14).
pub(crate) fn enable_request_migration() -> io::Result<bool> {
    switch_on(std::path::Path::new(MIGRATE_REQ))
}

/// Writes 1 to a boolean setting at `path` that reads 0; whether it did.
fn switch_on(path: &std::path::Path) -> io::Result<bool> {
    let now = std::fs::read_to_string(path)?;
    if now.trim() != "0" {
        return Ok(false);
    }
    std::fs::write(path, "1")?;
    Ok(true)
}

/// CLOCK_MONOTONIC in milliseconds, truncated to 32 bits (the clock TCP timestamps
/// count in).
pub(crate) fn monotonic_ms() -> io::Result<u32> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which lives for the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut now) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((now.tv_sec as u64 * 1000 + now.tv_nsec as u64 / 1_000_000) as u32)
}

/// `membarrier(MEMBARRIER_CMD_GLOBAL)`: returns after an RCU grace period
/// (`synchronize_rcu`) on a machine with more than one CPU; on one CPU, every packet in
/// flight has been handled by the time this thread runs.
pub(crate) fn membarrier_global() -> io::Result<()> {
    // SAFETY: membarrier takes no pointers.
    let r = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL, 0, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;

    #[test]
    fn the_port_range_is_read_or_refused_clearly() {
        assert_eq!(port_range("32768\t60999\n").ok(), Some((32768, 60999)));
        for bad in ["", "32768", "60999 32768", "1 70000", "a b"] {
            let e = port_range(bad).expect_err(bad);
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{bad:?}");
            assert!(e.to_string().contains("ip_local_port_range reads"), "{e}");
        }
        // This machine's own range reads.
        assert!(ephemeral_ports().is_ok());
    }

    #[test]
    fn a_setting_is_switched_on_once_and_a_missing_one_says_so() {
        let dir = std::env::temp_dir().join(format!("waypoint-switch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tcp_migrate_req");
        std::fs::write(&path, "0\n").unwrap();
        assert!(switch_on(&path).unwrap(), "off: turned on");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "1");
        assert!(!switch_on(&path).unwrap(), "on already: left alone");
        std::fs::write(&path, "2\n").unwrap();
        assert!(!switch_on(&path).unwrap(), "another value: left alone");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "2\n");
        let e = switch_on(&dir.join("absent")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "a kernel without it");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
