//! The pure model: Kubernetes objects + this node -> what the dataplane must do.
//!
//! Everything kube-proxy decides (which Services are proxied, which endpoints count,
//! traffic policies, affinity, no-endpoint reject) is decided here, without I/O, so it
//! is unit-tested without root. See `../shared/reference/kube-proxy-contract.md`.

mod cidr;
mod compute;
mod endpoints;
mod render;
mod types;

pub use cidr::Cidr;
pub use compute::compute;
pub use render::render;
pub use types::*;

/// YAML fixture helpers shared with the planner's tests.
#[cfg(test)]
pub(crate) use compute::testutil;

#[cfg(test)]
mod external_tests;
