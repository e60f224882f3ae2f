//! Records real ClientHellos as test fixtures for the `sni` module.
//!
//! Run once and commit the output (the hellos carry fresh randoms and key shares, so every
//! run produces different bytes):
//!
//! ```text
//! cargo run --manifest-path tools/record-hellos/Cargo.toml [-- OUT_DIR]
//! ```
//!
//! OUT_DIR defaults to `waypoint-user/testdata/`. Needs the `openssl`
//! CLI. Hello completeness is judged by this file's own minimal record framing, not by the
//! parser under test, so the fixtures are an independent check on it.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use rustls::crypto::aws_lc_rs;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, RootCertStore};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const SNI: &str = "8080.reviews.bookinfo.mesh.local";

fn main() -> Result<()> {
    let out = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../waypoint-user/testdata"));
    std::fs::create_dir_all(&out)?;

    // aws-lc-rs default provider: X25519MLKEM768 first, so a PQ + X25519 key share.
    save(
        &out,
        "rustls_pq.bin",
        &rustls_hello(aws_lc_rs::default_provider(), true)?,
    )?;
    let mut classic = aws_lc_rs::default_provider();
    classic.kx_groups = vec![aws_lc_rs::kx_group::X25519];
    save(&out, "rustls_classic.bin", &rustls_hello(classic, true)?)?;
    save(
        &out,
        "rustls_no_sni.bin",
        &rustls_hello(aws_lc_rs::default_provider(), false)?,
    )?;

    save(
        &out,
        "openssl.bin",
        &openssl_hello(&["-servername", SNI, "-alpn", "h2,http/1.1"])?,
    )?;
    save(
        &out,
        "openssl_tls12.bin",
        &openssl_hello(&["-servername", SNI, "-tls1_2"])?,
    )?;
    save(
        &out,
        "openssl_no_sni.bin",
        &openssl_hello(&["-noservername"])?,
    )?;
    Ok(())
}

fn save(dir: &Path, name: &str, hello: &[u8]) -> Result<()> {
    std::fs::write(dir.join(name), hello)?;
    println!("{name}: {} bytes", hello.len());
    Ok(())
}

/// Drives a rustls client against nothing and keeps its first flight.
fn rustls_hello(provider: rustls::crypto::CryptoProvider, sni: bool) -> Result<Vec<u8>> {
    let mut config = ClientConfig::builder_with_provider(Arc::new(provider))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.enable_sni = sni;
    let mut conn = ClientConnection::new(Arc::new(config), ServerName::try_from(SNI)?)?;
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out)?;
    }
    Ok(out)
}

/// Points `openssl s_client` at a local listener and reads its ClientHello.
fn openssl_hello(args: &[&str]) -> Result<Vec<u8>> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = listener.local_addr()?;
    let mut child = Command::new("openssl")
        .args(["s_client", "-connect", &addr.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let (mut stream, _) = listener.accept()?;
    let hello = read_handshake_message(&mut stream);
    // Closing makes s_client give up; kill in case it lingers.
    let _ = stream.write_all(&[0x15, 3, 3, 0, 2, 2, 40]); // fatal handshake_failure alert
    drop(stream);
    let _ = child.kill();
    let _ = child.wait();
    hello
}

/// Reads handshake records until the first handshake message is complete.
fn read_handshake_message(stream: &mut impl Read) -> Result<Vec<u8>> {
    let mut wire = Vec::new();
    let mut message = Vec::new();
    loop {
        let mut header = [0u8; 5];
        stream.read_exact(&mut header)?;
        if header[0] != 0x16 {
            return Err(format!("unexpected record type {}", header[0]).into());
        }
        let mut body = vec![0u8; usize::from(u16::from_be_bytes([header[3], header[4]]))];
        stream.read_exact(&mut body)?;
        wire.extend_from_slice(&header);
        wire.extend_from_slice(&body);
        message.extend_from_slice(&body);
        if let [_, a, b, c, ..] = message[..] {
            let len = 4 + (usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c));
            if message.len() >= len {
                return Ok(wire);
            }
        }
    }
}
