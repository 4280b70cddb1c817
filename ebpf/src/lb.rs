//! Frontend lookup and backend selection, shared by every hook.

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_ktime_get_ns},
};
use aya_log_ebpf::warn;
use ferry_common::{
    Addr, addr_from_v4_be,
    lb::{
        AFFINITY_KIND_CLIENT, AFFINITY_KIND_SOCKET, AffinityKey, AffinityValue, BACKEND_F_LOCAL,
        BACKEND_F_TERMINATING, Backend, MAX_BACKENDS_PER_SERVICE, MemberKey, SVC_F_AFFINITY,
        SVC_F_DROP, SVC_F_LOCAL_POLICY, SVC_F_TERMINATING_FALLBACK, ServiceKey,
    },
    metrics::{
        COUNT_AFFINITY_FULL, COUNT_AFFINITY_HIT, COUNT_BACKEND_MISSING, COUNT_DROP_NO_LOCAL,
        COUNT_REJECT_NO_ENDPOINTS,
    },
};

use crate::maps::{AFFINITY, BACKENDS, MEMBERS, SERVICES, count};

/// How long an unconnected UDP socket keeps its backend without traffic (kube-proxy
/// relies on nf_conntrack's UDP timeout, 30 s by default).
const UDP_STICKY_NS: u64 = 30 * 1_000_000_000;

pub(crate) enum Verdict {
    /// Not a Service frontend (or a write is in flight): leave the socket alone.
    Pass,
    /// Translate to this backend address and port (network byte order); `svc_id`
    /// identifies the ServicePort.
    Forward { addr: Addr, port: u16, svc_id: u32 },
    /// No endpoint at all: refuse.
    Reject,
    /// Local traffic policy with no local endpoint: drop.
    Drop,
}

/// Picks a backend for a Service frontend. `sticky_socket` is the socket cookie when the
/// caller wants per-socket stickiness (unconnected UDP). The helpers that only affinity
/// needs (network namespace cookie, clock) run only for a frontend that has it.
#[inline(always)]
pub(crate) fn select<C: EbpfContext>(
    ctx: &C,
    addr: Addr,
    port: u16,
    proto: u8,
    scope: u8,
    sticky_socket: Option<u64>,
) -> Verdict {
    let mut key = ServiceKey {
        addr,
        port,
        slot: 0,
        proto,
        scope,
        _pad: [0; 2],
    };
    // SAFETY: values are plain data; a concurrent update can at worst give a stale copy.
    let svc = match unsafe { SERVICES.get(&key) } {
        Some(v) => *v,
        None => return Verdict::Pass,
    };
    if svc.count == 0 {
        if svc.flags & SVC_F_DROP != 0 {
            count(COUNT_DROP_NO_LOCAL);
            return Verdict::Drop;
        }
        count(COUNT_REJECT_NO_ENDPOINTS);
        return Verdict::Reject;
    }
    let affinity_key = if svc.flags & SVC_F_AFFINITY != 0 {
        Some((
            AffinityKey {
                // SAFETY: valid for cgroup sock_addr programs (5.7+). One cookie per
                // network namespace: one per pod, one for the host.
                client: unsafe { bpf_get_netns_cookie(ctx.as_ptr()) },
                svc_id: svc.svc_id,
                kind: AFFINITY_KIND_CLIENT,
            },
            svc.affinity_timeout_s as u64 * 1_000_000_000,
        ))
    } else {
        sticky_socket.map(|cookie| {
            (
                AffinityKey {
                    client: cookie,
                    svc_id: svc.svc_id,
                    kind: AFFINITY_KIND_SOCKET,
                },
                UDP_STICKY_NS,
            )
        })
    };

    // SAFETY: helper without preconditions; 0 where nothing remembers a backend.
    let now = match affinity_key {
        Some(_) => unsafe { bpf_ktime_get_ns() },
        None => 0,
    };
    if let Some((akey, timeout_ns)) = affinity_key {
        if let Some(backend) = remembered_backend(&akey, svc.svc_id, svc.flags, now, timeout_ns) {
            count(COUNT_AFFINITY_HIT);
            return Verdict::Forward {
                addr: backend.addr,
                port: backend.port,
                svc_id: svc.svc_id,
            };
        }
    }

    let n = if svc.count > MAX_BACKENDS_PER_SERVICE {
        MAX_BACKENDS_PER_SERVICE
    } else {
        svc.count
    };
    // SAFETY: helper without preconditions.
    let r = unsafe { bpf_get_prandom_u32() };
    key.slot = (r % n as u32) as u16 + 1;
    // A miss below means the agent published a count before its slots or backends, a
    // bug worth a log line (this is the miss path, never taken per connection normally).
    let slot = match unsafe { SERVICES.get(&key) } {
        Some(v) => *v,
        None => {
            count(COUNT_BACKEND_MISSING);
            warn!(
                ctx,
                "ferry: service id {} slot {} missing", svc.svc_id, key.slot
            );
            return Verdict::Pass;
        }
    };
    let backend_id = slot.backend_id;
    // The common case: an IPv4 backend copied into its slot, no backend lookup.
    let (addr, port) = if let Some((ip, port)) = slot.inline_v4() {
        (addr_from_v4_be(ip), port)
    } else {
        match unsafe { BACKENDS.get(&backend_id) } {
            Some(b) => (b.addr, b.port),
            None => {
                count(COUNT_BACKEND_MISSING);
                warn!(
                    ctx,
                    "ferry: service id {} backend {} missing", svc.svc_id, backend_id
                );
                return Verdict::Pass;
            }
        }
    };
    if let Some((akey, _)) = affinity_key {
        let value = AffinityValue {
            last_used_ns: now,
            backend_id,
            _pad: 0,
        };
        if AFFINITY.insert(&akey, &value, 0).is_err() {
            count(COUNT_AFFINITY_FULL);
        }
    }
    Verdict::Forward {
        addr,
        port,
        svc_id: svc.svc_id,
    }
}

/// The backend an affinity or stickiness entry points at, if the entry is fresh and the
/// backend still belongs to this frontend's set. Refreshes the entry's timestamp.
#[inline(always)]
fn remembered_backend(
    akey: &AffinityKey,
    svc_id: u32,
    svc_flags: u16,
    now: u64,
    timeout_ns: u64,
) -> Option<Backend> {
    let entry = AFFINITY.get_ptr_mut(akey)?;
    // SAFETY: pointer from a successful lookup; LRU entries stay valid for this program run.
    let value = unsafe { &mut *entry };
    remembered(value, svc_id, svc_flags, now, timeout_ns)
}

/// The backend of an affinity entry (`value`, from any affinity map), if the entry is
/// fresh and its backend still fits the frontend `svc_id`/`svc_flags`; refreshes the
/// entry then. Shared by the socket hooks and the tc path, so that both apply one rule.
#[inline(always)]
pub(crate) fn remembered(
    value: &mut AffinityValue,
    svc_id: u32,
    svc_flags: u16,
    now: u64,
    timeout_ns: u64,
) -> Option<Backend> {
    if now.wrapping_sub(value.last_used_ns) > timeout_ns {
        return None;
    }
    let member = MemberKey {
        svc_id,
        backend_id: value.backend_id,
    };
    // SAFETY: read-only lookup of plain data.
    unsafe { MEMBERS.get(&member) }?;
    // SAFETY: as above.
    let backend = unsafe { BACKENDS.get(&value.backend_id) }?;
    // MEMBERS is per ServicePort, but its frontends' sets can differ: a Local ClusterIP
    // next to a cluster-wide NodePort or externalIP, a terminating fallback next to ready
    // endpoints. A backend remembered through another frontend must fit this one's set.
    if svc_flags & SVC_F_LOCAL_POLICY != 0 && backend.flags & BACKEND_F_LOCAL == 0 {
        return None;
    }
    if backend.flags & BACKEND_F_TERMINATING != 0 && svc_flags & SVC_F_TERMINATING_FALLBACK == 0 {
        return None;
    }
    value.last_used_ns = now;
    Some(*backend)
}
