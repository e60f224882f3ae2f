//! The proxy under test: accept, read the hello, connect upstream, and hand both sockets
//! to the dataplane, counting connections that did not end cleanly.

use std::{
    io,
    net::{SocketAddr, TcpListener as StdListener},
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
        Arc,
    },
};

use tokio::{io::AsyncReadExt as _, net::TcpListener, runtime::Runtime};
use waypoint::dataplane::{Dataplane, End, Limits};

use crate::HELLO_LEN;

/// Per-proxy bookkeeping, so a run can wait for its connections to finish and report
/// connections that did not end cleanly.
#[derive(Default)]
pub(crate) struct ProxyCounters {
    pub(crate) active: AtomicUsize,
    pub(crate) not_closed: AtomicU64,
    pub(crate) errors: AtomicU64,
}

pub(crate) fn start_proxy(
    rt: &Runtime,
    dp: Arc<Dataplane>,
    target: SocketAddr,
    counters: Arc<ProxyCounters>,
    limits: Limits,
) -> SocketAddr {
    let std_listener = StdListener::bind("127.0.0.1:0").expect("bind proxy");
    let addr = std_listener.local_addr().expect("proxy addr");
    std_listener
        .set_nonblocking(true)
        .expect("nonblocking proxy listener");
    rt.spawn(async move {
        let listener = TcpListener::from_std(std_listener).expect("register proxy listener");
        loop {
            let Ok((mut down, _)) = listener.accept().await else {
                continue;
            };
            let (dp, counters) = (dp.clone(), counters.clone());
            counters.active.fetch_add(1, Relaxed);
            tokio::spawn(async move {
                let result = async {
                    let mut hello = [0u8; HELLO_LEN];
                    down.read_exact(&mut hello).await?;
                    let up = tokio::net::TcpStream::connect(target).await?;
                    down.set_nodelay(true)?;
                    up.set_nodelay(true)?;
                    dp.forward(down.into(), up.into(), hello.to_vec(), limits)
                        .await
                        .map_err(io::Error::other)
                }
                .await;
                match result {
                    Ok(o) if o.end == End::Closed => {}
                    Ok(o) => {
                        eprintln!("  warning: proxied connection ended {:?}", o.end);
                        counters.not_closed.fetch_add(1, Relaxed);
                    }
                    Err(e) => {
                        eprintln!("  warning: proxied connection failed: {e:?}");
                        counters.errors.fetch_add(1, Relaxed);
                    }
                }
                counters.active.fetch_sub(1, Relaxed);
            });
        }
    });
    addr
}
