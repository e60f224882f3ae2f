//! Reading and writing a connection's sockets: the one [`write_now`] (what a socket takes
//! at once, never waiting) and the one [`write_all`] (all of it, waiting for room) that
//! every dataplane uses, whatever tells it the socket has room.
//!
//! Both write behind tokio's back: tokio's own writes do not even try while its reactor
//! has not seen the socket writable (a socket just registered is not), and would wait a
//! turn of the event loop for nothing. A stale "writable" costs one WouldBlock later.

use std::{
    io::{self, Read as _, Write as _},
    os::fd::{AsFd, BorrowedFd},
};

use tokio::{
    io::{unix::AsyncFd, Interest},
    net::TcpStream,
};

/// Reads what `sock` holds now, without waiting, whatever tokio's readiness cache says
/// (tokio's `try_read` would leave behind bytes that arrived since its reactor last
/// turned).
pub(crate) fn read_now(sock: &impl AsFd, buf: &mut [u8]) -> io::Result<usize> {
    (&*socket2::SockRef::from(sock)).read(buf)
}

/// One write(2): what `sock` takes of `buf`, or WouldBlock.
fn write_once(sock: &impl AsFd, buf: &[u8]) -> io::Result<usize> {
    (&*socket2::SockRef::from(sock)).write(buf)
}

/// Writes what `sock` takes now of `buf`, retrying interrupted writes, and never waits.
/// Returns how much went: less than all when the socket would block, or when an error
/// came after some bytes went (those bytes are on their way; the error comes back on the
/// next write). An error before any byte went is returned.
pub(crate) fn write_now(sock: &impl AsFd, buf: &[u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match write_once(sock, &buf[done..]) {
            Ok(0) if done == 0 => return Err(io::ErrorKind::WriteZero.into()),
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}

/// A socket and what tells when it has room: tokio's reactor, a registration made for
/// the wait, or the SockHash path's own epoll set.
pub(crate) trait Writable: AsFd {
    /// Waits until the socket may have room, then runs `write` once; a WouldBlock from
    /// it means no room after all, and the wait starts again.
    async fn when_writable(&self, write: impl FnMut() -> io::Result<usize>) -> io::Result<usize>;
}

/// Writes all of `buf` to `to`: what it takes at once ([`write_now`]), then the rest as
/// it has room. Errors: the first error of a write, WriteZero for a socket that takes
/// nothing.
pub(crate) async fn write_all(to: &impl Writable, buf: &[u8]) -> io::Result<()> {
    let mut done = write_now(to, buf)?;
    while done < buf.len() {
        match to.when_writable(|| write_once(to, &buf[done..])).await {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Writable for TcpStream {
    async fn when_writable(&self, write: impl FnMut() -> io::Result<usize>) -> io::Result<usize> {
        // `async_io` clears tokio's readiness on a WouldBlock and waits again.
        self.async_io(Interest::WRITABLE, write).await
    }
}

impl Writable for AsyncFd<BorrowedFd<'_>> {
    async fn when_writable(
        &self,
        mut write: impl FnMut() -> io::Result<usize>,
    ) -> io::Result<usize> {
        self.async_io(Interest::WRITABLE, |_| write()).await
    }
}

/// An unregistered socket ([`super::Socket::Ready`]) writes all of `buf`: what it takes
/// at once, and only if it has to wait is it registered with the reactor, for the wait
/// alone. It stays the caller's, unregistered, whatever happens.
pub(crate) async fn write_all_unregistered(
    sock: &std::net::TcpStream,
    buf: &[u8],
) -> io::Result<()> {
    let done = write_now(sock, buf)?;
    if done == buf.len() {
        return Ok(());
    }
    let waiter = crate::sys::register(sock.as_fd(), Interest::WRITABLE)?;
    write_all(&waiter, &buf[done..]).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;
    use tokio::io::AsyncReadExt as _;

    /// A nonblocking, unregistered sender with a 4 KiB send buffer, a task that reads all
    /// its peer receives, and 4 MiB to send: far more than the socket takes at once.
    async fn small_buffer_sender() -> (
        std::net::TcpStream,
        tokio::task::JoinHandle<Vec<u8>>,
        Vec<u8>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        sender.set_nonblocking(true).unwrap();
        socket2::SockRef::from(&sender)
            .set_send_buffer_size(4096)
            .unwrap();
        let (mut receiver, _) = listener.accept().await.unwrap();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            receiver.read_to_end(&mut got).await.unwrap();
            got
        });
        let data: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
        (sender, reader, data)
    }

    /// What the socket does not take at once goes as the reactor reports room, in order,
    /// and all of it arrives.
    #[tokio::test]
    async fn write_all_writes_everything_in_order() {
        let (sender, reader, data) = small_buffer_sender().await;
        let sender = TcpStream::from_std(sender).unwrap();
        write_all(&sender, &data).await.unwrap();
        drop(sender);
        assert!(reader.await.unwrap() == data, "bytes lost or out of order");
    }

    /// A write that finds a full buffer returns what went, never waits, and the rest goes
    /// later.
    #[tokio::test]
    async fn write_now_takes_what_goes_and_returns() {
        let (sender, reader, data) = small_buffer_sender().await;
        let first = write_now(&sender, &data).unwrap();
        assert!(
            first > 0 && first < data.len(),
            "took {first} of {}",
            data.len()
        );
        let sender = TcpStream::from_std(sender).unwrap();
        write_all(&sender, &data[first..]).await.unwrap();
        drop(sender);
        assert!(reader.await.unwrap() == data, "bytes lost or out of order");
    }

    /// A peer that resets while the writer waits for room: the error comes back, the
    /// write never hangs.
    #[tokio::test]
    async fn a_reset_peer_ends_the_write_with_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let sender = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        socket2::SockRef::from(&sender)
            .set_send_buffer_size(4096)
            .unwrap();
        let (receiver, _) = listener.accept().await.unwrap();
        let data = vec![7u8; 4 << 20];
        let reset = async {
            // Closing with unread bytes and a zero linger sends RST.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            socket2::SockRef::from(&receiver)
                .set_linger(Some(std::time::Duration::ZERO))
                .unwrap();
            drop(receiver);
        };
        let (written, ()) = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            tokio::join!(write_all(&sender, &data), reset)
        })
        .await
        .expect("the write ends once the peer resets");
        let e = written.expect_err("4 MiB cannot all go to a peer that reset");
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
            "{e}"
        );
    }

    /// An unregistered pod socket whose send buffer fills: the writer waits for it to
    /// drain (registering it only for that), loses nothing, and leaves the socket
    /// unregistered and usable.
    #[tokio::test]
    async fn an_unregistered_socket_writes_everything_and_stays_unregistered() {
        let (sender, reader, data) = small_buffer_sender().await;
        write_all_unregistered(&sender, &data).await.unwrap();
        write_all_unregistered(&sender, b"tail").await.unwrap();
        // Registering it now succeeds only if the writer took it out of the reactor.
        let sender = TcpStream::from_std(sender).unwrap();
        drop(sender);
        let mut want = data;
        want.extend_from_slice(b"tail");
        assert!(reader.await.unwrap() == want, "bytes lost or out of order");
    }
}
