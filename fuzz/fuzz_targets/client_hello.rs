//! Arbitrary bytes as the first flight on the tunnel port: the reader and the SNI grammar
//! must never panic, and a resumed parse must agree with a fresh one.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The module itself, not the daemon crate: the parser has no dependency on the rest.
#[path = "../../waypoint-user/src/sni.rs"]
#[allow(dead_code, reason = "the async reader is not fuzzed here")]
mod sni;

use sni::{parse_client_hello, parse_sni, HelloError, HelloParser, DEFAULT_MAX_HELLO_LEN};

fuzz_target!(|data: &[u8]| {
    let result = parse_client_hello(data, DEFAULT_MAX_HELLO_LEN);
    if let Ok(hello) = &result {
        assert!(hello.wire_len() <= data.len());
        let _ = parse_sni(hello.sni(), "mesh.local");
    }
    if let Err(HelloError::NeedMore { at_least }) = result {
        assert!(at_least >= 1);
    }
    // Same bytes fed in two steps through the resumable parser.
    let mut parser = HelloParser::new(DEFAULT_MAX_HELLO_LEN);
    let first = parser.parse(&data[..data.len() / 2]);
    if matches!(first, Err(HelloError::NeedMore { .. })) {
        assert_eq!(parser.parse(data), result);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = parse_sni(text, "mesh.local");
    }
});
