//! The tc programs on `--devices`: tcx links pinned in `<bpffs>/links/`, one per device
//! and direction, so they outlive the agent. A restarted (or migrating) agent swaps the
//! program behind each pinned link in place (`BPF_LINK_UPDATE`), and detaches the devices
//! no longer listed by removing their pins.

use std::{
    fs,
    os::fd::AsFd,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    programs::{LinkOrder, SchedClassifier, TcAttachType, tc::TcAttachOptions},
};
use tracing::{info, warn};

use super::{
    bpf_sys,
    loader::{LoaderError, pin_link, remove_if_present},
};
use crate::node;

/// `(program, attach type, pin suffix)`. Names are the entry points in `ebpf/src/main.rs`.
pub const TC_PROGRAMS: [(&str, TcAttachType, &str); 2] = [
    ("ferry_tc_ingress", TcAttachType::Ingress, "ingress"),
    ("ferry_tc_egress", TcAttachType::Egress, "egress"),
];

/// Every tc link pin starts with this.
const PIN_PREFIX: &str = "tc_";
const BPF_LINK_TYPE_TCX: u32 = 11;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;

/// The link pin of `device` in direction `suffix`. bpffs refuses `.` in names (VLAN
/// devices such as `eth0.100` have one), so it is escaped, and so is the escape.
pub fn pin_name(device: &str, suffix: &str) -> String {
    let device = device.replace('%', "%25").replace('.', "%2e");
    format!("{PIN_PREFIX}{device}_{suffix}")
}

/// True when the object carries the tc programs (an object built before the tc path
/// does not).
pub fn has_programs(ebpf: &Ebpf) -> bool {
    TC_PROGRAMS
        .iter()
        .all(|(name, _, _)| ebpf.program(name).is_some())
}

/// Loads the tc programs (verifier), before anything is attached.
pub fn load(ebpf: &mut Ebpf) -> Result<(), LoaderError> {
    for (name, _, _) in TC_PROGRAMS {
        program(ebpf, name)?
            .load()
            .map_err(|source| LoaderError::Program {
                program: name,
                source,
            })?;
    }
    Ok(())
}

fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, LoaderError> {
    let prog_err = |source| LoaderError::Program {
        program: name,
        source,
    };
    ebpf.program_mut(name)
        .ok_or(prog_err(aya::programs::ProgramError::NotLoaded))?
        .try_into()
        .map_err(prog_err)
}

/// Attaches (or swaps) both programs on every device, then detaches devices that are
/// no longer listed.
pub fn attach(ebpf: &mut Ebpf, devices: &[String], links: &Path) -> Result<(), LoaderError> {
    for device in devices {
        let ifindex = node::ifindex(device).ok_or_else(|| LoaderError::Device {
            device: device.clone(),
            reason: "no such device".into(),
        })?;
        for (name, attach_type, suffix) in TC_PROGRAMS {
            let pin = links.join(pin_name(device, suffix));
            attach_one(ebpf, name, device, ifindex, attach_type, &pin)?;
        }
    }
    let wanted: Vec<String> = devices
        .iter()
        .flat_map(|d| TC_PROGRAMS.iter().map(move |(_, _, s)| pin_name(d, s)))
        .collect();
    for pin in pins(links) {
        let name = pin.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| !wanted.contains(&n)) {
            remove(&pin)?;
            info!(pin = %pin.display(), "device no longer listed: tc program detached");
        }
    }
    Ok(())
}

fn attach_one(
    ebpf: &mut Ebpf,
    name: &'static str,
    device: &str,
    ifindex: u32,
    attach_type: TcAttachType,
    pin: &Path,
) -> Result<(), LoaderError> {
    let prog_err = |source| LoaderError::Program {
        program: name,
        source,
    };
    let want_type = match attach_type {
        TcAttachType::Ingress => BPF_TCX_INGRESS,
        _ => BPF_TCX_EGRESS,
    };
    let prog = program(ebpf, name)?;
    if pin.exists() {
        match bpf_sys::obj_get(pin) {
            Ok(link) => {
                let same = bpf_sys::link_info(link.as_fd()).is_ok_and(|i| {
                    let (index, kind) = i.tcx_target();
                    i.link_type == BPF_LINK_TYPE_TCX && index == ifindex && kind == want_type
                });
                if same {
                    let prog_fd = prog.fd().map_err(prog_err)?;
                    bpf_sys::link_update(link.as_fd(), prog_fd.as_fd()).map_err(|source| {
                        LoaderError::Io {
                            what: "updating pinned link",
                            path: pin.into(),
                            source,
                        }
                    })?;
                    info!(
                        program = name,
                        device, "swapped tc program behind pinned link"
                    );
                    return Ok(());
                }
                // The device was recreated (new ifindex) or the pin is not ours.
                warn!(
                    program = name,
                    device, "pinned tc link is not attached to this device; re-attaching"
                );
            }
            Err(e) => warn!(program = name, device, error = %e, "stale tc link pin; re-attaching"),
        }
        remove(pin)?;
    }
    let options = TcAttachOptions::TcxOrder(LinkOrder::default());
    let link_id = prog
        .attach_with_options(device, attach_type, options)
        .map_err(|source| LoaderError::Device {
            device: device.into(),
            reason: format!("attaching {name} with tcx (kernel 6.6 or newer): {source}"),
        })?;
    pin_link(prog.take_link(link_id).map_err(prog_err)?, name, pin)?;
    info!(program = name, device, "attached");
    Ok(())
}

/// Every tc link pin in `links`.
pub fn pins(links: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(links) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(PIN_PREFIX))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

fn remove(pin: &Path) -> Result<(), LoaderError> {
    remove_if_present(pin, &mut Vec::new())
}

#[cfg(test)]
mod tests {
    use super::pin_name;

    #[test]
    fn pin_names_are_per_device_and_direction_without_dots() {
        assert_eq!(pin_name("eth0", "ingress"), "tc_eth0_ingress");
        assert_eq!(pin_name("eth0.100", "egress"), "tc_eth0%2e100_egress");
        assert_eq!(pin_name("a%2eb", "egress"), "tc_a%252eb_egress");
        assert_ne!(
            pin_name("eth0.100", "egress"),
            pin_name("eth0%2e100", "egress")
        );
    }
}
