//! ferry's agent as a library: the binary in `main.rs` is a thin CLI over it.
//!
//! - [`source`] turns the world (a manifests directory) into Kubernetes objects;
//! - [`model`] decides, purely, what the dataplane must do (kube-proxy's contract);
//! - [`dataplane`] is the only code that touches BPF maps and programs;
//! - [`agent`] runs the sync loop; [`http`] serves health and metrics; [`list`] renders
//!   the live maps for `ferry list`; [`explain`] answers `ferry explain`; [`takeover`]
//!   removes the rules a kube-proxy left behind;
//! - [`podnet`] is the pod network of `--pod-network`: CNI configuration, routes between
//!   nodes, masquerade.

pub mod agent;
pub mod btree;
pub mod dataplane;
pub mod engine;
pub mod explain;
pub mod healthcheck;
pub mod http;
pub mod list;
pub mod model;
pub mod node;
pub mod podnet;
pub mod residency;
pub mod source;
pub mod status;
pub mod takeover;
