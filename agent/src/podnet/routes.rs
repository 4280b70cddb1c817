//! The routes to the other nodes' pod CIDRs in the main table, kept equal to the plan.
//!
//! Every route the agent makes carries the protocol number [`RTPROT_FERRY`] (`ip route`
//! shows `proto 245`), and only routes with that number are ever replaced or removed: a
//! route of another owner to the same CIDR is reported and left alone. A restarted agent
//! finds its routes by that number and changes nothing when they are still right.

use std::collections::BTreeSet;

use ferry_cni::{
    ipam::Cidr as NlCidr,
    netlink::{Netlink, RT_SCOPE_UNIVERSE, Route},
};

use super::plan::PodRoute;
use crate::model::Cidr;

/// The routing protocol number of ferry's routes (unassigned by iproute2's rt_protos).
pub const RTPROT_FERRY: u8 = 245;

/// What one reconcile did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RouteReport {
    pub added: Vec<PodRoute>,
    pub removed: Vec<Cidr>,
    pub errors: Vec<String>,
}

impl RouteReport {
    pub fn changed(&self) -> bool {
        !self.added.is_empty() || !self.removed.is_empty()
    }
}

fn nl_cidr(c: &Cidr) -> NlCidr {
    NlCidr {
        addr: c.addr,
        prefix: c.len,
    }
}

/// The kernel route for `w`; overlay routes go `onlink` through the VXLAN device `vxlan`.
fn ours(w: &PodRoute, vxlan: Option<i32>) -> Route {
    Route {
        dst: nl_cidr(&w.dst),
        gateway: Some(w.via),
        oif: if w.overlay { vxlan } else { None },
        scope: RT_SCOPE_UNIVERSE,
        protocol: RTPROT_FERRY,
        onlink: w.overlay,
    }
}

/// Makes ferry's routes in the main table exactly `want`; `vxlan` is the index of the
/// overlay device (overlay routes are skipped without one). Blocking (netlink).
pub fn reconcile(nl: &mut Netlink, want: &BTreeSet<PodRoute>, vxlan: Option<i32>) -> RouteReport {
    let mut report = RouteReport::default();
    let have = match nl.routes() {
        Ok(r) => r,
        Err(e) => {
            report.errors.push(format!("listing the routes: {e}"));
            return report;
        }
    };
    let to_agent = |r: &Route| Cidr::new(r.dst.addr, r.dst.prefix);
    for w in want {
        let same_dst: Vec<&Route> = have.iter().filter(|r| to_agent(r) == Some(w.dst)).collect();
        let route = ours(w, vxlan);
        if w.overlay && vxlan.is_none() {
            continue;
        }
        if same_dst.iter().any(|r| {
            r.protocol == RTPROT_FERRY
                && r.gateway == route.gateway
                && r.onlink == route.onlink
                && (route.oif.is_none() || r.oif == route.oif)
        }) {
            continue;
        }
        if let Some(other) = same_dst.iter().find(|r| r.protocol != RTPROT_FERRY) {
            report.errors.push(format!(
                "route to {} exists already and is not ferry's (protocol {}, via {:?}): left alone, pods of that CIDR are not routed by ferry",
                w.dst, other.protocol, other.gateway
            ));
            continue;
        }
        // Replaces ferry's own route to the CIDR if its gateway changed.
        match nl.add_route(&route) {
            Ok(()) => report.added.push(*w),
            Err(e) if w.overlay => report.errors.push(format!("adding route {w}: {e}")),
            Err(e) => report.errors.push(format!(
                "adding route {w}: {e} (a node's InternalIP must be on a link this node shares; otherwise use --overlay vxlan)"
            )),
        }
    }
    let wanted: BTreeSet<Cidr> = want.iter().map(|w| w.dst).collect();
    for r in have.iter().filter(|r| r.protocol == RTPROT_FERRY) {
        let Some(dst) = to_agent(r) else { continue };
        if wanted.contains(&dst) {
            continue;
        }
        match nl.delete_route(r) {
            Ok(_) => report.removed.push(dst),
            Err(e) => report
                .errors
                .push(format!("removing route {dst} (its node is gone): {e}")),
        }
    }
    report
}
