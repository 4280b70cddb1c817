//! Loading the programs, pinning maps and links, and swapping programs in place.
//!
//! Everything lives under the `--bpffs` directory so that programs and maps outlive the
//! agent: on restart the maps are reopened (not recreated) and each pinned link gets the
//! new program through `BPF_LINK_UPDATE`, so there is never a moment without a program.

use std::{
    fs,
    os::{fd::AsFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData},
    programs::{CgroupAttachMode, CgroupSockAddr, links::FdLink},
};
use ferry_common::{
    LAYOUT_VERSION, META_MAP, Meta,
    ct::{CT_MAP, CtEntry, CtKey, FLOW_PORTS_MAP, FlowPorts},
    ext::{ClientAffinityKey, MAGLEV_MAP, SNAT_ADDRS_MAP, SOURCE_RANGES_MAP, TC_AFFINITY_MAP},
    lb::{AFFINITY_MAP, AffinityKey, AffinityValue, BACKENDS_MAP, MEMBERS_MAP, SERVICES_MAP},
    metrics::COUNTERS_MAP,
    sock::{RevNatKey, RevNatValue, SOCK_REVNAT_MAP, SockRevNat, TCP_REVNAT_MAP},
};
use tracing::{info, warn};

use super::{bpf_sys, kernel::KernelMaps, plan::Capacity, tc};

/// The eBPF object, embedded at build time (empty when it was not built).
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ferry.bpf.o"));

/// Every program, in attach order. Names are the entry points in `ebpf/src/main.rs`.
pub const PROGRAMS: [&str; 8] = [
    "ferry_recvmsg4",
    "ferry_recvmsg6",
    "ferry_getpeername4",
    "ferry_getpeername6",
    "ferry_sendmsg4",
    "ferry_sendmsg6",
    "ferry_connect4",
    "ferry_connect6",
];

/// Maps whose size follows the planning capacity: growing replaces them with a new
/// generation (see [`super::growth`]); every other map is kept as it is.
pub const GENERATION_MAPS: [&str; 6] = [
    SERVICES_MAP,
    BACKENDS_MAP,
    MEMBERS_MAP,
    ferry_common::metrics::SVC_CONNS_MAP,
    MAGLEV_MAP,
    SOURCE_RANGES_MAP,
];

/// Maps pinned per layout, in `<bpffs>/v<N>/`. Conntrack is not among them: it is
/// pinned in `<bpffs>` itself ([`ct_pin`]), so flows survive restarts and migrations.
pub const ALL_MAPS: [&str; 13] = [
    META_MAP,
    SERVICES_MAP,
    BACKENDS_MAP,
    MEMBERS_MAP,
    AFFINITY_MAP,
    SOCK_REVNAT_MAP,
    TCP_REVNAT_MAP,
    COUNTERS_MAP,
    ferry_common::metrics::SVC_CONNS_MAP,
    MAGLEV_MAP,
    SOURCE_RANGES_MAP,
    SNAT_ADDRS_MAP,
    TC_AFFINITY_MAP,
];

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Kernel map size per unit of planning capacity (see `load_and_attach`).
pub const HEADROOM: u32 = 2;

/// Largest capacity a flag may ask for (keeps `capacity * HEADROOM` in range).
pub const MAX_CAPACITY: u32 = 1 << 24;

#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error(
        "the agent was built without its eBPF object; run `cargo xtask build` (it builds target/bpf/ferry.bpf.o first)"
    )]
    NoObject,
    #[error("--bpffs {path}: {reason}")]
    Bpffs { path: PathBuf, reason: String },
    #[error("--cgroup {path}: {reason}")]
    Cgroup { path: PathBuf, reason: String },
    #[error(
        "pinned maps in {path} use layout version {found}, this agent writes {expected}; \
         run `ferry cleanup --bpffs {path}` (drops live state) or run the matching agent"
    )]
    LayoutMismatch {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {program}: {source}")]
    Program {
        program: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("map {map}: {source}")]
    Map {
        map: &'static str,
        source: aya::maps::MapError,
    },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "program {program}: its attachment is not a bpf_link ({source}); kernel 5.7 or newer is needed"
    )]
    Link {
        program: &'static str,
        source: aya::programs::links::LinkError,
    },
    #[error("pinning link {path}: {source}")]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error("--devices {device}: {reason}")]
    Device { device: String, reason: String },
    #[error(
        "--devices: the embedded eBPF object has no tc programs (ferry_tc_ingress, ferry_tc_egress); rebuild with `cargo xtask build`"
    )]
    NoTcPrograms,
}

#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub bpffs: PathBuf,
    pub cgroup: PathBuf,
    /// Capacity of maps created now, sized by the agent from its first list (pinned maps
    /// keep theirs; the agent grows them when they are too small).
    pub capacity: Capacity,
    /// The `--max-*` bounds: the maps never grow beyond them.
    pub bound: Capacity,
    /// Affinity / UDP stickiness map size.
    pub affinity_entries: u32,
    /// Socket reverse-translation map size.
    pub revnat_entries: u32,
    /// Devices for the tc programs; empty: none (and links of earlier ones detached).
    pub devices: Vec<String>,
    /// tc conntrack map size (LRU; two entries per flow).
    pub conntrack_entries: u32,
}

/// The loaded object (kept alive while the agent runs) and handles on its maps.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub maps: KernelMaps,
    /// True when pinned state from an earlier agent was adopted.
    pub adopted: bool,
    /// The maps' real capacity (pinned maps keep their size across restarts).
    pub capacity: Capacity,
    /// Attaching is a separate step ([`attach`]): when another layout is pinned, the new
    /// maps must be filled before any program that reads them is swapped in.
    pub pending: Pending,
    /// Forwards the programs' aya-log records (miss and error paths only) to `log`,
    /// which the agent's tracing subscriber picks up.
    pub logger: Option<BpfLogger>,
}

pub type BpfLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

/// What [`attach`] needs.
pub struct Pending {
    cgroup: fs::File,
    cgroup_id: u64,
    bpffs: PathBuf,
    maps_dir: PathBuf,
    /// Older layouts to migrate from (and remove) once the new maps are filled.
    pub migrate_from: Vec<(u32, PathBuf)>,
    devices: Vec<String>,
    /// A grown generation: where its new maps are pinned until they replace the
    /// current ones in `maps_dir` ([`commit_generation`]).
    staging: Option<PathBuf>,
}

fn links_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("links")
}

/// The conntrack pin, outside every layout directory.
pub fn ct_pin(bpffs: &Path) -> PathBuf {
    bpffs.join(CT_MAP)
}

/// The tc path's port filter pin, beside conntrack: its bits must cover every port the
/// tracked flows use, so it lives exactly as long as the conntrack table.
pub fn flow_ports_pin(bpffs: &Path) -> PathBuf {
    bpffs.join(FLOW_PORTS_MAP)
}

/// Whether the port filter must be created (and seeded from the tracked flows): it is
/// not pinned, or pinned with another shape (then it is removed here).
fn flow_ports_missing(pin: &Path) -> Result<bool, LoaderError> {
    let Ok(info) = MapData::from_pin(pin).and_then(|d| d.info()) else {
        return Ok(true);
    };
    if info.value_size() as usize != std::mem::size_of::<FlowPorts>() || info.max_entries() != 1 {
        warn!(pin = %pin.display(), "the flow port filter changed shape: it is replaced and seeded from the tracked flows");
        remove_if_present(pin, &mut Vec::new())?;
        return Ok(true);
    }
    Ok(false)
}

/// A conntrack pin whose entries have another shape than this build's cannot be shared
/// (the programs would misread it): it is removed, and the flows it tracked restart.
fn drop_incompatible_ct(pin: &Path) -> Result<(), LoaderError> {
    let Ok(info) = MapData::from_pin(pin).and_then(|d| d.info()) else {
        return Ok(());
    };
    let fits = info.key_size() as usize == std::mem::size_of::<CtKey>()
        && info.value_size() as usize == std::mem::size_of::<CtEntry>();
    if !fits {
        warn!(pin = %pin.display(), "conntrack entries changed shape: the pinned table is replaced, tracked flows restart");
        remove_if_present(pin, &mut Vec::new())?;
    }
    Ok(())
}

/// The map layout this agent writes. `FERRY_LAYOUT_VERSION` overrides it: a rehearsal
/// knob that makes two builds of the same code behave like two layouts, so the
/// migration path is exercised for real (tests, and operators before an upgrade).
pub fn layout_version() -> u32 {
    std::env::var("FERRY_LAYOUT_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LAYOUT_VERSION)
}

/// Where the maps of one layout version are pinned: `<bpffs>/v<N>/`. Links live in
/// `<bpffs>/links/` and outlive every layout (their program is swapped in place).
pub fn maps_dir(bpffs: &Path, version: u32) -> PathBuf {
    bpffs.join(format!("v{version}"))
}

/// Where a grown generation's new maps are pinned while they are filled:
/// `<bpffs>/v<N>_grow/` (bpffs refuses dots in names). Never read by anyone else.
fn staging_dir(bpffs: &Path, version: u32) -> PathBuf {
    bpffs.join(format!("v{version}_grow"))
}

/// Pinned layouts other than `current`: `(version, directory of its map pins)`. The
/// first release pinned maps directly in `<bpffs>` (layout 1).
pub fn other_layouts(bpffs: &Path, current: u32) -> Vec<(u32, PathBuf)> {
    let mut out = Vec::new();
    if let Ok(entries) = fs::read_dir(bpffs) {
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(v) = name
                .to_str()
                .and_then(|n| n.strip_prefix('v'))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if v != current && e.path().join(META_MAP).exists() {
                out.push((v, e.path()));
            }
        }
    }
    if let Ok(Some(v)) = pinned_layout(bpffs) {
        out.push((v, bpffs.to_path_buf()));
    }
    out.sort();
    out
}

fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct we own; `c` is a valid C string.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type == BPF_FS_MAGIC
    }
}

/// Makes sure `dir` exists on a bpffs, mounting /sys/fs/bpf when nothing is mounted there.
fn prepare_bpffs(dir: &Path) -> Result<(), LoaderError> {
    let err = |reason: String| LoaderError::Bpffs {
        path: dir.into(),
        reason,
    };
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    if !is_bpffs(&probe) {
        let default = Path::new("/sys/fs/bpf");
        if dir.starts_with(default) && !is_bpffs(default) {
            mount_bpffs(default).map_err(|e| {
                err(format!(
                    "no bpffs mounted and mounting /sys/fs/bpf failed: {e}"
                ))
            })?;
        } else {
            return Err(err(format!(
                "{} is not on a bpf filesystem; mount one (`mount -t bpf bpf /sys/fs/bpf`) or pick a directory below one",
                probe.display()
            )));
        }
    }
    fs::create_dir_all(links_dir(dir)).map_err(|e| err(format!("cannot create it: {e}")))
}

fn mount_bpffs(target: &Path) -> std::io::Result<()> {
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    let t = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid C strings; mount has no memory preconditions beyond that.
    let rc = unsafe {
        libc::mount(
            c("bpf").as_ptr(),
            t.as_ptr(),
            c("bpf").as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Reads the layout version pinned in `bpffs`, if any.
fn pinned_layout(bpffs: &Path) -> Result<Option<u32>, LoaderError> {
    let path = bpffs.join(META_MAP);
    if !path.exists() {
        return Ok(None);
    }
    let map_err = |source| LoaderError::Map {
        map: META_MAP,
        source,
    };
    let data = MapData::from_pin(&path).map_err(map_err)?;
    let meta: Array<MapData, Meta> = Array::try_from(Map::Array(data)).map_err(map_err)?;
    Ok(Some(meta.get(&0, 0).map_err(map_err)?.layout_version))
}

/// The configuration errors [`load`] would find, checked before the agent waits for its
/// first list (the programs are loaded after it, sized from what it holds): no embedded
/// object, no bpffs, a cgroup that cannot be opened.
pub fn preflight(opts: &LoadOptions) -> Result<(), LoaderError> {
    if OBJECT.is_empty() {
        return Err(LoaderError::NoObject);
    }
    prepare_bpffs(&opts.bpffs)?;
    fs::File::open(&opts.cgroup).map_err(|e| LoaderError::Cgroup {
        path: opts.cgroup.clone(),
        reason: format!("cannot open it ({e}); pass a cgroup v2 directory"),
    })?;
    Ok(())
}

/// Whether `object` has CO-RE relocations (the `core_relo` part of its `.BTF.ext`
/// section): only those need the kernel's BTF. `None` when the ELF cannot be read.
fn has_core_relocations(object: &[u8]) -> Option<bool> {
    let bytes = |o: usize, n: usize| object.get(o..o.checked_add(n)?);
    let u16_at = |o| bytes(o, 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |o| bytes(o, 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let u64_at =
        |o| bytes(o, 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize);
    // 64-bit little-endian ELF (bpfel).
    if bytes(0, 6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let (shoff, shentsize) = (u64_at(0x28)?, u16_at(0x3a)?);
    let (shnum, shstrndx) = (u16_at(0x3c)?, u16_at(0x3e)?);
    // (name offset, file offset, size) of section `i`.
    let section = |i: usize| {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        Some((u32_at(h)?, u64_at(h + 24)?, u64_at(h + 32)?))
    };
    let names = section(shstrndx)?.1;
    for i in 0..shnum {
        let (name, offset, size) = section(i)?;
        if !object
            .get(names.checked_add(name)?..)?
            .starts_with(b".BTF.ext\0")
        {
            continue;
        }
        // btf_ext_header: magic, version, flags, hdr_len, then offset/length pairs of
        // func_info, line_info and (when hdr_len covers it) core_relo.
        let hdr_len = u32_at(offset + 4)?;
        return Some(hdr_len >= 32 && size >= 32 && u32_at(offset + 28)? > 0);
    }
    Some(false)
}

/// aya's loader, one per process. `EbpfLoader::new` reads and parses the kernel's whole
/// BTF (5.5 MiB read, 9.4 MiB parsed at 30000 Services' heaptrack), which this object
/// never needs (no CO-RE relocations). Made once, early ([`prepare`]): made per load,
/// that transient ran beside the first full plan and was the agent's peak RSS (96.4 MiB
/// at 30000x4 against 88.7 for the plan itself), and it came back at every growth.
/// Every load sets the same pins and sizes, so what a previous load set is overwritten.
static LOADER: Mutex<Option<EbpfLoader<'static>>> = Mutex::new(None);

/// Makes the process's loader now, while the agent holds little else (see [`LOADER`]).
pub fn prepare() {
    drop(loader());
}

fn loader() -> MutexGuard<'static, Option<EbpfLoader<'static>>> {
    // A load that panicked left nothing half made: the loader is only configured.
    let mut guard = LOADER.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        let mut loader = EbpfLoader::new();
        if has_core_relocations(OBJECT) == Some(false) {
            // The parsed kernel BTF goes now; only CO-RE relocations would read it.
            loader.btf(None);
        }
        *guard = Some(loader);
    }
    guard
}

/// Loads the programs and opens (or creates) this layout's pinned maps. Nothing is
/// attached yet: see [`attach`].
pub fn load(opts: &LoadOptions) -> Result<Loaded, LoaderError> {
    load_at(opts, opts.capacity, false)
}

/// Loads the programs again with a new generation of the [`GENERATION_MAPS`], sized for
/// `capacity` and pinned apart, and every other map shared with the current generation
/// (the same objects). Fill `maps`, then [`commit_generation`] (or
/// [`discard_generation`]).
pub fn load_generation(opts: &LoadOptions, capacity: Capacity) -> Result<Loaded, LoaderError> {
    load_at(opts, capacity, true)
}

fn load_at(opts: &LoadOptions, capacity: Capacity, grow: bool) -> Result<Loaded, LoaderError> {
    if OBJECT.is_empty() {
        return Err(LoaderError::NoObject);
    }
    prepare_bpffs(&opts.bpffs)?;
    let cgroup = fs::File::open(&opts.cgroup).map_err(|e| LoaderError::Cgroup {
        path: opts.cgroup.clone(),
        reason: format!("cannot open it ({e}); pass a cgroup v2 directory"),
    })?;
    let cgroup_id = cgroup.metadata().map(|m| m.ino()).unwrap_or(0);

    let version = layout_version();
    let dir = maps_dir(&opts.bpffs, version);
    fs::create_dir_all(&dir).map_err(|source| LoaderError::Io {
        what: "creating",
        path: dir.clone(),
        source,
    })?;
    // A generation an agent did not finish (it died while filling) is dropped.
    let staging = staging_dir(&opts.bpffs, version);
    if staging.exists() {
        remove_layout(&opts.bpffs, &staging)?;
    }
    let adopted = match pinned_layout(&dir)? {
        Some(found) if found != version => {
            return Err(LoaderError::LayoutMismatch {
                path: dir.clone(),
                found,
                expected: version,
            });
        }
        Some(_) => true,
        None => false,
    };
    let migrate_from = if grow {
        Vec::new() // the first generation's migration is the agent's to finish
    } else {
        other_layouts(&opts.bpffs, version)
    };
    let capacity = if grow {
        fs::create_dir_all(&staging).map_err(|source| LoaderError::Io {
            what: "creating",
            path: staging.clone(),
            source,
        })?;
        capacity
    } else {
        effective_capacity(capacity, &dir)
    };

    // Socket state (reverse NAT, affinity, the tc path's client pins) is taken over as the very same map objects
    // when their entries did not change shape: old and new programs then read and write
    // one map, and no connection made during the swap loses its entry.
    let shared = match grow {
        true => Vec::new(), // shared already: the pins in `dir` are reused as they are
        false => shared_socket_maps(&dir, &migrate_from),
    };
    let mut pins: Vec<(&str, PathBuf)> = ALL_MAPS
        .iter()
        .map(|m| match grow && GENERATION_MAPS.contains(m) {
            true => (*m, staging.join(m)),
            false => (*m, dir.join(m)),
        })
        .collect();
    for (name, old) in &shared {
        if let Some(p) = pins.iter_mut().find(|(n, _)| n == name) {
            p.1 = old.clone();
        }
    }
    let ct = ct_pin(&opts.bpffs);
    drop_incompatible_ct(&ct)?;
    pins.push((CT_MAP, ct));
    let flow_ports = flow_ports_pin(&opts.bpffs);
    let seed_flow_ports = flow_ports_missing(&flow_ports)?;
    pins.push((FLOW_PORTS_MAP, flow_ports));
    let mut guard = loader();
    let loader = guard.as_mut().expect("made by loader()");
    for (name, path) in pins {
        loader.map_pin_path(name, path);
    }
    // Kernel maps get twice the planning capacity: during one apply the old and the new
    // content briefly coexist (inserts go before deletes), and that must never overflow.
    loader
        .map_max_entries(SERVICES_MAP, capacity.services * HEADROOM)
        .map_max_entries(BACKENDS_MAP, capacity.backends * HEADROOM)
        // A service's members are at most its backend slots.
        .map_max_entries(MEMBERS_MAP, capacity.services * HEADROOM)
        .map_max_entries(AFFINITY_MAP, opts.affinity_entries)
        .map_max_entries(TC_AFFINITY_MAP, opts.affinity_entries)
        .map_max_entries(SOCK_REVNAT_MAP, opts.revnat_entries)
        // One counter per ServicePort, indexed by its service id (from 1). Every
        // ServicePort holds a service-map entry and ids are recycled lowest first, so the
        // planning capacity covers the live ones (an id released in the last plan and not
        // reused yet can sit above them; one past the array is not counted, its connects
        // go on). Not doubled like the hash maps: a per-CPU array allocates each slot when
        // it is created (524,288 slots take 0.62 s, the largest part of a program load).
        .map_max_entries(
            ferry_common::metrics::SVC_CONNS_MAP,
            capacity.services.saturating_add(1),
        )
        // At most one Maglev table and a few ranges per ServicePort; neither map is
        // preallocated, so the size is only a bound.
        .map_max_entries(MAGLEV_MAP, capacity.services * HEADROOM)
        .map_max_entries(SOURCE_RANGES_MAP, capacity.services * HEADROOM)
        .map_max_entries(CT_MAP, opts.conntrack_entries);
    let mut ebpf = loader.load(OBJECT)?;

    for (name, old) in &shared {
        let pin = dir.join(name);
        if let Some(map) = ebpf.map(name) {
            map.pin(&pin).map_err(|source| LoaderError::Pin {
                path: pin.clone(),
                source,
            })?;
            info!(map = name, from = %old.display(), "taking over socket state map from the old layout");
        }
    }
    let map_err = |source| LoaderError::Map {
        map: META_MAP,
        source,
    };
    let mut meta: Array<_, Meta> = ebpf
        .take_map(META_MAP)
        .ok_or(map_err(aya::maps::MapError::InvalidName {
            name: META_MAP.into(),
        }))
        .and_then(|m| Array::try_from(m).map_err(map_err))?;
    meta.set(
        0,
        Meta {
            layout_version: version,
            _pad: 0,
        },
        0,
    )
    .map_err(map_err)?;

    for name in PROGRAMS {
        let prog_err = |source| LoaderError::Program {
            program: name,
            source,
        };
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .ok_or(prog_err(aya::programs::ProgramError::NotLoaded))?
            .try_into()
            .map_err(prog_err)?;
        prog.load().map_err(prog_err)?;
    }
    // The tc programs are loaded only when devices need them: an object built before
    // the tc path still serves an agent without --devices.
    if !opts.devices.is_empty() {
        if !tc::has_programs(&ebpf) {
            return Err(LoaderError::NoTcPrograms);
        }
        tc::load(&mut ebpf)?;
    }
    let mut maps = KernelMaps::from_ebpf(&mut ebpf)
        .map_err(|(map, source)| LoaderError::Map { map, source })?;
    // A new filter knows no port yet: flows an earlier agent tracked keep theirs before
    // any program reads it (programs are attached later).
    if let Some(ext) = maps.external.as_mut().filter(|_| seed_flow_ports) {
        let (flows, ports) = ext.seed_flow_ports().map_err(|source| LoaderError::Map {
            map: FLOW_PORTS_MAP,
            source,
        })?;
        if flows > 0 {
            info!(
                flows,
                ports, "flow port filter seeded from the tracked flows"
            );
        }
    }
    let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %e, "eBPF log records will not be shown");
            None
        }
    };
    let pending = Pending {
        cgroup,
        cgroup_id,
        bpffs: opts.bpffs.clone(),
        maps_dir: dir,
        migrate_from,
        devices: opts.devices.clone(),
        staging: grow.then_some(staging),
    };
    Ok(Loaded {
        ebpf,
        maps,
        adopted,
        capacity,
        logger,
        pending,
    })
}

/// Attaches every program through its pinned link, swapping the program in place when
/// a link is already pinned. When older layouts are pinned (call this only after the new
/// maps hold the full desired state), their socket state is copied over first, the
/// programs are swapped reply-side first, and the old maps are removed.
pub fn attach(ebpf: &mut Ebpf, p: &Pending) -> Result<(), LoaderError> {
    for (_, old) in &p.migrate_from {
        copy_socket_state(old, &p.maps_dir);
    }
    for name in PROGRAMS {
        attach_or_swap(ebpf, name, &p.cgroup, p.cgroup_id, &p.bpffs)?;
    }
    tc::attach(ebpf, &p.devices, &links_dir(&p.bpffs))?;
    for (version, old) in &p.migrate_from {
        // Connections made by the old programs while we swapped.
        copy_socket_state(old, &p.maps_dir);
        remove_layout(&p.bpffs, old)?;
        info!(
            from = version,
            to = layout_version(),
            "migrated: programs swapped, old maps removed"
        );
    }
    Ok(())
}

/// Socket-state maps of an older layout whose entry sizes match this build's: `(name,
/// pin path)`, for the new layout to reuse as they are. Only when the new layout has not
/// pinned its own yet. The TCP sockets' slots are carried over only this way (an array
/// entry is keyed by slot, not by socket, so there is nothing to copy entry by entry).
fn shared_socket_maps(dir: &Path, olds: &[(u32, PathBuf)]) -> Vec<(&'static str, PathBuf)> {
    let sizes = [
        (
            SOCK_REVNAT_MAP,
            std::mem::size_of::<RevNatKey>(),
            std::mem::size_of::<RevNatValue>(),
        ),
        (
            AFFINITY_MAP,
            std::mem::size_of::<AffinityKey>(),
            std::mem::size_of::<AffinityValue>(),
        ),
        (
            TC_AFFINITY_MAP,
            std::mem::size_of::<ClientAffinityKey>(),
            std::mem::size_of::<AffinityValue>(),
        ),
        (
            TCP_REVNAT_MAP,
            std::mem::size_of::<u32>(),
            std::mem::size_of::<SockRevNat>(),
        ),
    ];
    let mut out = Vec::new();
    for (name, k, v) in sizes {
        if dir.join(name).exists() {
            continue;
        }
        // The newest old layout first: it holds the most recent connections.
        for (_, old) in olds.iter().rev() {
            let path = old.join(name);
            let fits = MapData::from_pin(&path)
                .and_then(|d| d.info())
                .is_ok_and(|i| i.key_size() as usize == k && i.value_size() as usize == v);
            if fits {
                out.push((name, path));
                break;
            }
        }
    }
    out
}

/// Copies reverse-NAT and affinity entries between layouts whose entry sizes agree;
/// best effort: a socket that loses its entry only sees the backend's address in
/// `getpeername`/`recvmsg`, its traffic is unaffected.
fn copy_socket_state(from: &Path, to: &Path) {
    for name in [SOCK_REVNAT_MAP, AFFINITY_MAP, TC_AFFINITY_MAP] {
        let (Ok(src), Ok(dst)) = (
            MapData::from_pin(from.join(name)),
            MapData::from_pin(to.join(name)),
        ) else {
            continue;
        };
        let (Ok(si), Ok(di)) = (src.info(), dst.info()) else {
            continue;
        };
        if si.id() == di.id() {
            continue; // the new layout took this very map over
        }
        if si.key_size() != di.key_size() || si.value_size() != di.value_size() {
            warn!(
                map = name,
                "entry layout changed: socket state not carried over"
            );
            continue;
        }
        let copied = match name {
            SOCK_REVNAT_MAP => copy_entries::<RevNatKey, RevNatValue>(src, dst),
            TC_AFFINITY_MAP => copy_entries::<ClientAffinityKey, AffinityValue>(src, dst),
            _ => copy_entries::<AffinityKey, AffinityValue>(src, dst),
        };
        info!(
            map = name,
            copied, "carried socket state over to the new layout"
        );
    }
}

fn copy_entries<K: aya::Pod, V: aya::Pod>(src: MapData, dst: MapData) -> usize {
    let (Ok(src), Ok(mut dst)) = (
        HashMap::<_, K, V>::try_from(Map::LruHashMap(src)),
        HashMap::<_, K, V>::try_from(Map::LruHashMap(dst)),
    ) else {
        return 0;
    };
    src.iter()
        .flatten()
        .filter(|(k, v)| dst.insert(k, v, 0).is_ok())
        .count()
}

/// Removes one layout's map pins (and its directory, unless it is the bpffs root of
/// layout 1). Programs still holding the maps keep them alive until they are swapped.
fn remove_layout(bpffs: &Path, dir: &Path) -> Result<Vec<PathBuf>, LoaderError> {
    let mut removed = Vec::new();
    for name in ALL_MAPS {
        remove_if_present(&dir.join(name), &mut removed)?;
    }
    if dir != bpffs {
        remove_dir_if_present(dir, &mut removed)?;
    }
    Ok(removed)
}

/// Pinned maps keep their size across restarts (the agent grows them when it needs to).
fn effective_capacity(want: Capacity, dir: &Path) -> Capacity {
    let pinned = |name: &str, want: u32| -> u32 {
        MapData::from_pin(dir.join(name))
            .and_then(|d| d.info())
            .map_or(want, |info| info.max_entries() / HEADROOM)
    };
    Capacity {
        services: pinned(SERVICES_MAP, want.services),
        backends: pinned(BACKENDS_MAP, want.backends),
    }
}

/// Makes a filled generation the current one: the programs are swapped to it behind
/// their pinned links (when `swap`), then each of its map pins replaces the current
/// one by `rename(2)`, so `<bpffs>/v<N>/` never lacks a pin. The old maps go away with
/// the last program and handle that holds them.
pub fn commit_generation(ebpf: &mut Ebpf, p: &Pending, swap: bool) -> Result<(), LoaderError> {
    let Some(staging) = &p.staging else {
        return Ok(());
    };
    if swap {
        for name in PROGRAMS {
            attach_or_swap(ebpf, name, &p.cgroup, p.cgroup_id, &p.bpffs)?;
        }
        tc::attach(ebpf, &p.devices, &links_dir(&p.bpffs))?;
    }
    for name in GENERATION_MAPS {
        let (from, to) = (staging.join(name), p.maps_dir.join(name));
        if !from.exists() {
            continue; // an object without the tc maps
        }
        fs::rename(&from, &to).map_err(|source| LoaderError::Io {
            what: "replacing pin",
            path: to.clone(),
            source,
        })?;
    }
    remove_dir_if_present(staging, &mut Vec::new())
}

/// Drops a generation that could not be filled: its pins go; the current generation
/// was never touched.
pub fn discard_generation(p: &Pending) {
    if let Some(staging) = &p.staging
        && let Err(e) = remove_layout(&p.bpffs, staging)
    {
        warn!(error = %e, "removing an unfinished map generation");
    }
}

/// Attaches `name` to the cgroup through a pinned link, or, when a link from an earlier
/// agent is pinned for the same cgroup, swaps its program atomically.
fn attach_or_swap(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &fs::File,
    cgroup_id: u64,
    bpffs: &Path,
) -> Result<(), LoaderError> {
    let prog_err = |source| LoaderError::Program {
        program: name,
        source,
    };
    let prog: &mut CgroupSockAddr = ebpf
        .program_mut(name)
        .ok_or(LoaderError::Program {
            program: name,
            source: aya::programs::ProgramError::NotLoaded,
        })?
        .try_into()
        .map_err(prog_err)?;
    let pin = links_dir(bpffs).join(name);
    if pin.exists() {
        match bpf_sys::obj_get(&pin) {
            Ok(link) => {
                let same_cgroup =
                    bpf_sys::link_info(link.as_fd()).is_ok_and(|i| i.cgroup_id == cgroup_id);
                if same_cgroup {
                    let prog_fd = prog.fd().map_err(prog_err)?;
                    bpf_sys::link_update(link.as_fd(), prog_fd.as_fd()).map_err(|source| {
                        LoaderError::Io {
                            what: "updating pinned link",
                            path: pin.clone(),
                            source,
                        }
                    })?;
                    info!(program = name, "swapped program behind pinned link");
                    return Ok(());
                }
                warn!(
                    program = name,
                    "pinned link belongs to another cgroup; re-attaching"
                );
            }
            Err(e) => warn!(program = name, error = %e, "stale link pin; re-attaching"),
        }
        fs::remove_file(&pin).map_err(|source| LoaderError::Io {
            what: "removing stale link pin",
            path: pin.clone(),
            source,
        })?;
    }
    // bpf_link attachments are always multi-attach; the kernel rejects any flag here, and
    // `Single` is the mode that passes none.
    let link_id = prog
        .attach(cgroup, CgroupAttachMode::Single)
        .map_err(prog_err)?;
    pin_link(prog.take_link(link_id).map_err(prog_err)?, name, &pin)?;
    info!(program = name, "attached");
    Ok(())
}

/// Pins a link just attached, so that the attachment outlives the agent.
pub(super) fn pin_link<L>(link: L, program: &'static str, pin: &Path) -> Result<(), LoaderError>
where
    L: TryInto<FdLink, Error = aya::programs::links::LinkError>,
{
    let link: FdLink = link
        .try_into()
        .map_err(|source| LoaderError::Link { program, source })?;
    link.pin(pin).map_err(|source| LoaderError::Pin {
        path: pin.into(),
        source,
    })?;
    Ok(())
}

/// Detaches everything and removes the pins. Idempotent: missing pins are fine.
pub fn cleanup(bpffs: &Path) -> Result<Vec<PathBuf>, LoaderError> {
    let mut removed = Vec::new();
    let links = links_dir(bpffs);
    for name in PROGRAMS {
        remove_if_present(&links.join(name), &mut removed)?;
    }
    // Every device's tc links, whatever --devices says now (a pin is the attachment).
    for pin in tc::pins(&links) {
        remove_if_present(&pin, &mut removed)?;
    }
    remove_if_present(&ct_pin(bpffs), &mut removed)?;
    remove_if_present(&flow_ports_pin(bpffs), &mut removed)?;
    let mut layouts = other_layouts(bpffs, u32::MAX);
    layouts.retain(|(_, d)| d != bpffs);
    for (_, dir) in layouts {
        removed.extend(remove_layout(bpffs, &dir)?);
    }
    // Generations an agent did not finish growing.
    for e in fs::read_dir(bpffs).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().ends_with("_grow") {
            removed.extend(remove_layout(bpffs, &e.path())?);
        }
    }
    // Layout 1 pinned maps in the root; removing its names is harmless otherwise.
    removed.extend(remove_layout(bpffs, bpffs)?);
    for dir in [links.as_path(), bpffs] {
        remove_dir_if_present(dir, &mut removed)?;
    }
    Ok(removed)
}

fn remove_dir_if_present(dir: &Path, removed: &mut Vec<PathBuf>) -> Result<(), LoaderError> {
    match fs::remove_dir(dir) {
        Ok(()) => {
            removed.push(dir.to_path_buf());
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(LoaderError::Io {
            what: "removing directory (not empty?)",
            path: dir.into(),
            source,
        }),
    }
}

pub(super) fn remove_if_present(
    path: &Path,
    removed: &mut Vec<PathBuf>,
) -> Result<(), LoaderError> {
    match fs::remove_file(path) {
        Ok(()) => {
            removed.push(path.to_path_buf());
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(LoaderError::Io {
            what: "removing pin",
            path: path.into(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal 64-bit little-endian ELF: a null section, the section names and a
    /// `.BTF.ext` header saying how many bytes of CO-RE relocations follow.
    fn elf_with_btf_ext(core_relo_len: u32) -> Vec<u8> {
        let names = b"\0.shstrtab\0.BTF.ext\0";
        let mut ext = vec![0u8; 32];
        ext[0..2].copy_from_slice(&0xeb9fu16.to_le_bytes());
        ext[2] = 1;
        ext[4..8].copy_from_slice(&32u32.to_le_bytes());
        ext[28..32].copy_from_slice(&core_relo_len.to_le_bytes());
        let shoff = 64 + names.len() + ext.len();
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        elf.extend_from_slice(names);
        elf.extend_from_slice(&ext);
        let header = |name: u32, offset: usize, size: usize| {
            let mut h = vec![0u8; 64];
            h[0..4].copy_from_slice(&name.to_le_bytes());
            h[24..32].copy_from_slice(&(offset as u64).to_le_bytes());
            h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            h
        };
        elf.extend(header(0, 0, 0));
        elf.extend(header(1, 64, names.len()));
        elf.extend(header(11, 64 + names.len(), ext.len()));
        elf
    }

    #[test]
    fn the_kernel_btf_is_needed_only_for_core_relocations() {
        assert_eq!(has_core_relocations(&elf_with_btf_ext(0)), Some(false));
        assert_eq!(has_core_relocations(&elf_with_btf_ext(48)), Some(true));
        assert_eq!(has_core_relocations(b"not an object"), None);
        let mut cut = elf_with_btf_ext(48);
        cut.truncate(100);
        assert_eq!(has_core_relocations(&cut), None, "section headers cut off");
        if !OBJECT.is_empty() {
            assert_eq!(
                has_core_relocations(OBJECT),
                Some(false),
                "the embedded object is readable (and has no CO-RE relocations today)"
            );
        }
    }
}
