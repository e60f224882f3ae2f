//! A private etcd for one test: its own loopback ports and a temporary data directory;
//! killed (and the directory removed) on drop. It can be killed and restarted mid-test on
//! the same data directory, like a crashed and rebooted etcd server.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A running (or killed) etcd.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

fn free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

impl Etcd {
    /// Starts etcd on 127.0.0.1:(23000 + 20 * slot) (+1 for peers), or the next free pair
    /// above it, and waits until it answers.
    pub async fn start(slot: u16) -> Etcd {
        let mut port = 23000 + 20 * slot;
        while !(free(port) && free(port + 1)) {
            port += 2;
        }
        let dir = std::env::temp_dir().join(format!(
            "waypoint-etcd-{}-{slot}-{port}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut etcd = Etcd {
            child: None,
            dir,
            client_port: port,
            peer_port: port + 1,
        };
        etcd.spawn().await;
        etcd
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// `etcd:URL`, for `--registry`.
    pub fn location(&self) -> String {
        format!("etcd:{}", self.url())
    }

    async fn spawn(&mut self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.join("etcd.log")).unwrap();
        let child = Command::new("/usr/bin/etcd")
            .args(["--name", "default", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting /usr/bin/etcd (Debian etcd-server; run deploy/setup.sh)");
        self.child = Some(child);
        self.wait_healthy().await;
    }

    async fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
                panic!("etcd exited: {status}\n{log}");
            }
            let opts = etcd_client::ConnectOptions::new()
                .with_connect_timeout(Duration::from_millis(500))
                .with_timeout(Duration::from_secs(1));
            if let Ok(mut c) = etcd_client::Client::connect([self.url()], Some(opts)).await {
                if c.get("health", None).await.is_ok() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd at {} never became healthy",
                self.url()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A client.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.url()], None)
            .await
            .unwrap()
    }

    /// SIGKILLs etcd (the data directory stays).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same data directory and ports.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
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
