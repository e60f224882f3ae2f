//! waypoint: an eBPF-accelerated per-node east-west waypoint for multi-cluster
//! service-mesh traffic. See docs/ARCHITECTURE.md for how the pieces fit.
#![deny(rust_2018_idioms)]

pub mod admin;
pub mod app;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod envoy;
pub mod horizon;
pub mod kubernetes;
pub mod metrics;
pub mod migrate;
pub mod model;
pub mod registry;
pub mod router;
pub mod sni;
pub mod store;
mod sys;
pub mod telemetry;
pub mod workers;
