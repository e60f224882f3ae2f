//! Two clusters end to end on one machine: network namespaces for an underlay, nodes and
//! pods (both clusters on the same pod CIDR, as two default Flannel clusters), a real etcd,
//! the real `waypoint` daemon on every node, and pods that speak mTLS with SPIFFE SVIDs
//! from one test CA; in IPv4 or in IPv6 (see `topology`). The integration test
//! (`tests/two_clusters.rs`) and the demo
//! (`waypoint-e2e demo`, `cargo xtask demo`) both drive it. Needs root.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod client;
pub mod demo;
pub mod netns;
pub mod pki;
pub mod process;
pub mod tls;
pub mod topology;
pub mod world;
