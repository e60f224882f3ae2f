//! A leaving daemon hands its rewritten connections' sockets to the pods (each B) to
//! the daemon that adopts its program (see `adopt.rs`), over a unix socket
//! (SCM_RIGHTS).
//!
//! B holds the connection's 4-tuple: closed, it frees the port for the next dial to the
//! same pod, whose packets the connection's entries would rewrite into the old client's
//! conversation. A killed daemon's Bs close with it, and the adopter binds the ports
//! again at once; a leaving daemon's Bs never close: they pass from hand to hand.
//!
//! The leaving daemon listens on `waypoint/rewrite-leaving/<program id>` (an abstract
//! SOCK_SEQPACKET socket: per network namespace, gone with the process) *before* it
//! lets go of its program's owner name. The adopter, having taken the name, connects,
//! reads the hello ([`HELLO`], which carries the protocol's version), then messages of
//! slots (u32 each, native order) with one descriptor per slot, until the end. A
//! version it does not read ends the exchange: the leaving daemon's Bs then close with
//! it, and the adopter holds the ports as after a kill.

use std::{
    io::{self, IoSlice, IoSliceMut},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    time::{Duration, Instant},
};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    self, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr,
};

/// The first message: the protocol and its version.
pub const HELLO: &[u8] = b"waypoint-rewrite-handoff/1";

/// Descriptors per message (the kernel takes at most 253, `SCM_MAX_FD`).
const BATCH: usize = 200;

/// How long the adopter waits for each message.
const RECEIVE_WAIT: Duration = Duration::from_secs(5);

fn name(prog_id: u32) -> String {
    format!("waypoint/rewrite-leaving/{prog_id}")
}

/// The leaving daemon's listener, bound before its owner name goes.
#[derive(Debug)]
pub struct Offer {
    listener: OwnedFd,
}

impl Offer {
    /// Listens for program `prog_id`'s adopter.
    pub fn listen(prog_id: u32) -> io::Result<Offer> {
        let listener = socket::socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        let addr = UnixAddr::new_abstract(name(prog_id).as_bytes())?;
        socket::bind(listener.as_raw_fd(), &addr)?;
        socket::listen(&listener, socket::Backlog::new(1)?)?;
        Ok(Offer { listener })
    }

    /// Waits up to `within` for the adopter, then sends it `sockets` (slot, B). Returns
    /// whether an adopter took them; the descriptors are this process's to close either
    /// way (the adopter holds its own).
    pub fn give(&self, sockets: &[(u32, OwnedFd)], within: Duration) -> io::Result<bool> {
        let timeout = PollTimeout::try_from(within).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(
            std::os::fd::AsFd::as_fd(&self.listener),
            PollFlags::POLLIN,
        )];
        if poll(&mut fds, timeout)? == 0 {
            return Ok(false);
        }
        let raw = socket::accept(self.listener.as_raw_fd())?;
        // SAFETY: accept returned a new descriptor that nothing else owns.
        let conn = unsafe { OwnedFd::from_raw_fd(raw) };
        // An adopter that stops reading must not hold this daemon's exit.
        let timeout = nix::sys::time::TimeVal::new(RECEIVE_WAIT.as_secs() as libc::time_t, 0);
        socket::setsockopt(&conn, socket::sockopt::SendTimeout, &timeout)?;
        send(&conn, HELLO, &[])?;
        for chunk in sockets.chunks(BATCH) {
            let slots: Vec<u8> = chunk.iter().flat_map(|(s, _)| s.to_ne_bytes()).collect();
            let fds: Vec<RawFd> = chunk.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
            send(&conn, &slots, &fds)?;
        }
        Ok(true)
    }
}

fn send(conn: &OwnedFd, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let iov = [IoSlice::new(payload)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    socket::sendmsg::<()>(conn.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None)?;
    Ok(())
}

/// Errors of receiving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The socket calls failed.
    #[error("receiving the leaving daemon's sockets: {0}")]
    Io(#[from] io::Error),
    /// Another protocol, or another version of it.
    #[error("the leaving daemon speaks {0:?}, this one {HELLO:?}")]
    Version(String),
    /// A message whose descriptors do not match its slots.
    #[error("a message of {slots} bytes of slots came with {fds} descriptors")]
    Malformed {
        /// The payload's length.
        slots: usize,
        /// The descriptors it carried.
        fds: usize,
    },
}

/// Takes program `prog_id`'s Bs from its leaving daemon, if one offers them: (slot, B)
/// pairs, none if no daemon listens (it was killed).
pub fn receive(prog_id: u32) -> Result<Vec<(u32, OwnedFd)>, Error> {
    let conn = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(io::Error::from)?;
    let addr = UnixAddr::new_abstract(name(prog_id).as_bytes()).map_err(io::Error::from)?;
    match socket::connect(conn.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(nix::Error::ECONNREFUSED | nix::Error::ENOENT) => return Ok(Vec::new()),
        Err(e) => return Err(io::Error::from(e).into()),
    }
    let deadline = Instant::now() + RECEIVE_WAIT;
    let mut got = Vec::new();
    let mut buf = vec![0u8; BATCH * 4];
    let (n, _) = recv(&conn, &mut buf, &mut got, deadline)?;
    if buf.get(..n) != Some(HELLO) {
        return Err(Error::Version(
            String::from_utf8_lossy(buf.get(..n).unwrap_or_default()).into_owned(),
        ));
    }
    let mut sockets = Vec::new();
    loop {
        let mut fds = Vec::new();
        let (n, _) = recv(&conn, &mut buf, &mut fds, deadline)?;
        if n == 0 && fds.is_empty() {
            return Ok(sockets);
        }
        if n != 4 * fds.len() {
            return Err(Error::Malformed {
                slots: n,
                fds: fds.len(),
            });
        }
        for (slot, fd) in buf.chunks_exact(4).zip(fds) {
            let slot = u32::from_ne_bytes([slot[0], slot[1], slot[2], slot[3]]);
            sockets.push((slot, fd));
        }
    }
}

/// One message into `buf`, its descriptors into `fds`; (bytes, descriptors).
fn recv(
    conn: &OwnedFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Instant,
) -> Result<(usize, usize), Error> {
    let left = deadline.saturating_duration_since(Instant::now());
    let mut pfd = [PollFd::new(
        std::os::fd::AsFd::as_fd(conn),
        PollFlags::POLLIN,
    )];
    if poll(
        &mut pfd,
        PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX),
    )
    .map_err(io::Error::from)?
        == 0
    {
        return Err(io::Error::from(io::ErrorKind::TimedOut).into());
    }
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; BATCH]);
    let msg = socket::recvmsg::<()>(
        conn.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    let n = msg.bytes;
    let before = fds.len();
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(received) = c {
            // SAFETY: SCM_RIGHTS installed these descriptors in this process; nothing
            // else owns them.
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    Ok((n, fds.len() - before))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// Sockets pass with their slots, in batches; no listener means nothing to take.
    #[test]
    fn sockets_pass_with_their_slots() {
        let id = u32::MAX - 1 - u32::from(std::process::id() as u16);
        assert!(receive(id).unwrap().is_empty());
        let offer = Offer::listen(id).unwrap();
        // More than a batch: 450 sockets, each a pipe's end whose partner tells it apart.
        let mut ends = Vec::new();
        let mut sockets = Vec::new();
        for slot in 0..450u32 {
            let (r, w) = nix::unistd::pipe().unwrap();
            nix::unistd::write(&w, &slot.to_ne_bytes()).unwrap();
            ends.push(w);
            sockets.push((slot + 7, r));
        }
        let adopter = std::thread::spawn(move || receive(id).unwrap());
        assert!(offer.give(&sockets, Duration::from_secs(5)).unwrap());
        drop(sockets);
        let got = adopter.join().unwrap();
        assert_eq!(got.len(), 450);
        for (slot, fd) in got {
            let mut b = [0u8; 4];
            nix::unistd::read(&fd, &mut b).unwrap();
            assert_eq!(u32::from_ne_bytes(b) + 7, slot);
        }
    }

    /// A leaving daemon of another protocol version, or one whose message's descriptors
    /// do not match its slots: the adopter takes nothing, with an error that says why
    /// (it then holds the ports itself, as after a kill).
    #[test]
    fn another_version_or_a_malformed_message_is_refused() {
        let id = u32::MAX - 2 - u32::from(std::process::id() as u16);
        let leaving = |first: &'static [u8], second: Option<(&'static [u8], usize)>| {
            let offer = Offer::listen(id).unwrap();
            std::thread::spawn(move || {
                let raw = socket::accept(offer.listener.as_raw_fd()).unwrap();
                // SAFETY: accept returned a new descriptor that nothing else owns.
                let conn = unsafe { OwnedFd::from_raw_fd(raw) };
                send(&conn, first, &[]).unwrap();
                if let Some((slots, n)) = second {
                    let pipes: Vec<_> = (0..n).map(|_| nix::unistd::pipe().unwrap()).collect();
                    let fds: Vec<RawFd> = pipes.iter().map(|(r, _)| r.as_raw_fd()).collect();
                    send(&conn, slots, &fds).unwrap();
                }
                // Held until the adopter has read (it closes its end).
                let mut b = [0u8; 1];
                let _ = socket::recv(conn.as_raw_fd(), &mut b, MsgFlags::empty());
            })
        };
        let next = leaving(b"waypoint-rewrite-handoff/2", None);
        match receive(id) {
            Err(Error::Version(v)) => assert_eq!(v, "waypoint-rewrite-handoff/2"),
            other => panic!("expected a version refusal, got {other:?}"),
        }
        next.join().unwrap();
        // Two slots, three descriptors.
        let bad = leaving(HELLO, Some((&[0u8; 8], 3)));
        match receive(id) {
            Err(Error::Malformed { slots: 8, fds: 3 }) => {}
            other => panic!("expected a malformed message, got {other:?}"),
        }
        bad.join().unwrap();
    }
}
