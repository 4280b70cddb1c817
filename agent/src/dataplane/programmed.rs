//! What the kernel holds, indexed by ServicePort, so that a change to one Service is
//! planned from that Service's entries alone: the cost of a sync follows the size of
//! the change, not the size of the cluster.
//!
//! The full path ([`Programmed::full`]) serves the first sync and recovery: it plans
//! every ServicePort against whatever the pinned maps hold (adopting ids, pruning the
//! rest). [`Programmed::update`] then plans each later change incrementally.

use std::collections::{BTreeMap, BTreeSet};

use ferry_common::lb::{Backend, MAX_BACKENDS_PER_SERVICE, MemberKey, ServiceKey, ServiceValue};

use super::plan::{
    Capacity, Ids, MapContent, MapKind, Owned, Plan, PlanError, desired_content_owned, diff,
    footprint, place,
};
use crate::model::{ServicePortId, ServicePortState};

#[derive(Debug, Default)]
pub struct Programmed {
    /// The content the kernel holds once the last plan was applied.
    pub content: MapContent,
    ids: Ids,
    owners: BTreeMap<ServicePortId, Owned>,
    /// How many ServicePorts reference each backend id. A BTreeMap built from a sorted
    /// list: 120,000 ids (30000x4) in a hash table take 262,144 buckets (2.3 MiB), in full
    /// B-tree nodes 1.2 MiB.
    backend_refs: BTreeMap<u32, u32>,
    /// Slot-0 entries in `content.services`, kept current so status never walks the map.
    frontends: usize,
}

/// A full plan ([`Programmed::full`]).
pub struct Full {
    pub programmed: Programmed,
    pub plan: Plan,
    /// What was not placed, and why.
    pub errors: Vec<PlanError>,
    /// The states still needed: those with an external-origin frontend (for the tc
    /// planner) and those not placed (to retry).
    pub kept: Vec<ServicePortState>,
}

/// The original values of everything one update touched, to diff against.
#[derive(Default)]
struct Touched {
    services: BTreeMap<ServiceKey, Option<ServiceValue>>,
    backends: BTreeMap<u32, Option<Backend>>,
    members: BTreeMap<MemberKey, bool>,
}

impl Programmed {
    /// Plans the whole desired state (sorted by id) against `current` (what the kernel
    /// holds now). When `current` is empty the plan is empty too: write `content` with
    /// `KernelMaps::fill`. The states are consumed; [`Full::kept`] has those still needed.
    pub fn full(
        desired: impl IntoIterator<Item = ServicePortState>,
        current: &MapContent,
        cap: Capacity,
    ) -> Full {
        let mut ids = Ids::adopt(current);
        // The ServicePorts' ids come from the kernel's frontends; `owners` keeps them.
        let (content, errors, owners, kept) =
            desired_content_owned(desired, &mut ids, current, cap);
        // Empty maps are filled straight from `content` (KernelMaps::fill): no plan.
        let mut plan = if current == &MapContent::default() {
            Plan::default()
        } else {
            diff(current, &content)
        };
        // Ids the kernel holds that the new content does not use: zeroed, then free.
        let in_use: BTreeSet<u32> = owners.values().map(|o| o.svc_id).collect();
        let gone: BTreeSet<u32> = current
            .services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(_, v)| v.svc_id)
            .filter(|id| !in_use.contains(id))
            .collect();
        for id in gone {
            ids.release_service(id);
        }
        plan.released_services = ids.take_released();
        let mut refs: Vec<u32> = owners.values().flat_map(|o| o.backends(&content)).collect();
        refs.sort_unstable();
        let backend_refs = run_lengths(&refs);
        drop(refs);
        let frontends = content.services.keys().filter(|k| k.slot == 0).count();
        Full {
            programmed: Programmed {
                content,
                ids,
                owners,
                backend_refs,
                frontends,
            },
            plan,
            errors,
            kept,
        }
    }

    pub fn programmed_ports(&self) -> usize {
        self.owners.len()
    }

    pub fn is_programmed(&self, id: &ServicePortId) -> bool {
        self.owners.contains_key(id)
    }

    /// Plans a batch of changes: `None` removes a ServicePort. A ServicePort that no
    /// longer fits keeps what it had (a full map never loses live state) and is reported.
    pub fn update(
        &mut self,
        changes: &[(ServicePortId, Option<&ServicePortState>)],
        cap: Capacity,
    ) -> (Plan, Vec<PlanError>) {
        let mut touched = Touched::default();
        let mut errors = Vec::new();
        // Removals first, so the space they free is there for the rest.
        for (id, _) in changes.iter().filter(|(_, s)| s.is_none()) {
            if let Some(svc_id) = self.owners.get(id).map(|o| o.svc_id) {
                self.ids.release_service(svc_id);
            }
            self.remove(id, &mut touched);
        }
        // Then ServicePorts already programmed, then new ones: a new Service that does
        // not fit can never push out a live one.
        let (live, new): (Vec<_>, Vec<_>) = changes
            .iter()
            .filter_map(|(id, s)| s.map(|s| (id, s)))
            .partition(|(id, _)| self.owners.contains_key(*id));
        for (id, state) in live.into_iter().chain(new) {
            if let Err(e) = self.replace(id, state, cap, &mut touched) {
                errors.push(e);
            }
        }
        let mut plan = self.plan_touched(&touched);
        plan.released_services = self.ids.take_released();
        (plan, errors)
    }

    fn remove(&mut self, id: &ServicePortId, t: &mut Touched) {
        let Some(owned) = self.owners.remove(id) else {
            return;
        };
        // Read what it owns before its entries go.
        let keys: Vec<ServiceKey> = owned.keys(&self.content).collect();
        let backends = owned.backends(&self.content);
        for k in &keys {
            t.services
                .entry(*k)
                .or_insert_with(|| self.content.services.get(k).copied());
            if self.content.services.remove(k).is_some() && k.slot == 0 {
                self.frontends -= 1;
            }
        }
        for b in backends {
            let m = MemberKey {
                svc_id: owned.svc_id,
                backend_id: b,
            };
            t.members.entry(m).or_insert(true);
            self.content.members.remove(&m);
            self.release_backend(b, t);
        }
    }

    fn release_backend(&mut self, b: u32, t: &mut Touched) {
        let refs = self.backend_refs.entry(b).or_default();
        *refs = refs.saturating_sub(1);
        if *refs == 0 {
            self.backend_refs.remove(&b);
            t.backends
                .entry(b)
                .or_insert_with(|| self.content.backends.get(&b).copied());
            if let Some(backend) = self.content.backends.remove(&b) {
                self.ids
                    .backends
                    .remove(&(backend.addr, backend.port, backend.proto));
            }
        }
    }

    fn replace(
        &mut self,
        id: &ServicePortId,
        state: &ServicePortState,
        cap: Capacity,
        t: &mut Touched,
    ) -> Result<(), PlanError> {
        if let Some(f) = state
            .frontends
            .iter()
            .find(|f| f.set.endpoints.len() > MAX_BACKENDS_PER_SERVICE as usize)
        {
            return Err(PlanError::TooManyEndpoints {
                service: id.clone(),
                count: f.set.endpoints.len(),
                max: MAX_BACKENDS_PER_SERVICE,
            });
        }
        self.check_capacity(id, state, cap)?;
        let svc_id = match self.owners.get(id) {
            Some(o) => o.svc_id,
            None => self.ids.fresh_service(),
        };
        // Place first, while the old entries still hold their backend ids, so a backend
        // that stays keeps its id and is not rewritten; then drop the old entries.
        let mut scratch = MapContent::default();
        let owned = place(state, svc_id, &mut self.ids, &mut scratch);
        for b in scratch.backends.keys() {
            *self.backend_refs.entry(*b).or_default() += 1;
        }
        self.remove(id, t);
        for (k, v) in scratch.services {
            t.services
                .entry(k)
                .or_insert_with(|| self.content.services.get(&k).copied());
            if self.content.services.insert(k, v).is_none() && k.slot == 0 {
                self.frontends += 1;
            }
        }
        for (b, v) in scratch.backends {
            t.backends
                .entry(b)
                .or_insert_with(|| self.content.backends.get(&b).copied());
            self.content.backends.insert(b, v);
        }
        for m in scratch.members {
            t.members
                .entry(m)
                .or_insert_with(|| self.content.members.contains(&m));
            self.content.members.insert(m);
        }
        self.owners.insert(id.clone(), owned);
        Ok(())
    }

    fn check_capacity(
        &self,
        id: &ServicePortId,
        state: &ServicePortState,
        cap: Capacity,
    ) -> Result<(), PlanError> {
        let (entries, tuples) = footprint(state);
        let old = self.owners.get(id);
        let old_entries = old.map_or(0, |o| o.keys(&self.content).count() as u32);
        let used = self.content.services.len() as u32 - old_entries;
        PlanError::check_room(id, MapKind::Services, entries, used, cap)?;
        // Backends after the change: the new tuples nobody has yet come in, and the ones
        // only this ServicePort used and no longer needs go out.
        let fresh = tuples
            .iter()
            .filter(|t| !self.ids.backends.contains_key(t))
            .count() as u32;
        let freed = old.map_or(0, |o| {
            o.backends(&self.content)
                .iter()
                .filter(|b| self.backend_refs.get(b).copied().unwrap_or(0) <= 1)
                .filter(|b| {
                    self.content
                        .backends
                        .get(b)
                        .is_none_or(|v| !tuples.contains(&(v.addr, v.port, v.proto)))
                })
                .count() as u32
        });
        let used_b = (self.content.backends.len() as u32).saturating_sub(freed);
        PlanError::check_room(id, MapKind::Backends, fresh, used_b, cap)
    }

    /// The writes for everything touched: old values against the new content.
    fn plan_touched(&self, t: &Touched) -> Plan {
        let mut old = MapContent::default();
        let mut new = MapContent::default();
        for (k, before) in &t.services {
            if let Some(v) = before {
                old.services.insert(*k, *v);
            }
            if let Some(v) = self.content.services.get(k) {
                new.services.insert(*k, *v);
            }
        }
        for (b, before) in &t.backends {
            if let Some(v) = before {
                old.backends.insert(*b, *v);
            }
            if let Some(v) = self.content.backends.get(b) {
                new.backends.insert(*b, *v);
            }
        }
        for (m, before) in &t.members {
            if *before {
                old.members.insert(*m);
            }
            if self.content.members.contains(m) {
                new.members.insert(*m);
            }
        }
        diff(&old, &new)
    }

    /// ServicePorts currently programmed, with what they own.
    pub fn owners(&self) -> impl Iterator<Item = (&ServicePortId, &Owned)> {
        self.owners.iter()
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends
    }
}

/// Each distinct value of a sorted list with the number of times it occurs.
fn run_lengths(sorted: &[u32]) -> BTreeMap<u32, u32> {
    // In chunks: `collect` would hold every pair in a list and a sort buffer beside the
    // tree (8 MiB for 400,000 backends at the peak of the first plan).
    let mut out: crate::btree::Chunked<BTreeMap<u32, u32>> = Default::default();
    for run in sorted.chunk_by(|a, b| a == b) {
        out.push((run[0], run.len() as u32));
    }
    out.build()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeSet;

    use ferry_common::lb::ServiceKey;

    use super::*;
    use crate::dataplane::plan::{
        fmt_endpoint,
        tests::{apply, desired, docs, web},
    };
    use crate::model::DesiredState;

    /// [`Programmed::full`] of a copy of `desired`, as a tuple.
    pub(crate) fn full_of(
        desired: &DesiredState,
        current: &MapContent,
        cap: Capacity,
    ) -> (Programmed, Plan, Vec<PlanError>) {
        let full = Programmed::full(desired.services.values().cloned(), current, cap);
        (full.programmed, full.plan, full.errors)
    }

    /// What the datapath would do, independent of ids: per frontend, its flags and the
    /// backends its slots reach.
    fn semantic(c: &MapContent) -> BTreeMap<String, (u16, BTreeSet<String>)> {
        c.services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(k, v)| {
                let backends = (1..=v.count)
                    .map(|slot| {
                        let id = c.services[&ServiceKey { slot, ..*k }].backend_id;
                        let b = c.backends[&id];
                        fmt_endpoint(&b.addr, u16::from_be(b.port))
                    })
                    .collect();
                (
                    fmt_endpoint(&k.addr, u16::from_be(k.port)),
                    (v.flags, backends),
                )
            })
            .collect()
    }

    /// The changes between two desired states, as the agent computes them.
    fn changes<'a>(
        before: &DesiredState,
        after: &'a DesiredState,
    ) -> Vec<(ServicePortId, Option<&'a ServicePortState>)> {
        let mut out: Vec<_> = before
            .services
            .keys()
            .filter(|id| !after.services.contains_key(id))
            .map(|id| (id.clone(), None))
            .collect();
        for (id, s) in &after.services {
            if before.services.get(id) != Some(s) {
                out.push((id.clone(), Some(s)));
            }
        }
        out
    }

    /// Runs `steps` incrementally; after each, the simulated kernel equals the planned
    /// content and means the same as a full plan from scratch.
    fn run(steps: &[String]) -> Vec<Plan> {
        let cap = Capacity::default();
        let mut kernel = MapContent::default();
        let mut prev = DesiredState::default();
        let (mut p, _, _) = full_of(&prev, &kernel, cap);
        let mut plans = Vec::new();
        for (i, yaml) in steps.iter().enumerate() {
            let next = desired(yaml);
            let (plan, errors) = p.update(&changes(&prev, &next), cap);
            assert!(errors.is_empty(), "step {i}: {errors:?}");
            kernel = apply(&kernel, &plan);
            assert_eq!(
                kernel, p.content,
                "step {i}: the kernel must hold what was planned"
            );
            let (full, _, _) = full_of(&next, &MapContent::default(), cap);
            assert_eq!(
                semantic(&p.content),
                semantic(&full.content),
                "step {i}: incremental != full"
            );
            let used: BTreeSet<u32> = p
                .owners
                .values()
                .flat_map(|o| o.backends(&p.content))
                .collect();
            let stored: BTreeSet<u32> = p.content.backends.keys().copied().collect();
            assert_eq!(
                used, stored,
                "step {i}: backends stored must be exactly those referenced"
            );
            let frontends = p.content.services.keys().filter(|k| k.slot == 0).count();
            assert_eq!(
                p.frontend_count(),
                frontends,
                "step {i}: the frontend counter must follow the map"
            );
            plans.push(plan);
            prev = next;
        }
        plans
    }

    #[test]
    fn incremental_matches_full_through_changes() {
        run(&[
            docs(&[
                web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
                web("b", "10.96.0.2", &["10.0.0.2"]),
            ]),
            // b grows, sharing 10.0.0.1 with a
            docs(&[
                web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
                web("b", "10.96.0.2", &["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
            ]),
            // a loses everything (reject), c appears
            docs(&[
                web("a", "10.96.0.1", &[]),
                web("b", "10.96.0.2", &["10.0.0.1", "10.0.0.3"]),
                web("c", "10.96.0.3", &["10.0.0.9"]),
            ]),
            // a removed, c moves to a's ClusterIP
            docs(&[
                web("b", "10.96.0.2", &["10.0.0.3"]),
                web("c", "10.96.0.1", &["10.0.0.9"]),
            ]),
            String::new(),
        ]);
    }

    #[test]
    fn a_change_touches_only_its_service() {
        let plans = run(&[
            docs(&[
                web("a", "10.96.0.1", &["10.0.0.1"]),
                web("b", "10.96.0.2", &["10.0.0.5"]),
            ]),
            docs(&[
                web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
                web("b", "10.96.0.2", &["10.0.0.5"]),
            ]),
        ]);
        let p = &plans[1];
        let b_vip = crate::dataplane::plan::addr_of(&"10.96.0.2".parse().unwrap());
        let touched: Vec<&ServiceKey> = p
            .frontends
            .iter()
            .flat_map(|f| {
                f.slot_upserts
                    .iter()
                    .map(|(k, _)| k)
                    .chain([&f.slot0])
                    .chain(&f.slot_deletes)
            })
            .chain(&p.frontend_deletes)
            .collect();
        assert!(
            touched.iter().all(|k| k.addr != b_vip),
            "b must not be rewritten: {touched:?}"
        );
        assert_eq!(
            p.backend_upserts.len(),
            1,
            "only the new backend is written: {p:?}"
        );
        assert!(
            p.backend_deletes.is_empty() && p.member_deletes.is_empty(),
            "{p:?}"
        );
    }

    #[test]
    fn unchanged_state_plans_nothing_and_full_adoption_writes_nothing() {
        let state = desired(&docs(&[web("a", "10.96.0.1", &["10.0.0.1"])]));
        let (p, _, _) = full_of(&state, &MapContent::default(), Capacity::default());
        assert!(
            p.ids.services.is_empty(),
            "the owners hold the ids: a full plan keeps no id table of its own"
        );
        assert_eq!(p.backend_refs, BTreeMap::from([(1, 1)]));
        let kernel = p.content.clone(); // what KernelMaps::fill writes
        // A restarted agent plans the same state against what is pinned: no writes.
        let (_, again, _) = full_of(&state, &kernel, Capacity::default());
        assert!(again.is_empty(), "restart must write nothing: {again:?}");
        let mut p = p;
        let (none, errors) = p.update(&[], Capacity::default());
        assert!(none.is_empty() && errors.is_empty());
    }

    /// Service ids index the per-Service counter array: under churn they must stay as
    /// few as the live Services, and an id is reused only by a plan after the one that
    /// released it (which zeroes its counter).
    #[test]
    fn service_ids_are_recycled_after_their_release() {
        let svc = |i: u32| web(&format!("s{i}"), &format!("10.96.1.{i}"), &["10.0.0.1"]);
        let ids =
            |p: &Programmed| -> BTreeSet<u32> { p.owners.values().map(|o| o.svc_id).collect() };
        let mut steps = Vec::new();
        for round in 0..20u32 {
            // Two live Services, a different pair each round.
            steps.push(docs(&[svc(round + 1), svc(round + 2)]));
        }
        let cap = Capacity::default();
        let mut p = full_of(&DesiredState::default(), &MapContent::default(), cap).0;
        let mut prev = DesiredState::default();
        let mut released_before = BTreeSet::new();
        for (i, yaml) in steps.iter().enumerate() {
            let next = desired(yaml);
            let (plan, errors) = p.update(&changes(&prev, &next), cap);
            assert!(errors.is_empty(), "{errors:?}");
            let live = ids(&p);
            assert!(
                live.iter().all(|id| *id <= 3),
                "step {i}: ids stay within the live count plus the ones in release: {live:?}"
            );
            let released: BTreeSet<u32> = plan.released_services.iter().copied().collect();
            assert!(
                released.is_disjoint(&live),
                "step {i}: a released id is not reused by the plan that releases it"
            );
            released_before = released;
            prev = next;
        }
        assert_eq!(released_before.len(), 1, "one Service goes each round");
        // A full plan against the kernel content releases what the desired state drops.
        let (_, plan, _) = full_of(&desired(&docs(&[svc(100)])), &p.content, cap);
        assert_eq!(plan.released_services.len(), 2, "{plan:?}");
    }

    #[test]
    fn growth_past_capacity_keeps_the_old_state() {
        let cap = Capacity {
            services: 4,
            backends: 10,
        };
        let one = desired(&docs(&[web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"])]));
        let (mut p, plan, errors) = full_of(&one, &MapContent::default(), cap);
        assert!(errors.is_empty());
        assert!(
            plan.is_empty(),
            "empty maps are filled from the content, not through a plan"
        );
        let kernel = p.content.clone(); // what KernelMaps::fill writes
        let four = desired(&docs(&[web(
            "a",
            "10.96.0.1",
            &["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"],
        )]));
        let (plan, errors) = p.update(&changes(&one, &four), cap);
        assert!(
            matches!(
                errors.as_slice(),
                [PlanError::MapFull {
                    flag: "max-services",
                    ..
                }]
            ),
            "{errors:?}"
        );
        assert!(plan.is_empty(), "nothing may be written: {plan:?}");
        assert_eq!(apply(&kernel, &plan), p.content);
        assert_eq!(
            semantic(&p.content),
            semantic(&full_of(&one, &MapContent::default(), cap).0.content)
        );
    }

    #[test]
    fn replacing_all_backends_at_backend_capacity_fits() {
        // {1,2} -> {3,4} with room for exactly 2 backends: the old ones are freed.
        let cap = Capacity {
            services: 100,
            backends: 2,
        };
        let before = desired(&docs(&[web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"])]));
        let after = desired(&docs(&[web("a", "10.96.0.1", &["10.0.0.3", "10.0.0.4"])]));
        let (mut p, _, _) = full_of(&before, &MapContent::default(), cap);
        let (_, errors) = p.update(&changes(&before, &after), cap);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(p.content.backends.len(), 2);
    }
}
