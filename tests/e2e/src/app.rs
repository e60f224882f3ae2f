//! The pod application: listens with mTLS on `<pod_ip>:15008`, requires a client
//! certificate from the CA, and for each connection first writes one JSON line saying who
//! it is and whom it saw ([`Greeting`]), then echoes every byte until the client is done.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncWriteExt as _, ReadHalf, WriteHalf},
    net::{TcpListener, TcpStream},
};
use tokio_rustls::{server::TlsStream, TlsAcceptor};

use crate::{pki::Files, tls};

/// `waypoint-e2e serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (`<pod_ip>:15008`).
    #[arg(long)]
    pub listen: SocketAddr,
    /// This pod's name, reported to clients.
    #[arg(long)]
    pub pod: String,
    /// The CA certificate (PEM).
    #[arg(long)]
    pub ca: PathBuf,
    /// This pod's SVID (PEM).
    #[arg(long)]
    pub cert: PathBuf,
    /// This pod's key (PEM).
    #[arg(long)]
    pub key: PathBuf,
}

/// The first line a pod writes on every connection.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Greeting {
    /// The pod's name.
    pub pod: String,
    /// The client's SPIFFE ID, from its verified certificate.
    pub peer_id: String,
    /// The SNI the client sent, if any.
    pub sni: Option<String>,
}

/// Serves until killed.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let files = Files {
        ca: args.ca,
        cert: args.cert,
        key: args.key,
    };
    let acceptor = TlsAcceptor::from(Arc::new(tls::server_config(&files)?));
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    eprintln!("pod {} listening on {}", args.pod, args.listen);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("accept: {e}");
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let pod = args.pod.clone();
        tokio::spawn(async move {
            match handle(acceptor, stream, pod).await {
                Ok(line) => eprintln!("from {peer}: {line}"),
                Err(e) => eprintln!("from {peer}: {e:#}"),
            }
        });
    }
}

async fn handle(acceptor: TlsAcceptor, stream: TcpStream, pod: String) -> anyhow::Result<String> {
    // A client that never finishes its handshake must not hold a task forever.
    let tls = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream))
        .await
        .context("handshake timed out")?
        .context("handshake")?;
    let (_, conn) = tls.get_ref();
    let greeting = Greeting {
        pod,
        peer_id: tls::peer_id(conn.peer_certificates()),
        sni: conn.server_name().map(str::to_owned),
    };
    let mut line = serde_json::to_vec(&greeting)?;
    line.push(b'\n');
    let (mut r, mut w): (
        ReadHalf<TlsStream<TcpStream>>,
        WriteHalf<TlsStream<TcpStream>>,
    ) = tokio::io::split(tls);
    w.write_all(&line).await.context("writing the greeting")?;
    let echoed = tokio::io::copy(&mut r, &mut w).await.context("echoing")?;
    w.shutdown().await.context("closing")?;
    Ok(format!(
        "peer {} sni {:?}: echoed {echoed} bytes",
        greeting.peer_id, greeting.sni
    ))
}
