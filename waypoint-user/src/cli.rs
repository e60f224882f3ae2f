//! The operator tools: `waypoint resolve` (the split-horizon view of a service port, read
//! straight from the registry), `waypoint registry put|list|delete` (records by hand,
//! for workloads outside Kubernetes and for labs) and `waypoint prepare-node` (the node's
//! kernel settings a container cannot write).

use std::{io::Write as _, net::IpAddr};

use anyhow::Context as _;
use serde::Serialize;

use crate::{
    envoy,
    horizon::{self, Mode, Query, ServiceName},
    model::{check_ports, Endpoint, ServicePort},
    registry::{
        self,
        etcd::{self, Connector, TlsArgs},
        record,
    },
};

/// Where the tools read and write.
#[derive(Clone, Debug, clap::Args)]
pub struct Source {
    /// The registry: `file:PATH` or `etcd:URL[,URL...]`, as for `waypoint run`.
    #[arg(long, env = "WAYPOINT_REGISTRY")]
    pub registry: registry::Location,

    // --etcd-ca, --etcd-cert, --etcd-key.
    #[command(flatten)]
    pub etcd: TlsArgs,
}

impl Source {
    fn connector(&self) -> anyhow::Result<Connector> {
        match &self.registry {
            registry::Location::Etcd(urls) => Ok(Connector::new(urls.clone(), &self.etcd)?),
            registry::Location::File(p) => anyhow::bail!(
                "{} is a file registry: edit the file instead (registry put and delete need etcd:URL)",
                p.display()
            ),
        }
    }

    /// Every endpoint the registry holds now; skipped records are reported on stderr.
    async fn endpoints(&self) -> anyhow::Result<Vec<(String, Endpoint)>> {
        match &self.registry {
            registry::Location::File(p) => Ok(registry::file::load(p)?
                .endpoints
                .into_iter()
                .map(|e| (record::key(&e).unwrap_or_default(), e))
                .collect()),
            registry::Location::Etcd(_) => {
                let listing = etcd::snapshot(&self.connector()?)
                    .await
                    .context("listing the registry")?;
                for (key, skip) in &listing.skipped {
                    eprintln!("skipped {key}: {skip}");
                }
                Ok(listing.endpoints.into_iter().collect())
            }
        }
    }
}

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    Table,
    /// JSON for programs (the same document as the admin API's `/v1/resolve`).
    Json,
}

/// Who is looking: the split-horizon viewer of `resolve` and `envoy-config`.
#[derive(Clone, Debug, clap::Args)]
pub struct ViewerArgs {
    /// The viewer's cluster: whose horizon to show.
    #[arg(long, env = "WAYPOINT_CLUSTER", default_value = "local")]
    pub cluster: String,

    /// The viewer's node (with `--east-west-waypoint always`, pods there stay direct).
    #[arg(
        long,
        visible_alias = "node-name",
        env = "WAYPOINT_NODE_NAME",
        default_value = "local"
    )]
    pub node: String,

    /// The viewer's region (for locality priorities).
    #[arg(long, env = "WAYPOINT_REGION", default_value = "")]
    pub region: String,

    /// The viewer's zone (for locality priorities).
    #[arg(long, env = "WAYPOINT_ZONE", default_value = "")]
    pub zone: String,

    /// Split-horizon mode: `off`, `cross-cluster` or `always` (see `waypoint run --help`).
    #[arg(
        long,
        visible_alias = "mode",
        env = "WAYPOINT_EAST_WEST_WAYPOINT",
        value_enum,
        default_value = "off"
    )]
    pub east_west_waypoint: Mode,

    /// The mesh domain of structured SNIs.
    #[arg(long, env = "WAYPOINT_MESH_DOMAIN", default_value = "mesh.local")]
    pub mesh_domain: String,

    /// The port waypoints listen on at their node IP.
    #[arg(long, env = "WAYPOINT_TUNNEL_PORT", default_value_t = 15443)]
    pub tunnel_port: u16,

    /// The pods' inbound port.
    #[arg(long, env = "WAYPOINT_POD_PORT", default_value_t = 15008)]
    pub pod_port: u16,
}

impl ViewerArgs {
    /// The viewer these flags describe.
    pub fn viewer(&self) -> horizon::Viewer {
        horizon::Viewer {
            cluster: self.cluster.clone(),
            node: self.node.clone(),
            region: self.region.clone(),
            zone: self.zone.clone(),
            mode: self.east_west_waypoint,
            mesh_domain: self.mesh_domain.clone(),
            tunnel_port: self.tunnel_port,
            pod_port: self.pod_port,
        }
    }
}

/// `waypoint resolve`.
#[derive(Clone, Debug, clap::Args)]
pub struct ResolveArgs {
    /// The service port: `<service>.<namespace>:<port>`, e.g. `reviews.bookinfo:9080` (the
    /// Service's `port`; each target's SNI names the pod port behind it)
    /// (service and namespace are DNS-1123 labels).
    pub target: Query,

    // --registry and the etcd TLS flags.
    #[command(flatten)]
    pub source: Source,

    // --cluster, --node, --region, --zone, --east-west-waypoint, --mesh-domain,
    // --tunnel-port, --pod-port.
    #[command(flatten)]
    pub viewer: ViewerArgs,

    /// `table` or `json`.
    #[arg(long, short, value_enum, default_value = "table")]
    pub output: Output,
}

/// `waypoint envoy-config`.
#[derive(Clone, Debug, clap::Args)]
pub struct EnvoyConfigArgs {
    /// The service: `<service>.<namespace>`, e.g. `reviews.bookinfo` (DNS-1123 labels).
    #[arg(long)]
    pub service: ServiceName,

    /// The service port, e.g. `9080`.
    #[arg(long)]
    pub port: u16,

    // --registry and the etcd TLS flags.
    #[command(flatten)]
    pub source: Source,

    // --cluster, --node, --region, --zone, --east-west-waypoint (--mode), --mesh-domain,
    // --tunnel-port, --pod-port.
    #[command(flatten)]
    pub viewer: ViewerArgs,

    /// A source pod on this node: `VALUE=NAMESPACE/SERVICE_ACCOUNT`, where VALUE is what
    /// its connections carry in filter state under --source-key (e.g. its network
    /// namespace). Repeat for each source. Its certificate is the SDS secret named by its
    /// SPIFFE ID.
    #[arg(long = "source", required = true)]
    pub sources: Vec<envoy::Source>,

    /// The filter-state key the transport socket matcher reads to tell sources apart.
    #[arg(
        long,
        env = "WAYPOINT_ENVOY_SOURCE_KEY",
        default_value = "envoy.network.namespace"
    )]
    pub source_key: String,

    /// SPIFFE trust domain shared by the clusters.
    #[arg(long, env = "WAYPOINT_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,

    /// Name of the Envoy cluster serving SDS (the SPIRE agent); it must exist in the
    /// proxy's bootstrap.
    #[arg(
        long,
        env = "WAYPOINT_ENVOY_SDS_CLUSTER",
        default_value = "spire_agent"
    )]
    pub sds_cluster: String,

    /// Connect timeout of the outbound cluster. Above 1 s, TCP's first retransmission of
    /// a lost SYN, so that one lost SYN or SYN-ACK does not fail the connection.
    #[arg(long, value_parser = crate::config::parse_duration, default_value = "2s")]
    pub connect_timeout: std::time::Duration,
}

/// `waypoint registry ...`.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum RegistryCommand {
    /// Write one endpoint record, with no lease: it stays until `registry delete`.
    Put(Box<PutArgs>),
    /// List every record under the root (all clusters); a file registry lists its
    /// endpoints with the keys etcd would give them.
    List(ListArgs),
    /// Delete records by key (as `list` prints them), or every key under a prefix.
    Delete(DeleteArgs),
}

/// `waypoint registry put`.
#[derive(Clone, Debug, clap::Args)]
pub struct PutArgs {
    // --registry and the etcd TLS flags.
    #[command(flatten)]
    pub source: Source,

    /// The whole record as JSON (the fields of the file registry's endpoints, e.g.
    /// `{"service":"reviews","namespace":"bookinfo","cluster":"b","pod_ip":"10.2.0.7",
    /// "node_name":"b1","node_ip":"192.168.1.2","ports":[9080],"exported":true}`).
    /// Replaces the per-field flags.
    #[arg(long, conflicts_with_all = ["service", "namespace", "cluster", "pod_ip", "node"])]
    pub json: Option<String>,

    /// Service name.
    #[arg(long, required_unless_present = "json")]
    pub service: Option<String>,
    /// Namespace.
    #[arg(long, required_unless_present = "json")]
    pub namespace: Option<String>,
    /// The pod's cluster.
    #[arg(long, required_unless_present = "json")]
    pub cluster: Option<String>,
    /// The pod's IP.
    #[arg(long, required_unless_present = "json")]
    pub pod_ip: Option<IpAddr>,
    /// The pod's node.
    #[arg(long, required_unless_present = "json")]
    pub node: Option<String>,
    /// The node's IP, routable from other clusters.
    #[arg(long)]
    pub node_ip: Option<IpAddr>,
    /// The pod's name (default: its IP in the key).
    #[arg(long, default_value = "")]
    pub pod_name: String,
    /// Region.
    #[arg(long, default_value = "")]
    pub region: String,
    /// Zone.
    #[arg(long, default_value = "")]
    pub zone: String,
    /// Service account.
    #[arg(long, default_value = "")]
    pub service_account: String,
    /// A pod port that serves the service (repeat for several; none means any).
    #[arg(long = "port")]
    pub ports: Vec<u16>,
    /// A service port and the pod port it goes to, `PORT:TARGET` (e.g. `80:9080`; repeat
    /// for several). Without it, each --port is a service port of the same number.
    #[arg(long = "service-port", value_parser = parse_service_port)]
    pub service_ports: Vec<ServicePort>,
    /// Mark the pod not ready.
    #[arg(long)]
    pub not_ready: bool,
    /// Mark the service exported to other clusters.
    #[arg(long)]
    pub exported: bool,
}

impl PutArgs {
    fn endpoint(&self) -> anyhow::Result<Endpoint> {
        let ep = self.unchecked()?;
        check_ports(&ep.ports, &ep.service_ports)?;
        Ok(ep)
    }

    fn unchecked(&self) -> anyhow::Result<Endpoint> {
        if let Some(json) = &self.json {
            return serde_json::from_str(json).context("--json is not an endpoint record");
        }
        // clap enforces these unless --json is given.
        let need = |v: &Option<String>, flag: &str| {
            v.clone()
                .with_context(|| format!("--{flag} is required without --json"))
        };
        Ok(Endpoint {
            service: need(&self.service, "service")?,
            namespace: need(&self.namespace, "namespace")?,
            cluster: need(&self.cluster, "cluster")?,
            region: self.region.clone(),
            zone: self.zone.clone(),
            pod_ip: self.pod_ip.context("--pod-ip is required without --json")?,
            pod_name: self.pod_name.clone(),
            node_name: need(&self.node, "node")?,
            node_ip: self.node_ip,
            service_account: self.service_account.clone(),
            ports: self.ports.clone(),
            service_ports: self.service_ports.clone(),
            ready: !self.not_ready,
            exported: self.exported,
        })
    }
}

/// `PORT:TARGET`, both 1–65535.
fn parse_service_port(s: &str) -> Result<ServicePort, String> {
    let bad = || format!("{s:?} is not PORT:TARGET with ports 1-65535 (e.g. 80:9080)");
    let (port, target) = s.split_once(':').ok_or_else(bad)?;
    let number = |p: &str| p.parse::<u16>().ok().filter(|&n| n != 0).ok_or_else(bad);
    Ok(ServicePort {
        port: number(port)?,
        target_port: number(target)?,
    })
}

/// ` service_ports=[80:9080, …]` for the table, empty without any.
fn service_ports(ports: &[ServicePort]) -> String {
    if ports.is_empty() {
        return String::new();
    }
    let each: Vec<String> = ports
        .iter()
        .map(|p| format!("{}:{}", p.port, p.target_port))
        .collect();
    format!(" service_ports=[{}]", each.join(", "))
}

/// `waypoint registry list`.
#[derive(Clone, Debug, clap::Args)]
pub struct ListArgs {
    // --registry and the etcd TLS flags.
    #[command(flatten)]
    pub source: Source,

    /// `table` or `json`.
    #[arg(long, short, value_enum, default_value = "table")]
    pub output: Output,
}

/// `waypoint registry delete`.
#[derive(Clone, Debug, clap::Args)]
pub struct DeleteArgs {
    // --registry and the etcd TLS flags.
    #[command(flatten)]
    pub source: Source,

    /// Keys to delete, as `registry list` prints them (under /aether/v1/regions/).
    #[arg(required = true)]
    pub keys: Vec<String>,

    /// Delete every key under each given key prefix (e.g. a whole node's records).
    #[arg(long)]
    pub prefix: bool,
}

/// Runs `waypoint resolve`.
pub async fn resolve(args: ResolveArgs) -> anyhow::Result<()> {
    let endpoints = args.source.endpoints().await?;
    let viewer = args.viewer.viewer();
    let view = horizon::resolve(&viewer, &args.target, endpoints.iter().map(|(_, e)| e));
    let out = match args.output {
        Output::Table => view.table(),
        Output::Json => serde_json::to_string_pretty(&view)? + "\n",
    };
    std::io::stdout().write_all(out.as_bytes())?;
    Ok(())
}

/// Runs `waypoint envoy-config`: prints the Bootstrap JSON on stdout, what the view left
/// out on stderr.
pub async fn envoy_config(args: EnvoyConfigArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.port != 0, "--port must not be 0");
    let ServiceName { service, namespace } = args.service;
    let query = Query {
        service,
        namespace,
        port: args.port,
    };
    let endpoints: Vec<Endpoint> = args
        .source
        .endpoints()
        .await?
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    let config = envoy::Config {
        trust_domain: args.trust_domain,
        sds_cluster: args.sds_cluster,
        source_key: args.source_key,
        sources: args.sources,
        connect_timeout: args.connect_timeout,
    };
    let generated = envoy::generate(&config, &args.viewer.viewer(), &query, &endpoints)?;
    let left = &generated.view.left_out;
    if left.not_ready + left.not_exported + left.no_node_ip > 0 {
        eprintln!(
            "left out: not_ready={} not_exported={} no_node_ip={}",
            left.not_ready, left.not_exported, left.no_node_ip
        );
    }
    let out = serde_json::to_string_pretty(&generated.bootstrap)? + "\n";
    std::io::stdout().write_all(out.as_bytes())?;
    Ok(())
}

#[derive(Serialize)]
struct Listed<'a> {
    key: &'a str,
    #[serde(flatten)]
    endpoint: &'a Endpoint,
}

/// Runs `waypoint registry ...`.
pub async fn registry(cmd: RegistryCommand) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout();
    match cmd {
        RegistryCommand::Put(args) => {
            let ep = args.endpoint()?;
            let mut client = args.source.connector()?.connect().await?;
            let key = etcd::put(&mut client, &ep).await?;
            writeln!(stdout, "{key}")?;
        }
        RegistryCommand::List(args) => {
            // Either registry lists: the file's records get the keys etcd would give them.
            let endpoints = args.source.endpoints().await?;
            match args.output {
                Output::Json => {
                    let listed: Vec<Listed<'_>> = endpoints
                        .iter()
                        .map(|(key, endpoint)| Listed { key, endpoint })
                        .collect();
                    writeln!(stdout, "{}", serde_json::to_string_pretty(&listed)?)?;
                }
                Output::Table => {
                    for (key, e) in &endpoints {
                        let node_ip = e.node_ip.map(|i| i.to_string()).unwrap_or("-".into());
                        writeln!(
                            stdout,
                            "{key}  pod_ip={} node_ip={node_ip} ports={:?}{} ready={} exported={}",
                            e.pod_ip,
                            e.ports,
                            service_ports(&e.service_ports),
                            e.ready,
                            e.exported
                        )?;
                    }
                }
            }
        }
        RegistryCommand::Delete(args) => {
            let mut client = args.source.connector()?.connect().await?;
            let mut total = 0;
            for key in &args.keys {
                total += etcd::delete(&mut client, key, args.prefix).await?;
            }
            writeln!(stdout, "deleted {total}")?;
        }
    }
    Ok(())
}

/// Runs `waypoint prepare-node`: turns on `net.ipv4.tcp_migrate_req` in this network
/// namespace (the host's, for the host-network DaemonSet), which the daemon's container
/// cannot write (its /proc/sys is read-only) and without which a rolling update resets
/// the connections queued on the old daemon's listeners. A kernel without the setting
/// (before 5.14) is said, not an error: there is nothing to turn on.
pub fn prepare_node() -> anyhow::Result<()> {
    let mut stdout = std::io::stdout();
    match crate::sys::enable_request_migration() {
        Ok(true) => writeln!(stdout, "net.ipv4.tcp_migrate_req: turned on")?,
        Ok(false) => writeln!(stdout, "net.ipv4.tcp_migrate_req: already on")?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => writeln!(
            stdout,
            "net.ipv4.tcp_migrate_req: this kernel has none (Linux 5.14 added it); a \
             rolling update resets the connections queued on the old daemon's listeners"
        )?,
        Err(e) => {
            return Err(e).context(
                "turning on net.ipv4.tcp_migrate_req (/proc/sys/net/ipv4/tcp_migrate_req): \
                 run privileged, in the host network",
            )
        }
    }
    Ok(())
}
