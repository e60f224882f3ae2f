//! Moving and checking pattern bytes over any stream (TLS or raw), and the stream adapter
//! a raw client needs: one that takes the server's answer byte off the front.

use std::{
    io,
    pin::Pin,
    sync::atomic::{AtomicU64, Ordering::Relaxed},
    task::{ready, Context, Poll},
};

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};

use super::scenario::Pattern;

/// Chunk size of pattern writes and reads.
const CHUNK: usize = 64 << 10;

/// Why a stream's bytes were not what they should be.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("byte {at} differs from what was sent")]
    Corrupt { at: u64 },
    #[error("end of stream after {got} of {want} bytes")]
    Short { got: u64, want: u64 },
    #[error("{extra} bytes more than the {want} expected")]
    Extra { extra: usize, want: u64 },
    #[error("the server's answer byte was {0:#04x}")]
    Answer(u8),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Bytes moved so far, readable from outside while the connection runs (what a failure
/// report shows of a connection that stopped moving).
#[derive(Debug, Default)]
pub struct Progress {
    pub sent: AtomicU64,
    pub received: AtomicU64,
}

/// Writes `len` bytes of `pattern` from offset 0.
pub async fn send<W: AsyncWrite + Unpin>(
    w: &mut W,
    pattern: Pattern,
    len: u64,
    progress: &Progress,
) -> Result<(), Error> {
    let mut buf = vec![0u8; CHUNK.min(len as usize)];
    let mut at = 0u64;
    while at < len {
        let n = buf.len().min((len - at) as usize);
        pattern.fill(at, &mut buf[..n]);
        w.write_all(&buf[..n]).await?;
        at += n as u64;
        progress.sent.fetch_add(n as u64, Relaxed);
    }
    w.flush().await?;
    Ok(())
}

/// Reads exactly `len` bytes and checks them against `pattern` from offset 0.
pub async fn expect<R: AsyncRead + Unpin>(
    r: &mut R,
    pattern: Pattern,
    len: u64,
    progress: &Progress,
) -> Result<(), Error> {
    expect_paced(r, pattern, len, CHUNK, None, progress).await
}

/// As [`expect`], reading at most `chunk` bytes at a time and sleeping `pause` after each
/// read (a slow reader).
pub async fn expect_paced<R: AsyncRead + Unpin>(
    r: &mut R,
    pattern: Pattern,
    len: u64,
    chunk: usize,
    pause: Option<std::time::Duration>,
    progress: &Progress,
) -> Result<(), Error> {
    let mut buf = vec![0u8; chunk.min(len as usize).max(1)];
    let mut at = 0u64;
    while at < len {
        let want = buf.len().min((len - at) as usize);
        let n = r.read(&mut buf[..want]).await?;
        if n == 0 {
            return Err(Error::Short { got: at, want: len });
        }
        if let Some(off) = pattern.mismatch(at, &buf[..n]) {
            return Err(Error::Corrupt { at: off });
        }
        at += n as u64;
        progress.received.fetch_add(n as u64, Relaxed);
        if let Some(p) = pause {
            tokio::time::sleep(p).await;
        }
    }
    Ok(())
}

/// Reads until the end of the stream, which must come with no byte before it.
pub async fn expect_eof<R: AsyncRead + Unpin>(r: &mut R, after: u64) -> Result<(), Error> {
    let mut b = [0u8; 512];
    match r.read(&mut b).await? {
        0 => Ok(()),
        extra => Err(Error::Extra { extra, want: after }),
    }
}

/// Echoes everything until the end of the stream, checking it against `pattern`;
/// returns the bytes echoed.
pub async fn echo<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    pattern: Pattern,
    progress: &Progress,
) -> Result<u64, Error> {
    let mut buf = vec![0u8; CHUNK];
    let mut at = 0u64;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(at);
        }
        if let Some(off) = pattern.mismatch(at, &buf[..n]) {
            return Err(Error::Corrupt { at: off });
        }
        at += n as u64;
        progress.received.fetch_add(n as u64, Relaxed);
        s.write_all(&buf[..n]).await?;
        // A TLS stream's write may return with records still held in its buffer (the
        // socket was full); unflushed, they would wait for the next read, which waits
        // for the client, which waits for them.
        s.flush().await?;
        progress.sent.fetch_add(n as u64, Relaxed);
    }
}

/// A raw client's stream: the server answers the hello with one byte before its echo;
/// reads take it off (and check it) first, so a client can stream right behind its hello
/// without waiting for the answer.
pub struct Answered<S> {
    answer: Option<u8>,
    inner: S,
}

impl<S> Answered<S> {
    pub fn new(answer: u8, inner: S) -> Answered<S> {
        Answered {
            answer: Some(answer),
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Answered<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(want) = this.answer {
            let mut one = [0u8; 1];
            let mut b = ReadBuf::new(&mut one);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut b))?;
            match *b.filled() {
                [] => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "end of stream before the server's answer",
                    )))
                }
                [got] if got == want => this.answer = None,
                [got, ..] => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        Error::Answer(got),
                    )))
                }
            }
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Answered<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
