//! A private etcd for one test: its own loopback ports and a temporary data directory;
//! killed (and the directory removed) on drop. It can be killed and restarted mid-test on
//! the same data directory, like a crashed and rebooted etcd server.
//!
//! Three shapes: one plain member ([`Etcd::start`]), one member serving clients over
//! mutual TLS ([`Etcd::start_tls`]), and a three-member cluster, plain or TLS
//! ([`Etcd::cluster`]), whose members can be killed and restarted one at a time. The TLS
//! material is generated with rcgen into the data directory at start ([`Pki`]).

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Whether clients talk TLS to etcd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Security {
    /// `http://`.
    Plain,
    /// `https://`, and etcd requires a client certificate signed by [`Pki::ca`]
    /// (`--client-cert-auth --trusted-ca-file`).
    MutualTls,
}

/// The TLS files of a [`Security::MutualTls`] etcd (PEM).
#[derive(Clone, Debug)]
pub struct Pki {
    /// The CA that signed etcd's server certificate and the client certificate.
    pub ca: PathBuf,
    /// A client certificate etcd accepts.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// Another CA, which signed nothing this etcd serves.
    pub other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

fn ca(name: &str) -> (CertificateParams, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (params, key)
}

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    name: &str,
    sans: &[&str],
    usages: Vec<ExtendedKeyUsagePurpose>,
) -> (String, String) {
    let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
    let mut params = CertificateParams::new(sans).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = usages;
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    /// Generates a CA, a server certificate for 127.0.0.1 and localhost, a client
    /// certificate, and an unrelated CA, into `dir`.
    fn generate(dir: &Path) -> Pki {
        let write = |name: &str, pem: &str| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let (params, key) = ca("waypoint test etcd CA");
        let ca_path = write("ca.pem", &params.self_signed(&key).unwrap().pem());
        let issuer = Issuer::new(params, key);
        // ClientAuth too: etcd 3.4's gRPC gateway dials etcd's own gRPC server with the
        // server certificate, and --client-cert-auth then checks it as a client's.
        let (cert, key) = leaf(
            &issuer,
            "etcd",
            &["127.0.0.1", "localhost"],
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let server_cert = write("server.pem", &cert);
        let server_key = write("server-key.pem", &key);
        let (cert, key) = leaf(
            &issuer,
            "waypoint-node",
            &[],
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        );
        let client_cert = write("client.pem", &cert);
        let client_key = write("client-key.pem", &key);
        let (params, key) = ca("some other CA");
        let other_ca = write("other-ca.pem", &params.self_signed(&key).unwrap().pem());
        Pki {
            ca: ca_path,
            client_cert,
            client_key,
            other_ca,
            server_cert,
            server_key,
        }
    }

    /// etcd_client's TLS options: the CA and the client certificate.
    pub fn client_options(&self) -> etcd_client::TlsOptions {
        let read = |p: &Path| std::fs::read(p).unwrap();
        etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read(&self.ca)))
            .identity(etcd_client::Identity::from_pem(
                read(&self.client_cert),
                read(&self.client_key),
            ))
    }
}

/// One etcd process.
struct Member {
    name: String,
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
}

/// A running (or killed) etcd: one member or a cluster.
pub struct Etcd {
    members: Vec<Member>,
    dir: PathBuf,
    security: Security,
    pki: Option<Pki>,
    /// `--initial-cluster`: every member's peer URL.
    initial_cluster: String,
    token: String,
}

fn free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Members of [`Etcd::cluster`].
pub const CLUSTER_SIZE: usize = 3;

impl Etcd {
    /// Starts a plain etcd on 127.0.0.1:(23000 + 20 * slot) (+1 for peers), or the next
    /// free pair above it, and waits until it answers.
    pub async fn start(slot: u16) -> Etcd {
        Etcd::launch(slot, 1, Security::Plain).await
    }

    /// [`Etcd::start`], serving clients over mutual TLS.
    pub async fn start_tls(slot: u16) -> Etcd {
        Etcd::launch(slot, 1, Security::MutualTls).await
    }

    /// Starts a cluster of [`CLUSTER_SIZE`] members (peers talk plain HTTP: the client
    /// side is what is under test), and waits until every member answers.
    pub async fn cluster(slot: u16, security: Security) -> Etcd {
        Etcd::launch(slot, CLUSTER_SIZE, security).await
    }

    async fn launch(slot: u16, size: usize, security: Security) -> Etcd {
        let ports = 2 * size as u16;
        let mut base = 23000 + 20 * slot;
        while !(base..base + ports).all(free) {
            base += ports;
        }
        let token = format!("waypoint-etcd-{}-{slot}-{base}", std::process::id());
        let dir = std::env::temp_dir().join(&token);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let pki = (security == Security::MutualTls).then(|| Pki::generate(&dir));
        let members: Vec<Member> = (0..size as u16)
            .map(|i| Member {
                name: format!("m{i}"),
                child: None,
                client_port: base + 2 * i,
                peer_port: base + 2 * i + 1,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut etcd = Etcd {
            members,
            dir,
            security,
            pki,
            initial_cluster,
            token,
        };
        // All members first: none answers before a quorum is up.
        for i in 0..size {
            etcd.spawn(i);
        }
        for i in 0..size {
            etcd.wait_healthy(i).await;
        }
        etcd
    }

    fn scheme(&self) -> &'static str {
        match self.security {
            Security::Plain => "http",
            Security::MutualTls => "https",
        }
    }

    /// Member `i`'s client URL.
    pub fn member_url(&self, i: usize) -> String {
        format!(
            "{}://127.0.0.1:{}",
            self.scheme(),
            self.members[i].client_port
        )
    }

    /// The first member's client URL.
    pub fn url(&self) -> String {
        self.member_url(0)
    }

    /// Every member's client URL, killed ones included.
    pub fn urls(&self) -> Vec<String> {
        (0..self.members.len())
            .map(|i| self.member_url(i))
            .collect()
    }

    /// `etcd:URL[,URL...]` with every member, for `--registry`.
    pub fn location(&self) -> String {
        format!("etcd:{}", self.urls().join(","))
    }

    /// The TLS files (panics on a plain etcd).
    pub fn pki(&self) -> &Pki {
        self.pki.as_ref().expect("an etcd with Security::MutualTls")
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("{}.log", self.members[i].name))
    }

    fn spawn(&mut self, i: usize) {
        let client = self.member_url(i);
        let m = &self.members[i];
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let log = std::fs::File::create(self.log(i)).unwrap();
        let mut cmd = Command::new("/usr/bin/etcd");
        cmd.args(["--name", &m.name, "--data-dir"])
            .arg(self.dir.join(&m.name))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-token", &self.token])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(pki) = &self.pki {
            cmd.arg("--cert-file")
                .arg(&pki.server_cert)
                .arg("--key-file")
                .arg(&pki.server_key)
                .arg("--trusted-ca-file")
                .arg(&pki.ca)
                .arg("--client-cert-auth");
        }
        let child = cmd
            .spawn()
            .expect("starting /usr/bin/etcd (Debian etcd-server; run deploy/setup.sh)");
        self.members[i].child = Some(child);
    }

    /// Connect options with a request timeout of `timeout`.
    fn options(&self, timeout: Duration) -> etcd_client::ConnectOptions {
        let opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(500))
            .with_timeout(timeout);
        match &self.pki {
            Some(pki) => opts.with_tls(pki.client_options()),
            None => opts,
        }
    }

    async fn wait_healthy(&mut self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let child = self.members[i].child.as_mut();
            if let Some(Ok(Some(status))) = child.map(|c| c.try_wait()) {
                let log = std::fs::read_to_string(self.log(i)).unwrap_or_default();
                panic!("etcd member {i} exited: {status}\n{log}");
            }
            let url = self.member_url(i);
            if let Ok(mut c) =
                etcd_client::Client::connect([&url], Some(self.options(Duration::from_secs(2))))
                    .await
            {
                // A linearizable read: answered only once the member has a leader.
                if c.get("health", None).await.is_ok() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd at {url} never became healthy"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A client of the members that are running (with the client certificate on a TLS
    /// etcd): the tests' own view of etcd, independent of the code under test.
    pub async fn client(&self) -> etcd_client::Client {
        let live: Vec<String> = (0..self.members.len())
            .filter(|&i| self.members[i].child.is_some())
            .map(|i| self.member_url(i))
            .collect();
        // Generous: on a loaded machine the tests' own requests must not be what fails.
        etcd_client::Client::connect(live, Some(self.options(Duration::from_secs(10))))
            .await
            .unwrap()
    }

    fn stop(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILLs member `i` of a cluster (its data directory stays), then waits until the
    /// others answer a linearizable read: they have a leader again if `i` was it, so a
    /// test's own writes do not fail on the election.
    pub async fn kill_member(&mut self, i: usize) {
        self.stop(i);
        for j in 0..self.members.len() {
            if self.members[j].child.is_some() {
                self.wait_healthy(j).await;
            }
        }
    }

    /// Starts member `i` again on the same data directory and ports, and waits until it
    /// answers.
    pub async fn restart_member(&mut self, i: usize) {
        self.stop(i);
        self.spawn(i);
        self.wait_healthy(i).await;
    }

    /// SIGKILLs every member (the data directories stay).
    pub fn kill(&mut self) {
        for i in 0..self.members.len() {
            self.stop(i);
        }
    }

    /// Starts every member again on the same data directories and ports.
    pub async fn restart(&mut self) {
        self.kill();
        for i in 0..self.members.len() {
            self.spawn(i);
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after `timeout`. Returns
/// how long it took.
pub async fn eventually(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    loop {
        if cond() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
