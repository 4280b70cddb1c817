//! The tc path's per-ServicePort entries: the Maglev table of its external set
//! (`FERRY_MAGLEV`) and its LoadBalancer source ranges (`FERRY_SRC_RANGES`).
//!
//! Planned after the service planner ([`super::Programmed`]), from the ServicePort's
//! state and the ids the service planner gave it (read back from its content: the
//! external frontend's slots name the backend ids in endpoint order). A table is
//! rewritten only when its backend set changed; a table is 4 KiB, so none is kept in
//! memory, only the set it was built from.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ferry_common::{
    Addr, addr_is_v4,
    ext::{MAGLEV_MAP, MaglevTable, SourceRangeKey},
    lb::ServiceKey,
};

use super::{
    maglev::{self, MaglevBackend},
    plan::{MapContent, PlanError, addr_of, slot0_key},
};
use crate::model::{FrontendKind, Scope, ServicePortId, ServicePortState};

/// One `FERRY_SRC_RANGES` entry: a CIDR admitted for a service id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourceRange {
    pub svc_id: u32,
    /// Network address, as in the maps (network byte order, IPv4 mapped).
    pub addr: Addr,
    /// The trie's prefix length: 32 (svc id) + the address bits (96 + len for IPv4).
    pub prefix_len: u32,
}

impl SourceRange {
    pub fn lpm(&self) -> (u32, SourceRangeKey) {
        let key = SourceRangeKey {
            svc_id_be: self.svc_id.to_be(),
            addr: self.addr,
        };
        (self.prefix_len, key)
    }

    pub fn from_lpm(prefix_len: u32, key: &SourceRangeKey) -> SourceRange {
        SourceRange {
            svc_id: u32::from_be(key.svc_id_be),
            addr: key.addr,
            prefix_len,
        }
    }

    /// The CIDR's own prefix length (without the svc id and the IPv4 mapping).
    pub fn cidr_len(&self) -> u32 {
        let len = self.prefix_len.saturating_sub(32);
        if addr_is_v4(&self.addr) {
            len.saturating_sub(96)
        } else {
            len
        }
    }
}

/// What the kernel holds (or must hold) for the tc path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalContent {
    pub maglev: BTreeMap<u32, Box<MaglevTable>>,
    pub ranges: BTreeSet<SourceRange>,
}

/// The tc path's writes, applied by `KernelMaps::apply` around the frontend writes:
/// upserts after the members and before any slot 0, deletes after every slot 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalPlan {
    pub maglev_upserts: Vec<(u32, Box<MaglevTable>)>,
    pub range_upserts: Vec<SourceRange>,
    pub range_deletes: Vec<SourceRange>,
    pub maglev_deletes: Vec<u32>,
}

impl ExternalPlan {
    pub fn len(&self) -> usize {
        self.maglev_upserts.len()
            + self.range_upserts.len()
            + self.range_deletes.len()
            + self.maglev_deletes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What one ServicePort's tc entries were built from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct PortExternal {
    svc_id: u32,
    /// Its external set, sorted by address: the table is a function of it. Empty: no
    /// table (the frontends drop or reject).
    set: Vec<MaglevBackend>,
    ranges: Vec<SourceRange>,
}

/// The tc path's state per programmed ServicePort.
#[derive(Debug, Default)]
pub struct External {
    ports: HashMap<ServicePortId, PortExternal>,
    /// Tables in the kernel, for the capacity check.
    tables: usize,
    /// Tables the map may hold (one per ServicePort at most: `--max-services`).
    capacity: u32,
}

impl External {
    /// Plans every ServicePort against what the kernel holds (`current`): tables are
    /// written only where they differ, everything not desired is removed.
    pub fn full<'a>(
        desired: impl IntoIterator<Item = &'a ServicePortState>,
        content: &MapContent,
        current: &ExternalContent,
        capacity: u32,
    ) -> (External, ExternalPlan, Vec<PlanError>) {
        let mut ext = External {
            capacity,
            ..Default::default()
        };
        let mut plan = ExternalPlan::default();
        let mut errors = Vec::new();
        let mut want_tables = BTreeSet::new();
        let mut want_ranges = BTreeSet::new();
        for sp in desired {
            let Some(mut port) = port_state(sp, content) else {
                continue;
            };
            if !port.set.is_empty() {
                if ext.tables as u32 >= capacity {
                    errors.push(ext.full_error(&sp.id));
                    port.set.clear();
                } else {
                    let table = maglev::table(&port.set).expect("non-empty set");
                    if current.maglev.get(&port.svc_id) != Some(&table) {
                        plan.maglev_upserts.push((port.svc_id, table));
                    }
                    want_tables.insert(port.svc_id);
                    ext.tables += 1;
                }
            }
            want_ranges.extend(port.ranges.iter().copied());
            ext.ports.insert(sp.id.clone(), port);
        }
        plan.range_upserts = want_ranges.difference(&current.ranges).copied().collect();
        plan.range_deletes = current.ranges.difference(&want_ranges).copied().collect();
        plan.maglev_deletes = current
            .maglev
            .keys()
            .filter(|id| !want_tables.contains(id))
            .copied()
            .collect();
        (ext, plan, errors)
    }

    /// Plans a batch of ServicePort changes (`None`: removed). ServicePorts in `failed`
    /// kept their previous entries in the service planner and keep them here too.
    pub fn update(
        &mut self,
        changes: &[(ServicePortId, Option<&ServicePortState>)],
        content: &MapContent,
        failed: &BTreeSet<ServicePortId>,
    ) -> (ExternalPlan, Vec<PlanError>) {
        let mut plan = ExternalPlan::default();
        let mut errors = Vec::new();
        // Removals first, so the table room they free is there for the rest.
        let (gone, changed): (Vec<_>, Vec<_>) = changes.iter().partition(|(_, s)| s.is_none());
        for (id, state) in gone.into_iter().chain(changed) {
            if failed.contains(id) {
                continue;
            }
            let old = self.ports.remove(id).unwrap_or_default();
            let mut new = state
                .and_then(|s| port_state(s, content))
                .unwrap_or_default();
            let had_table = !old.set.is_empty();
            if !new.set.is_empty() && (old.set != new.set || old.svc_id != new.svc_id) {
                let room = self.tables - usize::from(had_table) < self.capacity as usize;
                if room {
                    let table = maglev::table(&new.set).expect("non-empty set");
                    plan.maglev_upserts.push((new.svc_id, table));
                } else {
                    errors.push(self.full_error(id));
                    new.set.clear();
                }
            }
            let has_table = !new.set.is_empty();
            if had_table && !(has_table && old.svc_id == new.svc_id) {
                plan.maglev_deletes.push(old.svc_id);
            }
            self.tables = self.tables - usize::from(had_table) + usize::from(has_table);
            let (before, after): (BTreeSet<_>, BTreeSet<_>) =
                (old.ranges.iter().collect(), new.ranges.iter().collect());
            plan.range_upserts
                .extend(after.difference(&before).map(|r| **r));
            plan.range_deletes
                .extend(before.difference(&after).map(|r| **r));
            if state.is_some() && (new.svc_id != 0) {
                self.ports.insert(id.clone(), new);
            }
        }
        (plan, errors)
    }

    /// The maps grew (`growth`): room for this many tables.
    pub fn set_capacity(&mut self, capacity: u32) {
        self.capacity = capacity;
    }

    /// ServicePorts with a Maglev table.
    pub fn tables(&self) -> usize {
        self.tables
    }

    fn full_error(&self, id: &ServicePortId) -> PlanError {
        PlanError::MapFull {
            service: id.clone(),
            map: MAGLEV_MAP,
            flag: "max-services",
            needed: 1,
            free: 0,
            capacity: self.capacity,
        }
    }
}

/// The tc entries `sp` needs, with the ids the service planner gave it; `None` when it
/// has no external frontend or is not programmed.
fn port_state(sp: &ServicePortState, content: &MapContent) -> Option<PortExternal> {
    let f = sp
        .frontends
        .iter()
        .find(|f| f.scope == Scope::ExternalOrigin)?;
    let key0 = slot0_key(f, sp.id.protocol);
    let svc_id = content.services.get(&key0)?.svc_id;
    let mut set = Vec::with_capacity(f.set.endpoints.len());
    for (i, e) in f.set.endpoints.iter().enumerate() {
        let slot = ServiceKey {
            slot: i as u16 + 1,
            ..key0
        };
        let id = content.services.get(&slot)?.backend_id;
        set.push(MaglevBackend {
            addr: addr_of(&e.addr),
            port_be: e.port.to_be(),
            id,
        });
    }
    set.sort();
    let restricted = sp
        .frontends
        .iter()
        .any(|f| f.scope == Scope::ExternalOrigin && f.kind == FrontendKind::LoadBalancer);
    let ranges = match (&sp.source_ranges, restricted) {
        (Some(cidrs), true) => cidrs
            .iter()
            .map(|c| SourceRange {
                svc_id,
                addr: addr_of(&c.addr),
                prefix_len: 32 + u32::from(c.len) + if c.addr.is_ipv4() { 96 } else { 0 },
            })
            .collect(),
        _ => Vec::new(),
    };
    Some(PortExternal {
        svc_id,
        set,
        ranges,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{
        dataplane::{
            Capacity, Programmed,
            plan::tests::{apply, desired},
            programmed::tests::full_of,
        },
        model::DesiredState,
    };

    const CAP: u32 = 16;

    /// A LoadBalancer `lb` (198.51.100.1:80, NodePort 30080, eTP `policy`) with the given
    /// endpoints on node-b (and `local` on node-a), restricted to `ranges` when not empty.
    pub(crate) fn lb(policy: &str, remote: &[&str], local: &[&str], ranges: &str) -> String {
        let mut eps = String::new();
        for (ips, node) in [(remote, "node-b"), (local, "node-a")] {
            for ip in ips {
                eps += &format!("- {{addresses: [{ip}], nodeName: {node}}}\n");
            }
        }
        let ranges = if ranges.is_empty() {
            String::new()
        } else {
            format!("  loadBalancerSourceRanges: [{ranges}]\n")
        };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: default}}\n\
             spec:\n  type: LoadBalancer\n  externalTrafficPolicy: {policy}\n  clusterIP: 10.96.0.1\n\
             {ranges}  ports: [{{name: http, port: 80, nodePort: 30080}}]\n\
             status: {{loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: lb-a, namespace: default, labels: {{kubernetes.io/service-name: lb}}}}\n\
             addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints:\n{eps}"
        )
    }

    /// The service planner and the tc planner side by side, as the agent runs them.
    struct Agent {
        programmed: Programmed,
        external: External,
        state: DesiredState,
        kernel: ExternalContent,
    }

    impl Agent {
        fn start(yaml: &str) -> (Agent, ExternalPlan) {
            Agent::restart(yaml, &ExternalContent::default())
        }

        fn restart(yaml: &str, kernel: &ExternalContent) -> (Agent, ExternalPlan) {
            let state = desired(yaml);
            let cap = Capacity::default();
            let (programmed, _, _) = full_of(&state, &MapContent::default(), cap);
            let (external, plan, errors) =
                External::full(state.services.values(), &programmed.content, kernel, CAP);
            assert!(errors.is_empty(), "{errors:?}");
            let mut agent = Agent {
                programmed,
                external,
                state,
                kernel: kernel.clone(),
            };
            agent.apply(&plan);
            (agent, plan)
        }

        fn sync(&mut self, yaml: &str) -> ExternalPlan {
            let next = desired(yaml);
            let mut changes: Vec<(ServicePortId, Option<&ServicePortState>)> = Vec::new();
            for id in self.state.services.keys() {
                if !next.services.contains_key(id) {
                    changes.push((id.clone(), None));
                }
            }
            for (id, s) in &next.services {
                if self.state.services.get(id) != Some(s) {
                    changes.push((id.clone(), Some(s)));
                }
            }
            let before = self.programmed.content.clone();
            let (lb_plan, errors) = self.programmed.update(&changes, Capacity::default());
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(apply(&before, &lb_plan), self.programmed.content);
            let (plan, errors) =
                self.external
                    .update(&changes, &self.programmed.content, &BTreeSet::new());
            assert!(errors.is_empty(), "{errors:?}");
            self.apply(&plan);
            self.state = next;
            plan
        }

        fn apply(&mut self, plan: &ExternalPlan) {
            for (id, t) in &plan.maglev_upserts {
                self.kernel.maglev.insert(*id, t.clone());
            }
            self.kernel
                .ranges
                .extend(plan.range_upserts.iter().copied());
            for r in &plan.range_deletes {
                self.kernel.ranges.remove(r);
            }
            for id in &plan.maglev_deletes {
                self.kernel.maglev.remove(id);
            }
        }

        /// The kernel holds exactly what a full plan from scratch would write.
        fn check(&self) {
            let want = tc_content(&self.state, &self.programmed.content);
            assert_eq!(self.kernel, want, "incremental != full");
        }
    }

    /// What the tc maps hold once `state` is planned from scratch over `content`.
    pub(crate) fn tc_content(state: &DesiredState, content: &MapContent) -> ExternalContent {
        let none = ExternalContent::default();
        let (_, plan, _) = External::full(state.services.values(), content, &none, CAP);
        let mut ext = ExternalContent::default();
        ext.maglev.extend(plan.maglev_upserts);
        ext.ranges.extend(plan.range_upserts);
        ext
    }

    fn text(plan: &ExternalPlan) -> String {
        let mut s = String::new();
        for (id, t) in &plan.maglev_upserts {
            let ids: BTreeSet<u32> = t.backend_ids.iter().copied().collect();
            s += &format!("+ maglev svc={id} backends={ids:?}\n");
        }
        for r in &plan.range_upserts {
            s += &format!(
                "+ range svc={} {}/{}\n",
                r.svc_id,
                super::super::plan::ip_of(&r.addr),
                r.cidr_len()
            );
        }
        for r in &plan.range_deletes {
            s += &format!(
                "- range svc={} {}/{}\n",
                r.svc_id,
                super::super::plan::ip_of(&r.addr),
                r.cidr_len()
            );
        }
        for id in &plan.maglev_deletes {
            s += &format!("- maglev svc={id}\n");
        }
        s
    }

    #[test]
    fn table_and_ranges_for_a_load_balancer() {
        let (a, plan) = Agent::start(&lb(
            "Cluster",
            &["10.0.0.1", "10.0.0.2"],
            &[],
            "203.0.113.0/24, \"2001:db8::/32\"",
        ));
        assert_eq!(
            text(&plan),
            "+ maglev svc=1 backends={1, 2}\n+ range svc=1 203.0.113.0/24\n"
        );
        let r = plan.range_upserts[0];
        let (len, key) = r.lpm();
        assert_eq!(len, 32 + 96 + 24, "svc id bits + IPv4-mapped prefix");
        assert_eq!(key.svc_id_be, 1u32.to_be());
        assert_eq!(SourceRange::from_lpm(len, &key), r);
        a.check();
    }

    #[test]
    fn table_follows_the_external_set_only_when_it_changes() {
        let (mut a, _) = Agent::start(&lb("Local", &["10.0.0.1"], &["10.0.0.9"], ""));
        assert_eq!(a.kernel.maglev.len(), 1);
        // A remote endpoint joins: the external (local) set is unchanged, no table write.
        let plan = a.sync(&lb("Local", &["10.0.0.1", "10.0.0.2"], &["10.0.0.9"], ""));
        assert_eq!(text(&plan), "");
        a.check();
        // A local endpoint joins: the table is rewritten.
        let plan = a.sync(&lb(
            "Local",
            &["10.0.0.1", "10.0.0.2"],
            &["10.0.0.9", "10.0.0.8"],
            "",
        ));
        assert_eq!(plan.maglev_upserts.len(), 1);
        a.check();
        // No local endpoint left: drop, no table.
        let plan = a.sync(&lb("Local", &["10.0.0.1"], &[], "10.0.0.0/8"));
        assert_eq!(text(&plan), "+ range svc=1 10.0.0.0/8\n- maglev svc=1\n");
        a.check();
        // Ranges change: new ones in, old ones out.
        let plan = a.sync(&lb("Local", &["10.0.0.1"], &[], "10.1.0.0/16"));
        assert_eq!(
            text(&plan),
            "+ range svc=1 10.1.0.0/16\n- range svc=1 10.0.0.0/8\n"
        );
        // The Service goes away: everything of it goes.
        let plan = a.sync("");
        assert_eq!(text(&plan), "- range svc=1 10.1.0.0/16\n");
        assert_eq!(a.kernel, ExternalContent::default());
    }

    /// A restarted agent adopts equal tables and prunes the rest.
    #[test]
    fn restart_writes_only_the_difference() {
        let yaml = lb("Cluster", &["10.0.0.1", "10.0.0.2"], &[], "203.0.113.0/24");
        let (a, _) = Agent::start(&yaml);
        let (_, again) = Agent::restart(&yaml, &a.kernel);
        assert!(again.is_empty(), "{again:?}");
        let mut stale = a.kernel.clone();
        stale.maglev.insert(99, stale.maglev[&1].clone());
        stale.ranges.insert(SourceRange {
            svc_id: 99,
            ..*stale.ranges.first().unwrap()
        });
        let (b, plan) = Agent::restart(&yaml, &stale);
        assert_eq!(
            text(&plan),
            "- range svc=99 203.0.113.0/24\n- maglev svc=99\n"
        );
        assert_eq!(b.kernel, a.kernel);
    }

    #[test]
    fn capacity_is_enforced_per_table() {
        let state = desired(&lb("Cluster", &["10.0.0.1"], &[], ""));
        let (p, _, _) = full_of(&state, &MapContent::default(), Capacity::default());
        let (ext, plan, errors) = External::full(
            state.services.values(),
            &p.content,
            &ExternalContent::default(),
            0,
        );
        assert!(plan.maglev_upserts.is_empty());
        assert!(matches!(
            errors.as_slice(),
            [PlanError::MapFull {
                flag: "max-services",
                ..
            }]
        ));
        assert_eq!(ext.tables(), 0);
    }
}
