//! Test harness: worlds of network namespaces, a cgroup and a bpffs directory, with the
//! real `ferry agent` binary and real clients. Everything a world creates is removed
//! when it is dropped, also when the test fails.
//!
//! Kernel tests never skip: when root, BPF, netns or cgroup v2 is missing they fail
//! with the reason.

pub mod cluster;
pub mod fakeapi;
pub mod manifests;
pub mod world;

pub use cluster::*;
pub use manifests::*;
pub use world::*;
