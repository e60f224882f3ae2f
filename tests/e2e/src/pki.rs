//! The test PKI: one CA for the shared trust domain, and an SVID per service account:
//! `spiffe://mesh.local/ns/<ns>/sa/<sa>` as a URI SAN, plus the DNS SAN
//! `*.<sa>.<ns>.mesh.local` so that an ordinary verifier accepts the structured SNI of
//! that service. Only pods get keys; the waypoints get nothing.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::topology::MESH_DOMAIN;

/// Errors of generating or writing the PKI.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// rcgen refused.
    #[error("generating {what}: {source}")]
    Generate {
        /// Which certificate.
        what: String,
        /// The cause.
        source: rcgen::Error,
    },
    /// Writing a file failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The SPIFFE ID of a service account.
pub fn spiffe_id(namespace: &str, service_account: &str) -> String {
    format!("spiffe://{MESH_DOMAIN}/ns/{namespace}/sa/{service_account}")
}

/// The DNS SAN of a service's certificate: matches every structured SNI of the service.
pub fn service_dns(namespace: &str, service: &str) -> String {
    format!("*.{service}.{namespace}.{MESH_DOMAIN}")
}

/// Where an identity's files are.
#[derive(Clone, Debug)]
pub struct Files {
    /// The CA certificate (PEM).
    pub ca: PathBuf,
    /// The identity's certificate (PEM).
    pub cert: PathBuf,
    /// The identity's private key (PEM).
    pub key: PathBuf,
}

/// A generated PKI on disk.
#[derive(Clone, Debug)]
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// Generates the CA and one SVID per `(namespace, service_account)` into `dir`.
    pub fn generate(dir: &Path, identities: &[(&str, &str)]) -> Result<Pki, Error> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Write {
            path: dir.to_owned(),
            source,
        })?;
        let gen = |what: &str| {
            let what = what.to_owned();
            move |source| Error::Generate { what, source }
        };
        let ca_key = KeyPair::generate().map_err(gen("the CA key"))?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(gen("the CA"))?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, format!("{MESH_DOMAIN} test CA"));
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).map_err(gen("the CA"))?;
        let pki = Pki {
            dir: dir.to_owned(),
        };
        pki.write("ca.pem", &ca_cert.pem())?;
        let issuer = Issuer::new(ca, ca_key);
        for (ns, sa) in identities {
            let id = spiffe_id(ns, sa);
            let what = format!("the SVID of {id}");
            let mut p = CertificateParams::new(vec![service_dns(ns, sa)]).map_err(gen(&what))?;
            p.distinguished_name.push(DnType::CommonName, id.clone());
            p.subject_alt_names
                .push(SanType::URI(id.clone().try_into().map_err(gen(&what))?));
            // Every pod is a server (its inbound) and a client (its outbound).
            p.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            let key = KeyPair::generate().map_err(gen(&what))?;
            let cert = p.signed_by(&key, &issuer).map_err(gen(&what))?;
            pki.write(&format!("{sa}.pem"), &cert.pem())?;
            pki.write(&format!("{sa}.key"), &key.serialize_pem())?;
        }
        Ok(pki)
    }

    /// Opens an existing PKI directory.
    pub fn open(dir: &Path) -> Pki {
        Pki {
            dir: dir.to_owned(),
        }
    }

    fn write(&self, name: &str, pem: &str) -> Result<(), Error> {
        let path = self.dir.join(name);
        std::fs::write(&path, pem).map_err(|source| Error::Write { path, source })
    }

    /// The files of service account `sa`.
    pub fn files(&self, sa: &str) -> Files {
        Files {
            ca: self.dir.join("ca.pem"),
            cert: self.dir.join(format!("{sa}.pem")),
            key: self.dir.join(format!("{sa}.key")),
        }
    }
}
