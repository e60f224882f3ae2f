//! The ClientHello reader's tests: well-formed hellos, every malformed shape, limits.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

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
