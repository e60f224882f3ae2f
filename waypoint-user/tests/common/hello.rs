//! Recorded ClientHellos (waypoint-user/testdata) and tools to re-frame and edit them.

/// Largest TLS record body.
pub const MAX_RECORD: usize = 1 << 14;

pub fn fixture(file: &str) -> Vec<u8> {
    let path = format!("{}/testdata/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The handshake message carried by `wire`'s records.
pub fn unframe(wire: &[u8]) -> Vec<u8> {
    let mut message = Vec::new();
    let mut rest = wire;
    while !rest.is_empty() {
        assert_eq!(rest[0], 0x16);
        let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
        message.extend_from_slice(&rest[5..5 + len]);
        rest = &rest[5 + len..];
    }
    message
}

/// Frames `message` into handshake records of the given body sizes; whatever is left goes
/// into maximal records.
pub fn frame(message: &[u8], sizes: &[usize]) -> Vec<u8> {
    let mut wire = Vec::new();
    let mut rest = message;
    let mut sizes = sizes.iter().copied();
    while !rest.is_empty() {
        let size = sizes.next().unwrap_or(MAX_RECORD).min(rest.len());
        let (chunk, tail) = rest.split_at(size);
        wire.extend_from_slice(&[0x16, 0x03, 0x01]);
        wire.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
        wire.extend_from_slice(chunk);
        rest = tail;
    }
    wire
}

/// Rebuilds a recorded hello with its extension list edited by `edit`, framed in as few
/// records as possible.
pub fn edit_extensions(wire: &[u8], edit: impl FnOnce(&mut Vec<(u16, Vec<u8>)>)) -> Vec<u8> {
    let message = unframe(wire);
    let body = &message[4..];
    let mut at = 2 + 32;
    at += 1 + usize::from(body[at]);
    at += 2 + usize::from(u16::from_be_bytes([body[at], body[at + 1]]));
    at += 1 + usize::from(body[at]);
    let prefix = &body[..at];
    let mut exts = Vec::new();
    let mut rest = &body[at + 2..];
    while !rest.is_empty() {
        let ty = u16::from_be_bytes([rest[0], rest[1]]);
        let len = usize::from(u16::from_be_bytes([rest[2], rest[3]]));
        exts.push((ty, rest[4..4 + len].to_vec()));
        rest = &rest[4 + len..];
    }
    edit(&mut exts);
    let mut ext_bytes = Vec::new();
    for (ty, data) in &exts {
        ext_bytes.extend_from_slice(&ty.to_be_bytes());
        ext_bytes.extend_from_slice(&u16::try_from(data.len()).unwrap().to_be_bytes());
        ext_bytes.extend_from_slice(data);
    }
    let mut new_body = prefix.to_vec();
    new_body.extend_from_slice(&u16::try_from(ext_bytes.len()).unwrap().to_be_bytes());
    new_body.extend_from_slice(&ext_bytes);
    let mut new_message = vec![0x01];
    new_message.extend_from_slice(&u32::try_from(new_body.len()).unwrap().to_be_bytes()[1..]);
    new_message.extend_from_slice(&new_body);
    frame(&new_message, &[])
}

pub fn server_name_ext(name: &[u8]) -> Vec<u8> {
    let mut data = u16::try_from(name.len() + 3)
        .unwrap()
        .to_be_bytes()
        .to_vec();
    data.push(0);
    data.extend_from_slice(&u16::try_from(name.len()).unwrap().to_be_bytes());
    data.extend_from_slice(name);
    data
}

pub fn with_server_name(wire: &[u8], name: &[u8]) -> Vec<u8> {
    edit_extensions(wire, |exts| {
        for (ty, data) in exts.iter_mut() {
            if *ty == 0 {
                *data = server_name_ext(name);
            }
        }
    })
}
