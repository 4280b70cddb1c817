//! The CNI commands: the store and netlink put to work.

use std::{fs::File, net::IpAddr, path::Path};

use serde_json::Value;

use crate::{
    config::{Attachment, Env, NetConf},
    error::{self, Error, Result},
    ipam::Cidr,
    netlink::{Link, Netlink, RT_SCOPE_LINK, RT_SCOPE_UNIVERSE, RTPROT_STATIC, Route},
    plan::{default_dst, gateway, host_address, host_veth_name},
    result::{Interface, PodAddress, add_result, mac_string},
    store::Store,
};

/// ADD: allocate (or find) the attachment's addresses, persist them, then wire the veth
/// pair. On failure the interfaces and the addresses are given back.
pub fn add(env: &Env, conf: &NetConf) -> Result<Value> {
    let att = env.attachment()?;
    let netns = env.netns()?;
    let ns = File::open(&netns).map_err(|e| {
        Error::env(
            "CNI_NETNS",
            format!("cannot open network namespace {netns}: {e}"),
        )
    })?;
    let ips = Store::lock(&conf.data_dir, &conf.name)?.allocate(&conf.ranges, &att)?;
    let addrs: Vec<PodAddress> = ips
        .iter()
        .zip(&conf.ranges)
        .map(|(ip, range)| PodAddress {
            ip: *ip,
            gateway: gateway(range),
        })
        .collect();
    match wire(conf, &att, &netns, &ns, &addrs) {
        Ok((host, pod)) => Ok(add_result(
            &conf.cni_version,
            conf.prev_result.as_ref(),
            &host,
            &pod,
            &addrs,
        )),
        Err(e) => {
            let host = host_veth_name(&conf.name, &att);
            if let Ok(mut nl) = Netlink::open() {
                let _ = nl.delete_link(&host);
            }
            if let Ok(store) = Store::lock(&conf.data_dir, &conf.name) {
                for ip in ips {
                    let _ = store.release(ip);
                }
            }
            Err(e)
        }
    }
}

fn wire(
    conf: &NetConf,
    att: &Attachment,
    netns: &str,
    ns: &File,
    addrs: &[PodAddress],
) -> Result<(Interface, Interface)> {
    let host_name = host_veth_name(&conf.name, att);
    let ifname = &att.ifname;
    let mut host = Netlink::open().map_err(|e| Error::netlink(format!("netlink socket: {e}")))?;
    // A retried ADD: the pair of the earlier attempt goes (with its peer in the pod).
    host.delete_link(&host_name)
        .map_err(|e| Error::netlink(format!("deleting stale host veth {host_name}: {e}")))?;
    host.create_veth(&host_name, ifname, ns, conf.mtu)
        .map_err(|e| {
            if e.errno == libc::EEXIST {
                Error::netlink(format!("an interface {ifname} already exists in {netns}"))
            } else {
                Error::netlink(format!(
                    "creating veth {host_name} with peer {ifname} in {netns}: {e}"
                ))
            }
        })?;

    let mut pod = Netlink::in_netns(Path::new(netns))
        .map_err(|e| Error::netlink(format!("entering network namespace {netns}: {e}")))?;
    let pod_link = find_link(&mut pod, ifname, netns)?;
    pod.set_up(pod_link.index)
        .map_err(|e| Error::netlink(format!("setting {ifname} up in {netns}: {e}")))?;
    for a in addrs {
        let addr = Cidr::host(a.ip);
        pod.add_address(pod_link.index, addr, RT_SCOPE_UNIVERSE)
            .map_err(|e| Error::netlink(format!("adding {addr} to {ifname} in {netns}: {e}")))?;
        for r in pod_routes(pod_link.index, a) {
            pod.add_route(&r).map_err(|e| {
                Error::netlink(format!(
                    "adding route {} to {ifname} in {netns}: {e}",
                    r.dst
                ))
            })?;
        }
    }

    let host_link = find_link(&mut host, &host_name, "the host namespace")?;
    host.set_up(host_link.index)
        .map_err(|e| Error::netlink(format!("setting {host_name} up: {e}")))?;
    for a in addrs {
        let gw = host_address(a.gateway);
        let scope = if a.gateway.is_ipv4() {
            RT_SCOPE_UNIVERSE
        } else {
            RT_SCOPE_LINK
        };
        host.add_address(host_link.index, gw, scope)
            .map_err(|e| Error::netlink(format!("adding {gw} to {host_name}: {e}")))?;
        let r = host_route(host_link.index, a.ip);
        host.add_route(&r)
            .map_err(|e| Error::netlink(format!("adding route {} via {host_name}: {e}", r.dst)))?;
    }
    Ok((
        Interface {
            name: host_name,
            mac: mac_string(&host_link.mac),
            mtu: conf.mtu,
            sandbox: None,
        },
        Interface {
            name: ifname.clone(),
            mac: mac_string(&pod_link.mac),
            mtu: conf.mtu,
            sandbox: Some(netns.to_string()),
        },
    ))
}

/// In the pod: the gateway on the link, then the default route via it.
fn pod_routes(index: i32, a: &PodAddress) -> [Route; 2] {
    [
        Route {
            dst: Cidr::host(a.gateway),
            gateway: None,
            oif: Some(index),
            scope: RT_SCOPE_LINK,
            protocol: RTPROT_STATIC,
            onlink: false,
        },
        Route {
            dst: default_dst(a.ip.is_ipv4()),
            gateway: Some(a.gateway),
            oif: Some(index),
            scope: RT_SCOPE_UNIVERSE,
            protocol: RTPROT_STATIC,
            onlink: false,
        },
    ]
}

/// On the node: the pod's address via its host veth.
fn host_route(index: i32, pod: IpAddr) -> Route {
    Route {
        dst: Cidr::host(pod),
        gateway: None,
        oif: Some(index),
        scope: RT_SCOPE_LINK,
        protocol: RTPROT_STATIC,
        onlink: false,
    }
}

fn find_link(nl: &mut Netlink, name: &str, place: &str) -> Result<Link> {
    nl.link(name)
        .map_err(|e| Error::netlink(format!("looking up {name} in {place}: {e}")))?
        .ok_or_else(|| Error::netlink(format!("{name} not found in {place}")))
}

/// DEL: the host veth goes (its peer in the pod with it), then the addresses. What is
/// already gone is fine: a missing netns, veth or allocation.
pub fn del(env: &Env, conf: &NetConf) -> Result<()> {
    let att = env.attachment()?;
    let host_name = host_veth_name(&conf.name, &att);
    let mut host = Netlink::open().map_err(|e| Error::netlink(format!("netlink socket: {e}")))?;
    host.delete_link(&host_name)
        .map_err(|e| Error::netlink(format!("deleting host veth {host_name}: {e}")))?;
    let store = Store::lock(&conf.data_dir, &conf.name)?;
    for ip in store.of(&att)? {
        store.release(ip)?;
    }
    Ok(())
}

/// CHECK: the allocation, the pod's interface with its addresses and routes, and the
/// host veth with the gateway address and the routes to the pod, as ADD made them.
pub fn check(env: &Env, conf: &NetConf) -> Result<()> {
    let att = env.attachment()?;
    let netns = env.netns()?;
    let expected = conf.prev_addresses(&att.ifname)?;
    let ips = Store::lock(&conf.data_dir, &conf.name)?.of(&att)?;
    if ips.is_empty() {
        return Err(Error::check(format!(
            "no address is allocated to container {} interface {}",
            att.container_id, att.ifname
        )));
    }
    for ip in &expected {
        if !ips.contains(ip) {
            return Err(Error::check(format!(
                "prevResult lists {ip}, but the IPAM store holds {ips:?} for container {} interface {}",
                att.container_id, att.ifname
            )));
        }
    }
    if !Path::new(&netns).exists() {
        return Err(Error::new(
            error::UNKNOWN_CONTAINER,
            "container unknown",
            format!("network namespace {netns} does not exist"),
        ));
    }
    let addrs: Vec<PodAddress> = ips
        .iter()
        .filter_map(|ip| {
            let range = conf.ranges.iter().find(|r| r.contains(*ip))?;
            Some(PodAddress {
                ip: *ip,
                gateway: gateway(range),
            })
        })
        .collect();
    let ifname = &att.ifname;
    let host_name = host_veth_name(&conf.name, &att);

    let mut pod = Netlink::in_netns(Path::new(&netns))
        .map_err(|e| Error::check(format!("entering network namespace {netns}: {e}")))?;
    let link = pod
        .link(ifname)
        .map_err(|e| Error::check(format!("looking up {ifname} in {netns}: {e}")))?
        .ok_or_else(|| Error::check(format!("interface {ifname} is missing in {netns}")))?;
    if !link.up {
        return Err(Error::check(format!(
            "interface {ifname} in {netns} is down"
        )));
    }
    if link.mtu != conf.mtu {
        return Err(Error::check(format!(
            "interface {ifname} in {netns} has MTU {}, expected {}",
            link.mtu, conf.mtu
        )));
    }
    let have = pod
        .addresses(link.index)
        .map_err(|e| Error::check(format!("listing addresses of {ifname} in {netns}: {e}")))?;
    let routes = pod
        .routes()
        .map_err(|e| Error::check(format!("listing routes in {netns}: {e}")))?;
    for a in &addrs {
        let addr = Cidr::host(a.ip);
        if !have.contains(&addr) {
            return Err(Error::check(format!(
                "address {addr} is missing on {ifname} in {netns} (it has {})",
                list(&have)
            )));
        }
        for want in pod_routes(link.index, a) {
            if !routes
                .iter()
                .any(|r| r.dst == want.dst && r.oif == want.oif && r.gateway == want.gateway)
            {
                let what = match want.gateway {
                    Some(gw) => format!("default route via {gw} dev {ifname}"),
                    None => format!("route {} dev {ifname}", want.dst),
                };
                return Err(Error::check(format!("{what} is missing in {netns}")));
            }
        }
    }

    let mut host = Netlink::open().map_err(|e| Error::check(format!("netlink socket: {e}")))?;
    let hl = host
        .link(&host_name)
        .map_err(|e| Error::check(format!("looking up {host_name}: {e}")))?
        .ok_or_else(|| Error::check(format!("host veth {host_name} is missing")))?;
    if !hl.up {
        return Err(Error::check(format!("host veth {host_name} is down")));
    }
    if link.peer_index != Some(hl.index) {
        return Err(Error::check(format!(
            "{ifname} in {netns} is not the peer of host veth {host_name}"
        )));
    }
    let host_addrs = host
        .addresses(hl.index)
        .map_err(|e| Error::check(format!("listing addresses of {host_name}: {e}")))?;
    let host_routes = host
        .routes()
        .map_err(|e| Error::check(format!("listing routes of the host: {e}")))?;
    for a in &addrs {
        let gw = host_address(a.gateway);
        if !host_addrs.contains(&gw) {
            return Err(Error::check(format!(
                "gateway address {gw} is missing on {host_name}"
            )));
        }
        let want = host_route(hl.index, a.ip);
        if !host_routes
            .iter()
            .any(|r| r.dst == want.dst && r.oif == want.oif)
        {
            return Err(Error::check(format!(
                "host route {} dev {host_name} is missing",
                want.dst
            )));
        }
    }
    Ok(())
}

fn list(c: &[Cidr]) -> String {
    if c.is_empty() {
        return "none".into();
    }
    c.iter().map(Cidr::to_string).collect::<Vec<_>>().join(", ")
}

/// GC: frees the allocations (and the host veths) of every attachment not in
/// `cni.dev/valid-attachments`, going on past errors and reporting them all.
pub fn gc(conf: &NetConf) -> Result<()> {
    let store = Store::lock(&conf.data_dir, &conf.name)?;
    let mut nl = Netlink::open().map_err(|e| Error::netlink(format!("netlink socket: {e}")))?;
    let mut failures = Vec::new();
    for a in store.allocations()? {
        if conf.valid_attachments.contains(&a.owner) {
            continue;
        }
        let host_name = host_veth_name(&conf.name, &a.owner);
        if let Err(e) = nl.delete_link(&host_name) {
            failures.push(format!("deleting host veth {host_name}: {e}"));
            continue;
        }
        if let Err(e) = store.release(a.ip) {
            failures.push(e.details);
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Error::new(
            error::GC_INCOMPLETE,
            "GC left stale resources",
            failures.join("; "),
        ))
    }
}

/// STATUS: ready when the store can be locked and every pod CIDR has a free address.
pub fn status(conf: &NetConf) -> Result<()> {
    let unavailable =
        |details: String| Error::new(error::NOT_AVAILABLE, "plugin not available", details);
    let store = Store::lock(&conf.data_dir, &conf.name).map_err(|e| unavailable(e.details))?;
    match store
        .exhausted(&conf.ranges)
        .map_err(|e| unavailable(e.details))?
    {
        Some(range) => Err(unavailable(format!("no free address in pod CIDR {range}"))),
        None => Ok(()),
    }
}
