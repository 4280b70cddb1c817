//! The pod network's fast path: `ferry-podnet.bpf.o` (ebpf/src/podnet.rs) on the pods'
//! host veths and on the devices other nodes' pod traffic arrives on, so that pod-to-pod
//! packets skip the node's forwarding path (netfilter, conntrack, a veth backlog queue).
//!
//! The links are held by this process, not pinned: when the agent stops, the programs go
//! with it and pod traffic takes the kernel's path again, which works on its own (the
//! routes and the CNI wiring stay). The programs only ever forward what the kernel's FIB
//! and neighbour tables say, so both paths deliver the same packets to the same places.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use aya::{
    Ebpf,
    maps::{
        HashMap as BpfHashMap, PerCpuArray,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        tc::{SchedClassifierLink, TcAttachOptions},
    },
};
use ferry_common::podnet::{
    DEST_LOCAL, DEST_REMOTE, PODNET_FROM_POD, PODNET_TO_POD, PodnetConfig, PodnetDest,
};
use tracing::info;

use crate::{model::Cidr, node};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ferry-podnet.bpf.o"));

const FROM_POD: &str = "ferry_podnet_from_pod";
const TO_POD: &str = "ferry_podnet_to_pod";
const DEST4: &str = "FERRY_PODNET_DEST4";
const DEST6: &str = "FERRY_PODNET_DEST6";
const VETHS: &str = "FERRY_PODNET_VETHS";
const CONFIG: &str = "FERRY_PODNET_CONFIG";
const COUNTERS: &str = "FERRY_PODNET_COUNTERS";

/// Packets the fast path forwarded since the programs were loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastPathCounters {
    pub from_pod: u64,
    pub to_pod: u64,
}

pub struct FastPath {
    ebpf: Ebpf,
    /// `ferry_podnet_from_pod` on each pod's host veth, by ifindex (with its name).
    veths: HashMap<u32, (String, SchedClassifierLink)>,
    /// `ferry_podnet_to_pod` on the uplinks and the VXLAN device, by name (with ifindex).
    uplinks: BTreeMap<String, (u32, SchedClassifierLink)>,
    /// What the destination tries hold.
    dest: BTreeMap<Cidr, PodnetDest>,
    /// What `FERRY_PODNET_CONFIG` holds.
    config: Option<PodnetConfig>,
}

impl FastPath {
    /// Loads the programs (verifier) and creates their maps; attaches nothing.
    pub fn load() -> Result<FastPath, String> {
        if OBJECT.is_empty() {
            return Err(
                "the agent was built without ferry-podnet.bpf.o; run `cargo xtask build`".into(),
            );
        }
        let mut ebpf =
            Ebpf::load(OBJECT).map_err(|e| format!("loading ferry-podnet.bpf.o: {e}"))?;
        for name in [FROM_POD, TO_POD] {
            program(&mut ebpf, name)?
                .load()
                .map_err(|e| format!("loading {name} (verifier): {e}"))?;
        }
        Ok(FastPath {
            ebpf,
            veths: HashMap::new(),
            uplinks: BTreeMap::new(),
            dest: BTreeMap::new(),
            config: None,
        })
    }

    /// The pod CIDRs: this node's, and the other nodes' (each with its node's IPv4
    /// underlay address when the fast path encapsulates to it). Entries no longer wanted
    /// go.
    pub fn set_destinations(
        &mut self,
        own: &[Cidr],
        others: &[(Cidr, Option<std::net::Ipv4Addr>)],
        problems: &mut Vec<String>,
    ) {
        let mut want: BTreeMap<Cidr, PodnetDest> = others
            .iter()
            .map(|(c, tunnel)| {
                let tunnel_v4 = tunnel.map_or(0, |a| u32::from_ne_bytes(a.octets()));
                (
                    *c,
                    PodnetDest {
                        kind: DEST_REMOTE,
                        tunnel_v4,
                    },
                )
            })
            .collect();
        want.extend(own.iter().map(|c| {
            (
                *c,
                PodnetDest {
                    kind: DEST_LOCAL,
                    tunnel_v4: 0,
                },
            )
        }));
        if want == self.dest {
            return;
        }
        for (cidr, dest) in &want {
            if self.dest.get(cidr) != Some(dest)
                && let Err(e) = write_dest(&mut self.ebpf, cidr, Some(*dest))
            {
                problems.push(format!("fast path: adding {cidr}: {e}"));
            }
        }
        for cidr in self.dest.keys().filter(|c| !want.contains_key(c)) {
            if let Err(e) = write_dest(&mut self.ebpf, cidr, None) {
                problems.push(format!("fast path: removing {cidr}: {e}"));
            }
        }
        self.dest = want;
    }

    /// The overlay's parameters (all zero without an overlay over IPv4).
    pub fn set_config(&mut self, config: PodnetConfig, problems: &mut Vec<String>) {
        if self.config == Some(config) {
            return;
        }
        let result = self
            .ebpf
            .map_mut(CONFIG)
            .ok_or_else(|| format!("no map {CONFIG}"))
            .and_then(|m| {
                aya::maps::Array::<_, PodnetConfig>::try_from(m).map_err(|e| e.to_string())
            })
            .and_then(|mut a| a.set(0, config, 0).map_err(|e| e.to_string()));
        match result {
            Ok(()) => self.config = Some(config),
            Err(e) => problems.push(format!("fast path: writing its configuration: {e}")),
        }
    }

    /// `ferry_podnet_to_pod` first on each of `devices` (before Service routing's tc
    /// program, which passes what is not a Service's on to the stack); devices no longer
    /// listed are let go.
    pub fn set_uplinks(&mut self, devices: &BTreeSet<String>, problems: &mut Vec<String>) {
        self.uplinks.retain(|name, (index, _)| {
            let keep = devices.contains(name) && node::ifindex(name) == Some(*index);
            if !keep {
                info!(device = %name, "pod network fast path: detached from the uplink");
            }
            keep
        });
        for device in devices {
            if self.uplinks.contains_key(device) {
                continue;
            }
            let Some(index) = node::ifindex(device) else {
                problems.push(format!("fast path: no device {device}"));
                continue;
            };
            match attach(&mut self.ebpf, TO_POD, device, LinkOrder::first()) {
                Ok(link) => {
                    info!(%device, "pod network fast path: attached to the uplink");
                    self.uplinks.insert(device.clone(), (index, link));
                }
                Err(e) => problems.push(format!("fast path: {e}")),
            }
        }
    }

    /// Attaches `ferry_podnet_from_pod` to every pod host veth that lacks it and lets go
    /// of the veths that are gone. Returns what went wrong, per veth.
    pub fn scan_pods(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        let present = match pod_veths() {
            Ok(p) => p,
            Err(e) => return vec![format!("fast path: listing the pods' veths: {e}")],
        };
        let gone: Vec<u32> = self
            .veths
            .iter()
            .filter(|(index, (name, _))| present.get(index) != Some(name))
            .map(|(index, _)| *index)
            .collect();
        for index in gone {
            self.veths.remove(&index);
            if let Err(e) = self.veth_map(index, false) {
                problems.push(format!("fast path: forgetting veth {index}: {e}"));
            }
        }
        for (index, name) in present {
            if self.veths.contains_key(&index) {
                continue;
            }
            match attach(&mut self.ebpf, FROM_POD, &name, LinkOrder::default()) {
                Ok(link) => {
                    if let Err(e) = self.veth_map(index, true) {
                        problems.push(format!("fast path: listing veth {name}: {e}"));
                    }
                    self.veths.insert(index, (name, link));
                }
                // Gone between the listing and the attach: the next scan forgets it.
                Err(_) if node::ifindex(&name) != Some(index) => {}
                Err(e) => problems.push(format!("fast path: {e}")),
            }
        }
        problems
    }

    fn veth_map(&mut self, index: u32, present: bool) -> Result<(), String> {
        let map = self
            .ebpf
            .map_mut(VETHS)
            .ok_or("no map FERRY_PODNET_VETHS")?;
        let mut veths: BpfHashMap<_, u32, u8> =
            BpfHashMap::try_from(map).map_err(|e| e.to_string())?;
        if present {
            veths.insert(index, 1, 0).map_err(|e| e.to_string())
        } else {
            match veths.remove(&index) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        }
    }

    /// How many pod veths carry the program.
    pub fn pods(&self) -> usize {
        self.veths.len()
    }

    pub fn counters(&self) -> FastPathCounters {
        let read = |slot: u32| -> u64 {
            self.ebpf
                .map(COUNTERS)
                .and_then(|m| PerCpuArray::<_, u64>::try_from(m).ok())
                .and_then(|a| a.get(&slot, 0).ok())
                .map_or(0, |v| v.iter().sum())
        };
        FastPathCounters {
            from_pod: read(PODNET_FROM_POD),
            to_pod: read(PODNET_TO_POD),
        }
    }
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier, String> {
    ebpf.program_mut(name)
        .ok_or_else(|| format!("ferry-podnet.bpf.o has no program {name}"))?
        .try_into()
        .map_err(|e| format!("{name}: {e}"))
}

fn attach(
    ebpf: &mut Ebpf,
    name: &str,
    device: &str,
    order: LinkOrder,
) -> Result<SchedClassifierLink, String> {
    let prog = program(ebpf, name)?;
    let id = prog
        .attach_with_options(
            device,
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(order),
        )
        .map_err(|e| format!("attaching {name} to {device} (tcx, kernel 6.6 or newer): {e}"))?;
    prog.take_link(id)
        .map_err(|e| format!("{name} on {device}: {e}"))
}

fn write_dest(ebpf: &mut Ebpf, cidr: &Cidr, kind: Option<PodnetDest>) -> Result<(), String> {
    fn apply<const N: usize>(
        ebpf: &mut Ebpf,
        map: &str,
        key: Key<[u8; N]>,
        kind: Option<PodnetDest>,
    ) -> Result<(), String> {
        let map = ebpf.map_mut(map).ok_or_else(|| format!("no map {map}"))?;
        let mut trie: LpmTrie<_, [u8; N], PodnetDest> =
            LpmTrie::try_from(map).map_err(|e| e.to_string())?;
        match kind {
            Some(v) => trie.insert(&key, v, 0).map_err(|e| e.to_string()),
            None => match trie.remove(&key) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(e.to_string()),
            },
        }
    }
    let len = u32::from(cidr.len);
    match cidr.addr {
        IpAddr::V4(a) => apply(ebpf, DEST4, Key::new(len, a.octets()), kind),
        IpAddr::V6(a) => apply(ebpf, DEST6, Key::new(len, a.octets()), kind),
    }
}

/// The pods' host veths (the plugin names them `fry…`), by ifindex. Asked of netlink,
/// not /sys/class/net, which shows the namespace sysfs was mounted in.
fn pod_veths() -> Result<BTreeMap<u32, String>, String> {
    let links = ferry_cni::netlink::Netlink::open()
        .map_err(|e| e.to_string())
        .and_then(|mut nl| nl.links().map_err(|e| e.to_string()))?;
    Ok(links
        .into_iter()
        .filter(|l| l.name.starts_with(ferry_cni::plan::HOST_VETH_PREFIX))
        .filter_map(|l| Some((u32::try_from(l.index).ok()?, l.name)))
        .collect())
}

/// The devices other nodes' pod traffic arrives on: those holding one of this node's
/// InternalIPs, and the VXLAN device when there is one.
pub fn uplinks(internal_ips: &[IpAddr], vxlan: Option<&str>) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = node::interface_addresses()
        .unwrap_or_default()
        .into_iter()
        .filter(|(_, ip)| internal_ips.contains(ip))
        .map(|(device, _)| device)
        .collect();
    out.extend(vxlan.map(str::to_owned));
    out
}
