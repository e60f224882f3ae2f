//! mTLS as the mesh's pods do it: the server requires a client certificate from the CA;
//! the client verifies the chain and the service's DNS SAN, and pins the server's SPIFFE
//! ID (the URI SAN), whatever SNI it sent to get routed.

use std::{path::Path, sync::Arc};

use rustls::{
    client::{
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
        WebPkiServerVerifier,
    },
    crypto::CryptoProvider,
    server::WebPkiClientVerifier,
    ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme,
};
use rustls_pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use crate::pki::Files;

/// Errors of building TLS configurations.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A PEM file could not be read.
    #[error("reading {path}: {source}")]
    Pem {
        /// The file.
        path: String,
        /// The cause.
        source: rustls_pki_types::pem::Error,
    },
    /// rustls refused the configuration.
    #[error("building the TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The verifier could not be built.
    #[error("building the certificate verifier: {0}")]
    Verifier(String),
    /// The name to verify is not a DNS name.
    #[error("{0:?} is not a valid DNS name")]
    Name(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let pem = |source| Error::Pem {
        path: path.display().to_string(),
        source,
    };
    CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, Error> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| Error::Pem {
        path: path.display().to_string(),
        source,
    })
}

fn roots(ca: &Path) -> Result<Arc<RootCertStore>, Error> {
    let mut roots = RootCertStore::empty();
    for c in certs(ca)? {
        roots.add(c)?;
    }
    Ok(Arc::new(roots))
}

/// The SPIFFE IDs (`spiffe://` URI SANs) of a DER certificate.
pub fn spiffe_ids(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) if u.starts_with("spiffe://") => {
                Some((*u).to_owned())
            }
            _ => None,
        })
        .collect()
}

/// The first SPIFFE ID of the first certificate, or an empty string.
pub fn peer_id(chain: Option<&[CertificateDer<'_>]>) -> String {
    chain
        .and_then(|c| c.first())
        .and_then(|c| spiffe_ids(c).into_iter().next())
        .unwrap_or_default()
}

/// A pod's inbound: its SVID, and a client certificate from the CA required.
pub fn server_config(files: &Files) -> Result<ServerConfig, Error> {
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(&files.ca)?, provider())
        .build()
        .map_err(|e| Error::Verifier(e.to_string()))?;
    Ok(ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(&files.cert)?, key(&files.key)?)?)
}

/// A source: presents its SVID; accepts only a server whose chain leads to the CA, whose
/// DNS SAN covers `verify_name` and whose SPIFFE ID is `expect_id`.
pub fn client_config(
    files: &Files,
    verify_name: &str,
    expect_id: &str,
) -> Result<ClientConfig, Error> {
    let inner = WebPkiServerVerifier::builder_with_provider(roots(&files.ca)?, provider())
        .build()
        .map_err(|e| Error::Verifier(e.to_string()))?;
    let name = ServerName::try_from(verify_name.to_owned())
        .map_err(|_| Error::Name(verify_name.to_owned()))?;
    let verifier = Arc::new(PinnedSpiffe {
        inner,
        name,
        expect: expect_id.to_owned(),
    });
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(certs(&files.cert)?, key(&files.key)?)?)
}

/// Verifies as WebPKI does for a fixed name, then pins the SPIFFE ID. The SNI on the wire
/// is a routing key for the waypoint (or a bare port for a direct dial), not the identity
/// the source expects, so the name checked is the service's, not the SNI.
#[derive(Debug)]
struct PinnedSpiffe {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
    expect: String,
}

impl ServerCertVerifier for PinnedSpiffe {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)?;
        let ids = spiffe_ids(end_entity);
        if !ids.contains(&self.expect) {
            return Err(rustls::Error::General(format!(
                "server SPIFFE ID {ids:?} is not the expected {}",
                self.expect
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The SPIFFE ID of the first certificate in a PEM file.
pub fn cert_id(path: &Path) -> Result<String, Error> {
    Ok(peer_id(Some(&certs(path)?)))
}
