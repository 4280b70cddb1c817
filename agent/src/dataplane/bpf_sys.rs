//! Raw `bpf(2)` calls that aya 0.14 does not expose: opening a pinned link, swapping the
//! program behind it atomically, reading which cgroup a link is attached to, and writing
//! many map entries in one call.

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_LINK_UPDATE: libc::c_long = 29;

fn sys_bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zeroed, 128-byte, 8-aligned buffer laid out as the command's
    // bpf_attr member; the kernel reads at most `size` bytes of it.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr) as u32,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Opens a pinned BPF object (map, program or link).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))?;
    let mut attr = [0u64; 16];
    attr[0] = c.as_ptr() as u64;
    let fd = sys_bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: the kernel returned a new file descriptor that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Writes `keys[i] -> values[i]` (`BPF_ANY`) in one call. `K` and `V` must be the map's
/// key and value types (aya checked their sizes when it opened the map). Returns how many
/// entries were written (the first ones) and the error that stopped the rest, if any.
pub fn update_batch<K: aya::Pod, V: aya::Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> (usize, io::Result<()>) {
    assert_eq!(keys.len(), values.len(), "one value per key");
    let mut attr = [0u64; 16];
    // struct { in_batch, out_batch, keys, values; u32 count, map_fd; elem_flags, flags }
    attr[2] = keys.as_ptr() as u64;
    attr[3] = values.as_ptr() as u64;
    attr[4] = keys.len() as u32 as u64 | ((map.as_raw_fd() as u32 as u64) << 32);
    let result = sys_bpf(BPF_MAP_UPDATE_BATCH, &mut attr).map(|_| ());
    // The kernel writes back how many it processed.
    let done = (attr[4] as u32 as usize).min(keys.len());
    (done, result)
}

/// Replaces the program behind a link in one step: no window without a program.
pub fn link_update(link: BorrowedFd<'_>, new_prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = [0u64; 16];
    attr[0] = link.as_raw_fd() as u32 as u64 | ((new_prog.as_raw_fd() as u32 as u64) << 32);
    sys_bpf(BPF_LINK_UPDATE, &mut attr).map(|_| ())
}

/// The part of `struct bpf_link_info` ferry reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    pub link_type: u32,
    pub id: u32,
    pub prog_id: u32,
    /// For cgroup links: the cgroup's id (the inode number of its directory).
    pub cgroup_id: u64,
    pub attach_type: u32,
}

impl LinkInfo {
    /// For tcx links: (ifindex, attach type), which share the union's first 8 bytes with
    /// a cgroup link's `cgroup_id`.
    pub fn tcx_target(&self) -> (u32, u32) {
        (self.cgroup_id as u32, (self.cgroup_id >> 32) as u32)
    }
}

pub fn link_info(link: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    let mut info = [0u64; 8];
    let mut attr = [0u64; 16];
    attr[0] = link.as_raw_fd() as u32 as u64 | ((std::mem::size_of_val(&info) as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(LinkInfo {
        link_type: info[0] as u32,
        id: (info[0] >> 32) as u32,
        prog_id: info[1] as u32,
        cgroup_id: info[2],
        attach_type: info[3] as u32,
    })
}
