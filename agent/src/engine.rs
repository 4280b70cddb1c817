//! The agent's view of the world and its incremental desired state.
//!
//! [`Store`] applies [`SourceEvent`]s and says which Services they touched. [`Engine`]
//! recomputes the model for exactly those Services (with their EndpointSlices) and
//! yields the ServicePort changes the dataplane must plan. Bursts of events between two
//! syncs collapse into one set of dirty Services.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::{core::v1::Node, discovery::v1::EndpointSlice};

use crate::{
    model::{
        self, FrontendKind, HealthCheck, NodeInfo, Problem, Protocol, Scope, ServicePortId,
        ServicePortState, Skip,
    },
    source::{ObjectKey, ServiceLite, SliceLite, SourceEvent, compact::Name},
};

const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Which Services need recomputing.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dirty {
    pub services: BTreeSet<ObjectKey>,
    /// Something every Service depends on changed (the node's zone, its addresses).
    pub all: bool,
}

impl Dirty {
    pub fn is_empty(&self) -> bool {
        !self.all && self.services.is_empty()
    }
}

/// The Service an EndpointSlice belongs to (same namespace, `kubernetes.io/service-name`).
fn owner_of(slice: &SliceLite) -> Option<ObjectKey> {
    let name = slice.label_value(SERVICE_NAME_LABEL)?;
    Some(ObjectKey::new(slice.namespace.clone(), name.clone()))
}

/// Gives a slice's `kubernetes.io/service-name` label its Service's stored name string.
fn share_owner_name(slice: &mut SliceLite, owner: &ObjectKey) {
    for (k, v) in slice.labels.iter_mut() {
        if *k == SERVICE_NAME_LABEL && *v == owner.name {
            *v = owner.name.clone();
        }
    }
}

/// The objects of the source, in ordered maps: a hash table is sized to the power of two
/// above its entries (65,536 buckets for 30,000), a B-tree built from a sorted list has
/// full nodes, and a Service's slices are a range of one set instead of a table of lists.
#[derive(Debug, Default)]
pub struct Store {
    services: BTreeMap<ObjectKey, Box<ServiceLite>>,
    /// Boxed, like the Services: a B-tree node holds 11 values whole.
    slices: BTreeMap<ObjectKey, Box<SliceLite>>,
    /// (Service, slice name) of every slice that names a Service (a slice is in its
    /// Service's namespace): a Service's slices are the range that starts at its key.
    by_service: BTreeSet<(ObjectKey, Name)>,
    /// Slices that name no Service (reported, never programmed).
    orphans: BTreeSet<ObjectKey>,
    /// One string per namespace, shared by every object in it.
    namespaces: BTreeSet<Name>,
    /// One string per node name, shared by the endpoints on that node (a string per
    /// endpoint was 3.7 MiB at 30000x4).
    node_names: BTreeSet<Name>,
    node: Option<Node>,
}

impl Store {
    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    /// Applies one event, adding what it touched to `dirty`.
    pub fn apply(&mut self, event: SourceEvent, dirty: &mut Dirty) {
        match event {
            SourceEvent::ServicesReset(list) => self.reset_services(list, dirty),
            SourceEvent::SlicesReset(list) => self.reset_slices(list, dirty),
            SourceEvent::ServiceApplied(svc) => self.put_service(svc, dirty),
            SourceEvent::ServiceDeleted(k) => {
                if self.services.remove(&k).is_some() {
                    dirty.services.insert(k);
                }
            }
            SourceEvent::SliceApplied(slice) => self.put_slice(slice, dirty),
            SourceEvent::SliceDeleted(k) => self.remove_slice(&k, dirty),
            SourceEvent::Node(node) => {
                let node = node.map(|n| *n);
                if zone_of(node.as_ref()) != zone_of(self.node.as_ref()) {
                    dirty.all = true;
                }
                self.node = node;
            }
            SourceEvent::Batch(events) => {
                for ev in events {
                    self.apply(ev, dirty);
                }
            }
            SourceEvent::Synced | SourceEvent::Connected(_) | SourceEvent::Unreadable(_) => {}
        }
    }

    /// The shared string of namespace `ns`.
    fn intern(&mut self, ns: &Name) -> Name {
        match self.namespaces.get(ns) {
            Some(shared) => shared.clone(),
            None => {
                self.namespaces.insert(ns.clone());
                ns.clone()
            }
        }
    }

    /// Forgets namespaces and node names no object uses any more.
    fn prune_namespaces(&mut self) {
        self.namespaces
            .retain(|ns| std::sync::Arc::strong_count(ns) > 1);
        self.node_names
            .retain(|n| std::sync::Arc::strong_count(n) > 1);
    }

    /// The slice with its namespace and its endpoints' node names shared.
    fn share_strings(&mut self, slice: &mut SliceLite) {
        slice.namespace = self.intern(&slice.namespace);
        for node in slice
            .endpoints
            .iter_mut()
            .filter_map(|e| e.node_name.as_mut())
        {
            match self.node_names.get(node) {
                Some(shared) => *node = shared.clone(),
                None => {
                    self.node_names.insert(node.clone());
                }
            }
        }
    }

    fn put_service(&mut self, mut svc: ServiceLite, dirty: &mut Dirty) {
        svc.namespace = self.intern(&svc.namespace);
        let k = svc.key();
        if self.services.get(&k).map(|b| &**b) != Some(&svc) {
            self.services.insert(k.clone(), Box::new(svc));
            dirty.services.insert(k);
        }
    }

    fn reset_services(&mut self, list: Vec<ServiceLite>, dirty: &mut Dirty) {
        // Collected from a list: sorted once, then built with full nodes.
        let next: BTreeMap<ObjectKey, Box<ServiceLite>> = list
            .into_iter()
            .map(|mut svc| {
                svc.namespace = self.intern(&svc.namespace);
                (svc.key(), Box::new(svc))
            })
            .collect();
        for (k, old) in &self.services {
            if next.get(k) != Some(old) {
                dirty.services.insert(k.clone());
            }
        }
        for k in next.keys() {
            if !self.services.contains_key(k) {
                dirty.services.insert(k.clone());
            }
        }
        self.services = next;
        self.prune_namespaces();
    }

    /// The Service's own key when it is stored: its names are shared, not copied.
    fn shared_key(&self, k: ObjectKey) -> ObjectKey {
        match self.services.get_key_value(&k) {
            Some((stored, _)) => stored.clone(),
            None => k,
        }
    }

    fn put_slice(&mut self, mut slice: SliceLite, dirty: &mut Dirty) {
        self.share_strings(&mut slice);
        let k = slice.key();
        if self.slices.get(&k).map(|s| &**s) == Some(&slice) {
            return;
        }
        self.remove_slice(&k, dirty);
        match owner_of(&slice) {
            Some(owner) => {
                let owner = self.shared_key(owner);
                share_owner_name(&mut slice, &owner);
                self.by_service.insert((owner.clone(), k.name.clone()));
                dirty.services.insert(owner);
            }
            None => {
                self.orphans.insert(k.clone());
            }
        }
        self.slices.insert(k, Box::new(slice));
    }

    fn remove_slice(&mut self, k: &ObjectKey, dirty: &mut Dirty) {
        let Some(old) = self.slices.remove(k) else {
            return;
        };
        self.orphans.remove(k);
        if let Some(owner) = owner_of(&old) {
            self.by_service.remove(&(owner.clone(), k.name.clone()));
            dirty.services.insert(owner);
        }
    }

    fn reset_slices(&mut self, list: Vec<SliceLite>, dirty: &mut Dirty) {
        let mut next: BTreeMap<ObjectKey, Box<SliceLite>> = list
            .into_iter()
            .map(|mut slice| {
                self.share_strings(&mut slice);
                (slice.key(), Box::new(slice))
            })
            .collect();
        // Both owners of a slice that changed are touched: it may have moved.
        for (k, old) in &self.slices {
            let new = next.get(k);
            if new != Some(old) {
                dirty.services.extend(owner_of(old));
                dirty.services.extend(new.and_then(|s| owner_of(s)));
            }
        }
        for (k, new) in &next {
            if !self.slices.contains_key(k) {
                dirty.services.extend(owner_of(new));
            }
        }
        // The index and the orphans are rebuilt from the new list, sorted once.
        let mut by_service = Vec::with_capacity(next.len());
        let mut orphans = Vec::new();
        for (k, slice) in next.iter_mut() {
            match owner_of(slice) {
                Some(owner) => {
                    let owner = self.shared_key(owner);
                    share_owner_name(slice, &owner);
                    by_service.push((owner, k.name.clone()));
                }
                None => orphans.push(k.clone()),
            }
        }
        self.by_service.clear();
        self.slices = next;
        self.by_service = by_service.into_iter().collect();
        self.orphans = orphans.into_iter().collect();
        self.prune_namespaces();
    }

    /// The keys of a Service's slices, in name order.
    fn slice_keys<'a>(&'a self, svc: &'a ObjectKey) -> impl Iterator<Item = ObjectKey> + 'a {
        // The empty name sorts first.
        let from = (svc.clone(), Name::from(""));
        self.by_service
            .range(from..)
            .take_while(move |(owner, _)| owner == svc)
            .map(|(owner, name)| ObjectKey::new(owner.namespace.clone(), name.clone()))
    }

    /// The Service's slices as API objects, for the model (built only for Services that
    /// are recomputed).
    fn slices_of(&self, svc: &ObjectKey) -> Vec<EndpointSlice> {
        self.slice_keys(svc)
            .filter_map(|k| self.slices.get(&k).map(|s| s.to_k8s()))
            .collect()
    }

    /// EndpointSlices that name no Service: reported, never programmed.
    fn orphan_problems(&self) -> Vec<Problem> {
        let mut out: Vec<Problem> = self
            .orphans
            .iter()
            .map(|k| Problem {
                object: format!("EndpointSlice {k}"),
                field: "metadata.labels".into(),
                message: format!(
                    "no {SERVICE_NAME_LABEL} label, so it belongs to no Service; it is ignored"
                ),
            })
            .collect();
        out.sort();
        out
    }

    /// The `endpoints.kubernetes.io/last-change-trigger-time` annotation of every
    /// EndpointSlice of `services` that has one: (Service, slice, raw value). Feeds
    /// kube-proxy's network programming latency (KP-03); the caller parses the RFC 3339
    /// value and observes each change once.
    pub fn trigger_times<'a>(
        &self,
        services: impl IntoIterator<Item = &'a ObjectKey>,
    ) -> Vec<(ObjectKey, ObjectKey, String)> {
        let mut out = Vec::new();
        for svc in services {
            for k in self.slice_keys(svc) {
                if let Some(v) = self.slices.get(&k).and_then(|s| s.trigger_time.as_deref()) {
                    out.push((svc.clone(), k, v.to_string()));
                }
            }
        }
        out
    }

    /// The Services with a slice that carries a trigger time: what a full sync observes
    /// network programming latency for. Not a set of every Service: at the end of the
    /// first sync, the agent's peak, that was 30,000 keys (3 MiB) at 30000x4.
    pub fn services_with_triggers(&self) -> BTreeSet<ObjectKey> {
        self.by_service
            .iter()
            .filter(|(owner, name)| {
                let k = ObjectKey::new(owner.namespace.clone(), name.clone());
                self.slices
                    .get(&k)
                    .is_some_and(|s| s.trigger_time.is_some())
            })
            .map(|(owner, _)| owner.clone())
            .collect()
    }
}

/// EndpointSlice annotation: when the change the slice carries was triggered (RFC 3339).
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

fn zone_of(node: Option<&Node>) -> Option<String> {
    node?.metadata.labels.as_ref()?.get(ZONE_LABEL).cloned()
}

/// kube-proxy's nodeEligible: false while the Node is being deleted or drained by the
/// cluster autoscaler (`/healthz` then answers 503 so load balancers move away).
pub fn node_eligible(node: Option<&Node>) -> bool {
    let Some(node) = node else { return true };
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    !tainted
}

type FrontendId = (std::net::IpAddr, u16, Protocol, Scope);

/// A ServicePort state change for the planner: `None` removes the ServicePort.
pub type Change = (ServicePortId, Option<ServicePortState>);

/// What the engine keeps of a ServicePort once its state went to the planner: a digest,
/// to tell whether a recompute changed it, and the frontends it owns, to release them.
/// The states themselves live only on their way to the planner (at 100000x4 keeping
/// them took 37.6 MiB at the agent's peak, beside the planner's map content).
#[derive(Debug)]
struct Kept {
    digest: u128,
    frontends: Box<[(std::net::IpAddr, u16, Scope)]>,
}

/// A 128-bit digest of `sp`: two SipHash runs over differently prefixed input. Two
/// states with the same digest are taken as equal (a collision, 2^-128 per change,
/// would leave one change unprogrammed).
fn digest(sp: &ServicePortState) -> u128 {
    use std::hash::{Hash, Hasher};
    let mut lo = std::hash::DefaultHasher::new();
    sp.hash(&mut lo);
    let mut hi = std::hash::DefaultHasher::new();
    u64::MAX.hash(&mut hi);
    sp.hash(&mut hi);
    (u128::from(hi.finish()) << 64) | u128::from(lo.finish())
}

/// A whole desired state, sorted by id, in chunks: as a full plan consumes it, each
/// chunk's memory is free for the plan's content (one list of 100,000 ServicePorts would
/// hold 11 MiB until the plan's end, the agent's peak).
#[derive(Debug, Default)]
pub struct States {
    chunks: Vec<Vec<ServicePortState>>,
}

impl States {
    const CHUNK: usize = 2048;

    fn from_sorted(mut all: Vec<ServicePortState>) -> States {
        let mut chunks = Vec::with_capacity(all.len().div_ceil(Self::CHUNK));
        // From the end, shrinking the list as it goes: never both whole.
        while !all.is_empty() {
            chunks.push(all.split_off(all.len().saturating_sub(Self::CHUNK)));
            all.shrink_to_fit();
        }
        chunks.reverse();
        States { chunks }
    }

    pub fn iter(&self) -> impl Iterator<Item = &ServicePortState> {
        self.chunks.iter().flatten()
    }

    pub fn len(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

impl IntoIterator for States {
    type Item = ServicePortState;
    type IntoIter = std::iter::Flatten<std::vec::IntoIter<Vec<ServicePortState>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.chunks.into_iter().flatten()
    }
}

impl<'a> IntoIterator for &'a States {
    type Item = &'a ServicePortState;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Vec<ServicePortState>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.chunks.iter().flatten()
    }
}

/// The desired state, recomputed for dirty Services only.
#[derive(Debug, Default)]
pub struct Engine {
    pub store: Store,
    pub node: NodeInfo,
    /// Per ServicePort given to the planner. Ordered by namespace and name first, so a
    /// Service's ports are one range of it.
    desired: BTreeMap<ServicePortId, Kept>,
    /// Which ServicePort owns each frontend: the first to claim it keeps it, so two
    /// Services fighting over an address never flap. A BTreeMap compacted after a full
    /// recompute: a hash table of 30,000 entries has 65,536 buckets of 80 bytes.
    owner: BTreeMap<FrontendId, ServicePortId>,
    /// Services that lost a frontend to its owner: recomputed when the owner lets go.
    losers: HashMap<FrontendId, BTreeSet<ObjectKey>>,
    problems: BTreeMap<ObjectKey, (Vec<Problem>, Vec<Skip>)>,
    /// Services that need a healthCheckNodePort server (KP-10).
    health: BTreeMap<ObjectKey, HealthCheck>,
    /// Port names shared by the ServicePort ids (a cluster has a few dozen).
    port_names: BTreeSet<std::sync::Arc<str>>,
}

impl Engine {
    pub fn new(node: NodeInfo) -> Engine {
        Engine {
            node,
            ..Default::default()
        }
    }

    /// The healthCheckNodePort servers the desired state needs, per Service.
    pub fn health_checks(&self) -> &BTreeMap<ObjectKey, HealthCheck> {
        &self.health
    }

    /// Every problem and skip, for logging and metrics.
    pub fn report(&self) -> (Vec<Problem>, Vec<Skip>) {
        let mut problems = self.store.orphan_problems();
        let mut skips = Vec::new();
        for (p, s) in self.problems.values() {
            problems.extend(p.iter().cloned());
            skips.extend(s.iter().cloned());
        }
        (problems, skips)
    }

    /// Recomputes the dirty Services; returns the ServicePorts whose state changed, with
    /// their new state (`None`: gone).
    pub fn recompute(&mut self, dirty: &Dirty) -> Vec<Change> {
        let mut changes = Vec::new();
        self.recompute_with(dirty.all, &dirty.services, false, &mut |id, state| {
            changes.push((id, state))
        });
        changes
    }

    /// Recomputes every Service; returns the whole desired state, sorted by id (a full
    /// plan needs it whole; it is not kept here).
    pub fn recompute_all(&mut self) -> States {
        let mut states = Vec::new();
        self.recompute_with(true, &BTreeSet::new(), true, &mut |_, state| {
            states.extend(state)
        });
        // Sorted already but for Services that won a frontend another one let go.
        states.sort_by(|a, b| a.id.cmp(&b.id));
        States::from_sorted(states)
    }

    /// Recomputes the Services in `dirty` (every one when `all`), passing changes to
    /// `out`; with `every` each state goes to `out`, changed or not.
    fn recompute_with(
        &mut self,
        all: bool,
        dirty: &BTreeSet<ObjectKey>,
        every: bool,
        out: &mut dyn FnMut(ServicePortId, Option<ServicePortState>),
    ) {
        self.node.zone = zone_of(self.store.node());
        let keys: BTreeSet<ObjectKey> = if all {
            let programmed = self
                .desired
                .keys()
                .map(|id| ObjectKey::new(&*id.namespace, &*id.name));
            self.store
                .services
                .keys()
                .cloned()
                .chain(programmed)
                .collect()
        } else {
            dirty.clone()
        };
        let mut work: Vec<ObjectKey> = keys.into_iter().rev().collect();
        let mut done = BTreeSet::new();
        while let Some(k) = work.pop() {
            if done.insert(k.clone()) {
                let freed = self.recompute_one(&k, every, out);
                work.extend(freed.into_iter().filter(|l| !done.contains(l)));
            }
        }
        if all {
            self.port_names
                .retain(|p| std::sync::Arc::strong_count(p) > 1);
            // Filled in key order, these maps' nodes are half full.
            crate::btree::compact(&mut self.desired);
            crate::btree::compact(&mut self.owner);
        }
    }

    /// Recomputes one Service, passing its changed states to `out` (all of them when
    /// `every`); returns Services waiting for a frontend it released.
    fn recompute_one(
        &mut self,
        k: &ObjectKey,
        every: bool,
        out: &mut dyn FnMut(ServicePortId, Option<ServicePortState>),
    ) -> BTreeSet<ObjectKey> {
        let (mut state, owner) = match self.store.services.get(k) {
            Some(svc) => (
                model::compute(&[svc.to_k8s()], &self.store.slices_of(k), &self.node),
                svc.key(),
            ),
            None => (model::DesiredState::default(), k.clone()),
        };
        let old_ports: BTreeSet<ServicePortId> = self.ports_of(k).cloned().collect();
        match std::mem::take(&mut state.health_checks)
            .into_values()
            .next()
        {
            Some(check) => self.health.insert(k.clone(), check),
            None => self.health.remove(k),
        };
        let mut released = BTreeSet::new();
        for id in &old_ports {
            released.extend(self.release_frontends(id));
        }
        let mut new_ports = BTreeSet::new();
        for (id, mut sp) in std::mem::take(&mut state.services) {
            let id = self.share_names(id, &owner);
            sp.id = id.clone();
            self.claim_frontends(k, &mut sp, &mut state.problems);
            if sp.frontends.is_empty() {
                continue;
            }
            new_ports.insert(id.clone());
            let kept = Kept {
                digest: digest(&sp),
                frontends: sp
                    .frontends
                    .iter()
                    .map(|f| (f.addr, f.port, f.scope))
                    .collect(),
            };
            let changed = self
                .desired
                .get(&id)
                .is_none_or(|old| old.digest != kept.digest);
            // Inserted either way: the frontends were released above.
            self.desired.insert(id.clone(), kept);
            if changed || every {
                // Without the room the model's pushes left (a retry may keep it).
                sp.frontends.shrink_to_fit();
                for f in &mut sp.frontends {
                    f.set.endpoints.shrink_to_fit();
                }
                out(id, Some(sp));
            }
        }
        for id in old_ports.difference(&new_ports) {
            self.desired.remove(id);
            out(id.clone(), None);
        }
        if state.problems.is_empty() && state.skips.is_empty() {
            self.problems.remove(k);
        } else {
            self.problems
                .insert(k.clone(), (state.problems, state.skips));
        }
        // Frontends this Service still holds are not free after all.
        released.retain(|fid| !self.owner.contains_key(fid));
        released
            .iter()
            .filter_map(|fid| self.losers.remove(fid))
            .flatten()
            .filter(|l| l != k)
            .collect()
    }

    /// `id` as kept already, or with the names of its Service's stored key and a port
    /// name shared with every ServicePort of that name: the model allocates an id and
    /// three strings per ServicePort, which would otherwise live on in the engine and the
    /// planner (2.9 MiB for the strings at 30,000).
    fn share_names(&mut self, id: ServicePortId, owner: &ObjectKey) -> ServicePortId {
        if let Some((kept, _)) = self.desired.get_key_value(&id) {
            return kept.clone();
        }
        let shared = |s: &std::sync::Arc<str>, theirs: &std::sync::Arc<str>| {
            if s == theirs {
                theirs.clone()
            } else {
                s.clone()
            }
        };
        let port_name = match self.port_names.get(&id.port_name) {
            Some(shared) => shared.clone(),
            None => {
                self.port_names.insert(id.port_name.clone());
                id.port_name.clone()
            }
        };
        ServicePortId::new(
            shared(&id.namespace, &owner.namespace),
            shared(&id.name, &owner.name),
            port_name,
            id.protocol,
            id.family,
        )
    }

    /// The ServicePorts of Service `k` in the desired state.
    fn ports_of<'a>(&'a self, k: &ObjectKey) -> impl Iterator<Item = &'a ServicePortId> + 'a {
        // The smallest id of the Service: empty port name, then the first protocol and
        // family.
        let first = ServicePortId::new(
            k.namespace.clone(),
            k.name.clone(),
            "",
            Protocol::Tcp,
            model::IpFamily::V4,
        );
        let (namespace, name) = (first.namespace.clone(), first.name.clone());
        self.desired
            .range(first..)
            .map(|(id, _)| id)
            .take_while(move |id| id.namespace == namespace && id.name == name)
    }

    /// Lets go of a ServicePort's frontends; returns them.
    fn release_frontends(&mut self, id: &ServicePortId) -> Vec<FrontendId> {
        let mut out = Vec::new();
        if let Some(kept) = self.desired.get(id) {
            for &(addr, port, scope) in &kept.frontends {
                let fid = (addr, port, id.protocol, scope);
                if self.owner.get(&fid) == Some(id) {
                    self.owner.remove(&fid);
                    out.push(fid);
                }
            }
        }
        out
    }

    fn claim_frontends(
        &mut self,
        k: &ObjectKey,
        sp: &mut ServicePortState,
        problems: &mut Vec<Problem>,
    ) {
        let id = sp.id.clone();
        sp.frontends.retain(|f| {
            let fid = (f.addr, f.port, id.protocol, f.scope);
            match self.owner.get(&fid) {
                // The external-origin twin of a frontend shares its verdict: one problem.
                Some(other) if *other != id && f.scope == Scope::ExternalOrigin => false,
                Some(other) if *other != id => {
                    self.losers.entry(fid).or_default().insert(k.clone());
                    problems.push(Problem {
                        object: format!("Service {k}"),
                        field: frontend_field(f.kind),
                        message: format!(
                            "{}:{}/{} is already served by {other}; this Service does not get it",
                            f.addr, f.port, id.protocol
                        ),
                    });
                    false
                }
                _ => {
                    self.owner.insert(fid, id.clone());
                    true
                }
            }
        });
    }
}

fn frontend_field(kind: FrontendKind) -> String {
    match kind {
        FrontendKind::ClusterIp => "spec.clusterIPs",
        FrontendKind::ExternalIp => "spec.externalIPs",
        FrontendKind::LoadBalancer => "status.loadBalancer.ingress",
        FrontendKind::NodePort => "spec.ports[].nodePort",
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, ip: &str, extra: &str) -> ServiceLite {
        let svc: k8s_openapi::api::core::v1::Service = serde_yaml::from_str(&format!(
            "metadata: {{name: {name}, namespace: default}}\nspec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}]{extra}}}"
        ))
        .unwrap();
        ServiceLite::from_k8s(&svc).unwrap()
    }

    fn slice(name: &str, svc: &str, ips: &[&str]) -> SliceLite {
        SliceLite::from_k8s(&slice_k8s(name, svc, ips)).unwrap()
    }

    fn slice_k8s(name: &str, svc: &str, ips: &[&str]) -> EndpointSlice {
        let eps: Vec<String> = ips
            .iter()
            .map(|ip| format!("{{addresses: [{ip}]}}"))
            .collect();
        serde_yaml::from_str(&format!(
            "metadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: {svc}}}}}\n\
             addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: [{}]",
            eps.join(", ")
        ))
        .unwrap()
    }

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new("default", name)
    }

    fn engine() -> Engine {
        Engine::new(NodeInfo {
            name: "node1".into(),
            addresses: vec![],
            zone: None,
            ..Default::default()
        })
    }

    fn feed(e: &mut Engine, events: Vec<SourceEvent>) -> Vec<Change> {
        let mut dirty = Dirty::default();
        for ev in events {
            e.store.apply(ev, &mut dirty);
        }
        e.recompute(&dirty)
    }

    /// The whole desired state (recomputing an unchanged store changes nothing).
    fn desired(e: &mut Engine) -> BTreeMap<ServicePortId, ServicePortState> {
        let states = e.recompute_all();
        assert_eq!(states.len(), states.iter().count());
        let again = e.recompute(&Dirty {
            all: true,
            ..Default::default()
        });
        assert!(again.is_empty(), "{again:?}");
        states.into_iter().map(|s| (s.id.clone(), s)).collect()
    }

    fn names(changes: &[(ServicePortId, Option<ServicePortState>)]) -> Vec<String> {
        changes
            .iter()
            .map(|(id, s)| format!("{}{}", id.name, if s.is_some() { "" } else { "-" }))
            .collect()
    }

    #[test]
    fn events_dirty_only_their_service() {
        let mut e = engine();
        let first = feed(
            &mut e,
            vec![
                SourceEvent::ServicesReset(vec![
                    svc("a", "10.96.0.1", ""),
                    svc("b", "10.96.0.2", ""),
                ]),
                SourceEvent::SlicesReset(vec![
                    slice("a-1", "a", &["10.0.0.1"]),
                    slice("b-1", "b", &["10.0.0.2"]),
                ]),
            ],
        );
        assert_eq!(names(&first), ["a", "b"]);
        let changed = feed(
            &mut e,
            vec![SourceEvent::SliceApplied(slice(
                "a-1",
                "a",
                &["10.0.0.1", "10.0.0.3"],
            ))],
        );
        assert_eq!(
            names(&changed),
            ["a"],
            "a slice change recomputes its Service only"
        );
        let same = feed(
            &mut e,
            vec![SourceEvent::SliceApplied(slice(
                "a-1",
                "a",
                &["10.0.0.1", "10.0.0.3"],
            ))],
        );
        assert!(
            same.is_empty(),
            "an identical object changes nothing: {same:?}"
        );
    }

    #[test]
    fn a_change_and_its_undoing_are_both_changes() {
        let mut e = engine();
        let one = slice("a-1", "a", &["10.0.0.1"]);
        let two = slice("a-1", "a", &["10.0.0.1", "10.0.0.2"]);
        feed(&mut e, services_a_and_b(one.clone()));
        for (step, s) in [two, one].into_iter().enumerate() {
            let n = s.endpoints.len();
            let changes = feed(&mut e, vec![SourceEvent::SliceApplied(s)]);
            assert_eq!(names(&changes), ["a"], "step {step}");
            let state = changes[0].1.as_ref().unwrap();
            assert_eq!(state.frontends[0].set.endpoints.len(), n, "step {step}");
        }
        let all: Vec<ServicePortState> = e.recompute_all().into_iter().collect();
        let ids: Vec<&str> = all.iter().map(|s| &*s.id.name).collect();
        assert_eq!(ids, ["a", "b"], "every state, sorted, changed or not");
        assert_eq!(all, desired(&mut e).into_values().collect::<Vec<_>>());
    }

    #[test]
    fn states_keep_their_order_across_chunks() {
        let n = States::CHUNK * 2 + 5;
        let all: Vec<ServicePortState> = (0..n)
            .map(|i| ServicePortState {
                id: ServicePortId::new(
                    "default",
                    format!("svc-{i:05}"),
                    "",
                    Protocol::Tcp,
                    model::IpFamily::V4,
                ),
                affinity_timeout_s: None,
                frontends: Vec::new(),
                source_ranges: None,
            })
            .collect();
        let states = States::from_sorted(all.clone());
        assert_eq!(states.chunks.len(), 3);
        assert_eq!(states.len(), n);
        assert!(states.iter().eq(all.iter()));
        assert_eq!(states.into_iter().collect::<Vec<_>>(), all);
    }

    #[test]
    fn a_burst_is_one_change_per_service() {
        let mut e = engine();
        feed(
            &mut e,
            vec![SourceEvent::ServicesReset(vec![svc("a", "10.96.0.1", "")])],
        );
        let burst = feed(
            &mut e,
            vec![
                SourceEvent::SliceApplied(slice("a-1", "a", &["10.0.0.1"])),
                SourceEvent::SliceApplied(slice("a-1", "a", &["10.0.0.1", "10.0.0.2"])),
                SourceEvent::SliceApplied(slice("a-2", "a", &["10.0.0.3"])),
            ],
        );
        assert_eq!(names(&burst), ["a"]);
        let eps = &burst[0].1.as_ref().unwrap().frontends[0].set.endpoints;
        assert_eq!(eps.len(), 3, "the burst's end state: {eps:?}");
    }

    #[test]
    fn relist_removes_what_disappeared() {
        let mut e = engine();
        feed(
            &mut e,
            vec![SourceEvent::ServicesReset(vec![
                svc("a", "10.96.0.1", ""),
                svc("b", "10.96.0.2", ""),
            ])],
        );
        let relist = feed(
            &mut e,
            vec![SourceEvent::ServicesReset(vec![svc("b", "10.96.0.2", "")])],
        );
        assert_eq!(names(&relist), ["a-"], "a was deleted during the outage");
        let deleted = feed(&mut e, vec![SourceEvent::ServiceDeleted(key("b"))]);
        assert_eq!(names(&deleted), ["b-"]);
    }

    #[test]
    fn a_frontend_freed_by_its_owner_goes_to_the_waiting_service() {
        let mut e = engine();
        let ext = ", externalIPs: [203.0.113.7]";
        feed(
            &mut e,
            vec![SourceEvent::ServicesReset(vec![svc("a", "10.96.0.1", ext)])],
        );
        feed(
            &mut e,
            vec![SourceEvent::ServiceApplied(svc("b", "10.96.0.2", ext))],
        );
        let (problems, _) = e.report();
        assert!(
            problems
                .iter()
                .any(|p| p.object == "Service default/b" && p.message.contains("already served")),
            "{problems:?}"
        );
        let b_id = desired(&mut e)
            .keys()
            .find(|id| &*id.name == "b")
            .unwrap()
            .clone();
        assert_eq!(
            desired(&mut e)[&b_id].frontends.len(),
            1,
            "b keeps only its ClusterIP while a holds the externalIP"
        );
        assert_eq!(e.report().0.len(), 1, "one problem, not one per scope");
        let changes = feed(&mut e, vec![SourceEvent::ServiceDeleted(key("a"))]);
        assert_eq!(
            names(&changes),
            ["a-", "b"],
            "b is recomputed when a lets go"
        );
        // ClusterIP, and the externalIP in both scopes.
        assert_eq!(changes[1].1.as_ref().unwrap().frontends.len(), 3);
        assert_eq!(desired(&mut e)[&b_id].frontends.len(), 3);
        assert!(e.report().0.is_empty(), "the conflict is resolved");
    }

    #[test]
    fn zone_change_recomputes_everything_and_node_eligibility() {
        let mut e = engine();
        feed(
            &mut e,
            vec![SourceEvent::ServicesReset(vec![
                svc("a", "10.96.0.1", ""),
                svc("b", "10.96.0.2", ""),
            ])],
        );
        let node: Node = serde_yaml::from_str(
            "metadata: {name: node1, labels: {topology.kubernetes.io/zone: z1}}",
        )
        .unwrap();
        let mut dirty = Dirty::default();
        e.store
            .apply(SourceEvent::Node(Some(Box::new(node.clone()))), &mut dirty);
        assert!(dirty.all, "a new zone can change every Service's topology");
        e.recompute(&dirty);
        assert_eq!(e.node.zone.as_deref(), Some("z1"));
        assert!(node_eligible(Some(&node)));
        let draining: Node = serde_yaml::from_str(
            "metadata: {name: node1}\nspec: {taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]}",
        )
        .unwrap();
        assert!(!node_eligible(Some(&draining)));
    }

    #[test]
    fn trigger_times_of_the_given_services_slices() {
        let mut e = engine();
        let mut a1 = slice("a-1", "a", &["10.0.0.1"]);
        a1.trigger_time = Some("2024-05-01T12:00:00Z".into());
        let mut b1 = slice("b-1", "b", &["10.0.0.2"]);
        b1.trigger_time = a1.trigger_time.clone();
        let a2 = slice("a-2", "a", &["10.0.0.3"]); // no annotation
        let c1 = slice("c-1", "c", &["10.0.0.4"]); // no annotation
        feed(&mut e, vec![SourceEvent::SlicesReset(vec![a1, a2, b1, c1])]);
        assert_eq!(
            e.store.trigger_times(&[key("a")]),
            vec![(key("a"), key("a-1"), "2024-05-01T12:00:00Z".to_string())]
        );
        assert_eq!(
            e.store.trigger_times(&[key("a"), key("b"), key("c")]).len(),
            2
        );
        assert_eq!(
            e.store.services_with_triggers(),
            [key("a"), key("b")].into(),
            "Services known by their slices, and only those with a trigger time (not c)"
        );
    }

    /// Services `a` and `b`, and `slice`.
    fn services_a_and_b(slice: SliceLite) -> Vec<SourceEvent> {
        vec![
            SourceEvent::ServicesReset(vec![svc("a", "10.96.0.1", ""), svc("b", "10.96.0.2", "")]),
            SourceEvent::SlicesReset(vec![slice]),
        ]
    }

    #[test]
    fn a_slice_moved_to_another_service_leaves_the_first() {
        let mut e = engine();
        let eps =
            |id: &ServicePortId, e: &mut Engine| desired(e)[id].frontends[0].set.endpoints.len();
        feed(&mut e, services_a_and_b(slice("s-1", "a", &["10.0.0.1"])));
        let id = |name: &str, e: &mut Engine| {
            desired(e)
                .keys()
                .find(|id| &*id.name == name)
                .unwrap()
                .clone()
        };
        let (a, b) = (id("a", &mut e), id("b", &mut e));
        assert_eq!((eps(&a, &mut e), eps(&b, &mut e)), (1, 0));
        let moved = feed(
            &mut e,
            vec![SourceEvent::SliceApplied(slice("s-1", "b", &["10.0.0.1"]))],
        );
        assert_eq!(names(&moved), ["a", "b"]);
        assert_eq!((eps(&a, &mut e), eps(&b, &mut e)), (0, 1));
        // A relist that moves it back, next to a new slice of b.
        let relist = feed(
            &mut e,
            vec![SourceEvent::SlicesReset(vec![
                slice("s-1", "a", &["10.0.0.1"]),
                slice("s-2", "b", &["10.0.0.2", "10.0.0.3"]),
            ])],
        );
        assert_eq!(names(&relist), ["a", "b"]);
        assert_eq!((eps(&a, &mut e), eps(&b, &mut e)), (1, 2));
        let gone = feed(&mut e, vec![SourceEvent::SliceDeleted(key("s-2"))]);
        assert_eq!(names(&gone), ["b"]);
        assert_eq!(eps(&b, &mut e), 0);
        assert_eq!(e.store.by_service.len(), 1, "{:?}", e.store.by_service);
    }

    #[test]
    fn objects_and_ids_share_their_names() {
        let mut e = engine();
        feed(&mut e, services_a_and_b(slice("a-1", "a", &["10.0.0.1"])));
        let svc_a = &e.store.services[&key("a")];
        let svc_b = &e.store.services[&key("b")];
        let slice = &e.store.slices[&key("a-1")];
        assert!(std::sync::Arc::ptr_eq(&svc_a.namespace, &svc_b.namespace));
        assert!(std::sync::Arc::ptr_eq(&svc_a.namespace, &slice.namespace));
        let owner = slice.label_value(SERVICE_NAME_LABEL).unwrap();
        assert!(std::sync::Arc::ptr_eq(&svc_a.name, owner));
        assert_eq!(e.store.namespaces.len(), 1);
        let kept: Vec<&ServicePortId> = e.desired.keys().collect();
        assert!(std::sync::Arc::ptr_eq(&kept[0].name, &svc_a.name));
        assert!(std::sync::Arc::ptr_eq(
            &kept[0].port_name,
            &kept[1].port_name
        ));
        let svc_a = svc_a.name.clone();
        let states = e.recompute_all();
        assert!(std::sync::Arc::ptr_eq(
            &states.iter().next().unwrap().id.name,
            &svc_a
        ));
    }

    #[test]
    fn orphan_slices_are_reported() {
        let mut e = engine();
        let mut orphan = slice("x-1", "x", &["10.0.0.1"]);
        orphan.labels = Box::new([]);
        feed(&mut e, vec![SourceEvent::SlicesReset(vec![orphan])]);
        let (problems, _) = e.report();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].message.contains("belongs to no Service"));
    }
    #[test]
    fn a_service_and_its_slice_in_either_order_have_the_endpoints() {
        for slice_first in [false, true] {
            let mut e = engine();
            feed(
                &mut e,
                vec![
                    SourceEvent::ServicesReset(vec![svc("beta", "10.96.0.2", "")]),
                    SourceEvent::SlicesReset(vec![slice("beta-1", "beta", &["10.0.0.1"])]),
                ],
            );
            let mut events = vec![
                SourceEvent::ServiceApplied(svc("alpha", "10.96.0.1", "")),
                SourceEvent::SliceApplied(slice("alpha-1", "alpha", &["10.0.0.1"])),
            ];
            if slice_first {
                events.reverse();
            }
            let changes = feed(&mut e, events);
            assert_eq!(names(&changes), ["alpha"], "slice first: {slice_first}");
            let state = changes[0].1.as_ref().unwrap();
            assert_eq!(
                state.frontends[0].set.endpoints.len(),
                1,
                "slice first: {slice_first}: {state:?}"
            );
        }
    }

    #[test]
    fn endpoints_on_one_node_share_its_name() {
        let on_node = |name: &str, ip: &str| {
            let s: EndpointSlice = serde_yaml::from_str(&format!(
                "metadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: a}}}}\n\
                 addressType: IPv4\nports: [{{name: http, port: 8080}}]\n\
                 endpoints: [{{addresses: [{ip}], nodeName: node-b}}]"
            ))
            .unwrap();
            SliceLite::from_k8s(&s).unwrap()
        };
        let mut e = engine();
        feed(
            &mut e,
            vec![
                SourceEvent::SlicesReset(vec![on_node("a-1", "10.0.0.1")]),
                SourceEvent::SliceApplied(on_node("a-2", "10.0.0.2")),
            ],
        );
        let node = |k: &str| {
            e.store.slices[&key(k)].endpoints[0]
                .node_name
                .clone()
                .unwrap()
        };
        assert_eq!(&*node("a-1"), "node-b");
        assert!(std::sync::Arc::ptr_eq(&node("a-1"), &node("a-2")));
        assert_eq!(e.store.node_names.len(), 1);
    }
}
