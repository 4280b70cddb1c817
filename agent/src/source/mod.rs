//! Sources turn the world into Kubernetes objects (Services and EndpointSlices).
//!
//! A source knows nothing about BPF or about kube-proxy's rules: it only reads,
//! validates and merges objects into an [`Objects`] snapshot that the model consumes.
//! Today the only source is a directory of manifests ([`manifests`]).

pub mod manifests;
pub mod store;

pub use store::{ObjectKey, Objects};
