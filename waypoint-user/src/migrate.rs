//! Where a closing tunnel listener's queued connections go.
//!
//! A rolling update starts the new daemon beside the old one; both listen on the tunnel
//! port (SO_REUSEPORT). When the old daemon closes a listener, the kernel moves the
//! connections queued on it to another listener of the group (Linux 5.14). Left to the
//! kernel's hash, the target may be another of the old daemon's listeners, closing a
//! moment later: the connection moves again, or is reset if that listener stops
//! listening between the choice and the move (`TcpExtTCPMigrateReqFailure`).
//!
//! At start, each daemon attaches waypoint-ebpf's `reuseport` program to the group, with
//! its own listeners in the program's map: a closing listener's connections then move to
//! the newest daemon's listeners, once. New connections are still spread by the kernel's
//! hash. The group keeps the program after its daemon exits; a closed listener leaves
//! the map, and with none left the kernel's hash chooses again.
//!
//! With the program attached, the kernel migrates whether or not
//! `net.ipv4.tcp_migrate_req` is on. Where it cannot load (Linux before 5.14, no
//! CAP_BPF), the daemon warns and the sysctl decides, as before.

use std::{net::TcpListener, os::fd::AsFd};

use aya::{
    maps::ReusePortSockArray,
    programs::{ProgramError, SkReuseport},
    Ebpf, EbpfLoader,
};
use waypoint_common::{LISTENERS_MAP, LISTENER_COUNT, MAX_LISTENERS, MIGRATE_PROG};

/// The `reuseport` object built by waypoint-user's build script from waypoint-ebpf.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/waypoint-reuseport"));

/// Why the program could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No listener, or more than the program's map can hold.
    #[error("{0} listeners: the migration program holds 1 to {MAX_LISTENERS}")]
    Count(usize),
    /// The object could not be loaded (its map created).
    #[error("loading the migration object: {0}")]
    Load(#[from] aya::EbpfError),
    /// The program is missing or the kernel refused it (before Linux 5.14 it has no
    /// migration hook).
    #[error("loading the migration program: {0}")]
    Program(#[from] ProgramError),
    /// A listener could not be put in the map.
    #[error("adding a listener to the migration map: {0}")]
    Map(#[from] aya::maps::MapError),
    /// The object has no such map.
    #[error("the migration object has no {LISTENERS_MAP} map")]
    NoMap,
}

/// The attached program; held for the daemon's life (the group holds the program itself,
/// and the program its map, either way).
pub struct Migration {
    _ebpf: Ebpf,
}

impl std::fmt::Debug for Migration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Migration")
    }
}

/// Puts `listeners` (one SO_REUSEPORT group, listening) in a new program's map and
/// attaches the program to their group, replacing whatever program the group had.
pub fn attach(listeners: &[TcpListener]) -> Result<Migration, Error> {
    let count = u32::try_from(listeners.len())
        .ok()
        .filter(|n| (1..=MAX_LISTENERS).contains(n))
        .ok_or(Error::Count(listeners.len()))?;
    // Kernels before 5.11 charge maps to RLIMIT_MEMLOCK; where it cannot be raised, the
    // load says so.
    let _ = crate::sys::raise_memlock_limit();
    let mut ebpf = EbpfLoader::new()
        .map_max_entries(LISTENERS_MAP, count)
        .override_global(LISTENER_COUNT, &count, true)
        .load(OBJECT)?;
    // The program first: where the kernel refuses it, the listeners are left untouched.
    let program: &mut SkReuseport = ebpf
        .program_mut(MIGRATE_PROG)
        .ok_or(ProgramError::NotLoaded)?
        .try_into()?;
    program.load()?;
    {
        let mut map: ReusePortSockArray<_> = ebpf
            .map_mut(LISTENERS_MAP)
            .ok_or(Error::NoMap)?
            .try_into()?;
        for (i, listener) in (0..count).zip(listeners) {
            map.set(i, listener, 0)?;
        }
    }
    let program: &SkReuseport = ebpf
        .program(MIGRATE_PROG)
        .ok_or(ProgramError::NotLoaded)?
        .try_into()?;
    // The map is full before the group runs the program.
    program.attach(listeners[0].as_fd())?;
    Ok(Migration { _ebpf: ebpf })
}

#[cfg(test)]
mod tests {
    //! The program against the kernel: listeners that accept nothing, connections
    //! queued on them, and a listener closed.
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

    use std::{
        io::Write as _,
        net::{SocketAddr, TcpStream},
    };

    use super::*;

    /// A listener of the group on `addr` (port 0: a new group), accepting nothing.
    fn listener(addr: SocketAddr) -> TcpListener {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.set_reuse_port(true).unwrap();
        s.bind(&addr.into()).unwrap();
        s.listen(1024).unwrap();
        s.into()
    }

    /// Connections queued for `accept` on `l` (`tcpi_unacked` of a listener).
    fn queued(l: &TcpListener) -> u32 {
        crate::sys::tcp_info(l).unwrap().tcpi_unacked
    }

    fn before_5_14() -> bool {
        use aya::util::KernelVersion;
        KernelVersion::current().is_ok_and(|v| v < KernelVersion::new(5, 14, 0))
    }

    /// No listener: refused before anything is loaded.
    #[test]
    fn no_listener_is_refused() {
        assert!(matches!(attach(&[]), Err(Error::Count(0))));
    }

    /// The old daemon's two listeners and the new daemon's two, with the new one's
    /// program attached; 128 connections queued over the four. Closing the second old
    /// listener moves its connections to the new listeners only: the first old
    /// listener's queue does not grow, and no connection is lost. (Left to the hash, a
    /// third of them go to the first old listener: the group's array puts its last
    /// listener in the closed one's place, and the hash that chose the closed one then
    /// falls on the first a third of the time. Checked by hand: without the program
    /// attached, this test fails.)
    #[test]
    fn a_closing_listeners_connections_move_to_the_newest_listeners() {
        let old0 = listener("127.0.0.1:0".parse().unwrap());
        let addr = old0.local_addr().unwrap();
        let old1 = listener(addr);
        let new = [listener(addr), listener(addr)];
        let migration = attach(&new);
        if before_5_14() {
            // No migration hook: the daemon warns and leaves it to the sysctl.
            assert!(migration.is_err(), "the program loaded before Linux 5.14");
            return;
        }
        let _migration = migration.expect("attaching the migration program");
        let clients: Vec<TcpStream> = (0..128)
            .map(|_| {
                let mut c = TcpStream::connect(addr).unwrap();
                c.write_all(b"x").unwrap();
                c
            })
            .collect();
        let all = || queued(&old0) + queued(&old1) + queued(&new[0]) + queued(&new[1]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while all() < 128 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} of 128 queued",
                all()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let (on_old0, on_old1) = (queued(&old0), queued(&old1));
        assert!(
            on_old1 > 0,
            "the hash put no connection on the second listener"
        );
        drop(old1);
        assert_eq!(
            queued(&old0),
            on_old0,
            "a connection moved to a closing daemon's listener"
        );
        assert_eq!(
            queued(&new[0]) + queued(&new[1]) + queued(&old0),
            128,
            "every connection is still queued"
        );
        drop(clients);
    }
}
