//! The scale check's helper processes (this binary, hidden subcommands). Each holds its
//! share of the connections in its own file table, so that no process needs more
//! descriptors than RLIMIT_NOFILE allows. Both exit when their stdin closes (the parent
//! died or is done), and within a deadline in any case.

use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use serde_json::json;

use crate::{
    hello,
    servers::{Servers, ANSWER},
    sys,
};

const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// An echo "pod" on `ip:port` until stdin closes.
pub fn server(ip: IpAddr, sink_ip: IpAddr, port: u16) -> anyhow::Result<()> {
    sys::raise_nofile(1 << 20)?;
    let servers = Servers::start(&[ip], sink_ip, port, hello::len())?;
    println!("ready");
    // Blocks until the parent closes our stdin (or dies).
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    servers.shutdown();
    Ok(())
}

/// One connection from `src` through the waypoint, established end to end.
fn open(src: Ipv4Addr, target: SocketAddr, hello: &[u8]) -> std::io::Result<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    let one: libc::c_int = 1;
    // Without it, bind() would reserve the port for every destination: the kernel would
    // run out of ports at ~28k per source address instead of per 4-tuple.
    // SAFETY: setsockopt reads one c_int from a live local; the fd is owned by `sock`.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            std::ptr::from_ref(&one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    sock.bind(&SocketAddr::new(IpAddr::V4(src), 0).into())?;
    sock.connect_timeout(&target.into(), IO_TIMEOUT)?;
    let mut c: TcpStream = sock.into();
    c.set_read_timeout(Some(IO_TIMEOUT))?;
    c.set_write_timeout(Some(IO_TIMEOUT))?;
    c.write_all(hello)?;
    let mut b = [0u8; 1];
    c.read_exact(&mut b)?;
    if b[0] != ANSWER {
        return Err(std::io::Error::other("unexpected answer"));
    }
    Ok(c)
}

/// Opens `count` connections from `src` to `target`, reports, then follows the parent's
/// commands on stdin: `check` (one byte echoed on every 997th connection) and `close`.
pub fn client(
    src: Ipv4Addr,
    target: SocketAddr,
    count: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    sys::raise_nofile(1 << 20)?;
    let hello = hello::with_sni(hello::ECHO_SNI)?;
    let start = Instant::now();
    let deadline = start + timeout;
    let mut conns = Vec::with_capacity(count);
    let mut errors = 0usize;
    let mut first_error = None;
    // Bounded by the count, the deadline and an error budget.
    while conns.len() < count && Instant::now() < deadline && errors < 100 {
        match open(src, target, &hello) {
            Ok(c) => conns.push(c),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e.to_string());
            }
        }
    }
    println!(
        "{}",
        json!({"opened": conns.len(), "errors": errors, "first_error": first_error,
               "secs": start.elapsed().as_secs_f64()})
    );
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        match line.trim() {
            "check" => {
                let (mut checked, mut failed) = (0usize, 0usize);
                for c in conns.iter_mut().step_by(997) {
                    checked += 1;
                    let mut b = [0u8; 1];
                    if c.write_all(&[0x07])
                        .and_then(|()| c.read_exact(&mut b))
                        .is_err()
                        || b[0] != 0x07
                    {
                        failed += 1;
                    }
                }
                println!("{}", json!({"checked": checked, "failed": failed}));
            }
            _ => break,
        }
    }
    drop(conns);
    Ok(())
}
