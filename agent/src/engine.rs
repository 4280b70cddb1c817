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
    let name = slice.label(SERVICE_NAME_LABEL)?;
    Some(ObjectKey::new(slice.namespace.clone(), name))
}

#[derive(Debug, Default)]
pub struct Store {
    services: HashMap<ObjectKey, Box<ServiceLite>>,
    /// Boxed, like the Services: a table is sized to a power of two above its entries, and
    /// an empty bucket then costs a pointer, not a whole slice (about 3.8 MiB at 30000).
    slices: HashMap<ObjectKey, Box<SliceLite>>,
    /// Each Service's slices, by name (a slice is in its Service's namespace), sorted: a
    /// Vec, as a Service has one or a few, where a BTreeSet would allocate a whole node.
    slices_by_service: HashMap<ObjectKey, Vec<Name>>,
    /// Slices that name no Service (reported, never programmed).
    orphans: BTreeSet<ObjectKey>,
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
            SourceEvent::ServiceApplied(svc) => self.put_service(svc.key(), svc, dirty),
            SourceEvent::ServiceDeleted(k) => {
                if self.services.remove(&k).is_some() {
                    dirty.services.insert(k);
                }
            }
            SourceEvent::SliceApplied(slice) => self.put_slice(slice.key(), slice, dirty),
            SourceEvent::SliceDeleted(k) => self.remove_slice(&k, dirty),
            SourceEvent::Node(node) => {
                let node = node.map(|n| *n);
                if zone_of(node.as_ref()) != zone_of(self.node.as_ref()) {
                    dirty.all = true;
                }
                self.node = node;
            }
            SourceEvent::Synced | SourceEvent::Connected(_) | SourceEvent::Unreadable(_) => {}
        }
    }

    fn put_service(&mut self, k: ObjectKey, svc: ServiceLite, dirty: &mut Dirty) {
        if self.services.get(&k).map(|b| &**b) != Some(&svc) {
            self.services.insert(k.clone(), Box::new(svc));
            dirty.services.insert(k);
        }
    }

    fn reset_services(&mut self, list: Vec<ServiceLite>, dirty: &mut Dirty) {
        let mut next: HashMap<ObjectKey, Box<ServiceLite>> = HashMap::with_capacity(list.len());
        for svc in list {
            next.insert(svc.key(), Box::new(svc));
        }
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
    }

    fn put_slice(&mut self, k: ObjectKey, slice: SliceLite, dirty: &mut Dirty) {
        if self.slices.get(&k).map(|s| &**s) == Some(&slice) {
            return;
        }
        self.remove_slice(&k, dirty);
        match owner_of(&slice) {
            Some(owner) => {
                // The Service's own key when it is stored: its names are shared, not copied.
                let owner = match self.services.get_key_value(&owner) {
                    Some((k, _)) => k.clone(),
                    None => owner,
                };
                let names = self.slices_by_service.entry(owner.clone()).or_default();
                if let Err(at) = names.binary_search_by(|n| (**n).cmp(&k.name)) {
                    names.reserve_exact(1);
                    names.insert(at, k.name.clone());
                }
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
            if let Some(names) = self.slices_by_service.get_mut(&owner) {
                names.retain(|n| **n != *k.name);
                if names.is_empty() {
                    self.slices_by_service.remove(&owner);
                }
            }
            dirty.services.insert(owner);
        }
    }

    fn reset_slices(&mut self, list: Vec<SliceLite>, dirty: &mut Dirty) {
        let next: HashMap<ObjectKey, SliceLite> = list.into_iter().map(|s| (s.key(), s)).collect();
        let gone: Vec<ObjectKey> = self
            .slices
            .keys()
            .filter(|k| !next.contains_key(*k))
            .cloned()
            .collect();
        for k in gone {
            self.remove_slice(&k, dirty);
        }
        for (k, slice) in next {
            self.put_slice(k, slice, dirty);
        }
    }

    /// The keys of a Service's slices, in name order.
    fn slice_keys<'a>(&'a self, svc: &'a ObjectKey) -> impl Iterator<Item = ObjectKey> + 'a {
        let names = self.slices_by_service.get(svc).into_iter().flatten();
        names.map(|n| ObjectKey::new(svc.namespace.clone(), n.clone()))
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

    /// Every Service the store holds and every Service that still has slices.
    pub fn service_keys(&self) -> BTreeSet<ObjectKey> {
        self.services
            .keys()
            .chain(self.slices_by_service.keys())
            .cloned()
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

/// The desired state, kept per Service and updated for dirty Services only.
#[derive(Debug, Default)]
pub struct Engine {
    pub store: Store,
    pub node: NodeInfo,
    /// Ordered by namespace and name first, so a Service's ports are one range of it.
    desired: BTreeMap<ServicePortId, ServicePortState>,
    /// Which ServicePort owns each frontend: the first to claim it keeps it, so two
    /// Services fighting over an address never flap. A BTreeMap compacted after a full
    /// recompute: a hash table of 30,000 entries has 65,536 buckets of 80 bytes.
    owner: BTreeMap<FrontendId, ServicePortId>,
    /// Services that lost a frontend to its owner: recomputed when the owner lets go.
    losers: HashMap<FrontendId, BTreeSet<ObjectKey>>,
    problems: BTreeMap<ObjectKey, (Vec<Problem>, Vec<Skip>)>,
    /// Services that need a healthCheckNodePort server (KP-10).
    health: BTreeMap<ObjectKey, HealthCheck>,
}

impl Engine {
    pub fn new(node: NodeInfo) -> Engine {
        Engine {
            node,
            ..Default::default()
        }
    }

    pub fn desired(&self) -> &BTreeMap<ServicePortId, ServicePortState> {
        &self.desired
    }

    /// Lends the desired state out (a full plan reads it whole); give it back with
    /// [`Engine::restore_desired`].
    pub fn take_desired(&mut self) -> BTreeMap<ServicePortId, ServicePortState> {
        std::mem::take(&mut self.desired)
    }

    pub fn restore_desired(&mut self, desired: BTreeMap<ServicePortId, ServicePortState>) {
        self.desired = desired;
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

    /// Recomputes the dirty Services; returns the ServicePorts that changed (their new
    /// state, or their absence, is in [`Engine::desired`]: no copies, which at 10,000
    /// Services would double the desired state at the peak of the first sync).
    pub fn recompute(&mut self, dirty: &Dirty) -> Vec<ServicePortId> {
        self.node.zone = zone_of(self.store.node());
        let keys: BTreeSet<ObjectKey> = if dirty.all {
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
            dirty.services.clone()
        };
        let mut changes = Vec::new();
        let mut work: Vec<ObjectKey> = keys.into_iter().rev().collect();
        let mut done = BTreeSet::new();
        while let Some(k) = work.pop() {
            if done.insert(k.clone()) {
                let freed = self.recompute_one(&k, &mut changes);
                work.extend(freed.into_iter().filter(|l| !done.contains(l)));
            }
        }
        if dirty.all {
            // Filled in key order, these maps' nodes are half full.
            crate::btree::compact(&mut self.desired);
            crate::btree::compact(&mut self.owner);
        }
        changes
    }

    /// Recomputes one Service; returns Services waiting for a frontend it released.
    fn recompute_one(
        &mut self,
        k: &ObjectKey,
        changes: &mut Vec<ServicePortId>,
    ) -> BTreeSet<ObjectKey> {
        let mut state = match self.store.services.get(k) {
            Some(svc) => model::compute(&[svc.to_k8s()], &self.store.slices_of(k), &self.node),
            None => model::DesiredState::default(),
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
            self.claim_frontends(k, &mut sp, &mut state.problems);
            if sp.frontends.is_empty() {
                continue;
            }
            new_ports.insert(id.clone());
            if self.desired.get(&id) != Some(&sp) {
                // Kept until the next change: without the room the model's pushes left.
                sp.frontends.shrink_to_fit();
                for f in &mut sp.frontends {
                    f.set.endpoints.shrink_to_fit();
                }
                self.desired.insert(id.clone(), sp);
                changes.push(id);
            }
        }
        for id in old_ports.difference(&new_ports) {
            self.desired.remove(id);
            changes.push(id.clone());
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

    /// The ServicePorts of Service `k` in the desired state.
    fn ports_of<'a>(&'a self, k: &ObjectKey) -> impl Iterator<Item = &'a ServicePortId> + 'a {
        // The smallest id of the Service: empty port name, then the first protocol and
        // family.
        let first = ServicePortId {
            namespace: k.namespace.clone(),
            name: k.name.clone(),
            port_name: "".into(),
            protocol: Protocol::Tcp,
            family: model::IpFamily::V4,
        };
        let (namespace, name) = (first.namespace.clone(), first.name.clone());
        self.desired
            .range(first..)
            .map(|(id, _)| id)
            .take_while(move |id| id.namespace == namespace && id.name == name)
    }

    /// Lets go of a ServicePort's frontends; returns them.
    fn release_frontends(&mut self, id: &ServicePortId) -> Vec<FrontendId> {
        let mut out = Vec::new();
        if let Some(sp) = self.desired.get(id) {
            for f in &sp.frontends {
                let fid = (f.addr, f.port, id.protocol, f.scope);
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

    fn feed(
        e: &mut Engine,
        events: Vec<SourceEvent>,
    ) -> Vec<(ServicePortId, Option<ServicePortState>)> {
        let mut dirty = Dirty::default();
        for ev in events {
            e.store.apply(ev, &mut dirty);
        }
        let ids = e.recompute(&dirty);
        ids.into_iter()
            .map(|id| {
                let s = e.desired().get(&id).cloned();
                (id, s)
            })
            .collect()
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
        let b_id = e
            .desired()
            .keys()
            .find(|id| &*id.name == "b")
            .unwrap()
            .clone();
        assert_eq!(
            e.desired()[&b_id].frontends.len(),
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
        assert_eq!(e.desired()[&b_id].frontends.len(), 3);
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
        feed(&mut e, vec![SourceEvent::SlicesReset(vec![a1, a2, b1])]);
        assert_eq!(
            e.store.trigger_times(&[key("a")]),
            vec![(key("a"), key("a-1"), "2024-05-01T12:00:00Z".to_string())]
        );
        assert_eq!(
            e.store.trigger_times(&[key("a"), key("b"), key("c")]).len(),
            2
        );
        assert_eq!(
            e.store.service_keys(),
            [key("a"), key("b")].into(),
            "Services known by their slices too"
        );
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
}
