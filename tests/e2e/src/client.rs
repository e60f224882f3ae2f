//! The source client, playing a source pod's proxy: asks its own node's daemon for the
//! split-horizon view of a service port, dials what the view says with the SNI it says,
//! presents its SVID, verifies the server's, and pushes a deterministic byte stream
//! through the echo, comparing SHA-256 both ways. Also the abuse client, which sends what
//! a waypoint must refuse.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _},
    net::TcpStream,
};
use tokio_rustls::TlsConnector;

use crate::{
    admin::{self, Target},
    app::Greeting,
    pki::{self, Files},
    tls,
    topology::MESH_DOMAIN,
};

/// Deadline of a TCP connect: room for two lost SYNs on a lossy link (the kernel
/// resends after 1 s and 3 s), as a mesh client with a few seconds' budget has.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(7);

/// Deadline of the TLS handshake, which includes the waypoint's own dial of the pod
/// (up to `--connect-attempts` tries of `--connect-timeout` each).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Parses `64MiB`, `512KiB`, `1GiB` or a bare number of bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size"))?;
    let mult = match unit {
        "" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(format!("{s:?}: use KiB, MiB or GiB")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// The identity files of a pod, as flags.
#[derive(Clone, Debug, clap::Args)]
pub struct IdentityArgs {
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

impl IdentityArgs {
    fn files(&self) -> Files {
        Files {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }
}

/// `waypoint-e2e client`.
#[derive(Clone, Debug, clap::Args)]
pub struct ClientArgs {
    /// The admin address of this pod's own node's daemon (`<node_ip>:15021`).
    #[arg(long)]
    pub admin: SocketAddr,
    /// The service port: `<svc>.<ns>:<port>`.
    #[arg(long)]
    pub service: String,
    /// Dial the endpoint on this node (default: the first of the best priority).
    #[arg(long)]
    pub via: Option<String>,
    /// Bytes to send (and expect echoed): `64MiB`, `512KiB`, ...
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    pub bytes: u64,
    /// Send at most this many bytes per second (a long transfer that overlaps others).
    #[arg(long, value_parser = parse_size)]
    pub rate: Option<u64>,
    /// Ping-pong instead of a bulk transfer: this many messages, each written whole and
    /// its echo read back before the next (sizes from 1 byte to 16 KiB; `--bytes` is
    /// then unused).
    #[arg(long)]
    pub messages: Option<u32>,
    /// The server's service account (default: the service's name).
    #[arg(long)]
    pub expect_sa: Option<String>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    #[command(flatten)]
    pub identity: IdentityArgs,
}

/// What the client did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    /// The service port asked for.
    pub service: String,
    /// The endpoint chosen from the view.
    pub target: Option<Target>,
    /// The SNI sent (none: rustls sends no SNI that is not a DNS name, such as a bare
    /// port; the pod's app does not need it).
    pub sni_sent: Option<String>,
    /// The client's own SPIFFE ID.
    pub client_id: String,
    /// The server's SPIFFE ID, verified.
    pub server_id: String,
    /// What the server said about itself and about the client.
    pub greeting: Option<Greeting>,
    /// Bytes sent.
    pub sent: u64,
    /// Bytes received back.
    pub received: u64,
    /// SHA-256 of what was sent.
    pub sent_sha256: String,
    /// SHA-256 of what came back.
    pub received_sha256: String,
    /// Everything came back, unchanged.
    pub intact: bool,
    /// Wall time.
    pub elapsed_ms: u64,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

impl Report {
    /// Whether the exchange completed intact.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.intact
    }
}

/// The `<svc>.<ns>:<port>` parts.
fn split_service(s: &str) -> anyhow::Result<(String, String, u16)> {
    let (name, port) = s.rsplit_once(':').context("expected <svc>.<ns>:<port>")?;
    let (svc, ns) = name.split_once('.').context("expected <svc>.<ns>:<port>")?;
    Ok((svc.to_owned(), ns.to_owned(), port.parse()?))
}

/// Runs one exchange; never fails: what went wrong is in the report.
pub async fn run(args: ClientArgs) -> Report {
    let start = Instant::now();
    let mut report = Report {
        service: args.service.clone(),
        ..Report::default()
    };
    let limit = Duration::from_secs(args.timeout);
    match tokio::time::timeout(limit, exchange(&args, &mut report)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => report.error = Some(format!("{e:#}")),
        Err(_) => report.error = Some(format!("timed out after {limit:?}")),
    }
    report.elapsed_ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
    report
}

fn choose(view: &admin::View, via: Option<&str>) -> anyhow::Result<Target> {
    let found = match via {
        Some(node) => view.endpoints.iter().find(|t| t.node == node),
        None => view.endpoints.first(),
    };
    match found {
        Some(t) => Ok(t.clone()),
        None => bail!(
            "the view has no endpoint{}",
            via.map(|n| format!(" on node {n}")).unwrap_or_default()
        ),
    }
}

async fn exchange(args: &ClientArgs, report: &mut Report) -> anyhow::Result<()> {
    let (svc, ns, port) = split_service(&args.service)?;
    let files = args.identity.files();
    report.client_id = tls::cert_id(&files.cert)?;
    let (admin_addr, service) = (args.admin, args.service.clone());
    let view = tokio::task::spawn_blocking(move || admin::resolve(admin_addr, &service))
        .await
        .context("resolving")??;
    let target = choose(&view, args.via.as_deref())?;
    report.target = Some(target.clone());

    let verify_name = format!("{port}.{svc}.{ns}.{MESH_DOMAIN}");
    let expect = pki::spiffe_id(&ns, args.expect_sa.as_deref().unwrap_or(&svc));
    let config = tls::client_config(&files, &verify_name, &expect)?;
    let server_name = match rustls_pki_types::ServerName::try_from(target.sni.clone()) {
        Ok(n @ rustls_pki_types::ServerName::DnsName(_)) => {
            report.sni_sent = Some(target.sni.clone());
            n
        }
        _ => rustls_pki_types::ServerName::IpAddress(target.address.ip().into()),
    };
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target.address))
        .await
        .with_context(|| format!("connecting to {}: timed out", target.address))?
        .with_context(|| format!("connecting to {}", target.address))?;
    let mut stream = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        TlsConnector::from(Arc::new(config)).connect(server_name, tcp),
    )
    .await
    .context("TLS handshake: timed out")?
    .context("TLS handshake")?;
    report.server_id = tls::peer_id(stream.get_ref().1.peer_certificates());

    let line = read_line(&mut stream)
        .await
        .context("reading the greeting")?;
    report.greeting = Some(serde_json::from_slice(&line).context("parsing the greeting")?);

    if let Some(messages) = args.messages {
        let (sent, received, intact) = ping_pong(&mut stream, messages).await?;
        report.sent = sent;
        report.received = received;
        report.intact = intact;
        return Ok(());
    }
    let (r, w) = tokio::io::split(stream);
    let ((sent, sent_sha), (received, received_sha)) =
        tokio::try_join!(send(w, args.bytes, args.rate), receive(r))?;
    report.sent = sent;
    report.received = received;
    report.intact = sent == args.bytes && received == sent && sent_sha == received_sha;
    report.sent_sha256 = sent_sha;
    report.received_sha256 = received_sha;
    Ok(())
}

/// `messages` round trips of the pattern, each echo compared with what was sent; then
/// the client's close and the echo's. Returns bytes sent, bytes received and whether
/// every echo matched and the echo closed right after the last one.
async fn ping_pong<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    messages: u32,
) -> anyhow::Result<(u64, u64, bool)> {
    let mut pattern = Pattern(0x2545_f491_4f6c_dd1d);
    let (mut sent, mut received, mut intact) = (0u64, 0u64, true);
    let mut msg = vec![0u8; 16 << 10];
    let mut back = vec![0u8; 16 << 10];
    for i in 0..messages {
        // Sizes cycle through 1 B, a few hundred, a segment and several segments.
        let len = [1usize, 333, 1448, 4000, 16 << 10][i as usize % 5];
        pattern.fill(&mut msg[..len]);
        stream
            .write_all(&msg[..len])
            .await
            .with_context(|| format!("sending message {i}"))?;
        stream
            .read_exact(&mut back[..len])
            .await
            .with_context(|| format!("reading the echo of message {i}"))?;
        sent += len as u64;
        received += len as u64;
        intact &= back[..len] == msg[..len];
    }
    stream
        .shutdown()
        .await
        .context("closing the sending side")?;
    let mut rest = Vec::new();
    stream
        .read_to_end(&mut rest)
        .await
        .context("reading to the echo's close")?;
    received += rest.len() as u64;
    Ok((sent, received, intact && rest.is_empty()))
}

async fn read_line<R: AsyncRead + Unpin>(r: &mut R) -> anyhow::Result<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        let b = r.read_u8().await?;
        if b == b'\n' {
            return Ok(line);
        }
        if line.len() > 4096 {
            bail!("greeting longer than 4 KiB");
        }
        line.push(b);
    }
}

/// A deterministic byte stream (xorshift64), so that corruption anywhere shows up.
struct Pattern(u64);

impl Pattern {
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            let bytes = self.0.to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

async fn send<W: AsyncWrite + Unpin>(
    mut w: W,
    total: u64,
    rate: Option<u64>,
) -> anyhow::Result<(u64, String)> {
    let mut pattern = Pattern(0x9e37_79b9_7f4a_7c15);
    let mut buf = vec![0u8; 64 << 10];
    let mut hash = Sha256::new();
    let start = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        let n = usize::try_from((total - sent).min(buf.len() as u64)).unwrap_or(buf.len());
        pattern.fill(&mut buf[..n]);
        hash.update(&buf[..n]);
        w.write_all(&buf[..n]).await.context("sending")?;
        sent += n as u64;
        if let Some(rate) = rate.filter(|r| *r > 0) {
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    w.shutdown().await.context("closing the sending side")?;
    Ok((sent, hex(&hash.finalize())))
}

async fn receive<R: AsyncRead + Unpin>(mut r: R) -> anyhow::Result<(u64, String)> {
    let mut buf = vec![0u8; 64 << 10];
    let mut hash = Sha256::new();
    let mut received = 0u64;
    loop {
        let n = r.read(&mut buf).await.context("receiving")?;
        if n == 0 {
            return Ok((received, hex(&hash.finalize())));
        }
        hash.update(&buf[..n]);
        received += n as u64;
    }
}

/// What the abuse client sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum AbuseKind {
    /// A valid structured SNI for a service that is not exported.
    NotExported,
    /// A structured SNI under another domain than the mesh's.
    ForeignDomain,
    /// Bytes that are not TLS.
    Garbage,
    /// Connect and never send a hello.
    Silent,
}

/// `waypoint-e2e abuse`.
#[derive(Clone, Debug, clap::Args)]
pub struct AbuseArgs {
    /// The waypoint to abuse (`<node_ip>:15443`).
    #[arg(long)]
    pub target: SocketAddr,
    /// What to send.
    #[arg(long, value_enum)]
    pub kind: AbuseKind,
    /// The service whose port and namespace the TLS kinds use.
    #[arg(long, default_value = "internal.demo:9080")]
    pub service: String,
    #[command(flatten)]
    pub identity: IdentityArgs,
}

/// What the abuse client saw.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AbuseReport {
    /// What was sent.
    pub kind: AbuseKind,
    /// Whether the waypoint let it through (a TLS handshake completed, or bytes came back).
    pub accepted: bool,
    /// How it ended.
    pub outcome: String,
    /// From connect to the end.
    pub elapsed_ms: u64,
}

/// Runs one abusive connection.
pub async fn abuse(args: AbuseArgs) -> anyhow::Result<AbuseReport> {
    let start = Instant::now();
    let (svc, ns, port) = split_service(&args.service)?;
    let mut tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(args.target))
        .await
        .context("connect timed out")?
        .with_context(|| format!("connecting to {}", args.target))?;
    let tls_sni = match args.kind {
        AbuseKind::NotExported => Some(format!("{port}.{svc}.{ns}.{MESH_DOMAIN}")),
        AbuseKind::ForeignDomain => Some(format!("{port}.{svc}.{ns}.example.com")),
        AbuseKind::Garbage | AbuseKind::Silent => None,
    };
    let (accepted, outcome) = if let Some(sni) = tls_sni {
        let config = tls::client_config(
            &args.identity.files(),
            &format!("{port}.{svc}.{ns}.{MESH_DOMAIN}"),
            &pki::spiffe_id(&ns, &svc),
        )?;
        let name = rustls_pki_types::ServerName::try_from(sni)?;
        match tokio::time::timeout(
            Duration::from_secs(10),
            TlsConnector::from(Arc::new(config)).connect(name, tcp),
        )
        .await
        {
            Ok(Ok(_)) => (true, "handshake completed".to_owned()),
            Ok(Err(e)) => (false, format!("handshake failed: {e}")),
            Err(_) => (false, "handshake timed out".to_owned()),
        }
    } else {
        if args.kind == AbuseKind::Garbage {
            tcp.write_all(b"GET / HTTP/1.1\r\nHost: waypoint\r\n\r\n")
                .await?;
        }
        // The waypoint must close it: after the garbage at once, after the hello
        // timeout for the silent one.
        let mut buf = [0u8; 1024];
        match tokio::time::timeout(Duration::from_secs(15), tcp.read(&mut buf)).await {
            Ok(Ok(0)) => (false, "closed by the waypoint".to_owned()),
            Ok(Ok(n)) => (true, format!("{n} bytes came back")),
            Ok(Err(e)) => (false, format!("reset: {e}")),
            Err(_) => (true, "still open after 15 s".to_owned()),
        }
    };
    Ok(AbuseReport {
        kind: args.kind,
        accepted,
        outcome,
        elapsed_ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("3"), Ok(3));
        assert!(parse_size("3MB").is_err());
    }
}
