//! The routers under test: no router (direct), the waypoint daemon with each dataplane,
//! nginx (`stream` + `ssl_preread`, one worker) and HAProxy (`mode tcp`, `req.ssl_sni`,
//! one thread). Each runs as a non-daemon child in its own process group, with its config
//! generated into the run's temp directory, and routes the echo and sink server names to
//! the benchmark's servers.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use crate::{
    cli::Figure,
    hello,
    procs::{self, Group},
    servers::{Servers, ANSWER},
};

/// How long a router may take to start routing.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Errors starting a router.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Writing a config file failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// No free port.
    #[error("finding a free loopback port: {0}")]
    Port(std::io::Error),
    /// The child could not be started.
    #[error(transparent)]
    Spawn(#[from] procs::Error),
    /// The child never routed a probe connection.
    #[error("{name} did not route a probe connection within {secs} s: {detail}; its log: {log}")]
    NotReady {
        /// The router.
        name: String,
        /// The deadline.
        secs: u64,
        /// The last probe's error or the exit status.
        detail: String,
        /// Where its stderr went.
        log: String,
    },
    /// Building a hello failed.
    #[error(transparent)]
    Hello(#[from] hello::Error),
}

/// Which router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Direct,
    Ebpf,
    Splice,
    Copy,
    Nginx,
    Haproxy,
    /// The waypoint's eBPF dataplane with `--rewrite-splice`: the TC program rewrites
    /// connections' packet headers on lo (every bench connection is same-host).
    EbpfRewrite,
    /// The waypoint as it runs with no dataplane flag (`--dataplane auto`): on a kernel
    /// with the 2023 sockmap fixes, ebpf-rewrite's paths. Not in [`Kind::ALL`] (the
    /// bench's ebpf-rewrite row is the same path); the soak runs it by name.
    Auto,
    /// Experiment, not a product: `experiments/tcp-rewrite` (a Python SNI proxy whose
    /// connections get their packet headers rewritten at lo's TC ingress). Only
    /// with `--only tc-rewrite`; see docs/PERFORMANCE.md.
    TcRewrite,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Direct,
        Kind::Ebpf,
        Kind::EbpfRewrite,
        Kind::Splice,
        Kind::Copy,
        Kind::Nginx,
        Kind::Haproxy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::Ebpf => "ebpf",
            Kind::Splice => "splice",
            Kind::Copy => "copy",
            Kind::Nginx => "nginx",
            Kind::Haproxy => "haproxy",
            Kind::EbpfRewrite => "ebpf-rewrite",
            Kind::Auto => "auto",
            Kind::TcRewrite => "tc-rewrite",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .chain([Kind::Auto, Kind::TcRewrite])
            .find(|k| k.name() == s)
    }

    /// Whether `figure` measures this router. The experiment's setup, churn and memory
    /// would measure its Python proxy, not the splice, so it has none of them.
    pub fn measures(self, figure: Figure) -> bool {
        self != Kind::TcRewrite || !matches!(figure, Figure::Setup | Figure::Churn | Figure::Memory)
    }

    /// A waypoint dataplane (the rows the goals apply to).
    pub fn is_waypoint(self) -> bool {
        matches!(
            self,
            Kind::Ebpf | Kind::EbpfRewrite | Kind::Auto | Kind::Splice | Kind::Copy
        )
    }
}

/// Where a client connects and what it sends first.
#[derive(Clone)]
pub struct Target {
    pub addr: SocketAddr,
    pub hello: Vec<u8>,
}

/// What every router is configured with.
#[derive(Clone, Copy)]
pub struct Setup<'a> {
    pub dir: &'a Path,
    pub servers: &'a Servers,
    pub waypoint_bin: &'a Path,
    /// Connections the router must accept (sizes nginx's and HAProxy's tables and the
    /// waypoint's limit).
    pub max_connections: usize,
    /// The routers' RLIMIT_NOFILE (inherited): nginx and HAProxy refuse configs that
    /// need more.
    pub nofile: u64,
    /// The waypoint's `RUST_LOG` (`WAYPOINT_BENCH_LOG` overrides it).
    pub log_filter: &'a str,
    /// More arguments for the waypoint (after the ones the bench sets).
    pub waypoint_args: &'a [&'a str],
}

/// A running router (or none, for direct).
pub struct Router {
    pub kind: Kind,
    pub echo: Target,
    pub sink: Target,
    group: Option<Group>,
    /// The waypoint's admin address.
    pub admin: Option<SocketAddr>,
    /// Where the router's output goes (none for direct).
    pub log: Option<PathBuf>,
}

impl Router {
    /// Starts `kind` and waits until it routes a probe connection.
    pub fn start(kind: Kind, setup: &Setup<'_>) -> Result<Router, Error> {
        Router::start_at(kind, setup, None, 0)
    }

    /// Starts instance `instance` of `kind` listening on `listen` (default: a free
    /// loopback port). Several waypoints can share one address (SO_REUSEPORT).
    pub fn start_at(
        kind: Kind,
        setup: &Setup<'_>,
        listen: Option<SocketAddr>,
        instance: usize,
    ) -> Result<Router, Error> {
        let echo_hello = hello::with_sni(hello::ECHO_SNI)?;
        let sink_hello = hello::with_sni(hello::SINK_SNI)?;
        if kind == Kind::Direct {
            return Ok(Router {
                kind,
                echo: Target {
                    addr: setup.servers.echo_addr(),
                    hello: echo_hello,
                },
                sink: Target {
                    addr: setup.servers.sink_addr(),
                    hello: sink_hello,
                },
                group: None,
                admin: None,
                log: None,
            });
        }
        let listen = match listen {
            Some(l) => l,
            None => SocketAddr::new(IpAddr::from([127, 0, 0, 1]), free_port()?),
        };
        let log = setup.dir.join(format!("{}-{instance}.log", kind.name()));
        let (cmd, admin) = match kind {
            Kind::Nginx => (nginx(setup, listen)?, None),
            Kind::Haproxy => (haproxy(setup, listen)?, None),
            Kind::TcRewrite => (tc_rewrite(setup, listen), None),
            _ => {
                let admin = SocketAddr::new(listen.ip(), free_port()?);
                (waypoint(kind, setup, listen, admin)?, Some(admin))
            }
        };
        let name = format!(
            "waypoint-bench-{}-{}-{instance}",
            std::process::id(),
            kind.name()
        );
        let cgroup = match procs::Cgroup::create(&name) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!(
                    "{}: no cgroup of its own ({e}); it shares the benchmark's",
                    kind.name()
                );
                None
            }
        };
        let group = Group::spawn(cmd, &log, cgroup)?;
        let mut r = Router {
            kind,
            echo: Target {
                addr: listen,
                hello: echo_hello,
            },
            sink: Target {
                addr: listen,
                hello: sink_hello,
            },
            group: Some(group),
            admin,
            log: Some(log.clone()),
        };
        r.wait_ready(&log)?;
        Ok(r)
    }

    /// The router's process group leader, if it is a process.
    pub fn pid(&self) -> Option<i32> {
        self.group.as_ref().map(Group::pid)
    }

    fn wait_ready(&mut self, log: &Path) -> Result<(), Error> {
        let start = Instant::now();
        let mut last = String::from("no attempt");
        while start.elapsed() < READY_TIMEOUT {
            if let Some(status) = self.group.as_mut().and_then(Group::exited) {
                last = format!("exited with {status}");
                break;
            }
            // A waypoint sharing its address with others: the probe could land on a
            // sibling, so its own readiness decides.
            if let Some(admin) = self.admin {
                if !ready(admin) {
                    last = "/readyz not 200 yet".into();
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            }
            match probe(&self.echo) {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(Error::NotReady {
            name: self.kind.name().into(),
            secs: READY_TIMEOUT.as_secs(),
            detail: last,
            log: log.display().to_string(),
        })
    }

    /// Whether the router's process is still running.
    pub fn alive(&mut self) -> bool {
        self.group.as_mut().is_some_and(|g| g.exited().is_none())
    }

    /// Stops the router (also done on drop).
    pub fn stop(&mut self) {
        if let Some(g) = self.group.as_mut() {
            g.stop();
        }
        if self.kind == Kind::TcRewrite {
            // The group dies by SIGKILL, so the proxy cannot detach its program itself.
            let _ = Command::new("tc")
                .args(["filter", "del", "dev", "lo", "ingress", "prio", "7"])
                .output();
        }
    }
}

/// One connection through the router: hello + one byte, expect the answer and the echo.
pub fn probe(t: &Target) -> std::io::Result<()> {
    let mut c = TcpStream::connect_timeout(&t.addr, Duration::from_secs(1))?;
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut first = t.hello.clone();
    first.push(0x42);
    c.write_all(&first)?;
    let mut back = [0u8; 2];
    c.read_exact(&mut back)?;
    if back != [ANSWER, 0x42] {
        return Err(std::io::Error::other(format!("unexpected answer {back:?}")));
    }
    Ok(())
}

/// Whether the waypoint's admin server answers /readyz with 200.
fn ready(admin: SocketAddr) -> bool {
    let Ok(mut c) = TcpStream::connect_timeout(&admin, Duration::from_secs(1)) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
    if c.write_all(b"GET /readyz HTTP/1.0\r\nHost: x\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    c.read_exact(&mut head).is_ok() && head.ends_with(b" 200")
}

/// A loopback port nobody listens on right now (the child binds it a moment later).
fn free_port() -> Result<u16, Error> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(Error::Port)?;
    Ok(l.local_addr().map_err(Error::Port)?.port())
}

fn write(path: PathBuf, text: &str) -> Result<PathBuf, Error> {
    std::fs::write(&path, text).map_err(|source| Error::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

fn waypoint(
    kind: Kind,
    setup: &Setup<'_>,
    listen: SocketAddr,
    admin: SocketAddr,
) -> Result<Command, Error> {
    let s = setup.servers;
    let endpoint = |service: &str, ip: &IpAddr| {
        serde_json::json!({
            "service": service, "namespace": hello::NAMESPACE, "cluster": "bench",
            "pod_ip": ip, "node_name": "bench-node", "ports": [hello::SERVICE_PORT],
            "exported": true, "ready": true,
        })
    };
    let mut endpoints: Vec<_> = s
        .echo_ips
        .iter()
        .map(|ip| endpoint(hello::ECHO_SERVICE, ip))
        .collect();
    endpoints.push(endpoint(hello::SINK_SERVICE, &s.sink_ip));
    let file = write(
        setup.dir.join(format!("endpoints-{}.json", kind.name())),
        &serde_json::json!({ "endpoints": endpoints }).to_string(),
    )?;
    let mut cmd = Command::new(setup.waypoint_bin);
    cmd.arg("run")
        .args(["--tunnel-addr", &listen.to_string()])
        .args(["--admin-addr", &admin.to_string()])
        .arg("--registry")
        .arg(format!("file:{}", file.display()))
        .args(["--cluster", "bench", "--node-name", "bench-node"])
        .args(["--pod-port", &s.port.to_string()])
        .args([
            "--dataplane",
            if kind == Kind::EbpfRewrite {
                "ebpf"
            } else {
                kind.name()
            },
        ])
        .args(["--max-connections", &setup.max_connections.to_string()])
        // Twice the connections (two sockets each) plus room.
        .args([
            "--max-sockets",
            &(2 * setup.max_connections + 1024).max(262_144).to_string(),
        ])
        .args(if kind == Kind::EbpfRewrite {
            &["--rewrite-splice"][..]
        } else {
            &[]
        })
        .args(setup.waypoint_args)
        .env(
            "RUST_LOG",
            std::env::var("WAYPOINT_BENCH_LOG").unwrap_or_else(|_| setup.log_filter.into()),
        );
    Ok(cmd)
}

fn tc_rewrite(setup: &Setup<'_>, listen: SocketAddr) -> Command {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/tcp-rewrite/proxy.py");
    let mut cmd = Command::new("python3");
    cmd.arg(script)
        .arg(listen.to_string())
        .arg(setup.servers.echo_addr().to_string())
        .arg(setup.servers.sink_addr().to_string());
    cmd
}

fn nginx(setup: &Setup<'_>, listen: SocketAddr) -> Result<Command, Error> {
    let s = setup.servers;
    let dir = setup.dir.display();
    // Two file descriptors per proxied connection, plus the listener and logs.
    let nofile = setup.nofile as usize;
    let conns = (2 * setup.max_connections + 1024).min(nofile.saturating_sub(64));
    let conf = format!(
        r#"# Generated by waypoint-bench: one worker, SNI routing with ssl_preread.
load_module /usr/lib/nginx/modules/ngx_stream_module.so;
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{
    worker_connections {conns};
}}
stream {{
    map $ssl_preread_server_name $upstream {{
        {echo_sni} {echo};
        {sink_sni} {sink};
        default 127.0.0.1:9;
    }}
    server {{
        listen {listen} backlog=4096;
        ssl_preread on;
        proxy_pass $upstream;
        proxy_connect_timeout 5s;
        proxy_timeout 1h;
    }}
}}
"#,
        nofile = nofile,
        echo_sni = hello::ECHO_SNI,
        sink_sni = hello::SINK_SNI,
        echo = s.echo_addr(),
        sink = s.sink_addr(),
    );
    let path = write(setup.dir.join("nginx.conf"), &conf)?;
    let mut cmd = Command::new("nginx");
    cmd.arg("-e")
        .arg(setup.dir.join("nginx-error.log"))
        .arg("-p")
        .arg(setup.dir)
        .arg("-c")
        .arg(path);
    Ok(cmd)
}

fn haproxy(setup: &Setup<'_>, listen: SocketAddr) -> Result<Command, Error> {
    let s = setup.servers;
    let conf = format!(
        r#"# Generated by waypoint-bench: one thread, SNI routing from the ClientHello.
global
    nbthread 1
    maxconn {max}

defaults
    mode tcp
    maxconn {max}
    timeout connect 5s
    timeout client 1h
    timeout server 1h

frontend tunnel
    bind {listen}
    tcp-request inspect-delay 5s
    tcp-request content accept if {{ req.ssl_hello_type 1 }}
    use_backend echo if {{ req.ssl_sni -i {echo_sni} }}
    use_backend sink if {{ req.ssl_sni -i {sink_sni} }}

backend echo
    server echo {echo}

backend sink
    server sink {sink}
"#,
        // HAProxy needs about two descriptors per connection and refuses to start when
        // the file limit cannot hold maxconn.
        max = (setup.max_connections + 1024).min((setup.nofile as usize).saturating_sub(200) / 2),
        echo_sni = hello::ECHO_SNI,
        sink_sni = hello::SINK_SNI,
        echo = s.echo_addr(),
        sink = s.sink_addr(),
    );
    let path = write(setup.dir.join("haproxy.cfg"), &conf)?;
    let mut cmd = Command::new("haproxy");
    // -db: stay in the foreground, no daemon.
    cmd.arg("-db").arg("-f").arg(path);
    Ok(cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_experiment_is_only_run_by_name_and_without_setup_churn_or_memory() {
        assert_eq!(Kind::parse("tc-rewrite"), Some(Kind::TcRewrite));
        assert!(!Kind::ALL.contains(&Kind::TcRewrite));
        assert!(!Kind::TcRewrite.is_waypoint());
        for f in Figure::ALL {
            let expected = !matches!(f, Figure::Setup | Figure::Churn | Figure::Memory);
            assert_eq!(Kind::TcRewrite.measures(f), expected, "{f:?}");
            assert!(Kind::Ebpf.measures(f), "{f:?}");
        }
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.name()), Some(k));
        }
    }
}
