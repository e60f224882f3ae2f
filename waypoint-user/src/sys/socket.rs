//! Socket options and queries by descriptor.

use std::{
    io,
    mem::{size_of, MaybeUninit},
    os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd},
};

/// `SO_COOKIE` (Linux 4.12); the libc crate does not define it for every target.
const SO_COOKIE: libc::c_int = 57;

/// A descriptor these calls act on: a borrowed socket, or a raw descriptor its owner
/// keeps open for the call (a closed one fails with EBADF).
pub(crate) trait Fd {
    /// The descriptor's number.
    fn raw(&self) -> RawFd;
}

impl<T: AsFd + ?Sized> Fd for &T {
    fn raw(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

impl Fd for BorrowedFd<'_> {
    fn raw(&self) -> RawFd {
        self.as_raw_fd()
    }
}

impl Fd for RawFd {
    fn raw(&self) -> RawFd {
        *self
    }
}

/// Plain old data a `getsockopt` may fill: any bytes are a valid value.
trait Plain: Copy {}
impl Plain for u32 {}
impl Plain for u64 {}
impl Plain for libc::tcp_info {}

/// Sets an `int` socket option.
pub(crate) fn setsockopt_int(
    fd: impl Fd,
    level: libc::c_int,
    opt: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the option value points at a live c_int and the length is its size; a
    // descriptor that is not open fails with EBADF.
    let rc = unsafe {
        libc::setsockopt(
            fd.raw(),
            level,
            opt,
            (&raw const value).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads a socket option of type `T`. Returns it with the length the kernel wrote.
fn getsockopt<T: Plain>(fd: RawFd, level: libc::c_int, opt: libc::c_int) -> io::Result<(T, usize)> {
    let mut value = MaybeUninit::<T>::zeroed();
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `value` is valid for writes of `len` bytes, and `len` for one socklen_t;
    // the kernel writes at most `len` bytes.
    let rc = unsafe { libc::getsockopt(fd, level, opt, value.as_mut_ptr().cast(), &raw mut len) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zeroed, then partly or wholly written by the kernel; any bytes are a valid
    // `T` (`Plain`).
    Ok((unsafe { value.assume_init() }, len as usize))
}

/// Reads a 32-bit socket option.
pub(crate) fn getsockopt_u32(fd: impl Fd, level: libc::c_int, opt: libc::c_int) -> io::Result<u32> {
    getsockopt::<u32>(fd.raw(), level, opt).map(|(v, _)| v)
}

/// The socket's cookie (`SO_COOKIE`): the kernel's unique number for it, which the
/// SockHash and the verdict key sockets by.
pub(crate) fn cookie(fd: impl Fd) -> io::Result<u64> {
    getsockopt::<u64>(fd.raw(), libc::SOL_SOCKET, SO_COOKIE).map(|(v, _)| v)
}

/// The socket's `TCP_INFO`. An error if the kernel filled less than the fields up to
/// `tcpi_bytes_received` (Linux 4.1), which the dataplanes read.
pub(crate) fn tcp_info(fd: impl Fd) -> io::Result<libc::tcp_info> {
    let (info, len) = getsockopt::<libc::tcp_info>(fd.raw(), libc::IPPROTO_TCP, libc::TCP_INFO)?;
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_received) + size_of::<u64>();
    if len < needed {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "short TCP_INFO"));
    }
    Ok(info)
}

/// Sets SO_RCVLOWAT to `n`. Setting it also makes the kernel check at once whether the
/// socket has data to report (`tcp_set_rcvlowat` → `tcp_data_ready`).
pub(crate) fn set_rcvlowat(fd: impl Fd, n: libc::c_int) -> io::Result<()> {
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, n)
}

/// Runs the socket's write-space callback (`sk_write_space`), changing nothing else:
/// sets `TCP_NOTSENT_LOWAT` to the value it has, and the kernel calls the callback after
/// every set of that option.
///
/// For a socket in a SockHash the callback is the psock's, which schedules the backlog
/// that sends what the verdict redirected to it. Before the 2023 sockmap series (Linux
/// 6.4; 6.1.32), a backlog that found the socket not writeable gave up until that
/// callback ran, and TCP runs it only for a writer that had found the queue full: bytes
/// redirected at the wrong moment stayed in the backlog for good. This is the wake-up
/// the daemon gives such a backlog.
pub(crate) fn wake_writer(fd: impl Fd) -> io::Result<()> {
    let (lowat, _) = getsockopt::<u32>(fd.raw(), libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT)?;
    // Bit for bit: the kernel keeps the option as a u32 (0: the sysctl's value).
    let same = libc::c_int::from_ne_bytes(lowat.to_ne_bytes());
    setsockopt_int(fd, libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT, same)
}

/// An `ioctl` that writes one `int` (SIOCINQ, SIOCOUTQ, SIOCOUTQNSD).
pub(crate) fn ioctl_int(fd: impl Fd, req: libc::Ioctl) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    // SAFETY: the requests this is called with write one int through the pointer.
    if unsafe { libc::ioctl(fd.raw(), req, &raw mut v) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

/// Bytes in the socket's send queue, sent or not (SIOCOUTQ).
pub(crate) fn unsent_or_unacked(fd: impl Fd) -> io::Result<u64> {
    ioctl_int(fd, libc::TIOCOUTQ).map(|n| u64::try_from(n).unwrap_or(0))
}

/// Bytes received and not yet read from the socket (SIOCINQ).
pub(crate) fn queued(fd: impl Fd) -> io::Result<usize> {
    ioctl_int(fd, libc::FIONREAD).map(|n| usize::try_from(n).unwrap_or(0))
}

/// Reads from the socket into the spare capacity of `buf` (which must have some),
/// without zeroing it first, and extends `buf` by what was read.
pub(crate) fn recv_spare(fd: impl Fd, buf: &mut Vec<u8>) -> io::Result<usize> {
    let spare = buf.spare_capacity_mut();
    // SAFETY: the spare capacity is valid for writes of its length for the call.
    let n = unsafe { libc::recv(fd.raw(), spare.as_mut_ptr().cast(), spare.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    // SAFETY: recv initialised the first `n` bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// Copies what the socket's receive queue holds into `buf` without taking it out
/// (`MSG_PEEK`, without waiting). Returns how many bytes it copied: 0 at a FIN or with
/// nothing queued.
pub(crate) fn peek(fd: impl Fd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length for the call.
    let n = unsafe {
        libc::recv(
            fd.raw(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use std::net::{TcpListener, TcpStream};

    use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

    use super::*;

    /// The write-space callback of a TCP socket wakes its writers: an edge-triggered
    /// EPOLLOUT, consumed once, comes again only if the callback ran.
    #[test]
    fn wake_writer_runs_the_write_space_callback_and_keeps_the_option() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let _server = listener.accept().unwrap();
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).unwrap();
        let watched = EpollEvent::new(EpollFlags::EPOLLOUT | EpollFlags::EPOLLET, 7);
        epoll.add(&client, watched).unwrap();
        let mut events = [EpollEvent::empty(); 4];
        let ready = |events: &mut [EpollEvent]| epoll.wait(events, EpollTimeout::ZERO).unwrap();
        assert_eq!(ready(&mut events), 1, "a new socket is writable");
        assert_eq!(ready(&mut events), 0, "the edge was consumed");

        wake_writer(&client).unwrap();
        assert_eq!(ready(&mut events), 1, "the callback woke the writer");
        assert_eq!(events[0].data(), 7);
        let lowat = |s: &TcpStream| getsockopt_u32(s, libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT);
        assert_eq!(lowat(&client).unwrap(), 0, "the option is as it was");

        setsockopt_int(&client, libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT, 131_072).unwrap();
        wake_writer(&client).unwrap();
        assert_eq!(lowat(&client).unwrap(), 131_072, "a set value stays");
    }
}
