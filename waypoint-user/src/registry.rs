//! Where endpoints come from. `--registry file:PATH` reads a static file (watched for
//! changes); the etcd registry comes next.

pub mod file;

use std::path::PathBuf;

/// A registry location given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A JSON file of endpoints, re-read when it changes.
    File(PathBuf),
}

/// Errors of the registry location syntax.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParseError {
    /// Not one of the known schemes.
    #[error("unknown registry {0:?}: expected file:PATH")]
    Unknown(String),
}

impl std::str::FromStr for Location {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some(("file", path)) if !path.is_empty() => Ok(Location::File(PathBuf::from(path))),
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
        assert!("zk:foo".parse::<Location>().is_err());
        assert!("/plain/path".parse::<Location>().is_err());
    }
}
