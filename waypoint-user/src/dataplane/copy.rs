//! The portable dataplane: a userspace read/write copy per direction.
//!
//! Slowest of the three, but needs nothing from the kernel beyond TCP. It is also the
//! reference the other dataplanes are tested against.

use std::{
    io,
    pin::pin,
    sync::atomic::{AtomicU64, Ordering::Relaxed},
};

use tokio::net::TcpStream;

use super::{
    classify_read_error, classify_write_error, drive, shutdown_write, DirEnd, Limits, Outcome,
};

/// Size of each direction's copy buffer.
const BUF_SIZE: usize = 64 * 1024;

/// The userspace copy dataplane. Stateless.
#[derive(Clone, Debug, Default)]
pub struct Copy;

impl Copy {
    /// See [`super::Dataplane::forward`].
    pub async fn forward(
        &self,
        downstream: TcpStream,
        upstream: TcpStream,
        initial: Vec<u8>,
        limits: Limits,
    ) -> io::Result<Outcome> {
        let d2u = AtomicU64::new(0);
        let u2d = AtomicU64::new(0);
        let down_to_up = pin!(async {
            if let Err(e) = write_all(&upstream, &initial).await {
                return classify_write_error(e);
            }
            d2u.fetch_add(initial.len() as u64, Relaxed);
            // Not held for the connection's lifetime.
            drop(initial);
            pump(&downstream, &upstream, &d2u).await
        });
        let up_to_down = pin!(pump(&upstream, &downstream, &u2d));
        let end = drive(
            &downstream,
            &upstream,
            limits,
            down_to_up,
            up_to_down,
            || d2u.load(Relaxed) + u2d.load(Relaxed),
        )
        .await;
        Ok(Outcome {
            downstream_to_upstream: d2u.load(Relaxed),
            upstream_to_downstream: u2d.load(Relaxed),
            end,
        })
    }
}

/// Writes all of `buf` to `sock`, waiting for send-buffer space as needed.
pub(crate) async fn write_all(sock: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        sock.writable().await?;
        match sock.try_write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn pump(src: &TcpStream, dst: &TcpStream, moved: &AtomicU64) -> DirEnd {
    // Allocated at the first readable event and never zeroed (reads go into its spare
    // capacity): an idle connection holds no buffer, and a short one pays no memset.
    let mut buf = Vec::new();
    loop {
        if let Err(e) = src.readable().await {
            return classify_read_error(e);
        }
        buf.clear();
        if buf.capacity() < BUF_SIZE {
            buf.reserve_exact(BUF_SIZE);
        }
        let n = match src.try_read_buf(&mut buf) {
            Ok(0) => {
                return match shutdown_write(dst) {
                    Ok(()) => DirEnd::Eof,
                    Err(e) => classify_write_error(e),
                }
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return classify_read_error(e),
        };
        if let Err(e) = write_all(dst, &buf[..n]).await {
            return classify_write_error(e);
        }
        moved.fetch_add(n as u64, Relaxed);
    }
}
