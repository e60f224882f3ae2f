//! The servers behind the proxy: a discarding sink and an echo server, plain threads
//! with blocking sockets, one thread per connection.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener as StdListener},
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
        Arc,
    },
    thread,
};

use crate::{CHUNK, HELLO_LEN, REPLY_LEN, TEARDOWN_TIMEOUT};

/// A server that reads the hello, then discards everything until EOF.
pub(crate) struct Sink {
    pub(crate) addr: SocketAddr,
    /// Bytes received after the hello, over all connections.
    pub(crate) bytes: Arc<AtomicU64>,
    /// Connections not yet closed.
    pub(crate) open: Arc<AtomicUsize>,
}

pub(crate) fn start_sink() -> Sink {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind sink");
    let addr = listener.local_addr().expect("sink addr");
    let bytes = Arc::new(AtomicU64::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let (b, o) = (bytes.clone(), open.clone());
    thread::Builder::new()
        .name("sink-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                let (b, o) = (b.clone(), o.clone());
                // Counted before the thread starts so a waiter never sees a false zero.
                o.fetch_add(1, Relaxed);
                thread::spawn(move || {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(TEARDOWN_TIMEOUT));
                    let mut hello = [0u8; HELLO_LEN];
                    if s.read_exact(&mut hello).is_ok() && s.write_all(&[0x16; REPLY_LEN]).is_ok() {
                        let mut buf = vec![0u8; CHUNK];
                        while let Ok(n @ 1..) = s.read(&mut buf) {
                            b.fetch_add(n as u64, Relaxed);
                        }
                    }
                    drop(s);
                    o.fetch_sub(1, Relaxed);
                });
            }
        })
        .expect("spawn sink");
    Sink { addr, bytes, open }
}

/// A server that reads the hello, then echoes every byte back.
pub(crate) fn start_echo() -> SocketAddr {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind echo");
    let addr = listener.local_addr().expect("echo addr");
    thread::Builder::new()
        .name("echo-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                thread::spawn(move || {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(TEARDOWN_TIMEOUT));
                    let mut hello = [0u8; HELLO_LEN];
                    if s.read_exact(&mut hello).is_err() || s.write_all(&[0x16; REPLY_LEN]).is_err()
                    {
                        return;
                    }
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = s.read(&mut buf) {
                        if s.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        })
        .expect("spawn echo");
    addr
}
