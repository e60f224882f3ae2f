//! The admin HTTP server, on its own port: `/metrics`, `/healthz` (liveness: answers
//! while the process runs, depends on nothing external) and `/readyz` (readiness).

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1, service::service_fn, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::metrics::Metrics;

/// Readiness: set once the daemon can serve, cleared when it starts draining.
#[derive(Debug, Default)]
pub struct Readiness {
    ready: AtomicBool,
}

impl Readiness {
    /// Marks the daemon ready or not.
    pub fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Whether the daemon is ready.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

/// Errors of the admin server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The admin address could not be bound.
    #[error("binding the admin server on {addr}: {source} (is another waypoint running?)")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// A bound admin server.
pub struct Admin {
    listener: TcpListener,
}

impl Admin {
    /// Binds the admin address.
    pub async fn bind(addr: SocketAddr) -> Result<Admin, Error> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Bind { addr, source })?;
        Ok(Admin { listener })
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `stop` is cancelled.
    pub async fn serve(
        self,
        metrics: Arc<Metrics>,
        ready: Arc<Readiness>,
        stop: CancellationToken,
    ) {
        if let Ok(addr) = self.listener.local_addr() {
            info!(%addr, "admin server listening");
        }
        loop {
            let (stream, _) = tokio::select! {
                _ = stop.cancelled() => return,
                r = self.listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        debug!(error = %e, "admin accept failed");
                        continue;
                    }
                },
            };
            let metrics = metrics.clone();
            let ready = ready.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let resp = respond(req.uri().path(), &metrics, &ready);
                    async move { Ok::<_, Infallible>(resp) }
                });
                if let Err(e) = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await
                {
                    debug!(error = %e, "admin connection failed");
                }
            });
        }
    }
}

fn respond(path: &str, metrics: &Metrics, ready: &Readiness) -> Response<Full<Bytes>> {
    let (status, body) = match path {
        "/metrics" => (StatusCode::OK, metrics.render()),
        "/healthz" => (StatusCode::OK, "ok\n".to_owned()),
        "/readyz" if ready.is_ready() => (StatusCode::OK, "ready\n".to_owned()),
        "/readyz" => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned()),
        _ => (StatusCode::NOT_FOUND, "not found\n".to_owned()),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
}
