//! Registry records for the etcd test binaries (`tests/registry_etcd.rs`,
//! `tests/registry_etcd_tls.rs`): the endpoints they write, the node they register as, and
//! the store's convergence on what etcd holds.

use std::{collections::BTreeMap, future::Future, time::Duration};

use waypoint::{
    model::Endpoint,
    registry::{
        etcd::{LocalEndpoint, NodeIdentity},
        record,
    },
    store::Store,
};

/// How long a store may take to hold what etcd holds.
pub const WAIT: Duration = Duration::from_secs(20);

/// A `reviews.bookinfo` endpoint on port 9080. Its node IP is distinct per cluster and pod:
/// 192.168.<cluster letter>.<pod IP's last octet>.
pub fn endpoint(cluster: &str, node: &str, pod: &str, ip: &str) -> Endpoint {
    Endpoint {
        service: "reviews".into(),
        namespace: "bookinfo".into(),
        cluster: cluster.into(),
        region: "eu".into(),
        zone: format!("eu-{cluster}"),
        pod_ip: ip.parse().unwrap(),
        pod_name: pod.into(),
        node_name: node.into(),
        node_ip: Some(
            format!(
                "192.168.{}.{}",
                cluster.as_bytes()[0] - b'a' + 1,
                ip.rsplit('.').next().unwrap()
            )
            .parse()
            .unwrap(),
        ),
        service_account: "reviews".into(),
        ports: vec![9080],
        service_ports: Vec::new(),
        ready: true,
        exported: true,
    }
}

/// A `reviews.bookinfo` pod of this node, as the registrar lists it.
pub fn local(pod: &str, ip: &str) -> LocalEndpoint {
    LocalEndpoint {
        service: "reviews".into(),
        namespace: "bookinfo".into(),
        pod_ip: ip.parse().unwrap(),
        pod_name: pod.into(),
        service_account: "reviews".into(),
        ports: vec![9080],
        service_ports: Vec::new(),
        ready: true,
        exported: true,
    }
}

/// The node a registrar registers as.
pub fn identity(cluster: &str, node: &str, node_ip: Option<&str>) -> NodeIdentity {
    NodeIdentity {
        cluster: cluster.into(),
        node: node.into(),
        node_ip: node_ip.map(|i| i.parse().unwrap()),
        region: "eu".into(),
        zone: format!("eu-{cluster}"),
    }
}

/// The store's content keyed like etcd.
pub fn content(store: &Store) -> BTreeMap<String, Endpoint> {
    store
        .snapshot()
        .all()
        .map(|e| (record::key(e).unwrap(), Endpoint::clone(e)))
        .collect()
}

pub fn has_pod(store: &Store, pod: &str) -> bool {
    store.snapshot().all().any(|e| e.pod_name == pod)
}

/// Waits until the store holds exactly what `etcd_content` reads from etcd (and, unless
/// `empty` allows it, something); how long that took.
pub async fn converges<F, Fut>(store: &Store, etcd_content: F, empty: bool) -> Duration
where
    F: Fn() -> Fut,
    Fut: Future<Output = BTreeMap<String, Endpoint>>,
{
    let start = std::time::Instant::now();
    loop {
        let want = etcd_content().await;
        if (empty || !want.is_empty()) && content(store) == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < WAIT,
            "store never converged:\nstore {:#?}\netcd {:#?}",
            content(store).keys(),
            want.keys()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
