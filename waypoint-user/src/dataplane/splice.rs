//! The splice dataplane: per direction, splice(2) from the source socket into a pipe and
//! from the pipe into the destination socket. Bytes never enter userspace; tokio
//! readiness drives the calls, so there is no thread per connection.

use std::{
    io,
    os::fd::{AsFd, OwnedFd},
    pin::pin,
    sync::atomic::{AtomicU64, Ordering::Relaxed},
};

use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags};
use tokio::{io::Interest, net::TcpStream};

use super::{
    classify_read_error, classify_write_error, drive, shutdown_write, stall::Watchdog,
    tally::Tally, write_all, DirEnd, Kind, Limits, Outcome,
};

/// Default pipe capacity per direction. The kernel default (64 KiB) caps each splice
/// call at 16 pages; a larger pipe moves more per syscall.
pub const DEFAULT_PIPE_SIZE: usize = 1024 * 1024;

/// The splice dataplane.
#[derive(Clone, Debug)]
pub struct Splice {
    pipe_size: usize,
    tally: &'static Tally,
}

impl Default for Splice {
    fn default() -> Self {
        Splice::new(DEFAULT_PIPE_SIZE)
    }
}

impl Splice {
    /// A splice dataplane whose pipes hold `pipe_size` bytes (the kernel may round up, or
    /// refuse above /proc/sys/fs/pipe-max-size, in which case the default size is kept).
    pub fn new(pipe_size: usize) -> Self {
        Splice {
            pipe_size,
            tally: Tally::leak(Kind::Splice),
        }
    }

    pub(super) fn tally(&self) -> &'static Tally {
        self.tally
    }

    /// See [`super::Dataplane::forward`].
    pub async fn forward(
        &self,
        downstream: TcpStream,
        upstream: TcpStream,
        initial: Vec<u8>,
        limits: Limits,
    ) -> io::Result<Outcome> {
        let d2u_pipe = Pipe::new(self.pipe_size)?;
        let u2d_pipe = Pipe::new(self.pipe_size)?;
        let d2u = AtomicU64::new(0);
        let u2d = AtomicU64::new(0);
        let down_to_up = pin!(async {
            if let Err(e) = write_all(&upstream, &initial).await {
                return classify_write_error(e);
            }
            d2u.fetch_add(initial.len() as u64, Relaxed);
            // Not held for the connection's lifetime.
            drop(initial);
            pump(&downstream, &upstream, &d2u_pipe, &d2u).await
        });
        let up_to_down = pin!(pump(&upstream, &downstream, &u2d_pipe, &u2d));
        let mut watchdog = Watchdog::new(self.tally, limits.stall_after);
        let end = drive(
            &downstream,
            &upstream,
            limits,
            down_to_up,
            up_to_down,
            || d2u.load(Relaxed) + u2d.load(Relaxed),
            |now, moved| {
                watchdog.check(now, moved, &downstream, &upstream, None);
                None
            },
        )
        .await;
        Ok(Outcome {
            downstream_to_upstream: d2u.load(Relaxed),
            upstream_to_downstream: u2d.load(Relaxed),
            end,
        })
    }
}

struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

impl Pipe {
    fn new(size: usize) -> io::Result<Pipe> {
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        let size = i32::try_from(size).unwrap_or(i32::MAX);
        let capacity = match nix::fcntl::fcntl(&write, FcntlArg::F_SETPIPE_SZ(size)) {
            Ok(actual) => usize::try_from(actual).unwrap_or(64 * 1024),
            // Above pipe-max-size for an unprivileged process: keep the default.
            Err(_) => 64 * 1024,
        };
        Ok(Pipe {
            read,
            write,
            capacity,
        })
    }
}

fn splice(from: impl AsFd, to: impl AsFd, len: usize) -> io::Result<usize> {
    nix::fcntl::splice(
        from,
        None,
        to,
        None,
        len,
        SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK,
    )
    .map_err(io::Error::from)
}

async fn pump(src: &TcpStream, dst: &TcpStream, pipe: &Pipe, moved: &AtomicU64) -> DirEnd {
    loop {
        // Fill the (empty) pipe from the source.
        let filled = src
            .async_io(Interest::READABLE, || {
                splice(src, &pipe.write, pipe.capacity)
            })
            .await;
        let mut in_pipe = match filled {
            Ok(0) => {
                return match shutdown_write(dst) {
                    Ok(()) => DirEnd::Eof,
                    Err(e) => classify_write_error(e),
                }
            }
            Ok(n) => n,
            Err(e) => return classify_read_error(e),
        };
        // Drain it into the destination before reading more, so bytes stay in order and
        // at most one pipe's worth is in flight per direction.
        while in_pipe > 0 {
            match dst
                .async_io(Interest::WRITABLE, || splice(&pipe.read, dst, in_pipe))
                .await
            {
                Ok(n) => {
                    in_pipe -= n;
                    moved.fetch_add(n as u64, Relaxed);
                }
                Err(e) => return classify_write_error(e),
            }
        }
    }
}
