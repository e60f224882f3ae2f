//! The load generator's side of a connection: connecting with the hello, and the
//! bounded waits that keep a stuck dataplane from hanging the benchmark.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream as StdStream},
    thread,
    time::{Duration, Instant},
};

use crate::{HELLO_LEN, REPLY_LEN, TEARDOWN_TIMEOUT};

/// Polls `done` every millisecond until it holds or `TEARDOWN_TIMEOUT` passes.
pub(crate) fn wait_for(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > TEARDOWN_TIMEOUT {
            eprintln!("  warning: timed out waiting for {what}");
            return;
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Connects, sends the hello and, unless `eager`, waits for the server's reply.
pub(crate) fn connect(addr: SocketAddr, eager: bool) -> StdStream {
    let mut s = StdStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("TCP_NODELAY");
    s.set_read_timeout(Some(TEARDOWN_TIMEOUT))
        .expect("read timeout");
    s.set_write_timeout(Some(TEARDOWN_TIMEOUT))
        .expect("write timeout");
    s.write_all(&[0x16; HELLO_LEN]).expect("send hello");
    if !eager {
        let mut reply = [0u8; REPLY_LEN];
        s.read_exact(&mut reply).expect("receive the hello reply");
    }
    s
}
