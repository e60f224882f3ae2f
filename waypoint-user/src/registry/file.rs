//! The static file registry: a JSON document `{"endpoints": [...]}` (see
//! [`crate::model::Endpoint`] for the fields), re-read when its modification time or size
//! changes. A file that fails to parse keeps the last good state in force and is logged.

use std::{
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    model::Endpoint,
    store::{Snapshot, Store},
};

/// How often the file's metadata is checked.
const POLL: Duration = Duration::from_secs(1);

/// The file's document.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Document {
    /// Every endpoint.
    pub endpoints: Vec<Endpoint>,
}

/// Errors reading the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("reading endpoints file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a valid endpoints document.
    #[error("parsing endpoints file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// An endpoint's ports do not hold together.
    #[error("endpoints file {path}: {source}")]
    Ports {
        /// The file.
        path: PathBuf,
        /// Which endpoint, and what is wrong.
        source: crate::model::BadPorts,
    },
}

/// Reads and parses the file.
pub fn load(path: &Path) -> Result<Document, Error> {
    let text = std::fs::read(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })?;
    let doc: Document = serde_json::from_slice(&text).map_err(|source| Error::Parse {
        path: path.to_owned(),
        source,
    })?;
    let each = doc.endpoints.iter().map(|e| {
        let (svc, ns) = (e.service.as_str(), e.namespace.as_str());
        (svc, ns, e.ports.as_slice(), e.service_ports.as_slice())
    });
    crate::model::check_each(each).map_err(|source| Error::Ports {
        path: path.to_owned(),
        source,
    })?;
    Ok(doc)
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Loads the file into `store` once (an error here is fatal: the operator pointed at a
/// missing or broken file), then watches it until `stop`.
pub async fn run(path: PathBuf, store: Store, stop: CancellationToken) -> Result<(), Error> {
    let mut last = stamp(&path);
    let doc = load(&path)?;
    info!(path = %path.display(), endpoints = doc.endpoints.len(), "endpoints file loaded");
    store.replace(Snapshot::new(doc.endpoints, true));
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(POLL) => {}
            }
            let now = stamp(&path);
            if now == last {
                continue;
            }
            last = now;
            match load(&path) {
                Ok(doc) => {
                    info!(path = %path.display(), endpoints = doc.endpoints.len(), "endpoints file reloaded");
                    store.replace(Snapshot::new(doc.endpoints, true));
                }
                Err(e) => {
                    warn!(error = %e, "endpoints file not reloaded; keeping the last good state")
                }
            }
        }
    });
    Ok(())
}
