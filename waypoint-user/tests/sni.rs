//! ClientHello reader and structured-SNI tests on hellos recorded from rustls and
//! `openssl s_client` (see `testdata/README.md`), re-framed, grown and broken in the ways
//! a tunnel port can see.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
mod common;

use common::hello::{
    edit_extensions, fixture, frame, server_name_ext, unframe, with_server_name, MAX_RECORD,
};
use waypoint::sni::{
    parse_client_hello, parse_sni, read_client_hello, HelloError, HelloParser, ReadHelloError,
    SniError, Target, DEFAULT_MAX_HELLO_LEN,
};

const SNI: &str = "8080.reviews.bookinfo.mesh.local";
const DOMAIN: &str = "mesh.local";

struct Fixture {
    file: &'static str,
    sni: bool,
    alpn: &'static [&'static [u8]],
    pq: bool,
}

const FIXTURES: &[Fixture] = &[
    Fixture {
        file: "rustls_pq.bin",
        sni: true,
        alpn: &[b"h2"],
        pq: true,
    },
    Fixture {
        file: "rustls_classic.bin",
        sni: true,
        alpn: &[b"h2"],
        pq: false,
    },
    Fixture {
        file: "rustls_no_sni.bin",
        sni: false,
        alpn: &[b"h2"],
        pq: true,
    },
    Fixture {
        file: "openssl.bin",
        sni: true,
        alpn: &[b"h2", b"http/1.1"],
        pq: false,
    },
    Fixture {
        file: "openssl_tls12.bin",
        sni: true,
        alpn: &[],
        pq: false,
    },
    Fixture {
        file: "openssl_no_sni.bin",
        sni: false,
        alpn: &[],
        pq: false,
    },
];

fn with_sni() -> impl Iterator<Item = (&'static str, Vec<u8>)> {
    FIXTURES
        .iter()
        .filter(|f| f.sni)
        .map(|f| (f.file, fixture(f.file)))
}

fn parse(wire: &[u8]) -> Result<waypoint::sni::Hello, HelloError> {
    parse_client_hello(wire, DEFAULT_MAX_HELLO_LEN)
}

/// Splits `message` into `n` records of near-equal size.
fn frame_into(message: &[u8], n: usize) -> Vec<u8> {
    let size = message.len().div_ceil(n);
    frame(message, &vec![size; n])
}

/// Adds padding extensions (RFC 7685) totalling about `bytes`.
fn padded(wire: &[u8], mut bytes: usize) -> Vec<u8> {
    edit_extensions(wire, |exts| {
        while bytes > 0 {
            let chunk = bytes.min(60_000);
            // Only one padding extension is legal; use private-use types for the rest.
            let ty = if exts.iter().any(|(t, _)| *t == 0x0015) {
                0xff00 + exts.len() as u16
            } else {
                0x0015
            };
            exts.push((ty, vec![0; chunk]));
            bytes -= chunk;
        }
    })
}

/// A hello with its extension block filled to the 65535-byte maximum: the handshake
/// message alone then exceeds 64 KiB.
fn huge(wire: &[u8]) -> Vec<u8> {
    edit_extensions(wire, |exts| {
        let used: usize = exts.iter().map(|(_, data)| 4 + data.len()).sum();
        let room = usize::from(u16::MAX) - used - 2 * 4;
        exts.push((0x0015, vec![0; room / 2]));
        exts.push((0xff00, vec![0; room - room / 2]));
    })
}

/// Every strict prefix must ask for more (and never for more than is really missing);
/// the whole thing must give `want`.
/// A resumable parser fed the same growing prefixes must agree with fresh parses.
fn assert_prefixes(wire: &[u8], want: Result<&str, HelloError>) {
    let mut resumed = HelloParser::new(DEFAULT_MAX_HELLO_LEN);
    for cut in 0..wire.len() {
        assert_eq!(
            resumed.parse(&wire[..cut]),
            parse(&wire[..cut]),
            "cut {cut}"
        );
        match parse(&wire[..cut]) {
            Err(HelloError::NeedMore { at_least }) => assert!(
                (1..=wire.len() - cut).contains(&at_least),
                "cut {cut}/{}: at_least {at_least}",
                wire.len()
            ),
            other => panic!("cut {cut}/{}: {other:?}", wire.len()),
        }
    }
    let got = parse(wire);
    assert_eq!(resumed.parse(wire), got);
    // Once complete, more bytes behind the hello change nothing.
    assert_eq!(resumed.parse(&[wire, b"\x17\x03\x03"].concat()), got);
    match want {
        Ok(sni) => {
            let hello = got.unwrap();
            assert_eq!(hello.sni(), sni);
            assert_eq!(hello.wire_len(), wire.len());
        }
        Err(e) => assert_eq!(got, Err(e)),
    }
}

#[test]
fn recorded_hellos_parse() {
    for f in FIXTURES {
        let wire = fixture(f.file);
        let got = parse(&wire);
        if !f.sni {
            assert_eq!(got, Err(HelloError::NoSni), "{}", f.file);
            continue;
        }
        let hello = got.unwrap_or_else(|e| panic!("{}: {e}", f.file));
        assert_eq!(hello.sni(), SNI, "{}", f.file);
        assert_eq!(hello.wire_len(), wire.len(), "{}", f.file);
        assert_eq!(hello.alpn(), f.alpn, "{}", f.file);
        assert_eq!(hello.pq_key_share(), f.pq, "{}", f.file);
        assert_eq!(
            parse_sni(hello.sni(), DOMAIN),
            Ok(Target {
                port: 8080,
                service: "reviews".into(),
                namespace: "bookinfo".into(),
            })
        );
    }
    // The post-quantum hello is the big one (ML-KEM-768 share: 1184 + 32 bytes).
    assert!(fixture("rustls_pq.bin").len() > 1400);
}

#[test]
fn recorded_hellos_at_every_prefix() {
    for f in FIXTURES {
        let wire = fixture(f.file);
        let want = if f.sni {
            Ok(SNI)
        } else {
            Err(HelloError::NoSni)
        };
        assert_prefixes(&wire, want);
        // Whatever follows the hello (early data, garbage) is not the parser's business.
        let mut more = wire.clone();
        more.extend_from_slice(b"\x17\x03\x03\x00\x05early");
        assert_eq!(
            parse(&more).map(|h| h.wire_len()),
            parse(&wire).map(|h| h.wire_len())
        );
    }
}

#[test]
fn hello_split_across_records() {
    for (file, wire) in with_sni() {
        let message = unframe(&wire);
        for n in [2, 3] {
            let reframed = frame_into(&message, n);
            assert_eq!(reframed.len(), wire.len() + 5 * (n - 1), "{file}");
            assert_prefixes(&reframed, Ok(SNI));
        }
        // Uneven cuts, including through the handshake header and in the middle of the SNI.
        for sizes in [
            &[1][..],
            &[2, 1],
            &[3, 1, 1],
            &[60, 1],
            &[message.len() - 1],
        ] {
            let reframed = frame(&message, sizes);
            assert_eq!(parse(&reframed).unwrap().sni(), SNI, "{file} {sizes:?}");
        }
    }
}

#[test]
fn hello_larger_than_one_record() {
    let wire = padded(&fixture("rustls_pq.bin"), 20_000);
    assert!(wire.len() > MAX_RECORD + 5, "{}", wire.len());
    assert_eq!(unframe(&wire).len() / MAX_RECORD + 1, 2);
    assert_prefixes(&wire, Ok(SNI));
    let hello = parse(&wire).unwrap();
    assert!(hello.pq_key_share());

    // Near the 64 KiB default: four full-ish records still fit.
    let wire = padded(
        &fixture("rustls_classic.bin"),
        DEFAULT_MAX_HELLO_LEN - 1_000,
    );
    assert!(wire.len() > 3 * MAX_RECORD && wire.len() <= DEFAULT_MAX_HELLO_LEN);
    assert_eq!(parse(&wire).unwrap().sni(), SNI);
    // And re-framed into many small records it still parses, given the room.
    let message = unframe(&wire);
    let small = frame(&message, &vec![100; message.len() / 100 + 1]);
    assert_eq!(
        parse_client_hello(&small, 2 * DEFAULT_MAX_HELLO_LEN)
            .unwrap()
            .sni(),
        SNI
    );
    assert!(matches!(
        parse_client_hello(&small, DEFAULT_MAX_HELLO_LEN),
        Err(HelloError::TooLarge { .. })
    ));
}

#[test]
fn too_large_is_rejected_from_the_headers() {
    let huge = huge(&fixture("rustls_pq.bin"));
    assert!(unframe(&huge).len() > DEFAULT_MAX_HELLO_LEN);
    // The handshake length in the first record is enough to know.
    assert_eq!(
        parse(&huge[..9]),
        Err(HelloError::TooLarge {
            max_len: DEFAULT_MAX_HELLO_LEN
        })
    );
    let big = padded(&fixture("rustls_pq.bin"), 20_000);
    for max_len in [4096, big.len() - 1] {
        assert_eq!(
            parse_client_hello(&big[..9], max_len),
            Err(HelloError::TooLarge { max_len })
        );
    }
    assert!(parse_client_hello(&big, big.len()).is_ok());
}

/// Hands out one byte per successful poll and returns `Pending` in between, like the
/// slowest possible peer; EOF when the data runs out.
struct Trickle<'a> {
    data: &'a [u8],
    pending: bool,
    polls: usize,
}

impl<'a> Trickle<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self {
            data,
            pending: true,
            polls: 0,
        }
    }
}

impl AsyncRead for Trickle<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.polls += 1;
        if std::mem::take(&mut this.pending) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        this.pending = true;
        if let Some((&first, rest)) = this.data.split_first() {
            buf.put_slice(&[first]);
            this.data = rest;
        }
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn async_reader_one_byte_at_a_time() {
    let big = padded(&fixture("openssl.bin"), 30_000);
    let mut cases: Vec<(&str, Vec<u8>)> = with_sni().collect();
    let message = unframe(&cases[0].1);
    cases.push(("3 records", frame_into(&message, 3)));
    cases.push(("30k", big));
    // Pathological but legal: one handshake byte per record, trickled one byte per read.
    let classic = unframe(&fixture("rustls_classic.bin"));
    cases.push(("1-byte records", frame(&classic, &vec![1; classic.len()])));
    for (what, wire) in cases {
        let mut reader = Trickle::new(&wire);
        let mut buf = BytesMut::new();
        let hello = read_client_hello(&mut reader, &mut buf, DEFAULT_MAX_HELLO_LEN)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(hello.sni(), SNI, "{what}");
        assert_eq!(&buf[..], &wire[..], "{what}");
        assert!(reader.data.is_empty(), "{what}: did not read to the end");
    }
}

#[tokio::test]
async fn async_reader_does_not_wait_past_the_hello() {
    // The client sends its hello and then waits for the server: the reader must return
    // without a single byte more (a NeedMore overestimate would hang here).
    for (what, wire) in with_sni().chain([(
        "3 records",
        frame_into(&unframe(&fixture("rustls_pq.bin")), 3),
    )]) {
        let (mut client, mut server) = tokio::io::duplex(64);
        let writer = {
            let wire = wire.clone();
            tokio::spawn(async move {
                for chunk in wire.chunks(7) {
                    client.write_all(chunk).await.unwrap();
                }
                client // keep the stream open
            })
        };
        let mut buf = BytesMut::new();
        let hello = tokio::time::timeout(
            Duration::from_secs(10),
            read_client_hello(&mut server, &mut buf, DEFAULT_MAX_HELLO_LEN),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: waited for bytes that never come"))
        .unwrap();
        assert_eq!(hello.sni(), SNI);
        assert_eq!(&buf[..], &wire[..]);
        drop(writer.await.unwrap());
    }
}

#[tokio::test]
async fn async_reader_uses_buffered_bytes_and_keeps_extra_ones() {
    let wire = fixture("rustls_classic.bin");
    // All of it already buffered: no read at all.
    let mut buf = BytesMut::from(&wire[..]);
    let mut empty = tokio::io::empty();
    let hello = read_client_hello(&mut empty, &mut buf, DEFAULT_MAX_HELLO_LEN)
        .await
        .unwrap();
    assert_eq!(hello.wire_len(), wire.len());
    // Half buffered, rest plus early data on the wire: everything read stays in buf.
    let (head, tail) = wire.split_at(100);
    let mut rest = tail.to_vec();
    rest.extend_from_slice(b"\x17\x03\x03\x00\x01x");
    let mut buf = BytesMut::from(head);
    let hello = read_client_hello(&mut &rest[..], &mut buf, DEFAULT_MAX_HELLO_LEN)
        .await
        .unwrap();
    assert_eq!(hello.wire_len(), wire.len());
    assert!(buf.len() >= wire.len());
    assert_eq!(&buf[..wire.len()], &wire[..]);
}

#[tokio::test]
async fn async_reader_errors() {
    let wire = fixture("rustls_pq.bin");
    let mut buf = BytesMut::new();
    let err = read_client_hello(&mut &wire[..500], &mut buf, DEFAULT_MAX_HELLO_LEN)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ReadHelloError::Eof { buffered: 500 }),
        "{err}"
    );
    assert_eq!(err.reason(), "eof");

    let mut buf = BytesMut::new();
    let mut http = &b"GET / HTTP/1.1\r\nHost: reviews\r\n\r\n"[..];
    let err = read_client_hello(&mut http, &mut buf, DEFAULT_MAX_HELLO_LEN)
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "not_tls");

    // TooLarge after reading just the headers, not the whole hello.
    let huge = huge(&fixture("rustls_pq.bin"));
    let mut reader = Trickle::new(&huge);
    let mut buf = BytesMut::new();
    let err = read_client_hello(&mut reader, &mut buf, DEFAULT_MAX_HELLO_LEN)
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "hello_too_large");
    assert!(buf.len() < 100, "read {} bytes", buf.len());

    let mut buf = BytesMut::new();
    let err = read_client_hello(&mut &fixture("openssl_no_sni.bin")[..], &mut buf, 1 << 16)
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "no_sni");
}

#[test]
fn non_hellos_are_rejected() {
    let mut sslv2 = vec![
        0x80, 0x2e, 0x01, 0x03, 0x01, 0x00, 0x15, 0x00, 0x00, 0x00, 0x10,
    ];
    sslv2.extend_from_slice(&[0x07, 0x00, 0xc0, 0x05, 0x00, 0x80, 0x03, 0x00, 0x80]);
    sslv2.extend_from_slice(&[0x42; 16]);
    let server_hello = {
        let mut m = unframe(&fixture("openssl.bin"));
        m[0] = 0x02;
        frame(&m, &[])
    };
    let cases: &[(&str, &[u8])] = &[
        ("garbage", b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09"),
        ("http", b"GET / HTTP/1.1\r\nHost: reviews.bookinfo\r\n\r\n"),
        ("http2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("ssh", b"SSH-2.0-OpenSSH_9.2\r\n"),
        ("sslv2 compatible hello", &sslv2),
        ("alert record", b"\x15\x03\x03\x00\x02\x02\x28"),
        ("application data", b"\x17\x03\x03\x00\x05hello"),
        ("change cipher spec", b"\x14\x03\x03\x00\x01\x01"),
        ("server hello", &server_hello),
        ("record version 2.0", b"\x16\x02\x00\x00\x30\x01"),
        ("record version 3.9", b"\x16\x03\x09\x00\x30\x01"),
    ];
    for (what, wire) in cases {
        let err = parse(wire).unwrap_err();
        assert_eq!(err.reason(), "not_tls", "{what}: {err:?}");
        // Known from the first few bytes, without waiting for a full record.
        let early = &wire[..wire.len().min(6)];
        assert_eq!(
            parse(early).unwrap_err().reason(),
            "not_tls",
            "{what} early"
        );
    }
    for (what, wire) in [
        ("empty", &b""[..]),
        ("one byte", b"\x16"),
        ("header", b"\x16\x03\x01\x02\x00"),
    ] {
        assert!(
            matches!(parse(wire), Err(HelloError::NeedMore { .. })),
            "{what}"
        );
    }
    for (what, wire) in [
        ("zero-length record", &b"\x16\x03\x01\x00\x00"[..]),
        ("oversized record", b"\x16\x03\x01\x40\x01\x01"),
    ] {
        assert!(
            matches!(parse(wire), Err(HelloError::Malformed { .. })),
            "{what}"
        );
    }
}

/// Full path from wire bytes to a route, as the tunnel listener does it.
fn route(wire: &[u8]) -> Result<Target, &'static str> {
    let hello = parse(wire).map_err(|e| e.reason())?;
    parse_sni(hello.sni(), DOMAIN).map_err(|e| e.reason())
}

#[test]
fn sni_table_through_recorded_hello() {
    let base = fixture("rustls_pq.bin");
    let target = |port, service: &str, namespace: &str| {
        Ok(Target {
            port,
            service: service.into(),
            namespace: namespace.into(),
        })
    };
    let long_label = format!("8080.{}.bookinfo.mesh.local", "r".repeat(64));
    let cases: &[(&str, Result<Target, &str>)] = &[
        (
            "8080.reviews.bookinfo.mesh.local",
            target(8080, "reviews", "bookinfo"),
        ),
        (
            "8080.REVIEWS.BookInfo.MESH.local",
            target(8080, "reviews", "bookinfo"),
        ),
        (
            "8080.reviews.bookinfo.mesh.local.",
            target(8080, "reviews", "bookinfo"),
        ),
        ("1.a.b.mesh.local", target(1, "a", "b")),
        ("65535.a.b.mesh.local", target(65535, "a", "b")),
        ("10.0.0.1", Err("bad_sni")),
        ("[::1]", Err("bad_sni")),
        ("8080.reviews.bookinfo.example.com", Err("foreign_domain")),
        ("8080.reviews.bookinfo.notmesh.local", Err("foreign_domain")),
        ("0.reviews.bookinfo.mesh.local", Err("bad_sni")),
        ("65536.reviews.bookinfo.mesh.local", Err("bad_sni")),
        ("http.reviews.bookinfo.mesh.local", Err("bad_sni")),
        ("+8080.reviews.bookinfo.mesh.local", Err("bad_sni")),
        ("08080.reviews.bookinfo.mesh.local", Err("bad_sni")),
        (&long_label, Err("bad_sni")),
        ("8080..bookinfo.mesh.local", Err("bad_sni")),
        ("8080.reviews.bookinfo.mesh..local", Err("bad_sni")),
        ("8080", Err("bad_sni")),
        ("8080.reviews.mesh.local", Err("bad_sni")),
        ("8080.rev_iews.bookinfo.mesh.local", Err("bad_sni")),
        // An empty or non-ASCII host_name is refused by the hello reader already.
        ("", Err("bad_sni")),
        ("8080.réviews.bookinfo.mesh.local", Err("bad_sni")),
    ];
    for (sni, want) in cases {
        let wire = with_server_name(&base, sni.as_bytes());
        assert_eq!(route(&wire), *want, "{sni:?}");
    }
    // Two host names in one hello are ambiguous: refused, whichever is valid.
    let twice = edit_extensions(&base, |exts| {
        exts.push((0, server_name_ext(b"9090.ratings.bookinfo.mesh.local")));
    });
    assert_eq!(route(&twice), Err("not_tls"));
    assert_eq!(
        parse_sni("8080.reviews.bookinfo.mesh.local", "mesh..local"),
        Err(SniError::InvalidMeshDomain)
    );
}
