//! Sources turn the world into Kubernetes objects (Services, EndpointSlices, this Node).
//!
//! A source knows nothing about BPF or about kube-proxy's rules: it reads, validates and
//! reports objects as [`SourceEvent`]s. The agent keeps the store, coalesces bursts of
//! events into one sync, and recomputes only the Services an event touched.
//! - [`manifests`]: a directory of YAML/JSON, rescanned every 100 ms;
//! - [`kube`]: the Kubernetes API through kube-rs watchers.

pub mod compact;
mod defs;
pub mod kube;
pub mod lenient;
pub mod manifests;
pub mod store;
mod wire;

pub use compact::{ServiceLite, SliceLite};
use k8s_openapi::api::core::v1::Node;
pub use store::{ObjectKey, Objects};

/// What a source tells the agent, in order, over an unbounded channel.
// Each event is moved once through the channel; boxing the objects would only add an
// allocation per event.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum SourceEvent {
    /// The complete set of Services (initial list, relist after 410 Gone or a dropped
    /// watch, or a manifests rescan). Replaces every Service the agent knew. Compact,
    /// like the slices.
    ServicesReset(Vec<ServiceLite>),
    /// The complete set of EndpointSlices, likewise (compact: see [`compact`]).
    SlicesReset(Vec<SliceLite>),
    ServiceApplied(ServiceLite),
    ServiceDeleted(ObjectKey),
    SliceApplied(SliceLite),
    SliceDeleted(ObjectKey),
    /// This node's Node object; `None` when it does not exist (yet).
    Node(Option<Box<Node>>),
    /// Every initial list has arrived: the agent may do its first full sync.
    Synced,
    /// The source lost (false) or regained (true) its view of the world, for health
    /// reporting; the last programmed state stays in the kernel either way.
    Connected(bool),
    /// How many watched objects cannot be read now (each was reported when it turned
    /// unreadable); the `ferry_source_errors` gauge. Sent when the count changes.
    Unreadable(usize),
    /// Events that reach the same sync: one manifests scan's changes (a file's Service
    /// and its slices), so a Service is never programmed without endpoints that arrived
    /// with it.
    Batch(Vec<SourceEvent>),
}
