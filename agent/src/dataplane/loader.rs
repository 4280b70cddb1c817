//! Loading the programs, pinning maps and links, and swapping programs in place.
//!
//! Everything lives under the `--bpffs` directory so that programs and maps outlive the
//! agent: on restart the maps are reopened (not recreated) and each pinned link gets the
//! new program through `BPF_LINK_UPDATE`, so there is never a moment without a program.

use std::{
    fs,
    os::{fd::AsFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, Map, MapData},
    programs::{CgroupAttachMode, CgroupSockAddr, links::FdLink},
};
use ferry_common::{
    LAYOUT_VERSION, META_MAP, Meta,
    lb::{AFFINITY_MAP, BACKENDS_MAP, MEMBERS_MAP, SERVICES_MAP},
    metrics::COUNTERS_MAP,
    sock::SOCK_REVNAT_MAP,
};
use tracing::{info, warn};

use super::{bpf_sys, kernel::KernelMaps, plan::Capacity};

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

pub const ALL_MAPS: [&str; 7] = [
    META_MAP,
    SERVICES_MAP,
    BACKENDS_MAP,
    MEMBERS_MAP,
    AFFINITY_MAP,
    SOCK_REVNAT_MAP,
    COUNTERS_MAP,
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
}

#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub bpffs: PathBuf,
    pub cgroup: PathBuf,
    pub capacity: Capacity,
    /// Affinity / UDP stickiness map size.
    pub affinity_entries: u32,
    /// Socket reverse-translation map size.
    pub revnat_entries: u32,
}

/// The loaded object (kept alive while the agent runs) and handles on its maps.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub maps: KernelMaps,
    /// True when pinned state from an earlier agent was adopted.
    pub adopted: bool,
    /// The maps' real capacity (pinned maps keep their size across restarts).
    pub capacity: Capacity,
    /// Forwards the programs' aya-log records (miss and error paths only) to `log`,
    /// which the agent's tracing subscriber picks up.
    pub logger: Option<BpfLogger>,
}

pub type BpfLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

fn links_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("links")
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

pub fn load_and_attach(opts: &LoadOptions) -> Result<Loaded, LoaderError> {
    if OBJECT.is_empty() {
        return Err(LoaderError::NoObject);
    }
    prepare_bpffs(&opts.bpffs)?;
    let cgroup = fs::File::open(&opts.cgroup).map_err(|e| LoaderError::Cgroup {
        path: opts.cgroup.clone(),
        reason: format!("cannot open it ({e}); pass a cgroup v2 directory"),
    })?;
    let cgroup_id = cgroup.metadata().map(|m| m.ino()).unwrap_or(0);

    let adopted = match pinned_layout(&opts.bpffs)? {
        Some(found) if found != LAYOUT_VERSION => {
            return Err(LoaderError::LayoutMismatch {
                path: opts.bpffs.clone(),
                found,
                expected: LAYOUT_VERSION,
            });
        }
        Some(_) => true,
        None => false,
    };
    let capacity = effective_capacity(opts);

    let pins: Vec<(&str, PathBuf)> = ALL_MAPS.iter().map(|m| (*m, opts.bpffs.join(m))).collect();
    let mut loader = EbpfLoader::new();
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    // Kernel maps get twice the planning capacity: during one apply the old and the new
    // content briefly coexist (inserts go before deletes), and that must never overflow.
    loader
        .map_max_entries(SERVICES_MAP, opts.capacity.services * HEADROOM)
        .map_max_entries(BACKENDS_MAP, opts.capacity.backends * HEADROOM)
        // A service's members are at most its backend slots.
        .map_max_entries(MEMBERS_MAP, opts.capacity.services * HEADROOM)
        .map_max_entries(AFFINITY_MAP, opts.affinity_entries)
        .map_max_entries(SOCK_REVNAT_MAP, opts.revnat_entries);
    let mut ebpf = loader.load(OBJECT)?;

    let mut meta: Array<_, Meta> = ebpf
        .take_map(META_MAP)
        .ok_or(LoaderError::Map {
            map: META_MAP,
            source: aya::maps::MapError::InvalidName {
                name: META_MAP.into(),
            },
        })
        .and_then(|m| {
            Array::try_from(m).map_err(|source| LoaderError::Map {
                map: META_MAP,
                source,
            })
        })?;
    meta.set(
        0,
        Meta {
            layout_version: LAYOUT_VERSION,
            _pad: 0,
        },
        0,
    )
    .map_err(|source| LoaderError::Map {
        map: META_MAP,
        source,
    })?;

    for name in PROGRAMS {
        attach_or_swap(&mut ebpf, name, &cgroup, cgroup_id, &opts.bpffs)?;
    }
    let maps = KernelMaps::from_ebpf(&mut ebpf)
        .map_err(|(map, source)| LoaderError::Map { map, source })?;
    let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %e, "eBPF log records will not be shown");
            None
        }
    };
    Ok(Loaded {
        ebpf,
        maps,
        adopted,
        capacity,
        logger,
    })
}

/// The capacity the maps really have: pinned maps keep the size they were created with,
/// so the planner must plan against that, not against the flags.
fn effective_capacity(opts: &LoadOptions) -> Capacity {
    let pinned = |name: &str, want: u32| -> u32 {
        let Ok(info) = MapData::from_pin(opts.bpffs.join(name)).and_then(|d| d.info()) else {
            return want;
        };
        let pinned = info.max_entries() / HEADROOM;
        if pinned != want {
            warn!(
                map = name,
                pinned,
                requested = want,
                "pinned map keeps its size; a new size takes effect after `ferry cleanup`"
            );
        }
        pinned
    };
    Capacity {
        services: pinned(SERVICES_MAP, opts.capacity.services),
        backends: pinned(BACKENDS_MAP, opts.capacity.backends),
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
    prog.load().map_err(prog_err)?;
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
    let link: FdLink = prog
        .take_link(link_id)
        .map_err(prog_err)?
        .try_into()
        .map_err(|source| LoaderError::Link {
            program: name,
            source,
        })?;
    link.pin(&pin).map_err(|source| LoaderError::Pin {
        path: pin.clone(),
        source,
    })?;
    info!(program = name, "attached");
    Ok(())
}

/// Detaches everything and removes the pins. Idempotent: missing pins are fine.
pub fn cleanup(bpffs: &Path) -> Result<Vec<PathBuf>, LoaderError> {
    let mut removed = Vec::new();
    let links = links_dir(bpffs);
    for name in PROGRAMS {
        remove_if_present(&links.join(name), &mut removed)?;
    }
    for name in ALL_MAPS {
        remove_if_present(&bpffs.join(name), &mut removed)?;
    }
    for dir in [links.as_path(), bpffs] {
        match fs::remove_dir(dir) {
            Ok(()) => removed.push(dir.to_path_buf()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(LoaderError::Io {
                    what: "removing directory (not empty?)",
                    path: dir.into(),
                    source,
                });
            }
        }
    }
    Ok(removed)
}

fn remove_if_present(path: &Path, removed: &mut Vec<PathBuf>) -> Result<(), LoaderError> {
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
