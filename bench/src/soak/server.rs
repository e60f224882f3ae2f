//! The soak's pod: one listener behind the waypoint, on a runtime of its own. Each
//! connection starts with a ClientHello. The recorded one means raw mode: the server
//! answers one byte and reads the soak header in cleartext. Anything else is a real
//! handshake, which rustls completes (the record already read is handed back to it), and
//! the header comes inside TLS. A raw connection whose first byte after the hello is not
//! a header is a router's readiness probe, and is echoed.
//!
//! The server checks every byte it receives against the connection's pattern and records
//! failures by connection id; it also records which address each connection came from
//! (the waypoint's socket to the pod), for the failure report.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    runtime::Runtime,
};
use tokio_rustls::TlsAcceptor;

use super::{
    scenario::{Dir, Header, Pattern, Scenario, HEADER_LEN, MAGIC_FIRST},
    wire::{self, Progress},
};
use crate::servers::ANSWER;

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("building the soak server's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("binding the soak server on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A failure the server saw, by connection id when the header had arrived.
#[derive(Clone, Debug)]
pub struct Failure {
    pub id: Option<u64>,
    pub scenario: Option<Scenario>,
    pub error: String,
}

/// What the server records, shared with the run.
#[derive(Debug, Default)]
pub struct State {
    /// Connections open now (probes included).
    pub open: AtomicU64,
    /// Bytes checked (received and matched against the pattern).
    pub checked: AtomicU64,
    /// Connection id → the address the waypoint dialed from and the scenario, while
    /// open.
    pub peers: Mutex<HashMap<u64, (SocketAddr, Scenario)>>,
    /// Failures of connections that were not aborted on purpose.
    pub failures: Mutex<Vec<Failure>>,
}

/// The running server.
pub struct Server {
    rt: Runtime,
    pub addr: SocketAddr,
    pub state: Arc<State>,
}

impl Server {
    /// Listens on `addr` (port 0: the kernel picks); `hello` is the recorded hello of the
    /// raw mode.
    pub fn start(
        addr: SocketAddr,
        hello: Vec<u8>,
        tls: Arc<rustls::ServerConfig>,
    ) -> Result<Server, Error> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("soak-server")
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let listener = rt.block_on(async {
            let s =
                tokio::net::TcpSocket::new_v4().map_err(|source| Error::Bind { addr, source })?;
            s.set_reuseaddr(true)
                .map_err(|source| Error::Bind { addr, source })?;
            s.bind(addr)
                .map_err(|source| Error::Bind { addr, source })?;
            s.listen(4096)
                .map_err(|source| Error::Bind { addr, source })
        })?;
        let addr = listener
            .local_addr()
            .map_err(|source| Error::Bind { addr, source })?;
        let state = Arc::new(State::default());
        let hello = Arc::new(hello);
        let acceptor = TlsAcceptor::from(tls);
        rt.spawn(accept(listener, hello, acceptor, state.clone()));
        Ok(Server { rt, addr, state })
    }

    /// Stops the server, dropping what it holds.
    pub fn shutdown(self) {
        self.rt.shutdown_background();
    }
}

async fn accept(
    listener: TcpListener,
    hello: Arc<Vec<u8>>,
    acceptor: TlsAcceptor,
    state: Arc<State>,
) {
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => {
                let _ = tcp.set_nodelay(true);
                state.open.fetch_add(1, Relaxed);
                tokio::spawn(serve(
                    tcp,
                    peer,
                    hello.clone(),
                    acceptor.clone(),
                    state.clone(),
                ));
            }
            // Out of descriptors and the like: the connection waits in the backlog.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

async fn serve(
    tcp: TcpStream,
    peer: SocketAddr,
    hello: Arc<Vec<u8>>,
    acceptor: TlsAcceptor,
    state: Arc<State>,
) {
    let mut header = None;
    if let Err(e) = open(tcp, peer, &hello, &acceptor, &state, &mut header).await {
        let aborted = header
            .as_ref()
            .is_some_and(|h: &Header| h.spec.scenario == Scenario::Abort);
        // A connection its client resets on purpose may end any way at all here.
        if !aborted {
            if let Ok(mut f) = state.failures.lock() {
                f.push(Failure {
                    id: header.as_ref().map(|h| h.id),
                    scenario: header.as_ref().map(|h| h.spec.scenario),
                    error: format!("{e:#}"),
                });
            }
        }
    }
    if let (Some(h), Ok(mut peers)) = (&header, state.peers.lock()) {
        peers.remove(&h.id);
    }
    state.open.fetch_sub(1, Relaxed);
}

/// Reads the first record and serves the connection in the mode it shows.
async fn open(
    mut tcp: TcpStream,
    peer: SocketAddr,
    hello: &[u8],
    acceptor: &TlsAcceptor,
    state: &State,
    header: &mut Option<Header>,
) -> anyhow::Result<()> {
    let mut record = vec![0u8; 5];
    tcp.read_exact(&mut record).await?;
    let len = usize::from(u16::from_be_bytes([record[3], record[4]]));
    record.resize(5 + len, 0);
    tcp.read_exact(&mut record[5..]).await?;
    if record == hello {
        tcp.write_all(&[ANSWER]).await?;
        let mut first = [0u8; 1];
        tcp.read_exact(&mut first).await?;
        if first[0] != MAGIC_FIRST {
            // A readiness probe: echo it.
            tcp.write_all(&first).await?;
            let mut buf = [0u8; 1024];
            loop {
                let n = tcp.read(&mut buf).await?;
                if n == 0 {
                    return Ok(());
                }
                tcp.write_all(&buf[..n]).await?;
            }
        }
        let mut h = [0u8; HEADER_LEN];
        h[0] = first[0];
        tcp.read_exact(&mut h[1..]).await?;
        let h = Header::decode(&h).ok_or_else(|| anyhow::anyhow!("a damaged soak header"))?;
        *header = Some(h.clone());
        record_peer(state, &h, peer);
        scenario(&mut tcp, &h, state).await
    } else {
        // rustls reads the record already read first, then the rest.
        let (rd, wr) = tokio::io::split(tcp);
        let io = tokio::io::join(std::io::Cursor::new(record).chain(rd), wr);
        let mut tls = acceptor.accept(io).await?;
        let mut h = [0u8; HEADER_LEN];
        tls.read_exact(&mut h).await?;
        let h = Header::decode(&h).ok_or_else(|| anyhow::anyhow!("a damaged soak header"))?;
        *header = Some(h.clone());
        record_peer(state, &h, peer);
        scenario(&mut tls, &h, state).await
    }
}

fn record_peer(state: &State, h: &Header, peer: SocketAddr) {
    if let Ok(mut peers) = state.peers.lock() {
        peers.insert(h.id, (peer, h.spec.scenario));
    }
}

/// The server's side of a scenario, ending with its own close once the client's came.
async fn scenario<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    h: &Header,
    state: &State,
) -> anyhow::Result<()> {
    let spec = &h.spec;
    let up = Pattern::new(spec.seed, Dir::Up);
    let down = Pattern::new(spec.seed, Dir::Down);
    let progress = Progress::default();
    let result = match spec.scenario {
        Scenario::Short | Scenario::Bulk => {
            let got = wire::echo(s, up, &progress).await?;
            if got != spec.size {
                Err(wire::Error::Short {
                    got,
                    want: spec.size,
                })
            } else {
                Ok(())
            }
        }
        Scenario::PingPong | Scenario::Abort => wire::echo(s, up, &progress).await.map(drop),
        Scenario::SendThenWait => {
            wire::expect(s, up, spec.size, &progress).await?;
            wire::send(s, down, spec.size, &progress).await?;
            wire::expect_eof(s, spec.size).await
        }
        Scenario::SlowReader => {
            wire::send(s, down, spec.size, &progress).await?;
            wire::expect_eof(s, 0).await
        }
    };
    state
        .checked
        .fetch_add(progress.received.load(Relaxed), Relaxed);
    result?;
    // TLS: close_notify, then FIN.
    s.shutdown().await?;
    Ok(())
}
