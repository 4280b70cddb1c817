//! The pod network fast path's maps (`ferry-podnet.bpf.o`): pod CIDR tries, the pods'
//! host veths and per-program counters.

/// `FERRY_PODNET_DEST4/6` value: a pod CIDR of this node.
pub const DEST_LOCAL: u32 = 1;
/// `FERRY_PODNET_DEST4/6` value: a pod CIDR of another node.
pub const DEST_REMOTE: u32 = 2;

/// `FERRY_PODNET_COUNTERS` slot: packets `ferry_podnet_from_pod` forwarded.
pub const PODNET_FROM_POD: u32 = 0;
/// `FERRY_PODNET_COUNTERS` slot: packets `ferry_podnet_to_pod` forwarded.
pub const PODNET_TO_POD: u32 = 1;
pub const PODNET_COUNTERS_LEN: u32 = 2;
