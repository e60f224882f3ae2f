//! Where endpoints come from. `--registry file:PATH` reads a static file (watched for
//! changes): the single-node default. `--registry etcd:URL[,URL...]` mirrors the shared
//! etcd registry and registers this node's own endpoints (docs/REGISTRY.md).

pub mod etcd;
pub mod file;
pub mod local;
pub mod metrics;
pub mod record;

use std::path::PathBuf;

/// A registry location given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A JSON file of endpoints, re-read when it changes.
    File(PathBuf),
    /// An etcd cluster: its client URLs (`http://` or, with `--etcd-ca`, `https://`).
    Etcd(Vec<String>),
}

/// Errors of the registry location syntax.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    /// Not one of the known schemes.
    #[error("unknown registry {0:?}: expected file:PATH or etcd:http://HOST:2379[,http://HOST2:2379...]")]
    Unknown(String),
}

impl std::str::FromStr for Location {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some(("file", path)) if !path.is_empty() => Ok(Location::File(PathBuf::from(path))),
            Some(("etcd", urls)) => {
                let urls: Vec<String> = urls.split(',').map(|u| u.trim().to_owned()).collect();
                let valid = |u: &String| {
                    u.strip_prefix("http://")
                        .or_else(|| u.strip_prefix("https://"))
                        .is_some_and(|rest| !rest.is_empty())
                };
                if urls.iter().all(valid) {
                    Ok(Location::Etcd(urls))
                } else {
                    Err(ParseError::Unknown(s.to_owned()))
                }
            }
            _ => Err(ParseError::Unknown(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_locations() {
        assert_eq!(
            "file:/etc/waypoint/endpoints.json".parse(),
            Ok(Location::File("/etc/waypoint/endpoints.json".into()))
        );
        assert!("file:".parse::<Location>().is_err());
        assert_eq!(
            "etcd:http://10.0.0.1:2379,https://etcd-2:2379".parse(),
            Ok(Location::Etcd(vec![
                "http://10.0.0.1:2379".into(),
                "https://etcd-2:2379".into()
            ]))
        );
        assert!("etcd:".parse::<Location>().is_err());
        assert!("etcd:10.0.0.1:2379".parse::<Location>().is_err());
        assert!("etcd:http://a:2379,".parse::<Location>().is_err());
        assert!("zk:foo".parse::<Location>().is_err());
        assert!("/plain/path".parse::<Location>().is_err());
    }
}
