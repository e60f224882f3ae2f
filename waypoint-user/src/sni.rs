//! TLS ClientHello reader and structured-SNI parser for the tunnel port.
//!
//! Every connection accepted on the tunnel port starts with a cleartext TLS ClientHello
//! whose SNI names the destination as `<port>.<service>.<namespace>.<mesh domain>`, e.g.
//! `8080.reviews.bookinfo.mesh.local`. The waypoint never terminates that TLS session: it
//! peeks at the hello, routes on the SNI and then forwards the very same bytes. This module
//! owns the two pure steps of that:
//!
//! * [`parse_client_hello`]: a sans-IO reader that finds a complete ClientHello at the start
//!   of a buffer, reassembling it across TLS records and across reads, and extracts the SNI
//!   (plus ALPN and whether a post-quantum key share is offered, for logs and metrics);
//!   [`read_client_hello`] is the async loop around it;
//! * [`parse_sni`]: the structured-SNI grammar that turns that SNI into a routing [`Target`].
//!
//! Nothing here consumes or rewrites bytes and nothing here sleeps: the caller owns the
//! buffer (and must forward all of it, see [`read_client_hello`]) and the handshake timeout.
//!
//! # Why the record layer is parsed here and not by `tls-parser`
//!
//! `tls-parser` parses one record at a time and hands back the handshake messages inside
//! it; a ClientHello fragmented over several records (legal, and unavoidable above 16 KiB,
//! e.g. with large post-quantum key shares or padding) is not reassembled. So the record
//! framing, the reassembly and the early sanity checks (which let us reject junk and
//! oversized hellos before buffering them) are done here, and the reassembled ClientHello
//! body goes to [`tls_parser::parse_tls_handshake_client_hello`]. Extensions are only
//! *framed* generically; just `server_name`, ALPN and `key_share` are interpreted, so that an
//! unusual but harmless extension elsewhere cannot make us reject a hello the backend would
//! accept.

use std::borrow::Cow;
use std::net::IpAddr;

use bytes::BytesMut;
use tls_parser::{TlsExtension, TlsExtensionType};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Default cap on the wire size of a ClientHello (all of its records, headers included).
///
/// Same as Envoy's `tls_inspector` limit: far above any real hello (a post-quantum hello is
/// ~1.5-2 KiB) while bounding what one connection can make us buffer before routing.
pub const DEFAULT_MAX_HELLO_LEN: usize = 64 * 1024;

const RECORD_HEADER_LEN: usize = 5;
const HANDSHAKE_HEADER_LEN: usize = 4;
/// RFC 8446 §5.1 / RFC 5246 §6.2.1: a plaintext record fragment MUST NOT exceed 2^14 bytes.
/// The hello is always plaintext, so the 2^14 + 2048 slack that applies to protected records
/// is deliberately not granted: a larger record is rejected by any conforming server anyway.
const MAX_RECORD_LEN: usize = 1 << 14;
const CONTENT_TYPE_HANDSHAKE: u8 = 0x16;
const HANDSHAKE_TYPE_CLIENT_HELLO: u8 = 0x01;
/// Smallest possible ClientHello body: legacy_version(2) random(32) session_id(1+0)
/// cipher_suites(2+2) compression_methods(1+1). Lets a bogus length fail fast.
const MIN_CLIENT_HELLO_BODY_LEN: usize = 2 + 32 + 1 + 2 + 2 + 1 + 1;

const EXT_SERVER_NAME: u16 = 0;
const EXT_ALPN: u16 = 16;
const EXT_KEY_SHARE: u16 = 51;
const SERVER_NAME_TYPE_HOST_NAME: u8 = 0;

/// `NamedGroup` code points that carry a post-quantum (hybrid or pure ML-KEM) key share.
const PQ_GROUPS: &[u16] = &[
    0x11EC, // X25519MLKEM768, the one rustls/aws-lc-rs, BoringSSL and Go offer by default
    0x11EB, // SecP256r1MLKEM768
    0x11ED, // SecP384r1MLKEM1024
    0x0200, // MLKEM512
    0x0201, // MLKEM768
    0x0202, // MLKEM1024
    0x6399, // X25519Kyber768Draft00, still sent by older Chrome/Go
];

/// The parts of a complete ClientHello the waypoint cares about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    sni: String,
    wire_len: usize,
    alpn: Vec<Vec<u8>>,
    pq_key_share: bool,
}

impl Hello {
    /// The `host_name` from the server_name extension, exactly as sent (not lowercased);
    /// guaranteed non-empty printable ASCII. Feed it to [`parse_sni`].
    pub fn sni(&self) -> &str {
        &self.sni
    }

    /// Takes the SNI out without copying it.
    pub fn into_sni(self) -> String {
        self.sni
    }

    /// Bytes at the start of the buffer taken by the records that carry the hello, record
    /// headers included. Bytes after this offset (if any) belong to what the client sent next.
    pub fn wire_len(&self) -> usize {
        self.wire_len
    }

    /// ALPN protocol ids in the client's preference order; empty without the extension.
    pub fn alpn(&self) -> &[Vec<u8>] {
        &self.alpn
    }

    /// Whether the client sent a key share for a post-quantum group (X25519MLKEM768 and
    /// friends). Only an observation for logs/metrics: routing never depends on it.
    pub fn pq_key_share(&self) -> bool {
        self.pq_key_share
    }
}

/// Why a buffer does not (yet) hold a usable ClientHello.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// The buffer is a strict prefix of something that may still become a valid hello.
    /// `at_least` is a lower bound (never an overestimate, so it is safe to wait for that
    /// many bytes before trying again) on how many more bytes a valid hello needs.
    #[error("incomplete client hello: need at least {at_least} more bytes")]
    NeedMore { at_least: usize },
    /// The stream does not start with a TLS handshake record carrying a ClientHello:
    /// another protocol, an SSLv2-compatible hello, an alert, a ServerHello, ...
    #[error("not a tls client hello: {reason}")]
    NotTls { reason: &'static str },
    /// TLS record framing around a ClientHello, but the structure inside is broken.
    /// Kept apart from [`HelloError::NotTls`] for logs; both count as `not_tls` in metrics.
    #[error("malformed tls client hello: {reason}")]
    Malformed { reason: &'static str },
    /// A well-formed ClientHello without a server_name extension or `host_name` entry.
    #[error("client hello has no server name")]
    NoSni,
    /// The `host_name` is empty or not printable ASCII (RFC 6066 §3 requires ASCII).
    #[error("client hello server name is not a printable ascii host name")]
    InvalidSni,
    /// The hello needs more than `max_len` bytes on the wire. Detected from the record and
    /// handshake length headers, so without buffering the whole thing.
    #[error("client hello larger than {max_len} bytes")]
    TooLarge { max_len: usize },
}

impl HelloError {
    /// Stable, low-cardinality label for metrics. `need_more` is not a rejection.
    pub fn reason(&self) -> &'static str {
        match self {
            HelloError::NeedMore { .. } => "need_more",
            HelloError::NotTls { .. } | HelloError::Malformed { .. } => "not_tls",
            HelloError::NoSni => "no_sni",
            HelloError::InvalidSni => "bad_sni",
            HelloError::TooLarge { .. } => "hello_too_large",
        }
    }
}

/// Parses the ClientHello at the start of `buf`.
///
/// Call again with more bytes appended after [`HelloError::NeedMore`]; every other error is
/// final for this connection. Checks run on whatever prefix is present, so non-TLS bytes and
/// hellos announcing more than `max_len` bytes fail without waiting for the rest. Bytes after
/// the hello's last record are ignored (see [`Hello::wire_len`]).
///
/// Each call starts over; [`HelloParser`] resumes instead, for callers that parse after every
/// read.
pub fn parse_client_hello(buf: &[u8], max_len: usize) -> Result<Hello, HelloError> {
    HelloParser::new(max_len).parse(buf)
}

/// Resumable form of [`parse_client_hello`] for one connection.
///
/// Remembers the records already walked, so parsing after every read costs only the new
/// bytes' records instead of re-walking from the start: a client that trickles a hello made
/// of thousands of tiny records cannot make the waypoint quadratic. Every call must get the
/// same stream, only ever extended at the end (results are meaningless otherwise, though it
/// never panics).
#[derive(Debug, Clone)]
pub struct HelloParser {
    max_len: usize,
    /// Start of the first record not yet seen in full.
    pos: usize,
    /// Handshake bytes in the records before `pos`.
    handshake_seen: usize,
    /// The handshake header, which may itself be split across records.
    handshake_header: [u8; HANDSHAKE_HEADER_LEN],
    /// Handshake message length including its header, once the header is in.
    message_len: Option<usize>,
    /// Records before `pos`.
    records: usize,
}

impl HelloParser {
    /// A parser refusing hellos that need more than `max_len` wire bytes
    /// (usually [`DEFAULT_MAX_HELLO_LEN`]).
    pub fn new(max_len: usize) -> Self {
        Self {
            max_len,
            pos: 0,
            handshake_seen: 0,
            handshake_header: [0; HANDSHAKE_HEADER_LEN],
            message_len: None,
            records: 0,
        }
    }

    /// Same contract as [`parse_client_hello`], on the connection's bytes so far.
    pub fn parse(&mut self, buf: &[u8]) -> Result<Hello, HelloError> {
        let framing = self.frame(buf)?;
        let message = reassemble(buf, &framing)?;
        let body = message
            .get(HANDSHAKE_HEADER_LEN..)
            .ok_or(HelloError::Malformed {
                reason: "short handshake message",
            })?;
        parse_client_hello_body(body, framing.wire_len)
    }

    /// Walks the record layer until the ClientHello handshake message is complete.
    fn frame(&mut self, buf: &[u8]) -> Result<Framing, HelloError> {
        loop {
            if let Some(len) = self.message_len {
                if self.handshake_seen == len {
                    return Ok(Framing {
                        wire_len: self.pos,
                        message_len: len,
                        records: self.records,
                    });
                }
            }
            let pos = self.pos;
            let record = buf.get(pos..).unwrap_or_default();
            check_record_header(record, self.records == 0)?;

            let Some(&[_, _, _, len_hi, len_lo]) = record.get(..RECORD_HEADER_LEN) else {
                let missing = self
                    .message_lower_bound()
                    .saturating_sub(self.handshake_seen);
                return self.need_more(buf.len(), pos + min_wire_len(missing.max(1)));
            };
            let record_len = usize::from(u16::from_be_bytes([len_hi, len_lo]));
            if record_len == 0 {
                // RFC 8446 §5.1: zero-length handshake fragments MUST NOT be sent.
                return Err(HelloError::Malformed {
                    reason: "empty handshake record",
                });
            }
            if record_len > MAX_RECORD_LEN {
                return Err(HelloError::Malformed {
                    reason: "record longer than 2^14 bytes",
                });
            }
            let body_start = pos + RECORD_HEADER_LEN;
            let body_end = body_start + record_len;

            // Look at the handshake header as soon as its bytes arrive, even in an
            // incomplete record, to fail fast on type and length.
            if self.message_len.is_none() {
                let available = buf
                    .get(body_start..body_end.min(buf.len()))
                    .unwrap_or_default();
                self.take_handshake_header(available)?;
            }
            if let Some(len) = self.message_len {
                if self.handshake_seen + record_len > len {
                    // RFC 8446 §5.1: a ClientHello must end on a record boundary, since it
                    // can precede a key change. Anything sharing its last record is an error.
                    return Err(HelloError::Malformed {
                        reason: "data after client hello in the same record",
                    });
                }
            }

            let missing = self
                .message_lower_bound()
                .saturating_sub(self.handshake_seen + record_len);
            let min_total = body_end + min_wire_len(missing);
            if buf.len() < body_end {
                return self.need_more(buf.len(), min_total);
            }
            if min_total > self.max_len {
                return Err(HelloError::TooLarge {
                    max_len: self.max_len,
                });
            }
            self.handshake_seen += record_len;
            self.records += 1;
            self.pos = body_end;
        }
    }

    /// Copies the handshake header bytes found at the start of the current record's
    /// `available` body and checks them.
    fn take_handshake_header(&mut self, available: &[u8]) -> Result<(), HelloError> {
        for (i, &byte) in available.iter().enumerate() {
            let Some(slot) = self.handshake_header.get_mut(self.handshake_seen + i) else {
                break;
            };
            *slot = byte;
        }
        let header_bytes = (self.handshake_seen + available.len()).min(HANDSHAKE_HEADER_LEN);
        if header_bytes >= 1 && self.handshake_header[0] != HANDSHAKE_TYPE_CLIENT_HELLO {
            return Err(HelloError::NotTls {
                reason: "first handshake message is not a client hello",
            });
        }
        if header_bytes == HANDSHAKE_HEADER_LEN {
            let [_, a, b, c] = self.handshake_header;
            let body_len = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
            if body_len < MIN_CLIENT_HELLO_BODY_LEN {
                return Err(HelloError::Malformed {
                    reason: "client hello length too short",
                });
            }
            self.message_len = Some(HANDSHAKE_HEADER_LEN + body_len);
        }
        Ok(())
    }

    /// The handshake message length, or until its header is in, the smallest possible
    /// ClientHello, so that byte estimates stay lower bounds.
    fn message_lower_bound(&self) -> usize {
        self.message_len
            .unwrap_or(HANDSHAKE_HEADER_LEN + MIN_CLIENT_HELLO_BODY_LEN)
    }

    fn need_more(&self, have: usize, min_total: usize) -> Result<Framing, HelloError> {
        if min_total > self.max_len {
            Err(HelloError::TooLarge {
                max_len: self.max_len,
            })
        } else {
            Err(HelloError::NeedMore {
                at_least: min_total.saturating_sub(have).max(1),
            })
        }
    }
}

/// Where a complete ClientHello sits in the buffer.
struct Framing {
    /// Bytes of all records carrying the hello, headers included.
    wire_len: usize,
    /// Handshake message length including its 4-byte header.
    message_len: usize,
    records: usize,
}

/// Checks the bytes of a record header present so far.
fn check_record_header(header: &[u8], first: bool) -> Result<(), HelloError> {
    if let Some(&content_type) = header.first() {
        if content_type != CONTENT_TYPE_HANDSHAKE {
            return Err(if !first {
                // RFC 8446 §5.1: handshake messages MUST NOT be interleaved with other types.
                HelloError::Malformed {
                    reason: "non-handshake record inside client hello",
                }
            } else if content_type & 0x80 != 0 {
                HelloError::NotTls {
                    reason: "sslv2-compatible client hello",
                }
            } else {
                HelloError::NotTls {
                    reason: "first record is not a handshake record",
                }
            });
        }
    }
    // legacy_record_version is 0x0301..0x0303 in practice; accept SSL 3.0 to TLS 1.3 and
    // leave the actual version negotiation to the endpoints.
    if header.get(1).is_some_and(|&major| major != 3) {
        return Err(HelloError::NotTls {
            reason: "bad record version",
        });
    }
    if header.get(2).is_some_and(|&minor| minor > 4) {
        return Err(HelloError::NotTls {
            reason: "bad record version",
        });
    }
    Ok(())
}

/// Fewest wire bytes that can carry `handshake_bytes` more handshake bytes: full records,
/// each with its own header.
fn min_wire_len(handshake_bytes: usize) -> usize {
    handshake_bytes + handshake_bytes.div_ceil(MAX_RECORD_LEN) * RECORD_HEADER_LEN
}

/// Returns the handshake message, borrowing when it fits in one record (the common case).
fn reassemble<'a>(buf: &'a [u8], framing: &Framing) -> Result<Cow<'a, [u8]>, HelloError> {
    const INCONSISTENT: HelloError = HelloError::Malformed {
        reason: "inconsistent record framing",
    };
    if framing.records == 1 {
        let message = buf
            .get(RECORD_HEADER_LEN..RECORD_HEADER_LEN + framing.message_len)
            .ok_or(INCONSISTENT)?;
        return Ok(Cow::Borrowed(message));
    }
    let mut message = Vec::with_capacity(framing.message_len);
    let mut pos = 0;
    while pos < framing.wire_len {
        let Some(&[_, _, _, hi, lo]) = buf.get(pos..pos + RECORD_HEADER_LEN) else {
            return Err(INCONSISTENT);
        };
        let body_start = pos + RECORD_HEADER_LEN;
        let body_end = body_start + usize::from(u16::from_be_bytes([hi, lo]));
        message.extend_from_slice(buf.get(body_start..body_end).ok_or(INCONSISTENT)?);
        pos = body_end;
    }
    if message.len() != framing.message_len {
        return Err(INCONSISTENT);
    }
    Ok(Cow::Owned(message))
}

fn parse_client_hello_body(body: &[u8], wire_len: usize) -> Result<Hello, HelloError> {
    let (rest, hello) =
        tls_parser::parse_tls_handshake_client_hello(body).map_err(|_| HelloError::Malformed {
            reason: "bad client hello structure",
        })?;
    // tls-parser treats a truncated extensions block as "no extensions" and leaves it
    // unconsumed; a non-empty rest is therefore broken framing, not something to ignore.
    if !rest.is_empty() {
        return Err(HelloError::Malformed {
            reason: "bad extensions length",
        });
    }
    if hello.version.0 >> 8 != 3 {
        return Err(HelloError::Malformed {
            reason: "bad client hello version",
        });
    }
    let mut extensions = hello.ext.ok_or(HelloError::NoSni)?;
    let mut host_name = None;
    let mut alpn = Vec::new();
    let mut pq_key_share = false;
    let mut seen_server_name = false;
    while !extensions.is_empty() {
        // parse_tls_extension_unknown only frames (type, data) without interpreting the data.
        let (rest, extension) =
            tls_parser::parse_tls_extension_unknown(extensions).map_err(|_| {
                HelloError::Malformed {
                    reason: "bad extension framing",
                }
            })?;
        extensions = rest;
        let TlsExtension::Unknown(TlsExtensionType(ext_type), data) = extension else {
            return Err(HelloError::Malformed {
                reason: "bad extension framing",
            });
        };
        match ext_type {
            EXT_SERVER_NAME => {
                // Two SNIs could let the waypoint route on one and the backend serve the
                // other; RFC 8446 §4.2 forbids duplicate extensions, so refuse outright.
                if seen_server_name {
                    return Err(HelloError::Malformed {
                        reason: "duplicate server_name extension",
                    });
                }
                seen_server_name = true;
                host_name = parse_server_name(data)?;
            }
            EXT_ALPN => alpn = parse_alpn(data)?,
            EXT_KEY_SHARE => pq_key_share = key_share_has_pq_group(data)?,
            _ => {}
        }
    }
    let host_name = host_name.ok_or(HelloError::NoSni)?;
    if host_name.is_empty() || !host_name.iter().all(u8::is_ascii_graphic) {
        return Err(HelloError::InvalidSni);
    }
    let sni = String::from_utf8(host_name.to_vec()).map_err(|_| HelloError::InvalidSni)?;
    Ok(Hello {
        sni,
        wire_len,
        alpn,
        pq_key_share,
    })
}

/// Returns the `host_name` of a ClientHello server_name extension, if it has one.
///
/// The list framing is checked strictly here (tls-parser's list parser stops silently at
/// the first bad entry), entries are parsed by tls-parser.
fn parse_server_name(data: &[u8]) -> Result<Option<&[u8]>, HelloError> {
    const BAD: HelloError = HelloError::Malformed {
        reason: "bad server_name extension",
    };
    let mut list = vec16(data).ok_or(BAD)?;
    if list.is_empty() {
        return Err(BAD);
    }
    let mut host_name = None;
    while !list.is_empty() {
        let (rest, (name_type, name)) =
            tls_parser::parse_tls_extension_sni_hostname(list).map_err(|_| BAD)?;
        list = rest;
        if name_type.0 == SERVER_NAME_TYPE_HOST_NAME {
            // RFC 6066 §3: at most one name per type; same ambiguity as a duplicate extension.
            if host_name.is_some() {
                return Err(HelloError::Malformed {
                    reason: "duplicate host_name in server_name",
                });
            }
            host_name = Some(name);
        }
    }
    Ok(host_name)
}

fn parse_alpn(data: &[u8]) -> Result<Vec<Vec<u8>>, HelloError> {
    const BAD: HelloError = HelloError::Malformed {
        reason: "bad alpn extension",
    };
    match tls_parser::parse_tls_extension_alpn_content(data) {
        Ok(([], TlsExtension::ALPN(protocols))) => {
            Ok(protocols.into_iter().map(<[u8]>::to_vec).collect())
        }
        _ => Err(BAD),
    }
}

/// tls-parser keeps a ClientHello key_share as raw bytes, so walk `client_shares` here.
fn key_share_has_pq_group(data: &[u8]) -> Result<bool, HelloError> {
    const BAD: HelloError = HelloError::Malformed {
        reason: "bad key_share extension",
    };
    let mut shares = vec16(data).ok_or(BAD)?;
    let mut pq = false;
    while !shares.is_empty() {
        let Some(&[hi, lo]) = shares.get(..2) else {
            return Err(BAD);
        };
        let rest = shares.get(2..).ok_or(BAD)?;
        let key_exchange = vec16_prefix(rest).ok_or(BAD)?;
        pq |= PQ_GROUPS.contains(&u16::from_be_bytes([hi, lo]));
        shares = rest.get(2 + key_exchange.len()..).ok_or(BAD)?;
    }
    Ok(pq)
}

/// A `<0..2^16-1>` vector that must span exactly `data`.
fn vec16(data: &[u8]) -> Option<&[u8]> {
    let inner = vec16_prefix(data)?;
    (inner.len() + 2 == data.len()).then_some(inner)
}

/// A `<0..2^16-1>` vector at the start of `data`.
fn vec16_prefix(data: &[u8]) -> Option<&[u8]> {
    let &[hi, lo] = data.get(..2)? else {
        return None;
    };
    data.get(2..2 + usize::from(u16::from_be_bytes([hi, lo])))
}

/// Why [`read_client_hello`] could not produce a hello.
#[derive(Debug, thiserror::Error)]
pub enum ReadHelloError {
    #[error(transparent)]
    Hello(#[from] HelloError),
    /// The peer closed (or half-closed) before the hello was complete.
    #[error("connection closed after {buffered} bytes, before the client hello was complete")]
    Eof { buffered: usize },
    #[error("reading client hello: {0}")]
    Io(#[from] std::io::Error),
}

impl ReadHelloError {
    /// Stable, low-cardinality label for metrics; see [`HelloError::reason`].
    pub fn reason(&self) -> &'static str {
        match self {
            ReadHelloError::Hello(e) => e.reason(),
            ReadHelloError::Eof { .. } => "eof",
            ReadHelloError::Io(_) => "io_error",
        }
    }
}

/// Parses the ClientHello from what a nonblocking `r` holds now, without waiting:
/// `Ok(None)` when it needs bytes that have not arrived, and the caller then waits with
/// [`read_client_hello`], which goes on from what this left in `buf`. The tunnel
/// listener defers accepts until the first bytes are in, so a hello that fits one
/// segment is usually whole here, and its socket need not be registered with the
/// reactor at all.
pub fn read_client_hello_now<R>(
    r: &mut R,
    buf: &mut BytesMut,
    max_len: usize,
) -> Result<Option<Hello>, ReadHelloError>
where
    R: std::io::Read + ?Sized,
{
    let mut parser = HelloParser::new(max_len);
    loop {
        let at_least = match parser.parse(buf) {
            Err(HelloError::NeedMore { at_least }) => at_least,
            result => return Ok(Some(result?)),
        };
        buf.reserve(at_least);
        let start = buf.len();
        // Zeroed spare room: std's `Read` takes initialised bytes (a couple of KiB).
        buf.resize(buf.capacity(), 0);
        let read = r.read(&mut buf[start..]);
        buf.truncate(start + read.as_ref().map_or(0, |&n| n));
        match read {
            Ok(0) => return Err(ReadHelloError::Eof { buffered: start }),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reads from `r` into `buf` until `buf` starts with a complete ClientHello.
///
/// Bytes already in `buf` are parsed first. `buf` keeps everything read, which can run past
/// [`Hello::wire_len`] (e.g. TLS 1.3 early data sent right behind the hello): forward all of
/// `buf`, not just the hello. Returns as soon as the hello is complete or known to be bad,
/// so it never waits on a client that is itself waiting for the server. No timeout here:
/// wrap the call in `tokio::time::timeout`.
pub async fn read_client_hello<R>(
    r: &mut R,
    buf: &mut BytesMut,
    max_len: usize,
) -> Result<Hello, ReadHelloError>
where
    R: AsyncRead + Unpin + ?Sized,
{
    let mut parser = HelloParser::new(max_len);
    loop {
        let at_least = match parser.parse(buf) {
            Err(HelloError::NeedMore { at_least }) => at_least,
            result => return Ok(result?),
        };
        // Parse again after every read, however short: a non-TLS client that sent a few
        // bytes and now waits for an answer must be refused now, not at the timeout.
        // HelloParser keeps that linear in the bytes read.
        buf.reserve(at_least);
        if r.read_buf(buf).await? == 0 {
            return Err(ReadHelloError::Eof {
                buffered: buf.len(),
            });
        }
    }
}

/// Longest DNS name in text form, without the trailing dot (RFC 1035 §2.3.4).
pub const MAX_NAME_LEN: usize = 253;
const MAX_LABEL_LEN: usize = 63;

/// Where a structured SNI routes: a service port in some namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub port: u16,
    /// DNS-1123 label, lowercase.
    pub service: String,
    /// DNS-1123 label, lowercase.
    pub namespace: String,
}

/// Why an SNI does not name a routable [`Target`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SniError {
    /// A well-formed name outside the mesh domain: not ours to route.
    #[error("sni is not under the mesh domain")]
    ForeignDomain,
    /// Not a valid structured SNI (bad port or label, IP literal, bare port, too long, ...).
    #[error("bad sni: {reason}")]
    BadSni { reason: &'static str },
    /// The configured mesh domain is not a valid DNS name; nothing can match it. Config
    /// loading should catch this first with [`validate_mesh_domain`].
    #[error("invalid mesh domain")]
    InvalidMeshDomain,
}

impl SniError {
    /// Stable, low-cardinality label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SniError::ForeignDomain => "foreign_domain",
            SniError::BadSni { .. } => "bad_sni",
            SniError::InvalidMeshDomain => "bad_mesh_domain",
        }
    }
}

fn bad(reason: &'static str) -> SniError {
    SniError::BadSni { reason }
}

/// Parses a structured SNI `<port>.<service>.<namespace>.<mesh_domain>`.
///
/// * Matching is ASCII case-insensitive; `service` and `namespace` come back lowercase.
/// * One trailing dot on the whole name (`...mesh.local.`) is accepted on purpose: it is the
///   same absolute name (RFC 6066 says not to send it, but some resolvers-turned-SNI do),
///   and rejecting it would only turn a misbehaving client into a confusing outage.
///   The same holds for `mesh_domain`.
/// * `port` is canonical decimal 1-65535: no sign, no leading zero (`080` is rejected so
///   every port has exactly one spelling; SNI-keyed caches and metrics then never alias).
/// * `service` and `namespace` are DNS-1123 labels (`[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?`).
///   Kubernetes is stricter for services (DNS-1035: must start with a letter); that case
///   simply fails the service lookup downstream.
/// * IP literals (`10.0.0.1`, `[::1]`) are [`SniError::BadSni`], not `ForeignDomain`: no
///   client in the mesh sends one, so it is misuse rather than a name from elsewhere.
/// * A bare `<port>` (the intra-cluster form, e.g. `8080`) is [`SniError::BadSni`]: it only
///   means something to the destination's own node and is not routable at the waypoint.
/// * The name without the trailing dot is at most [`MAX_NAME_LEN`] bytes, labels at most 63
///   and never empty (`a..b` is rejected).
pub fn parse_sni(sni: &str, mesh_domain: &str) -> Result<Target, SniError> {
    let domain = check_mesh_domain(mesh_domain)?;
    let name = sni.strip_suffix('.').unwrap_or(sni);
    if name.is_empty() {
        return Err(bad("empty name"));
    }
    if !name.is_ascii() {
        return Err(bad("non-ascii name"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad("name longer than 253 bytes"));
    }
    if is_ip_literal(name) {
        return Err(bad("ip literal"));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(bad("empty label"));
        }
        if label.len() > MAX_LABEL_LEN {
            return Err(bad("label longer than 63 bytes"));
        }
    }
    if name.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(
            "bare port is the intra-cluster form, not routable here",
        ));
    }
    if name.eq_ignore_ascii_case(domain) {
        return Err(bad("missing <port>.<service>.<namespace>"));
    }
    // The suffix must start on a label boundary: `x.evilmesh.local` is not in `mesh.local`.
    let split = name.len().checked_sub(domain.len() + 1);
    let prefix = split
        .and_then(|at| {
            let (prefix, suffix) = (name.get(..at)?, name.get(at..)?);
            let suffix = suffix.strip_prefix('.')?;
            suffix.eq_ignore_ascii_case(domain).then_some(prefix)
        })
        .ok_or(SniError::ForeignDomain)?;

    let mut labels = prefix.split('.');
    let (Some(port), Some(service), Some(namespace), None) =
        (labels.next(), labels.next(), labels.next(), labels.next())
    else {
        return Err(bad(
            "expected <port>.<service>.<namespace> before the mesh domain",
        ));
    };
    let port = parse_port(port)?;
    // Input is matched case-insensitively, so an RFC 1123 label is a DNS-1123 label once
    // lowercased below.
    if !is_dns_label(service) {
        return Err(bad("service is not a dns-1123 label"));
    }
    if !is_dns_label(namespace) {
        return Err(bad("namespace is not a dns-1123 label"));
    }
    Ok(Target {
        port,
        service: service.to_ascii_lowercase(),
        namespace: namespace.to_ascii_lowercase(),
    })
}

fn is_ip_literal(name: &str) -> bool {
    // Only names with a ':' or a numeric last label can be IP addresses; skip the full
    // parse for everything else, i.e. for every real SNI.
    let maybe_ip = name.contains(':')
        || name
            .rsplit('.')
            .next()
            .is_some_and(|last| last.bytes().all(|b| b.is_ascii_digit()));
    name.starts_with('[') || (maybe_ip && name.parse::<IpAddr>().is_ok())
}

/// Checks a mesh domain the way [`parse_sni`] will use it; call it when loading config.
pub fn validate_mesh_domain(mesh_domain: &str) -> Result<(), SniError> {
    check_mesh_domain(mesh_domain).map(|_| ())
}

/// Returns the domain without its optional trailing dot.
fn check_mesh_domain(mesh_domain: &str) -> Result<&str, SniError> {
    let domain = mesh_domain.strip_suffix('.').unwrap_or(mesh_domain);
    // Leave room for at least `<port>.<svc>.<ns>.` in front.
    let valid = !domain.is_empty()
        && domain.len() <= MAX_NAME_LEN - "1.a.b.".len()
        && domain.split('.').all(is_dns_label)
        && !is_ip_literal(domain);
    if valid {
        Ok(domain)
    } else {
        Err(SniError::InvalidMeshDomain)
    }
}

fn parse_port(label: &str) -> Result<u16, SniError> {
    if !label.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("port is not a decimal number"));
    }
    if label.starts_with('0') {
        return Err(bad(if label == "0" {
            "port 0"
        } else {
            "port has a leading zero"
        }));
    }
    match label.parse::<u16>() {
        Ok(port) => Ok(port),
        Err(_) => Err(bad("port out of range")),
    }
}

/// RFC 1123 label, case-insensitive: letters, digits and inner hyphens, 1-63 bytes.
/// An RFC 1123 label, in either case (SNI matching is case-insensitive).
pub(crate) fn is_dns_label(label: &str) -> bool {
    let bytes = label.as_bytes();
    matches!((bytes.first(), bytes.last()), (Some(first), Some(last))
        if first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric())
        && bytes.len() <= MAX_LABEL_LEN
        && bytes
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'-')
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    const DOMAIN: &str = "mesh.local";

    /// Minimal ClientHello message (handshake header included) with the given extensions.
    fn client_hello_message(extensions: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[0x42; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // TLS_AES_128_GCM_SHA256
        body.extend_from_slice(&[0x01, 0x00]); // null compression
        let mut ext = Vec::new();
        for (ty, data) in extensions {
            ext.extend_from_slice(&ty.to_be_bytes());
            ext.extend_from_slice(&(data.len() as u16).to_be_bytes());
            ext.extend_from_slice(data);
        }
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut message = vec![HANDSHAKE_TYPE_CLIENT_HELLO];
        message.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        message.extend_from_slice(&body);
        message
    }

    fn sni_ext(names: &[(u8, &[u8])]) -> (u16, Vec<u8>) {
        let mut list = Vec::new();
        for (ty, name) in names {
            list.push(*ty);
            list.extend_from_slice(&(name.len() as u16).to_be_bytes());
            list.extend_from_slice(name);
        }
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&list);
        (EXT_SERVER_NAME, data)
    }

    /// Frames `message` into handshake records with the given body sizes (the last record
    /// takes the rest).
    fn records(message: &[u8], sizes: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = message;
        for &size in sizes.iter().chain(std::iter::once(&usize::MAX)) {
            if rest.is_empty() {
                break;
            }
            let (chunk, tail) = rest.split_at(size.min(rest.len()));
            out.extend_from_slice(&[CONTENT_TYPE_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
            out.extend_from_slice(chunk);
            rest = tail;
        }
        out
    }

    fn hello_for(name: &[u8]) -> Vec<u8> {
        records(&client_hello_message(&[sni_ext(&[(0, name)])]), &[])
    }

    #[test]
    fn minimal_hello_parses() {
        let wire = hello_for(b"8080.reviews.bookinfo.mesh.local");
        let hello = parse_client_hello(&wire, DEFAULT_MAX_HELLO_LEN).unwrap();
        assert_eq!(hello.sni(), "8080.reviews.bookinfo.mesh.local");
        assert_eq!(hello.wire_len(), wire.len());
        assert!(hello.alpn().is_empty());
        assert!(!hello.pq_key_share());
    }

    #[test]
    fn trailing_bytes_after_hello_are_not_consumed() {
        let mut wire = hello_for(b"a.b");
        let len = wire.len();
        wire.extend_from_slice(&[0x17, 3, 3, 0, 1, 0]);
        assert_eq!(
            parse_client_hello(&wire, DEFAULT_MAX_HELLO_LEN)
                .unwrap()
                .wire_len(),
            len
        );
    }

    #[test]
    fn handshake_header_split_one_byte_per_record() {
        let message = client_hello_message(&[sni_ext(&[(0, b"1.a.b.mesh.local")])]);
        let wire = records(&message, &[1, 1, 1, 1, 3]);
        let hello = parse_client_hello(&wire, DEFAULT_MAX_HELLO_LEN).unwrap();
        assert_eq!(hello.sni(), "1.a.b.mesh.local");
        assert_eq!(hello.wire_len(), wire.len());
        for cut in 0..wire.len() {
            assert!(matches!(
                parse_client_hello(&wire[..cut], DEFAULT_MAX_HELLO_LEN),
                Err(HelloError::NeedMore { at_least }) if at_least <= wire.len() - cut
            ));
        }
    }

    #[test]
    fn non_client_hello_type_fails_on_first_body_byte() {
        // ServerHello (2) in a handshake record: known bad after 6 bytes.
        let wire = [CONTENT_TYPE_HANDSHAKE, 3, 3, 0, 80, 2];
        assert!(matches!(
            parse_client_hello(&wire, DEFAULT_MAX_HELLO_LEN),
            Err(HelloError::NotTls { .. })
        ));
    }

    #[test]
    fn record_layer_nonsense_fails_from_the_header() {
        let cases: &[(&[u8], &str)] = &[
            (&[CONTENT_TYPE_HANDSHAKE, 3, 1, 0, 0], "empty record"),
            (&[CONTENT_TYPE_HANDSHAKE, 3, 1, 0x40, 0x01], "2^14 + 1"),
            (&[CONTENT_TYPE_HANDSHAKE, 3, 1, 0xff, 0xff], "64 KiB record"),
        ];
        for (wire, what) in cases {
            assert!(
                matches!(
                    parse_client_hello(wire, DEFAULT_MAX_HELLO_LEN),
                    Err(HelloError::Malformed { .. })
                ),
                "{what}"
            );
        }
        for wire in [
            &[CONTENT_TYPE_HANDSHAKE, 2][..],
            &[CONTENT_TYPE_HANDSHAKE, 3, 5],
        ] {
            assert!(matches!(
                parse_client_hello(wire, DEFAULT_MAX_HELLO_LEN),
                Err(HelloError::NotTls { .. })
            ));
        }
        // Handshake length below the smallest ClientHello.
        let wire = [CONTENT_TYPE_HANDSHAKE, 3, 1, 0, 10, 1, 0, 0, 6];
        assert!(matches!(
            parse_client_hello(&wire, DEFAULT_MAX_HELLO_LEN),
            Err(HelloError::Malformed { .. })
        ));
    }

    #[test]
    fn data_sharing_the_last_record_is_rejected_early() {
        let mut message = client_hello_message(&[sni_ext(&[(0, b"1.a.b.mesh.local")])]);
        message.extend_from_slice(&[0x0b, 0, 0, 0]); // a Certificate message behind it
        let wire = records(&message, &[]);
        // Rejected as soon as the handshake header is in, without the rest of the record.
        assert!(matches!(
            parse_client_hello(&wire[..RECORD_HEADER_LEN + HANDSHAKE_HEADER_LEN], 1 << 16),
            Err(HelloError::Malformed { .. })
        ));
    }

    #[test]
    fn interleaved_non_handshake_record_is_rejected() {
        let message = client_hello_message(&[sni_ext(&[(0, b"1.a.b.mesh.local")])]);
        let mut wire = records(&message[..20], &[]);
        wire.extend_from_slice(&[0x14, 3, 3, 0, 1, 1]); // ChangeCipherSpec
        assert!(matches!(
            parse_client_hello(&wire, DEFAULT_MAX_HELLO_LEN),
            Err(HelloError::Malformed { .. })
        ));
    }

    #[test]
    fn too_large_is_known_from_the_handshake_header() {
        let message =
            client_hello_message(&[sni_ext(&[(0, b"1.a.b.mesh.local")]), (21, vec![0; 5000])]);
        let wire = records(&message, &[]);
        let header = &wire[..RECORD_HEADER_LEN + HANDSHAKE_HEADER_LEN];
        assert_eq!(
            parse_client_hello(header, 4096),
            Err(HelloError::TooLarge { max_len: 4096 })
        );
        assert!(parse_client_hello(&wire, wire.len()).is_ok());
        assert_eq!(
            parse_client_hello(&wire, wire.len() - 1),
            Err(HelloError::TooLarge {
                max_len: wire.len() - 1
            })
        );
    }

    #[test]
    fn tiny_records_hit_the_limit() {
        // 1-byte records cost 6 wire bytes per handshake byte; the cap must still apply.
        let message = client_hello_message(&[sni_ext(&[(0, b"1.a.b.mesh.local")])]);
        let wire = records(&message, &vec![1; message.len()]);
        assert!(parse_client_hello(&wire, wire.len()).is_ok());
        assert!(matches!(
            parse_client_hello(&wire, wire.len() - 1),
            Err(HelloError::TooLarge { .. })
        ));
    }

    #[test]
    fn server_name_edge_cases() {
        let parse = |exts: &[(u16, Vec<u8>)]| {
            parse_client_hello(&records(&client_hello_message(exts), &[]), 1 << 16)
        };
        let ok = sni_ext(&[(0, b"1.a.b.mesh.local")]);
        assert_eq!(parse(&[]), Err(HelloError::NoSni));
        assert_eq!(
            parse(&[(16, vec![0, 3, 2, b'h', b'2'])]),
            Err(HelloError::NoSni)
        );
        assert_eq!(parse(&[sni_ext(&[(7, b"x")])]), Err(HelloError::NoSni));
        assert_eq!(parse(&[sni_ext(&[(0, b"")])]), Err(HelloError::InvalidSni));
        assert_eq!(
            parse(&[sni_ext(&[(0, b"a b")])]),
            Err(HelloError::InvalidSni)
        );
        assert_eq!(
            parse(&[sni_ext(&[(0, "ä.b".as_bytes())])]),
            Err(HelloError::InvalidSni)
        );
        assert_eq!(
            parse(&[sni_ext(&[(0, b"a\0b")])]),
            Err(HelloError::InvalidSni)
        );
        for broken in [
            vec![ok.clone(), ok.clone()],
            vec![sni_ext(&[(0, b"a.b"), (0, b"c.d")])],
            vec![(0, vec![])],
            vec![(0, vec![0, 0])],
            vec![(0, vec![0, 5, 0, 0, 9, b'a', b'b'])],
            vec![(0, [ok.1.clone(), vec![0]].concat())],
            vec![ok.clone(), (16, vec![0, 9, 2, b'h'])],
            vec![ok.clone(), (51, vec![0, 4, 0x11, 0xec, 0, 9])],
        ] {
            assert!(
                matches!(parse(&broken), Err(HelloError::Malformed { .. })),
                "{broken:?}"
            );
        }
        // An unknown name type next to host_name is skipped, as RFC 6066 intends.
        assert_eq!(
            parse(&[sni_ext(&[(7, b"x"), (0, b"a.b")])]).unwrap().sni(),
            "a.b"
        );
        let hello = parse(&[
            ok.clone(),
            (
                16,
                vec![
                    0, 12, 2, b'h', b'2', 8, b'h', b't', b't', b'p', b'/', b'1', b'.', b'1',
                ],
            ),
            (51, vec![0, 10, 0x11, 0xec, 0, 2, 1, 2, 0, 0x1d, 0, 0]),
        ])
        .unwrap();
        assert_eq!(hello.alpn(), &[b"h2".to_vec(), b"http/1.1".to_vec()]);
        assert!(hello.pq_key_share());
    }

    #[test]
    fn truncated_extensions_block_is_malformed_not_no_sni() {
        let mut message = client_hello_message(&[sni_ext(&[(0, b"1.a.b.mesh.local")])]);
        let ext_len_at = HANDSHAKE_HEADER_LEN + 2 + 32 + 1 + 4 + 2;
        message[ext_len_at + 1] += 1;
        assert!(matches!(
            parse_client_hello(&records(&message, &[]), 1 << 16),
            Err(HelloError::Malformed { .. })
        ));
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        let valid = hello_for(b"8080.reviews.bookinfo.mesh.local");
        for i in 0..10_000 {
            let mut buf: Vec<u8> = if i % 2 == 0 {
                let len = rng.random_range(0..512);
                (0..len).map(|_| rng.random()).collect()
            } else {
                // Mutate a valid hello so the parser gets past the record layer.
                let mut v = valid.clone();
                for _ in 0..rng.random_range(1..8) {
                    let at = rng.random_range(0..v.len());
                    v[at] = rng.random();
                }
                v.truncate(rng.random_range(0..=v.len()));
                v
            };
            if i % 3 == 0 {
                // Keep the record framing plausible more often.
                buf.splice(..buf.len().min(3), [CONTENT_TYPE_HANDSHAKE, 3, 1]);
            }
            if let Ok(hello) = parse_client_hello(&buf, DEFAULT_MAX_HELLO_LEN) {
                assert!(hello.wire_len() <= buf.len());
                let _ = parse_sni(hello.sni(), DOMAIN);
            }
            let text = String::from_utf8_lossy(&buf);
            let _ = parse_sni(&text, DOMAIN);
        }
    }

    fn target(port: u16, service: &str, namespace: &str) -> Target {
        Target {
            port,
            service: service.into(),
            namespace: namespace.into(),
        }
    }

    #[test]
    fn structured_sni_accepted() {
        let long = format!("443.{}.{}.mesh.local", "s".repeat(63), "n".repeat(63));
        let cases = [
            (
                "8080.reviews.bookinfo.mesh.local",
                target(8080, "reviews", "bookinfo"),
            ),
            ("1.a.b.mesh.local", target(1, "a", "b")),
            ("65535.a-1.0b.mesh.local", target(65535, "a-1", "0b")),
            (
                "8080.Reviews.BOOKINFO.Mesh.Local",
                target(8080, "reviews", "bookinfo"),
            ),
            (
                "8080.reviews.bookinfo.mesh.local.",
                target(8080, "reviews", "bookinfo"),
            ),
            (long.as_str(), target(443, &"s".repeat(63), &"n".repeat(63))),
        ];
        for (sni, want) in cases {
            assert_eq!(parse_sni(sni, DOMAIN), Ok(want), "{sni}");
        }
        // The mesh domain itself is case-insensitive and may carry the trailing dot.
        assert_eq!(
            parse_sni("80.a.b.mesh.local", "MESH.local."),
            Ok(target(80, "a", "b"))
        );
        assert_eq!(parse_sni("80.a.b.mesh", "mesh"), Ok(target(80, "a", "b")));
    }

    #[test]
    fn structured_sni_rejected() {
        let foreign = SniError::ForeignDomain;
        let long_name = format!("80.a.b.{}mesh.local", "x.".repeat(125));
        let cases: &[(&str, Option<SniError>)] = &[
            ("", None),
            (".", None),
            ("8080..bookinfo.mesh.local", None),
            (".8080.reviews.bookinfo.mesh.local", None),
            ("8080.reviews.bookinfo.mesh.local..", None),
            ("0.reviews.bookinfo.mesh.local", None),
            ("080.reviews.bookinfo.mesh.local", None),
            ("65536.reviews.bookinfo.mesh.local", None),
            ("99999999999.reviews.bookinfo.mesh.local", None),
            ("+80.reviews.bookinfo.mesh.local", None),
            ("-80.reviews.bookinfo.mesh.local", None),
            ("http.reviews.bookinfo.mesh.local", None),
            ("8080.reviews.mesh.local", None),
            ("8080.v1.reviews.bookinfo.mesh.local", None),
            ("reviews.bookinfo.mesh.local", None),
            ("mesh.local", None),
            ("8080.-reviews.bookinfo.mesh.local", None),
            ("8080.reviews-.bookinfo.mesh.local", None),
            ("8080.rev_iews.bookinfo.mesh.local", None),
            ("8080.reviews.book*info.mesh.local", None),
            ("8080.reviews.bookinfo.mesh.local\u{e9}", None),
            ("8080", None),
            ("8080.", None),
            ("10.0.0.1", None),
            ("[::1]", None),
            ("::1", None),
            ("8080.reviews.bookinfo.evilmesh.local", Some(foreign)),
            ("8080.reviews.bookinfo.mesh.local.evil", Some(foreign)),
            ("8080.reviews.bookinfo.example.com", Some(foreign)),
            ("local", Some(foreign)),
        ];
        for (sni, want) in cases {
            let got = parse_sni(sni, DOMAIN);
            match want {
                Some(err) => assert_eq!(got, Err(*err), "{sni}"),
                None => assert!(
                    matches!(got, Err(SniError::BadSni { .. })),
                    "{sni}: {got:?}"
                ),
            }
        }
        let long_label = format!("8080.{}.bookinfo.mesh.local", "r".repeat(64));
        assert!(matches!(
            parse_sni(&long_label, DOMAIN),
            Err(SniError::BadSni { .. })
        ));
        assert!(long_name.len() > MAX_NAME_LEN);
        assert!(matches!(
            parse_sni(&long_name, DOMAIN),
            Err(SniError::BadSni { .. })
        ));
    }

    #[test]
    fn invalid_mesh_domain_fails_closed() {
        for domain in [
            "",
            ".",
            "mesh..local",
            "-mesh.local",
            "mesh_local",
            "10.0.0.1",
            "mesh.local..",
        ] {
            assert_eq!(
                validate_mesh_domain(domain),
                Err(SniError::InvalidMeshDomain),
                "{domain}"
            );
            assert_eq!(
                parse_sni("8080.reviews.bookinfo.mesh.local", domain),
                Err(SniError::InvalidMeshDomain)
            );
        }
        assert_eq!(validate_mesh_domain("mesh.local."), Ok(()));
        assert_eq!(validate_mesh_domain("cluster.local"), Ok(()));
    }

    #[test]
    fn reasons_are_stable() {
        assert_eq!(HelloError::NeedMore { at_least: 1 }.reason(), "need_more");
        assert_eq!(HelloError::NotTls { reason: "" }.reason(), "not_tls");
        assert_eq!(HelloError::Malformed { reason: "" }.reason(), "not_tls");
        assert_eq!(HelloError::NoSni.reason(), "no_sni");
        assert_eq!(HelloError::InvalidSni.reason(), "bad_sni");
        assert_eq!(
            HelloError::TooLarge { max_len: 1 }.reason(),
            "hello_too_large"
        );
        assert_eq!(SniError::ForeignDomain.reason(), "foreign_domain");
        assert_eq!(SniError::BadSni { reason: "" }.reason(), "bad_sni");
        assert_eq!(SniError::InvalidMeshDomain.reason(), "bad_mesh_domain");
        assert_eq!(ReadHelloError::Eof { buffered: 0 }.reason(), "eof");
        assert_eq!(ReadHelloError::from(HelloError::NoSni).reason(), "no_sni");
        // Messages are lowercase, like every error in the crate.
        let message = SniError::BadSni { reason: "port 0" }.to_string();
        assert_eq!(message, "bad sni: port 0");
    }

    /// A reader that hands out its chunks one read at a time, then would block (or,
    /// with `eof`, ends).
    struct Chunks {
        chunks: std::collections::VecDeque<Vec<u8>>,
        eof: bool,
    }

    impl std::io::Read for Chunks {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let Some(mut chunk) = self.chunks.pop_front() else {
                if self.eof {
                    return Ok(0);
                }
                return Err(std::io::ErrorKind::WouldBlock.into());
            };
            let n = chunk.len().min(out.len());
            out[..n].copy_from_slice(&chunk[..n]);
            if n < chunk.len() {
                self.chunks.push_front(chunk.split_off(n));
            }
            Ok(n)
        }
    }

    fn chunks(wire: &[u8], cuts: &[usize], eof: bool) -> Chunks {
        let mut chunks = std::collections::VecDeque::new();
        let mut at = 0;
        for &cut in cuts.iter().chain(std::iter::once(&wire.len())) {
            chunks.push_back(wire[at..cut].to_vec());
            at = cut;
        }
        Chunks { chunks, eof }
    }

    /// A hello already whole, in one read or several, parses without waiting; bytes after
    /// it are kept for the pod.
    #[test]
    fn hello_now_parses_what_is_there() {
        let mut wire = hello_for(b"8080.reviews.bookinfo.mesh.local");
        let len = wire.len();
        wire.extend_from_slice(b"early data");
        for cuts in [vec![], vec![1], vec![5, 6, 40]] {
            let mut buf = BytesMut::with_capacity(8);
            let hello = read_client_hello_now(&mut chunks(&wire, &cuts, false), &mut buf, 4096)
                .unwrap()
                .expect("whole hello");
            assert_eq!(hello.sni(), "8080.reviews.bookinfo.mesh.local");
            assert_eq!(hello.wire_len(), len);
            assert!(buf.starts_with(&wire[..len]), "cuts {cuts:?}");
        }
    }

    /// A hello still on its way: None, with what came kept in `buf`, from which the async
    /// reader goes on.
    #[tokio::test]
    async fn hello_now_leaves_a_partial_hello_to_the_async_reader() {
        let wire = hello_for(b"8080.reviews.bookinfo.mesh.local");
        let cut = wire.len() / 2;
        let mut buf = BytesMut::new();
        let now = read_client_hello_now(&mut chunks(&wire[..cut], &[3], false), &mut buf, 4096);
        assert!(matches!(now, Ok(None)), "{now:?}");
        assert_eq!(&buf[..], &wire[..cut]);
        let mut rest = &wire[cut..];
        let hello = read_client_hello(&mut rest, &mut buf, 4096).await.unwrap();
        assert_eq!(hello.sni(), "8080.reviews.bookinfo.mesh.local");
        assert_eq!(&buf[..], &wire[..]);
    }

    /// Refusals come at once: a closed connection, a non-TLS client, a hello over the
    /// limit.
    #[test]
    fn hello_now_refuses_at_once() {
        let wire = hello_for(b"8080.reviews.bookinfo.mesh.local");
        let mut buf = BytesMut::new();
        let closed = read_client_hello_now(&mut chunks(&wire[..10], &[], true), &mut buf, 4096);
        assert!(
            matches!(closed, Err(ReadHelloError::Eof { buffered: 10 })),
            "{closed:?}"
        );
        let mut buf = BytesMut::new();
        let http = read_client_hello_now(
            &mut chunks(b"GET / HTTP/1.1\r\n", &[], false),
            &mut buf,
            4096,
        );
        assert!(matches!(http, Err(ReadHelloError::Hello(_))), "{http:?}");
        let mut buf = BytesMut::new();
        let big = read_client_hello_now(&mut chunks(&wire, &[], false), &mut buf, 20);
        assert!(matches!(big, Err(ReadHelloError::Hello(_))), "{big:?}");
    }
}
