//! Runs the whole daemon in-process (`App::start`) against echo "pods" on loopback
//! addresses, and reads its metrics over HTTP like Prometheus would.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::atomic::{AtomicU64, Ordering},
};

use clap::Parser as _;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};
use waypoint::{app::App, config::Config};

#[derive(clap::Parser)]
struct Args {
    #[command(flatten)]
    config: Config,
}

/// A temporary endpoints file, removed on drop.
pub struct EndpointsFile(pub PathBuf);

impl Drop for EndpointsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl EndpointsFile {
    pub fn new(endpoints: serde_json::Value) -> EndpointsFile {
        static N: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "waypoint-test-{}-{}.json",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::write(
            &path,
            serde_json::json!({ "endpoints": endpoints }).to_string(),
        )
        .unwrap();
        EndpointsFile(path)
    }
}

/// One endpoint record for the file registry.
pub fn endpoint(svc: &str, ip: &str, node: &str, exported: bool, ready: bool) -> serde_json::Value {
    serde_json::json!({
        "service": svc, "namespace": "bookinfo", "cluster": "a",
        "pod_ip": ip, "node_name": node, "ports": [8080],
        "exported": exported, "ready": ready,
    })
}

/// Starts the daemon with `args` (the tunnel and admin addresses default to ephemeral
/// loopback ports; the registry to `file`).
pub async fn start(file: &EndpointsFile, args: &[&str]) -> App {
    try_start(file, args).await.unwrap()
}

/// Where test daemons pin their rewrite programs, rather than the default that a node's
/// daemon uses.
pub const TEST_PIN_DIR: &str = "/sys/fs/bpf/waypoint-test";

/// The pin directory of the daemons spawned on `ip` (see [`spawn_on`]): one per test, as
/// each test has addresses of its own. A daemon of the same test started later adopts
/// what a killed one left; a later run of the test adopts what this one left (its live
/// connections' ports held until their idle timeout, their ended ones removed at once).
pub fn test_pin_dir(ip: std::net::IpAddr) -> String {
    // bpffs refuses names with a dot.
    format!("{TEST_PIN_DIR}/{}", ip.to_string().replace(['.', ':'], "_"))
}

/// Removes what the daemons pinned under `pin_dir` and left (their programs, with their
/// netlink filters on kernels without TCX, which removing the directory would leave),
/// then the directory.
pub fn remove_pins(pin_dir: &str) {
    waypoint::dataplane::pins::remove_unowned(pin_dir.as_ref());
    let _ = std::fs::remove_dir_all(pin_dir);
}

/// [`start`], returning its error.
pub async fn try_start(file: &EndpointsFile, args: &[&str]) -> anyhow::Result<App> {
    let registry = format!("file:{}", file.0.display());
    // The test binary's own: no daemon of another test run adopts its rewrite programs,
    // nor it theirs (see `test_pin_dir`).
    let pin_dir = format!("{}/{}", TEST_PIN_DIR, std::process::id());
    let defaults = [
        ("--tunnel-addr", "127.0.0.1:0"),
        ("--admin-addr", "127.0.0.1:0"),
        ("--cluster", "a"),
        ("--node-name", "n1"),
        ("--registry", registry.as_str()),
        ("--pin-dir", pin_dir.as_str()),
    ];
    let mut argv = vec!["waypoint"];
    for (flag, value) in defaults {
        if !args.contains(&flag) {
            argv.extend([flag, value]);
        }
    }
    argv.extend_from_slice(args);
    // Daemon logs only when asked for: they go straight to stderr, past the capture.
    if std::env::var_os("RUST_LOG").is_some() {
        waypoint::telemetry::init();
    }
    let config = Args::try_parse_from(argv).unwrap().config;
    App::start(config).await
}

/// An echo "pod" at `ip:port`: writes back every byte, then half-closes after EOF.
pub async fn echo_pod(ip: &str, port: u16) -> JoinHandle<()> {
    let addr = SocketAddr::new(ip.parse::<IpAddr>().unwrap(), port);
    let listener = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    })
}

/// Scrapes /metrics.
pub async fn metrics(admin: SocketAddr) -> String {
    let mut s = TcpStream::connect(admin).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The value of one sample, e.g. `waypoint_connections_rejected_total{reason="not_tls"}`;
/// 0 when absent.
pub async fn sample(admin: SocketAddr, series: &str) -> f64 {
    let text = metrics(admin).await;
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// GET a path on the admin server, returning the status code.
pub async fn status(admin: SocketAddr, path: &str) -> u16 {
    get(admin, path).await.0
}

/// GET a path on the admin server, returning the status code and the body.
pub async fn get(admin: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(admin).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The real `waypoint` binary in its own process (its own fd table and limits); killed on
/// drop.
pub struct Process {
    child: std::process::Child,
    pub tunnel_addr: SocketAddr,
    pub admin_addr: SocketAddr,
}

impl Process {
    /// The daemon's resident memory in KiB (`VmRSS`, from /proc).
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    /// The daemon's open descriptors, from /proc.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }

    /// SIGTERM, as the kubelet sends, and waits (at most 60 s) for the drain and the exit.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the waypoint process did not exit within 60 s of SIGTERM"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary with the tunnel and admin servers on `ip` (ports 15443 and 15021),
/// and waits until it is ready.
pub async fn spawn(file: &EndpointsFile, ip: &str, args: &[&str]) -> Process {
    spawn_with_fd_limit(file, ip, args, None).await
}

/// [`spawn`], with RLIMIT_NOFILE (soft and hard) set to `nofile` in the child.
pub async fn spawn_with_fd_limit(
    file: &EndpointsFile,
    ip: &str,
    args: &[&str],
    nofile: Option<u64>,
) -> Process {
    let child = Child {
        nofile,
        ..Child::default()
    };
    spawn_as(file, ip, args, child).await
}

/// [`spawn`], with the child set up as `child` says.
pub async fn spawn_as(file: &EndpointsFile, ip: &str, args: &[&str], child: Child) -> Process {
    let tunnel_addr: SocketAddr = format!("{ip}:15443").parse().unwrap();
    let admin_addr: SocketAddr = format!("{ip}:15021").parse().unwrap();
    spawn_on(file, tunnel_addr, admin_addr, args, child).await
}

/// How a daemon's process is set up before it runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Child {
    /// RLIMIT_NOFILE, soft and hard.
    pub nofile: Option<u64>,
    /// Without CAP_BPF and CAP_SYS_ADMIN (dropped from the bounding set, so that root's
    /// exec does not get them): no eBPF program loads.
    pub without_bpf: bool,
}

/// [`spawn`] on these addresses. A second process on the same tunnel address shares it
/// (SO_REUSEPORT), as in a rolling update; its own admin address tells when it is ready.
pub async fn spawn_on(
    file: &EndpointsFile,
    tunnel_addr: SocketAddr,
    admin_addr: SocketAddr,
    args: &[&str],
    setup: Child,
) -> Process {
    use std::os::unix::process::CommandExt as _;
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_waypoint"));
    // SAFETY: setrlimit and prctl are async-signal-safe, and the closure touches nothing
    // else.
    unsafe {
        command.pre_exec(move || {
            if let Some(n) = setup.nofile {
                let lim = libc::rlimit {
                    rlim_cur: n,
                    rlim_max: n,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if setup.without_bpf {
                for cap in [caps::Capability::CAP_BPF, caps::Capability::CAP_SYS_ADMIN] {
                    if libc::prctl(
                        libc::PR_CAPBSET_DROP,
                        libc::c_ulong::from(cap.index()),
                        0,
                        0,
                        0,
                    ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
            }
            Ok(())
        });
    }
    let pin_dir = test_pin_dir(tunnel_addr.ip());
    let pin_args = if args.contains(&"--pin-dir") {
        Vec::new()
    } else {
        vec!["--pin-dir", pin_dir.as_str()]
    };
    let child = command
        .arg("run")
        .args(["--tunnel-addr", &tunnel_addr.to_string()])
        .args(["--admin-addr", &admin_addr.to_string()])
        .args(["--cluster", "a", "--node-name", "n1"])
        .arg("--registry")
        .arg(format!("file:{}", file.0.display()))
        .args(args)
        .args(pin_args)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .spawn()
        .unwrap();
    let p = Process {
        child,
        tunnel_addr,
        admin_addr,
    };
    let ready = async {
        loop {
            if let Ok(mut s) = TcpStream::connect(admin_addr).await {
                let _ = s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n").await;
                let mut out = String::new();
                let _ = s.read_to_string(&mut out).await;
                if out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200") {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), ready)
        .await
        .expect("the waypoint process became ready");
    p
}
