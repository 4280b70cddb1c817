//! ferry's VXLAN overlay (`--overlay vxlan`): one VXLAN device, `ferry.vxlan`, without
//! learning. Every other node is an FDB entry (its MAC -> its underlay address) and one
//! permanent neighbour per pod CIDR (its endpoint address -> its MAC); the routes in
//! [`super::routes`] go `onlink` via those endpoint addresses. MACs are derived from the
//! underlay addresses ([`super::plan::vtep_mac`]), so nothing has to be published on
//! the Node objects. The device and every entry on it are ferry's: entries that no node
//! wants are removed.

use ferry_cni::{
    ipam::Cidr as NlCidr,
    netlink::{Neighbour, Netlink, RT_SCOPE_UNIVERSE},
};

use super::plan::{VXLAN_DEVICE, VXLAN_PORT, VXLAN_VNI, VxlanPlan, vxlan_overhead};

/// Makes the device match `plan` (created, or re-created when its MAC, MTU or underlay
/// changed), up, with its addresses and exactly the planned entries. Returns its index.
/// Blocking (netlink).
pub fn reconcile(
    nl: &mut Netlink,
    plan: &VxlanPlan,
    mtu: u32,
    errors: &mut Vec<String>,
) -> Option<i32> {
    let local = plan.local?;
    let dev_mtu = mtu - vxlan_overhead(local);
    let existing = match nl.link(VXLAN_DEVICE) {
        Ok(l) => l,
        Err(e) => {
            errors.push(format!("looking up {VXLAN_DEVICE}: {e}"));
            return None;
        }
    };
    let link = match existing {
        Some(l) if l.mac == plan.mac && l.mtu == dev_mtu => l,
        stale => {
            if stale.is_some() {
                tracing::info!(
                    device = VXLAN_DEVICE,
                    "pod network: re-creating the VXLAN device (its MAC or MTU changed)"
                );
                if let Err(e) = nl.delete_link(VXLAN_DEVICE) {
                    errors.push(format!("deleting the old {VXLAN_DEVICE}: {e}"));
                    return None;
                }
            }
            if let Err(e) = nl.create_vxlan(
                VXLAN_DEVICE,
                VXLAN_VNI,
                local,
                VXLAN_PORT,
                plan.mac,
                dev_mtu,
            ) {
                errors.push(format!("creating {VXLAN_DEVICE} (VNI {VXLAN_VNI}, local {local}, port {VXLAN_PORT}): {e}"));
                return None;
            }
            tracing::info!(device = VXLAN_DEVICE, %local, mtu = dev_mtu, "pod network: VXLAN device created");
            match nl.link(VXLAN_DEVICE) {
                Ok(Some(l)) => l,
                other => {
                    errors.push(format!(
                        "{VXLAN_DEVICE} is not there after creating it: {other:?}"
                    ));
                    return None;
                }
            }
        }
    };
    if !link.up
        && let Err(e) = nl.set_up(link.index)
    {
        errors.push(format!("setting {VXLAN_DEVICE} up: {e}"));
    }
    let have = nl.addresses(link.index).unwrap_or_default();
    for a in &plan.addresses {
        let want = NlCidr::host(*a);
        if !have.contains(&want)
            && let Err(e) = nl.add_address(link.index, want, RT_SCOPE_UNIVERSE)
        {
            errors.push(format!("adding {a} to {VXLAN_DEVICE}: {e}"));
        }
    }
    let want_fdb: Vec<Neighbour> = plan
        .fdb
        .iter()
        .map(|(mac, ip)| Neighbour { ip: *ip, mac: *mac })
        .collect();
    let want_neigh: Vec<Neighbour> = plan
        .neighbours
        .iter()
        .map(|(ip, mac)| Neighbour { ip: *ip, mac: *mac })
        .collect();
    sync_entries(
        "FDB entry",
        nl.fdb(link.index),
        &want_fdb,
        |nl, n| nl.replace_fdb(link.index, n),
        |nl, n| nl.delete_fdb(link.index, n).map(drop),
        nl,
        errors,
    );
    sync_entries(
        "neighbour",
        nl.neighbours(link.index),
        &want_neigh,
        |nl, n| nl.replace_neighbour(link.index, n),
        |nl, n| nl.delete_neighbour(link.index, n).map(drop),
        nl,
        errors,
    );
    Some(link.index)
}

/// Adds the wanted entries that are missing and removes those no node wants.
fn sync_entries<E: std::fmt::Display>(
    what: &str,
    have: Result<Vec<Neighbour>, E>,
    want: &[Neighbour],
    mut add: impl FnMut(&mut Netlink, &Neighbour) -> Result<(), E>,
    mut del: impl FnMut(&mut Netlink, &Neighbour) -> Result<(), E>,
    nl: &mut Netlink,
    errors: &mut Vec<String>,
) {
    let have = match have {
        Ok(h) => h,
        Err(e) => {
            errors.push(format!("listing the {what}s of {VXLAN_DEVICE}: {e}"));
            return;
        }
    };
    for n in want.iter().filter(|n| !have.contains(n)) {
        if let Err(e) = add(nl, n) {
            errors.push(format!(
                "{VXLAN_DEVICE} {what} {} {}: {e}",
                n.ip,
                mac(&n.mac)
            ));
        }
    }
    for n in have.iter().filter(|n| !want.contains(n)) {
        if let Err(e) = del(nl, n) {
            errors.push(format!("removing {VXLAN_DEVICE} {what} {}: {e}", n.ip));
        }
    }
}

fn mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Removes the device (overlay turned off); its routes and entries go with it.
pub fn remove(nl: &mut Netlink, errors: &mut Vec<String>) {
    match nl.delete_link(VXLAN_DEVICE) {
        Ok(true) => tracing::info!(
            device = VXLAN_DEVICE,
            "pod network: VXLAN device removed (no overlay)"
        ),
        Ok(false) => {}
        Err(e) => errors.push(format!("removing {VXLAN_DEVICE}: {e}")),
    }
}
