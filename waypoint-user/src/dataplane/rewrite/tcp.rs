//! The TCP side of the rewrite splice: a connection's four addresses and map keys, its
//! sockets' sequence numbers (from the handshake records, or read in repair mode),
//! resets sent from a raw socket, and the socket options that needs.

use std::{
    io,
    net::{SocketAddr, SocketAddrV4},
    os::fd::{AsFd, AsRawFd, RawFd},
};

use waypoint_common::{Established, RewriteKey, ESTABLISHED_V4};

use crate::dataplane::Socket;
use crate::sys;

use super::*;

/// The four addresses of a connection that can be rewritten.
#[derive(Clone, Copy)]
pub(super) struct Addrs {
    pub(super) client: SocketAddrV4,
    pub(super) a_local: SocketAddrV4,
    pub(super) b_local: SocketAddrV4,
    pub(super) pod: SocketAddrV4,
}

impl Addrs {
    /// The map's keys for the connection.
    pub(super) fn entries(&self) -> Entries {
        Entries {
            from_client: key(self.client, self.a_local),
            from_pod: key(self.pod, self.b_local),
        }
    }

    /// The client is on this host (a loopback address, or the address it connected to).
    /// A client that connected from another of this host's addresses is taken for a
    /// remote one; the MSS check catches it unless lo's MTU is the uplink's.
    pub(super) fn client_here(&self) -> bool {
        self.client.ip().is_loopback() || self.client.ip() == self.a_local.ip()
    }

    /// The pod is on this host (host network), as [`Addrs::client_here`].
    pub(super) fn pod_here(&self) -> bool {
        self.pod.ip().is_loopback() || self.pod.ip() == self.b_local.ip()
    }

    /// From the sockets' records (IPv4 only).
    pub(super) fn recorded(a: &Established, b: &Established) -> Option<Addrs> {
        if a.flags & b.flags & ESTABLISHED_V4 == 0 {
            return None;
        }
        let v4 = |ip: u32, port: u16| SocketAddrV4::new(ip.to_ne_bytes().into(), port);
        Some(Addrs {
            client: v4(a.remote_ip4, a.remote_port),
            a_local: v4(a.local_ip4, a.local_port),
            b_local: v4(b.local_ip4, b.local_port),
            pod: v4(b.remote_ip4, b.remote_port),
        })
    }

    pub(super) fn of(downstream: &Socket, upstream: &Socket) -> Option<Addrs> {
        let v4 = |a: io::Result<socket2::SockAddr>| match a.ok()?.as_socket()? {
            SocketAddr::V4(a) => Some(a),
            SocketAddr::V6(a) => Some(SocketAddrV4::new(a.ip().to_ipv4_mapped()?, a.port())),
        };
        let (a, b) = (
            socket2::SockRef::from(downstream),
            socket2::SockRef::from(upstream),
        );
        Some(Addrs {
            client: v4(a.peer_addr())?,
            a_local: v4(a.local_addr())?,
            b_local: v4(b.local_addr())?,
            pod: v4(b.peer_addr())?,
        })
    }
}

pub(super) fn key(from: SocketAddrV4, to: SocketAddrV4) -> RewriteKey {
    RewriteKey {
        saddr: u32::from_ne_bytes(from.ip().octets()),
        daddr: u32::from_ne_bytes(to.ip().octets()),
        sport: from.port().to_be(),
        dport: to.port().to_be(),
    }
}

/// Sequence numbers at the hand-over.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::dataplane) struct Seqs {
    /// A's next byte to send (the client's next ack).
    pub a_snd: u32,
    /// A's next byte expected from the client.
    pub a_rcv: u32,
    /// B's next byte to send.
    pub b_snd: u32,
    /// B's next byte expected from the pod.
    pub b_rcv: u32,
}

/// Step 1: A into repair mode with nothing unread, and both sockets' sequence numbers.
/// None if A holds bytes past the hello (A is then out of repair mode): a client that
/// streams on without waiting for the server's answer keeps landing segments in A until
/// the entries are in, and each costs the connection a reset at step 3 (reading them and
/// trying again did that to a quarter of `eager_clients_lose_nothing_silently`'s
/// connections); the SockHash path serves it without that risk.
///
/// Leaves both sockets with their receive queue selected, so that step 3 reads their
/// `rcv_nxt` with one call each ([`selected_seq`]).
pub(in crate::dataplane) fn snapshot(
    downstream: &Socket,
    upstream: &Socket,
) -> io::Result<Option<Seqs>> {
    let (a, b) = (downstream.as_raw_fd(), upstream.as_raw_fd());
    set_repair(a, 1)?;
    // `rcv_nxt` first, the queue after: A keeps receiving in repair mode, and a segment
    // landing between an empty queue and the read of `rcv_nxt` would fall before the
    // splice's first sequence number, lost without a trace (it was: 10 failures in 12
    // runs of `eager_clients_lose_nothing_silently`, bytes missing mid-stream). Read in
    // this order, a segment landing after the check moves `rcv_nxt` past `a_rcv`, which
    // step 3 sees: a reset, not a loss.
    let a_snd = queue_seq(a, TCP_SEND_QUEUE)?;
    let a_rcv = queue_seq(a, TCP_RECV_QUEUE)?;
    if ioctl_int(a, libc::TIOCINQ)? != 0 {
        set_repair(a, TCP_REPAIR_OFF_NO_WP)?;
        return Ok(None);
    }
    set_repair(b, 1)?;
    let b_seqs = queue_seq(b, TCP_SEND_QUEUE).and_then(|s| Ok((s, queue_seq(b, TCP_RECV_QUEUE)?)));
    set_repair(b, TCP_REPAIR_OFF_NO_WP)?;
    let (b_snd, b_rcv) = b_seqs?;
    Ok(Some(Seqs {
        a_snd,
        a_rcv,
        b_snd,
        b_rcv,
    }))
}

/// The sequence number of the queue last selected with `TCP_REPAIR_QUEUE`, in or out
/// of repair mode: the kernel resets the selection only when a socket enters repair
/// mode, and reads `TCP_QUEUE_SEQ` without checking the mode. Saves a socket that left
/// repair mode three calls (mode on, select, mode off).
pub(super) fn selected_seq(fd: RawFd) -> io::Result<u32> {
    getsockopt_u32(fd, TCP_QUEUE_SEQ)
}

/// Whether this process may open the raw socket [`send_rst`] sends from (CAP_NET_RAW):
/// checked once at load, because a rewritten connection that could not be reset could
/// not be ended at its idle timeout, lifetime or drain.
pub(in crate::dataplane) fn can_send_resets() -> io::Result<()> {
    socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::TCP),
    )
    .map(drop)
}

/// Sends a reset from `from` to `to` with sequence number `seq`, through a raw socket:
/// a rewritten connection's ends no longer talk to the waypoint's sockets, whose own
/// resets would carry sequence numbers the ends left behind (and be ignored).
pub(in crate::dataplane) fn send_rst(
    from: SocketAddrV4,
    to: SocketAddrV4,
    seq: u32,
) -> io::Result<()> {
    let sock = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::TCP),
    )?;
    sock.bind(&SocketAddr::V4(SocketAddrV4::new(*from.ip(), 0)).into())?;
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&from.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&to.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = 0x04; // RST
    let csum = tcp_checksum(from, to, &tcp);
    tcp[16..18].copy_from_slice(&csum.to_be_bytes());
    sock.send_to(&tcp, &SocketAddr::V4(SocketAddrV4::new(*to.ip(), 0)).into())?;
    Ok(())
}

/// The TCP checksum of `segment` (checksum field zero) over the IPv4 pseudo header.
pub(super) fn tcp_checksum(from: SocketAddrV4, to: SocketAddrV4, segment: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut add = |bytes: &[u8]| {
        for pair in bytes.chunks(2) {
            let hi = u32::from(pair[0]) << 8;
            sum += hi | pair.get(1).map_or(0, |&lo| u32::from(lo));
        }
    };
    add(&from.ip().octets());
    add(&to.ip().octets());
    add(&[0, 6]);
    add(&(segment.len() as u16).to_be_bytes());
    add(segment);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

pub(super) fn setsockopt_int(fd: RawFd, opt: libc::c_int, value: libc::c_int) -> io::Result<()> {
    sys::setsockopt_int(fd, libc::IPPROTO_TCP, opt, value)
}

pub(super) fn getsockopt_u32(fd: RawFd, opt: libc::c_int) -> io::Result<u32> {
    sys::getsockopt_u32(fd, libc::IPPROTO_TCP, opt)
}

/// Puts B into repair mode once everything it sent is acknowledged (its hello, and any
/// bytes or FIN it carried for the client); whether it is in repair mode now. Until then
/// it must be able to resend.
pub(super) fn silence(b: &impl AsFd) -> bool {
    crate::sys::unsent_or_unacked(b).is_ok_and(|n| n == 0)
        && set_repair(b.as_fd().as_raw_fd(), 1).is_ok()
}

pub(super) fn set_repair(fd: RawFd, mode: libc::c_int) -> io::Result<()> {
    setsockopt_int(fd, TCP_REPAIR, mode)
}

/// A queue's sequence number (the socket must be in repair mode): the send queue's is
/// `write_seq`, the receive queue's `rcv_nxt`.
pub(super) fn queue_seq(fd: RawFd, queue: libc::c_int) -> io::Result<u32> {
    setsockopt_int(fd, TCP_REPAIR_QUEUE, queue)?;
    getsockopt_u32(fd, TCP_QUEUE_SEQ)
}

/// Copies what `fd`'s receive queue holds into `buf` without taking it out (`MSG_PEEK`;
/// the only read repair mode allows, from the queue selected with `TCP_REPAIR_QUEUE`).
/// Returns how many bytes it copied: 0 at a FIN or with nothing queued.
pub(super) fn peek(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    sys::peek(fd, buf)
}

/// The socket's TSval clock as an offset from CLOCK_MONOTONIC in milliseconds, the
/// clock the program reads.
pub(in crate::dataplane) fn ts_clock(fd: RawFd) -> io::Result<u32> {
    let ts = getsockopt_u32(fd, TCP_TIMESTAMP)?;
    Ok(ts.wrapping_sub(sys::monotonic_ms()?))
}

pub(super) fn ioctl_int(fd: RawFd, req: libc::Ioctl) -> io::Result<libc::c_int> {
    sys::ioctl_int(fd, req)
}

/// What the rewrite needs of a connection's `TCP_INFO`.
pub(super) struct Info {
    /// Segments sent and not acknowledged.
    pub(super) unacked: u32,
    /// The MSS this socket advertised (from its route's MTU).
    pub(super) advmss: u32,
    pub(super) options: u8,
    /// Shift applied to windows the peer advertises.
    pub(super) snd_wscale: u8,
    /// Shift this socket applies to the windows it advertises.
    pub(super) rcv_wscale: u8,
    /// Sequence space received: data bytes and a FIN.
    pub(super) bytes_received: u64,
    /// Sequence space sent and acknowledged: data bytes and a FIN.
    pub(super) bytes_acked: u64,
    /// Bytes written and not yet sent.
    pub(super) notsent: u32,
    /// `tcpi_state`.
    pub(super) state: u8,
}

impl Info {
    /// A's and B's negotiated options agree, and each side's window scale is what the
    /// other end expects: a window field passes through unchanged.
    pub(super) fn lines_up_with(&self, b: &Info) -> bool {
        // Equal MSS: each end was told the same segment size, so a segment one end sends
        // fits the other's path.
        let mask = TCPI_OPT_TIMESTAMPS | TCPI_OPT_SACK | TCPI_OPT_WSCALE;
        self.options & mask == b.options & mask
            && self.snd_wscale == b.rcv_wscale
            && b.snd_wscale == self.rcv_wscale
            && self.advmss == b.advmss
    }
}

/// What the rewrite reads of `sock`'s `TCP_INFO`.
pub(super) fn info(sock: &impl AsFd) -> io::Result<Info> {
    let i = crate::dataplane::tcp_info(sock)?;
    Ok(Info {
        unacked: i.tcpi_unacked,
        advmss: i.tcpi_advmss,
        bytes_received: i.tcpi_bytes_received,
        bytes_acked: i.tcpi_bytes_acked,
        notsent: i.tcpi_notsent_bytes,
        state: i.tcpi_state,
        options: i.tcpi_options,
        // The two 4-bit fields: the send shift in the low nibble.
        snd_wscale: i.tcpi_snd_rcv_wscale & 0xf,
        rcv_wscale: i.tcpi_snd_rcv_wscale >> 4,
    })
}
