//! The portable dataplane: a userspace read/write copy per direction.
//!
//! Slowest of the three, but needs nothing from the kernel beyond TCP. It is also the
//! reference the other dataplanes are tested against.

use std::{
    future::Future,
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
            pump(&downstream, &upstream, &d2u, Ungated).await
        });
        let up_to_down = pin!(pump(&upstream, &downstream, &u2d, Ungated));
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

/// Reads into a stack buffer of this size until one fills it; then the direction switches
/// to a heap buffer of [`BUF_SIZE`] for good. An idle or request/response connection
/// then holds no buffer at all (a 64 KiB one per direction, with a page or two touched,
/// was most of the memory of an idle copied connection).
const SMALL_READ: usize = 4096;

/// What one read did.
enum Step {
    /// The source sent FIN.
    Eof,
    /// Read and written (to TCP) at once.
    Done(usize),
    /// Read; these bytes still have to be written.
    Rest(Vec<u8>, usize),
    /// Read into the heap buffer: its first bytes are to be written.
    Big(usize),
}

/// What a pump waits for before each read. The plain copy waits for its source only;
/// a connection that may move into the kernel also waits for the signal to park (see
/// `dataplane/handover.rs`). A trait, not an `Option`, so that the plain copy's pump does
/// not carry the handover's wait in its state: ~100 B more per pump.
pub(crate) trait Gate {
    /// Waits until `src` is readable. None: the pump is to check in again at once.
    fn wait<'a>(
        &'a self,
        src: &'a TcpStream,
    ) -> impl Future<Output = Option<io::Result<()>>> + Send + 'a;
    /// The pump wrote `n` bytes.
    fn moved(&self, _n: usize) {}
    /// The pump's source ended (EOF).
    fn ended(&self) {}
}

/// The plain copy's gate: the source's readiness only.
pub(crate) struct Ungated;

impl Gate for Ungated {
    async fn wait(&self, src: &TcpStream) -> Option<io::Result<()>> {
        Some(src.readable().await)
    }
}

/// Copies `src` to `dst` until EOF or an error, waiting at `gate` before each read.
pub(crate) async fn pump(
    src: &TcpStream,
    dst: &TcpStream,
    moved: &AtomicU64,
    gate: impl Gate,
) -> DirEnd {
    // Never zeroed: reads go into its spare capacity.
    let mut big: Vec<u8> = Vec::new();
    loop {
        let Some(readable) = gate.wait(src).await else {
            continue;
        };
        if let Err(e) = readable {
            return classify_read_error(e);
        }
        let step = if big.capacity() == 0 {
            // Not held across an await: it takes no room in this future.
            let mut small = [0u8; SMALL_READ];
            match src.try_read(&mut small) {
                Ok(0) => Step::Eof,
                Ok(n) => {
                    if n == SMALL_READ {
                        big.reserve_exact(BUF_SIZE);
                    }
                    match dst.try_write(&small[..n]) {
                        Ok(w) if w == n => Step::Done(n),
                        Ok(w) => Step::Rest(small[w..n].to_vec(), n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            Step::Rest(small[..n].to_vec(), n)
                        }
                        Err(e) => return classify_write_error(e),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return classify_read_error(e),
            }
        } else {
            big.clear();
            match src.try_read_buf(&mut big) {
                Ok(0) => Step::Eof,
                Ok(n) => Step::Big(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return classify_read_error(e),
            }
        };
        let written = match step {
            Step::Eof => {
                gate.ended();
                return match shutdown_write(dst) {
                    Ok(()) => DirEnd::Eof,
                    Err(e) => classify_write_error(e),
                };
            }
            Step::Done(n) => Ok(n),
            Step::Rest(rest, n) => write_all(dst, &rest).await.map(|()| n),
            Step::Big(n) => write_all(dst, &big[..n]).await.map(|()| n),
        };
        match written {
            Ok(n) => {
                moved.fetch_add(n as u64, Relaxed);
                gate.moved(n);
            }
            Err(e) => return classify_write_error(e),
        }
    }
}
