//! One soak connection from the client's side: connect to the waypoint, speak TLS
//! (rustls, the test PKI) or raw (the recorded hello with the header and the first bytes
//! right behind it), play the scenario, close, and check every byte and the close.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use rustls_pki_types::ServerName;
use tokio::{
    io::{AsyncRead, AsyncWrite, AsyncWriteExt as _},
    net::TcpStream,
    time::timeout_at,
};
use tokio_rustls::TlsConnector;

use super::{
    scenario::{Dir, Header, Pattern, Scenario},
    wire::{self, Answered, Progress},
};
use crate::servers::ANSWER;

/// How a connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// A real TLS 1.3 handshake end to end; the waypoint reads a real ClientHello.
    Tls,
    /// The recorded ClientHello, and the client's first bytes right behind it without
    /// waiting for an answer (what an eager client does to a waypoint's hand-over).
    Raw,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Tls => "tls",
            Mode::Raw => "raw",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        [Mode::Tls, Mode::Raw].into_iter().find(|m| m.name() == s)
    }
}

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connecting: {0}")]
    Connect(std::io::Error),
    #[error("TLS handshake: {0}")]
    Handshake(std::io::Error),
    #[error("not finished within {0:?}")]
    Deadline(Duration),
    #[error(transparent)]
    Wire(#[from] wire::Error),
}

/// What every connection needs.
#[derive(Clone)]
pub struct Client {
    /// The waypoint's tunnel address.
    pub target: SocketAddr,
    /// The recorded hello of the raw mode.
    pub hello: Arc<Vec<u8>>,
    pub tls: TlsConnector,
    /// The SNI: the waypoint's routing key for the soak's service.
    pub sni: ServerName<'static>,
    pub deadline: Duration,
}

/// A connection as it ended.
pub struct Ended {
    pub result: Result<(), Error>,
    /// The client's socket, still open on a failure (for the report); None if connecting
    /// failed.
    pub socket: Option<TcpStream>,
    pub elapsed: Duration,
}

impl Client {
    /// Runs one connection to its end or its deadline. On success the socket is closed
    /// (an abort's with a reset); on a failure it is handed back open.
    pub async fn run(&self, header: &Header, mode: Mode, progress: &Progress) -> Ended {
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started + self.deadline);
        let mut tcp = match timeout_at(deadline, TcpStream::connect(self.target)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                return Ended {
                    result: Err(Error::Connect(e)),
                    socket: None,
                    elapsed: started.elapsed(),
                }
            }
            Err(_) => {
                return Ended {
                    result: Err(Error::Deadline(self.deadline)),
                    socket: None,
                    elapsed: started.elapsed(),
                }
            }
        };
        let _ = tcp.set_nodelay(true);
        let result =
            match timeout_at(deadline, self.converse(&mut tcp, header, mode, progress)).await {
                Ok(r) => r,
                Err(_) => Err(Error::Deadline(self.deadline)),
            };
        let elapsed = started.elapsed();
        if result.is_ok() {
            if header.spec.scenario == Scenario::Abort {
                let _ = socket2::SockRef::from(&tcp).set_linger(Some(Duration::ZERO));
            }
            return Ended {
                result,
                socket: None,
                elapsed,
            };
        }
        Ended {
            result,
            socket: Some(tcp),
            elapsed,
        }
    }

    async fn converse(
        &self,
        tcp: &mut TcpStream,
        header: &Header,
        mode: Mode,
        progress: &Progress,
    ) -> Result<(), Error> {
        match mode {
            Mode::Tls => {
                let mut tls = self
                    .tls
                    .connect(self.sni.clone(), tcp)
                    .await
                    .map_err(Error::Handshake)?;
                tls.write_all(&header.encode())
                    .await
                    .map_err(wire::Error::from)?;
                play(&mut tls, header, progress).await
            }
            Mode::Raw => {
                let mut first = self.hello.to_vec();
                first.extend_from_slice(&header.encode());
                tcp.write_all(&first).await.map_err(wire::Error::from)?;
                play(&mut Answered::new(ANSWER, tcp), header, progress).await
            }
        }
    }
}

/// The client's side of a scenario, from the first byte after the header to the end of
/// the stream.
async fn play<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    h: &Header,
    progress: &Progress,
) -> Result<(), Error> {
    let spec = &h.spec;
    let up = Pattern::new(spec.seed, Dir::Up);
    let down = Pattern::new(spec.seed, Dir::Down);
    match spec.scenario {
        Scenario::Short => {
            wire::send(s, up, spec.size, progress).await?;
            wire::expect(s, up, spec.size, progress).await?;
            close(s, spec.size).await
        }
        Scenario::PingPong => {
            // The echo of message k is the pattern's bytes at the same offsets.
            let (mut sent, mut buf) = (0u64, Vec::new());
            for len in spec.messages() {
                buf.resize(len, 0);
                up.fill(sent, &mut buf);
                s.write_all(&buf).await.map_err(wire::Error::from)?;
                let mut got = 0;
                while got < len {
                    let n = tokio::io::AsyncReadExt::read(s, &mut buf[got..])
                        .await
                        .map_err(wire::Error::from)?;
                    if n == 0 {
                        return Err(wire::Error::Short {
                            got: sent + got as u64,
                            want: sent + len as u64,
                        }
                        .into());
                    }
                    got += n;
                }
                if let Some(at) = up.mismatch(sent, &buf) {
                    return Err(wire::Error::Corrupt { at }.into());
                }
                sent += len as u64;
                progress
                    .sent
                    .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
                progress
                    .received
                    .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
            }
            close(s, sent).await
        }
        Scenario::Bulk => {
            // Both directions at once; the client half-closes as soon as it has written
            // everything, while the echo still streams back.
            let (mut rd, mut wr) = tokio::io::split(s);
            let write = async {
                wire::send(&mut wr, up, spec.size, progress).await?;
                wr.shutdown().await?;
                Ok::<_, wire::Error>(())
            };
            let read = async {
                wire::expect(&mut rd, up, spec.size, progress).await?;
                wire::expect_eof(&mut rd, spec.size).await
            };
            tokio::try_join!(write, read)?;
            Ok(())
        }
        Scenario::SendThenWait => {
            wire::send(s, up, spec.size, progress).await?;
            wire::expect(s, down, spec.size, progress).await?;
            close(s, spec.size).await
        }
        Scenario::SlowReader => {
            wire::expect_paced(
                s,
                down,
                spec.size,
                4096,
                Some(Duration::from_millis(2)),
                progress,
            )
            .await?;
            close(s, spec.size).await
        }
        Scenario::Abort => {
            // Streams while reading the echo, and stops when `cut` bytes came back; the
            // caller then resets the connection.
            let (mut rd, mut wr) = tokio::io::split(s);
            let write = wire::send(&mut wr, up, spec.size, progress);
            let read = wire::expect(&mut rd, up, spec.cut, progress);
            tokio::pin!(write, read);
            tokio::select! {
                r = &mut read => r?,
                w = &mut write => {
                    w?;
                    read.await?;
                }
            }
            Ok(())
        }
    }
}

/// The client's close (close_notify and FIN), then the server's, with nothing before it.
async fn close<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, after: u64) -> Result<(), Error> {
    s.shutdown().await.map_err(wire::Error::from)?;
    wire::expect_eof(s, after).await?;
    Ok(())
}
