//! The first flight every benchmark connection sends: a recorded rustls 0.23 ClientHello
//! (aws-lc-rs provider, X25519MLKEM768 + X25519 key shares, 1498 bytes), replayed byte for
//! byte with only its server name changed. Replaying instead of handshaking keeps the load
//! generator's CPU out of the figures; the routers cannot tell the difference (none of
//! them decrypts).

/// The recorded hello; its SNI is `8080.reviews.bookinfo.mesh.local`.
const RECORDED: &[u8] = include_bytes!("../../waypoint-user/testdata/rustls_pq.bin");
const RECORDED_SNI: &[u8] = b"8080.reviews.bookinfo.mesh.local";

/// The service that echoes every byte (ping-pong, connection setup, idle connections).
/// Same length as the recorded name, so the hello keeps every length field valid.
pub const ECHO_SNI: &str = "8080.echosvc.bookinfo.mesh.local";
/// The service that discards every byte (bulk).
pub const SINK_SNI: &str = "8080.sinksvc.bookinfo.mesh.local";
/// Service names as registered in the waypoint's endpoints file.
pub const ECHO_SERVICE: &str = "echosvc";
pub const SINK_SERVICE: &str = "sinksvc";
pub const NAMESPACE: &str = "bookinfo";
pub const SERVICE_PORT: u16 = 8080;

/// Errors building a hello.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The recorded hello does not hold the expected name exactly once.
    #[error("the recorded hello does not carry {0:?} exactly once; was testdata regenerated?")]
    Sni(String),
    /// A replacement name of another length would break the record's length fields.
    #[error("server name {0:?} must be as long as the recorded one")]
    Length(String),
}

/// The recorded hello with its server name replaced by `sni`.
pub fn with_sni(sni: &str) -> Result<Vec<u8>, Error> {
    if sni.len() != RECORDED_SNI.len() {
        return Err(Error::Length(sni.to_owned()));
    }
    let at: Vec<usize> = RECORDED
        .windows(RECORDED_SNI.len())
        .enumerate()
        .filter(|(_, w)| *w == RECORDED_SNI)
        .map(|(i, _)| i)
        .collect();
    let [at] = at[..] else {
        return Err(Error::Sni(
            String::from_utf8_lossy(RECORDED_SNI).into_owned(),
        ));
    };
    let mut out = RECORDED.to_vec();
    out[at..at + sni.len()].copy_from_slice(sni.as_bytes());
    Ok(out)
}

/// Length of every hello the benchmark sends: the servers read exactly this much first.
pub fn len() -> usize {
    RECORDED.len()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn replaces_the_name_in_place() {
        let h = with_sni(ECHO_SNI).unwrap();
        assert_eq!(h.len(), len());
        assert!(h.windows(ECHO_SNI.len()).any(|w| w == ECHO_SNI.as_bytes()));
        assert!(with_sni("short").is_err());
    }
}
