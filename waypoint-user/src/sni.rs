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
mod tests;
