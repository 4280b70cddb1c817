//! The Gardener networking extension for type `ferry`. It runs in the seed, serves the
//! `Network` resources of shoots with `spec.networking.type: ferry`, and deploys ferry into
//! each shoot through a `ManagedResource`. See `docs/gardener.md`.
//!
//! Pure parts first, one concern each, with the I/O in `controller` only:
//! `types` (what is read and written), `config` (ferry's providerConfig), `decide` (who
//! routes Services, which IP families), `health` (the Network's health condition),
//! `render` (the shoot manifests from
//! `deploy/ferry.yaml`), `managed` (the Secret and ManagedResource), `operation` (which
//! operation a Network asks for) and `status` (the status patch); `controller` holds the
//! kube-rs loop, the health loop and the heartbeat; `leader` the leader election.

pub mod config;
pub mod controller;
pub mod decide;
pub mod health;
pub mod leader;
pub mod managed;
pub mod operation;
pub mod render;
pub mod status;
pub mod types;
