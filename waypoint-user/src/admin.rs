//! The admin HTTP server, on its own port: `/metrics`, `/healthz` (liveness: answers
//! while the process runs, depends on nothing external), `/readyz` (readiness; the body
//! says how the registry is doing) and `/v1/resolve` (the split-horizon view as JSON).

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

use crate::{
    horizon::{self, Query},
    metrics::Metrics,
    registry,
    store::Store,
};

/// What the admin API reads besides metrics and readiness.
#[derive(Debug)]
pub struct Api {
    /// The endpoint store.
    pub store: Store,
    /// This node as a split-horizon viewer (the defaults of `/v1/resolve`).
    pub viewer: horizon::Viewer,
    /// The etcd registry's health, when the registry is etcd.
    pub registry: Option<registry::metrics::Metrics>,
    /// The dataplane chosen and why, one line (see `dataplane::choice`).
    pub dataplane: String,
}

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
    #[error("binding the admin server on {addr}: {source}")]
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
        let listener =
            crate::router::listen(addr, 128).map_err(|source| Error::Bind { addr, source })?;
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
        api: Arc<Api>,
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
            let api = api.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let resp = respond(
                        req.uri().path(),
                        req.uri().query().unwrap_or(""),
                        &metrics,
                        &ready,
                        &api,
                    );
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

fn respond(
    path: &str,
    query: &str,
    metrics: &Metrics,
    ready: &Readiness,
    api: &Api,
) -> Response<Full<Bytes>> {
    // Readiness stays true while etcd is away (the last known state is served on
    // purpose); the body says so, for humans and alerts.
    let detail = || {
        let registry = api
            .registry
            .as_ref()
            .map(|r| format!("{}\n", r.detail()))
            .unwrap_or_default();
        format!("{registry}{}\n", api.dataplane)
    };
    let (status, body) = match path {
        "/metrics" => {
            if let Some(r) = &api.registry {
                r.refresh();
            }
            (StatusCode::OK, metrics.render())
        }
        "/healthz" => (StatusCode::OK, "ok\n".to_owned()),
        "/readyz" if ready.is_ready() => (StatusCode::OK, format!("ready\n{}", detail())),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready\n{}", detail()),
        ),
        "/v1/resolve" => resolve(query, api),
        _ => (StatusCode::NOT_FOUND, "not found\n".to_owned()),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
}

/// `/v1/resolve?service=<svc>.<ns>:<port>[&cluster=C][&node=N][&region=R][&zone=Z]
/// [&mode=off|cross-cluster|always]`: the view from this node, or from the viewer the
/// parameters describe.
fn resolve(query: &str, api: &Api) -> (StatusCode, String) {
    let mut viewer = api.viewer.clone();
    let mut target = None;
    for (k, v) in form_pairs(query) {
        match k.as_str() {
            "service" => target = Some(v),
            "cluster" => viewer.cluster = v,
            "node" => viewer.node = v,
            "region" => viewer.region = v,
            "zone" => viewer.zone = v,
            "mode" => match <horizon::Mode as clap::ValueEnum>::from_str(&v, false) {
                Ok(m) => viewer.mode = m,
                Err(_) => {
                    return (
                        StatusCode::BAD_REQUEST,
                        format!("mode {v:?}: expected off, cross-cluster or always\n"),
                    )
                }
            },
            _ => {
                return (
                    StatusCode::BAD_REQUEST,
                    format!("unknown parameter {k:?}\n"),
                )
            }
        }
    }
    let Some(target) = target else {
        return (
            StatusCode::BAD_REQUEST,
            "missing service=<svc>.<ns>:<port>\n".to_owned(),
        );
    };
    let q: Query = match target.parse() {
        Ok(q) => q,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")),
    };
    let snap = api.store.snapshot();
    let view = horizon::resolve(
        &viewer,
        &q,
        snap.endpoints(&q.namespace, &q.service)
            .iter()
            .map(AsRef::as_ref),
    );
    match serde_json::to_string_pretty(&view) {
        Ok(json) => (StatusCode::OK, json + "\n"),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

/// Splits an `application/x-www-form-urlencoded` query into decoded pairs.
fn form_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_queries() {
        assert_eq!(
            form_pairs("service=reviews.bookinfo%3A9080&cluster=b&x"),
            vec![
                ("service".to_owned(), "reviews.bookinfo:9080".to_owned()),
                ("cluster".to_owned(), "b".to_owned()),
                ("x".to_owned(), String::new()),
            ]
        );
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("a%zz"), "a%zz");
        assert_eq!(percent_decode("%41+b"), "A b");
    }
}
