//! The "pods": an echo server and a discarding sink on loopback addresses, on their own
//! tokio runtime inside the benchmark process. Both read the hello, answer one byte (the
//! stand-in for a ServerHello) and then echo or discard. Every router under test dials
//! the same servers, so their cost is the same in every row.
//!
//! The echo server may hold 100,000 idle connections: its per-connection state is one
//! small heap future, and the hello buffer is freed before the echo loop.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc,
    },
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    runtime::Runtime,
};

/// The byte servers answer a hello with.
pub const ANSWER: u8 = 0x16;

/// Errors starting the servers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime could not be built.
    #[error("building the servers' runtime: {0}")]
    Runtime(std::io::Error),
    /// A listener could not be bound.
    #[error("binding a server on {addr}: {source} (is the port taken?)")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// The servers and what they count.
pub struct Servers {
    rt: Runtime,
    /// Port shared by every server address (the waypoint's --pod-port).
    pub port: u16,
    pub echo_ips: Vec<IpAddr>,
    pub sink_ip: IpAddr,
    /// Bytes the sink received after the hellos.
    pub sunk: Arc<AtomicU64>,
    /// Connections the servers currently hold.
    pub open: Arc<AtomicU64>,
}

impl Servers {
    /// Starts the echo server on every `echo_ips` and the sink on `sink_ip`, all on one
    /// port (`port`, or chosen by the kernel when 0).
    pub fn start(
        echo_ips: &[IpAddr],
        sink_ip: IpAddr,
        port: u16,
        hello_len: usize,
    ) -> Result<Servers, Error> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-server")
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let sunk = Arc::new(AtomicU64::new(0));
        let open = Arc::new(AtomicU64::new(0));
        let (sink_listener, port) = rt.block_on(async {
            let addr = SocketAddr::new(sink_ip, port);
            let l = bind(addr).await?;
            let port = l
                .local_addr()
                .map_err(|source| Error::Bind { addr, source })?
                .port();
            Ok::<_, Error>((l, port))
        })?;
        let mut echo_listeners = Vec::new();
        for ip in echo_ips {
            echo_listeners.push(rt.block_on(bind(SocketAddr::new(*ip, port)))?);
        }
        let (s, o) = (sunk.clone(), open.clone());
        rt.spawn(accept_loop(sink_listener, o.clone(), move |c, o| {
            tokio::spawn(sink(c, hello_len, s.clone(), o));
        }));
        for l in echo_listeners {
            rt.spawn(accept_loop(l, o.clone(), move |c, o| {
                tokio::spawn(echo(c, hello_len, o));
            }));
        }
        Ok(Servers {
            rt,
            port,
            echo_ips: echo_ips.to_vec(),
            sink_ip,
            sunk,
            open,
        })
    }

    /// The same servers advertised as `echo_ips:port`: for routers whose pods are other
    /// processes (the scale check).
    pub fn advertising(mut self, echo_ips: Vec<IpAddr>, port: u16) -> Servers {
        self.echo_ips = echo_ips;
        self.port = port;
        self
    }

    pub fn echo_addr(&self) -> SocketAddr {
        SocketAddr::new(self.echo_ips[0], self.port)
    }

    pub fn sink_addr(&self) -> SocketAddr {
        SocketAddr::new(self.sink_ip, self.port)
    }

    /// Stops the servers, dropping every connection they hold.
    pub fn shutdown(self) {
        self.rt.shutdown_background();
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
    .map_err(|source| Error::Bind { addr, source })?;
    socket
        .set_reuseaddr(true)
        .map_err(|source| Error::Bind { addr, source })?;
    socket
        .bind(addr)
        .map_err(|source| Error::Bind { addr, source })?;
    // Deep backlog: the scale check opens connections in bursts.
    socket
        .listen(65_535)
        .map_err(|source| Error::Bind { addr, source })
}

async fn accept_loop(
    l: TcpListener,
    open: Arc<AtomicU64>,
    handle: impl Fn(TcpStream, Arc<AtomicU64>),
) {
    loop {
        match l.accept().await {
            Ok((c, _)) => {
                let _ = c.set_nodelay(true);
                open.fetch_add(1, Relaxed);
                handle(c, open.clone());
            }
            // EMFILE and friends: back off instead of spinning; the connection waits in
            // the backlog.
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
        }
    }
}

/// Reads the hello and answers it; false when the peer went away first.
async fn greet(c: &mut TcpStream, hello_len: usize) -> bool {
    let mut hello = vec![0u8; hello_len];
    c.read_exact(&mut hello).await.is_ok() && c.write_all(&[ANSWER]).await.is_ok()
}

async fn echo(mut c: TcpStream, hello_len: usize, open: Arc<AtomicU64>) {
    if greet(&mut c, hello_len).await {
        let mut buf = [0u8; 2048];
        while let Ok(n @ 1..) = c.read(&mut buf).await {
            if c.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    }
    open.fetch_sub(1, Relaxed);
}

async fn sink(mut c: TcpStream, hello_len: usize, sunk: Arc<AtomicU64>, open: Arc<AtomicU64>) {
    if greet(&mut c, hello_len).await {
        let mut buf = vec![0u8; 256 * 1024];
        while let Ok(n @ 1..) = c.read(&mut buf).await {
            sunk.fetch_add(n as u64, Relaxed);
        }
    }
    open.fetch_sub(1, Relaxed);
}
