//! Recovering connected UDP sockets whose Service backend went away.
//!
//! ferry translates a connected UDP socket once, in `connect()`: from then on the socket
//! is connected to the backend itself, and nothing in the packet path can move it. When
//! that backend leaves the Service (its pod may well keep running), a long-lived client
//! such as a DNS resolver stays pinned to it. This module finds such sockets with
//! `NETLINK_SOCK_DIAG` and aborts them with `SOCK_DESTROY` (`CONFIG_INET_DIAG_DESTROY`),
//! so the application notices at once and reconnects through the Service, which picks a
//! backend that still exists.
//!
//! # Call contract
//!
//! Call it after a sync has written the maps (so a reconnect can no longer pick the
//! removed backend), with the `(backend address, backend port)` pairs that sync removed
//! from UDP frontends:
//! - [`destroy_udp_sockets_through_services`]`(bpffs, backends)` when each backend is no
//!   longer behind any UDP frontend: every socket that reached it through any Service is
//!   destroyed;
//! - [`destroy_udp_sockets_to`]`(backends, check)` when a backend left one Service but
//!   may still be behind another: `check(cookie, backend, port)` decides per socket,
//!   typically with [`RevNatMap::lookup`] and the `svc_id` it returns (what the agent
//!   does with the (service id, backend) pairs of its member deletes).
//!
//! IPv4 backends may be given as `IpAddr::V4` or IPv4-mapped `IpAddr::V6`; both match
//! IPv4 sockets and IPv6 sockets connected to `::ffff:a.b.c.d`. An empty list is a no-op.
//! The call is blocking (it walks every network namespace of the node: a few ms for ten):
//! from async code run it in `tokio::task::spawn_blocking`. It never changes the calling
//! thread's namespace; each namespace is entered by a short-lived helper thread.
//!
//! It needs `CAP_NET_ADMIN` (destroy), `CAP_SYS_ADMIN` (setns), and, to reach pod
//! namespaces, the host PID namespace (`/proc/*/ns/net`) or the host's `/run/netns`.
//!
//! # What is destroyed, and what the application sees
//!
//! Only UDP sockets that are connected (`TCP_ESTABLISHED` in diag terms), whose peer is
//! one of the given backends, and whose socket cookie has an entry
//! `(cookie, backend, port)` in `FERRY_REVNAT` (written by the connect hook when it
//! translated a Service address) are touched. A socket connected straight to the pod IP
//! has no such entry and is left alone; TCP is never touched (kube-proxy keeps
//! established TCP flows too). Unconnected UDP needs none of this: its stickiness entry
//! is dropped with the membership, and its next `sendto()` picks a new backend.
//!
//! The kernel's `udp_abort()` sets `sk_err = ECONNABORTED`, wakes readers and
//! disconnects the socket (checked on 6.18):
//! - a `recv()` blocked at that moment fails with `ECONNABORTED` (which clears the error);
//! - otherwise the next `send()` fails with `EDESTADDRREQ`, and keeps failing so, since
//!   the socket has no peer any more;
//! - a socket that is `connect()`ed again reports the pending `ECONNABORTED` once, on its
//!   first `send()`, then works (through the Service: the connect hook picks a backend
//!   that still exists).
//!
//! So a client that closes the socket on error and opens a new one, as resolvers do
//! when a server fails, recovers on its next query (`ferry-probe udp-connected-loop`
//! does exactly that; in the kernel test `udp_recovery` it is answered by a remaining
//! backend 100-200 ms after the EndpointSlice change, the agent's watch included).
//!
//! # Limitations
//!
//! - `FERRY_REVNAT` is an LRU map: a socket whose entry was evicted (more live translated
//!   sockets than `--max-revnat`) is not recognised and stays pinned.
//! - A socket that sent unconnected datagrams through the Service to backend B and was
//!   later `connect()`ed straight to B's pod IP carries an entry for B and is destroyed
//!   as well.
//! - A socket is found only in a namespace that some process is in or that is pinned
//!   under one of [`Options::netns_dirs`]; a socket kept open after its creator left a
//!   namespace nobody else holds is not reached.
//! - `SO_REUSEPORT` groups of connected sockets on one 4-tuple: the kernel's exact lookup
//!   may find a sibling, whose cookie then does not match (reported as vanished).

use std::{
    collections::HashSet,
    fs, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::fs::MetadataExt,
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use aya::maps::{HashMap, Map, MapData, MapError};
use ferry_common::{
    Addr, addr_from_v4_be,
    sock::{RevNatKey, RevNatValue, SOCK_REVNAT_MAP},
};
use tracing::{debug, warn};

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x01;
const NLM_F_ACK: u16 = 0x04;
const NLM_F_DUMP: u16 = 0x300;
/// `TCP_ESTABLISHED`: what a connected UDP socket reports as its state.
const STATE_CONNECTED: u8 = 1;

const NLMSG_HDRLEN: usize = 16;
/// `struct inet_diag_sockid`.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg` (the part we read).
const MSG_LEN: usize = 4 + SOCKID_LEN + 20;

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("sock_diag in the agent's own network namespace: {0}")]
    OwnNamespace(String),
    #[error("no {map} pinned under {bpffs} (is the agent running with this --bpffs?)")]
    NotPinned { map: &'static str, bpffs: PathBuf },
    #[error("map {map} pinned at {path}: {source}")]
    Map {
        map: &'static str,
        path: PathBuf,
        source: MapError,
    },
}

/// Where to look for network namespaces.
#[derive(Clone, Debug)]
pub struct Options {
    /// Walk `/proc/*/ns/net` (every namespace some process is in).
    pub scan_proc: bool,
    /// Directories of pinned namespaces (`ip netns`, CNI, docker).
    pub netns_dirs: Vec<PathBuf>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            scan_proc: true,
            netns_dirs: vec![
                PathBuf::from("/run/netns"),
                PathBuf::from("/var/run/netns"),
                PathBuf::from("/var/run/docker/netns"),
            ],
        }
    }
}

/// One destroyed socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DestroyedSocket {
    /// Inode of the network namespace (as in `readlink /proc/PID/ns/net`).
    pub netns: u64,
    pub cookie: u64,
    pub local: SocketAddr,
    /// The removed backend the socket was connected to.
    pub peer: SocketAddr,
}

/// What a call found and did.
#[derive(Clone, Debug, Default)]
pub struct DestroyReport {
    /// Network namespaces scanned.
    pub namespaces: usize,
    /// Connected UDP sockets whose peer is one of the removed backends.
    pub matched: usize,
    /// Of those, connected without a Service (no reverse-NAT entry): left alone.
    pub direct: usize,
    pub destroyed: Vec<DestroyedSocket>,
    /// Sockets that closed or reconnected between the dump and the destroy.
    pub vanished: usize,
    /// Non-fatal problems (a namespace that went away, a destroy the kernel refused).
    pub failures: Vec<String>,
}

/// Read-only handles on every `FERRY_REVNAT` pinned under a bpffs directory: the one
/// pinned directly in it (layout 1) and those in its layout subdirectories
/// (`<bpffs>/v<N>/`, several while the agent migrates from one layout to the next). A
/// socket translated by any of them counts.
pub struct RevNatMap {
    maps: Vec<(PathBuf, HashMap<MapData, RevNatKey, RevNatValue>)>,
}

impl RevNatMap {
    /// Opens every pinned reverse-NAT map under `bpffs` (the agent's `--bpffs`).
    pub fn open(bpffs: &Path) -> Result<RevNatMap, SockDiagError> {
        let mut candidates = vec![bpffs.join(SOCK_REVNAT_MAP)];
        if let Ok(rd) = fs::read_dir(bpffs) {
            let mut dirs: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path().join(SOCK_REVNAT_MAP))
                .collect();
            dirs.sort();
            candidates.extend(dirs);
        }
        let mut maps = Vec::new();
        for path in candidates.into_iter().filter(|p| p.exists()) {
            match Self::open_pin(&path) {
                Ok(m) => maps.push((path, m)),
                // Removed meanwhile (the end of a migration): the others are enough.
                Err(_) if !path.exists() => {}
                Err(e) => return Err(e),
            }
        }
        if maps.is_empty() {
            return Err(SockDiagError::NotPinned {
                map: SOCK_REVNAT_MAP,
                bpffs: bpffs.to_path_buf(),
            });
        }
        Ok(RevNatMap { maps })
    }

    fn open_pin(path: &Path) -> Result<HashMap<MapData, RevNatKey, RevNatValue>, SockDiagError> {
        let err = |source| SockDiagError::Map {
            map: SOCK_REVNAT_MAP,
            path: path.to_path_buf(),
            source,
        };
        let data = MapData::from_pin(path).map_err(err)?;
        let map = Map::from_map_data(data).map_err(err)?;
        HashMap::try_from(map).map_err(err)
    }

    /// The pins that were opened.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.maps.iter().map(|(p, _)| p.as_path())
    }

    /// The Service a socket reached `backend` through, if its connect was translated.
    pub fn lookup(
        &self,
        cookie: u64,
        backend: IpAddr,
        port: u16,
    ) -> Result<Option<RevNatValue>, MapError> {
        let key = RevNatKey {
            cookie,
            addr: map_addr(backend),
            port: port.to_be(),
            _pad: [0; 6],
        };
        for (_, map) in &self.maps {
            match map.get(&key, 0) {
                Ok(v) => return Ok(Some(v)),
                Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// True when the socket reached `backend` through a Service. A failed lookup counts
    /// as "no" (the socket is left alone) and is logged.
    pub fn contains(&self, cookie: u64, backend: IpAddr, port: u16) -> bool {
        match self.lookup(cookie, backend, port) {
            Ok(v) => v.is_some(),
            Err(e) => {
                warn!(cookie, %backend, port, error = %e, "reading {SOCK_REVNAT_MAP}");
                false
            }
        }
    }
}

/// The map form of an address (16 bytes, network order, IPv4 mapped).
fn map_addr(ip: IpAddr) -> Addr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => addr_from_v4_be(u32::from_ne_bytes(v4.octets())),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            std::array::from_fn(|i| u32::from_ne_bytes(o[i * 4..i * 4 + 4].try_into().unwrap()))
        }
    }
}

/// [`destroy_udp_sockets_to`] with the reverse-NAT map pinned under `bpffs`: the whole
/// job, for the agent after a sync (see the module doc for the contract).
pub fn destroy_udp_sockets_through_services(
    bpffs: &Path,
    backends: &[(IpAddr, u16)],
) -> Result<DestroyReport, SockDiagError> {
    if backends.is_empty() {
        return Ok(DestroyReport::default());
    }
    let revnat = RevNatMap::open(bpffs)?;
    destroy_udp_sockets_to(backends, &|cookie, ip, port| {
        revnat.contains(cookie, ip, port)
    })
}

/// Destroys every connected UDP socket, in every network namespace, whose peer is one of
/// `backends` and for which `via_service(cookie, backend, port)` says the connect went
/// through a Service. `backend` is given canonical (IPv4 as `IpAddr::V4`).
pub fn destroy_udp_sockets_to(
    backends: &[(IpAddr, u16)],
    via_service: &impl Fn(u64, IpAddr, u16) -> bool,
) -> Result<DestroyReport, SockDiagError> {
    destroy_udp_sockets_with(&Options::default(), backends, via_service)
}

/// [`destroy_udp_sockets_to`] with explicit namespace sources.
pub fn destroy_udp_sockets_with(
    opts: &Options,
    backends: &[(IpAddr, u16)],
    via_service: &impl Fn(u64, IpAddr, u16) -> bool,
) -> Result<DestroyReport, SockDiagError> {
    let mut report = DestroyReport::default();
    if backends.is_empty() {
        return Ok(report);
    }
    let wanted: HashSet<(IpAddr, u16)> = backends
        .iter()
        .map(|(ip, port)| (ip.to_canonical(), *port))
        .collect();
    let namespaces = namespaces(opts)?;
    for (i, ns) in namespaces.iter().enumerate() {
        let sock = match diag_socket_in(&ns.path) {
            Ok(s) => s,
            // The agent's own namespace comes first: failing there is an error, not a
            // namespace that vanished.
            Err(e) if i == 0 => return Err(SockDiagError::OwnNamespace(e.to_string())),
            Err(e) => {
                // A process that exited between the walk and now is normal.
                if ns.path.exists() {
                    report.failures.push(format!(
                        "netns {} ({}): {e}",
                        ns.inode,
                        ns.path.display()
                    ));
                }
                continue;
            }
        };
        report.namespaces += 1;
        scan_namespace(&sock, ns.inode, &wanted, via_service, &mut report);
    }
    if !report.destroyed.is_empty() || !report.failures.is_empty() {
        debug!(
            namespaces = report.namespaces,
            matched = report.matched,
            direct = report.direct,
            destroyed = report.destroyed.len(),
            failures = report.failures.len(),
            "connected UDP sockets to removed backends"
        );
    }
    Ok(report)
}

fn scan_namespace(
    sock: &Diag,
    netns: u64,
    wanted: &HashSet<(IpAddr, u16)>,
    via_service: &impl Fn(u64, IpAddr, u16) -> bool,
    report: &mut DestroyReport,
) {
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let socks = match sock.dump_udp(family) {
            Ok(s) => s,
            Err(e) => {
                report.failures.push(format!(
                    "netns {netns}: dumping UDP sockets (family {family}): {e}"
                ));
                continue;
            }
        };
        for s in socks {
            let peer = s.peer();
            if !wanted.contains(&(peer.ip(), peer.port())) {
                continue;
            }
            report.matched += 1;
            if !via_service(s.cookie, peer.ip(), peer.port()) {
                report.direct += 1;
                continue;
            }
            match sock.destroy(&s) {
                Ok(true) => report.destroyed.push(DestroyedSocket {
                    netns,
                    cookie: s.cookie,
                    local: s.local(),
                    peer,
                }),
                Ok(false) => report.vanished += 1,
                Err(e) => report.failures.push(format!(
                    "netns {netns}: destroying UDP socket {} -> {peer} (cookie {}): {e}",
                    s.local(),
                    s.cookie
                )),
            }
        }
    }
}

struct Netns {
    inode: u64,
    path: PathBuf,
}

/// Every distinct network namespace: the agent's own first, then pinned ones, then
/// those of running processes.
fn namespaces(opts: &Options) -> Result<Vec<Netns>, SockDiagError> {
    let own = PathBuf::from("/proc/self/ns/net");
    let meta = fs::metadata(&own).map_err(|source| SockDiagError::Io {
        what: "reading",
        path: own.clone(),
        source,
    })?;
    let mut seen = HashSet::from([(meta.dev(), meta.ino())]);
    let mut out = vec![Netns {
        inode: meta.ino(),
        path: own,
    }];
    let mut add = |path: PathBuf| {
        if let Ok(m) = fs::metadata(&path)
            && seen.insert((m.dev(), m.ino()))
        {
            out.push(Netns {
                inode: m.ino(),
                path,
            });
        }
    };
    for dir in &opts.netns_dirs {
        let Ok(rd) = fs::read_dir(dir) else { continue };
        for e in rd.flatten() {
            add(e.path());
        }
    }
    if opts.scan_proc
        && let Ok(rd) = fs::read_dir("/proc")
    {
        let is_pid = |n: &str| n.bytes().all(|b| b.is_ascii_digit());
        for e in rd.flatten() {
            if e.file_name().to_str().is_some_and(is_pid) {
                add(e.path().join("ns/net"));
            }
        }
    }
    Ok(out)
}

/// A `NETLINK_SOCK_DIAG` socket bound (by creation) to one network namespace.
struct Diag {
    fd: OwnedFd,
}

static SEQ: AtomicU32 = AtomicU32::new(1);

/// Opens a sock_diag socket inside the namespace at `path`: a helper thread enters it,
/// creates the socket and exits. The socket stays in that namespace whoever uses it.
fn diag_socket_in(path: &Path) -> io::Result<Diag> {
    let path = path.to_path_buf();
    std::thread::Builder::new()
        .name("ferry-sockdiag".into())
        .spawn(move || -> io::Result<Diag> {
            let ns = fs::File::open(&path)?;
            // SAFETY: changes the namespace of this helper thread only; it exits next.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Diag::open()
        })?
        .join()
        .map_err(|_| io::Error::other("sock_diag helper thread panicked"))?
}

/// One socket from a dump.
struct DiagSock {
    family: u8,
    /// The raw `inet_diag_sockid`, sent back as is to destroy the socket.
    id: [u8; SOCKID_LEN],
    cookie: u64,
}

impl DiagSock {
    fn addr(&self, at: usize, port_at: usize) -> SocketAddr {
        let port = u16::from_be_bytes([self.id[port_at], self.id[port_at + 1]]);
        let ip = if self.family == libc::AF_INET as u8 {
            IpAddr::V4(Ipv4Addr::new(
                self.id[at],
                self.id[at + 1],
                self.id[at + 2],
                self.id[at + 3],
            ))
        } else {
            let o: [u8; 16] = self.id[at..at + 16].try_into().unwrap();
            IpAddr::V6(Ipv6Addr::from(o)).to_canonical()
        };
        SocketAddr::new(ip, port)
    }
    fn local(&self) -> SocketAddr {
        self.addr(4, 0)
    }
    fn peer(&self) -> SocketAddr {
        self.addr(20, 2)
    }
}

fn req(buf: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, family: u8, states: u32, id: &[u8]) {
    buf.clear();
    buf.extend_from_slice(&((NLMSG_HDRLEN + REQ_LEN) as u32).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(&[family, libc::IPPROTO_UDP as u8, 0, 0]);
    buf.extend_from_slice(&states.to_ne_bytes());
    buf.extend_from_slice(id);
    buf.resize(NLMSG_HDRLEN + REQ_LEN, 0);
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes(b[at..at + 2].try_into().unwrap())
}

impl Diag {
    fn open() -> io::Result<Diag> {
        // SAFETY: plain socket(2); the result is checked and owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                NETLINK_SOCK_DIAG,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval {
            tv_sec: Duration::from_secs(2).as_secs() as libc::time_t,
            tv_usec: 0,
        };
        // SAFETY: valid option buffer of the declared size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Diag { fd })
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: `msg` is a valid buffer; an unconnected netlink socket sends to the kernel.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receives netlink messages for `seq` and hands each (type, payload) to `f` until it
    /// returns `Some`, a `NLMSG_DONE` arrives (`Ok(None)`) or the kernel reports an error.
    fn recv_until<T>(
        &self,
        seq: u32,
        mut f: impl FnMut(u16, &[u8]) -> Option<io::Result<T>>,
    ) -> io::Result<Option<T>> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: `buf` is writable for its length; MSG_TRUNC reports the real size.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_TRUNC,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let n = n as usize;
            if n > buf.len() {
                return Err(io::Error::other(format!(
                    "netlink message of {n} bytes truncated"
                )));
            }
            let mut off = 0;
            while off + NLMSG_HDRLEN <= n {
                let len = u32_at(&buf, off) as usize;
                if len < NLMSG_HDRLEN || off + len > n {
                    return Err(io::Error::other("malformed netlink message"));
                }
                let kind = u16_at(&buf, off + 4);
                let mseq = u32_at(&buf, off + 8);
                let payload = &buf[off + NLMSG_HDRLEN..off + len];
                off += (len + 3) & !3;
                if mseq != seq {
                    continue;
                }
                match kind {
                    NLMSG_DONE => return Ok(None),
                    NLMSG_ERROR => {
                        let err = if payload.len() >= 4 {
                            u32_at(payload, 0) as i32
                        } else {
                            -libc::EPROTO
                        };
                        if err != 0 {
                            return Err(io::Error::from_raw_os_error(-err));
                        }
                        if let Some(r) = f(kind, payload) {
                            return r.map(Some);
                        }
                        return Ok(None);
                    }
                    _ => {
                        if let Some(r) = f(kind, payload) {
                            return r.map(Some);
                        }
                    }
                }
            }
        }
    }

    /// Every connected UDP socket of one family in this namespace.
    fn dump_udp(&self, family: u8) -> io::Result<Vec<DiagSock>> {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let mut msg = Vec::new();
        req(
            &mut msg,
            SOCK_DIAG_BY_FAMILY,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            family,
            1 << STATE_CONNECTED,
            &[],
        );
        self.send(&msg)?;
        let mut out = Vec::new();
        self.recv_until::<()>(seq, |kind, p| {
            if kind != SOCK_DIAG_BY_FAMILY || p.len() < MSG_LEN {
                return None;
            }
            // Filter again: the state filter is the kernel's, the family one too, but
            // a stray entry must never lead to a destroy.
            if p[0] != family || p[1] != STATE_CONNECTED {
                return None;
            }
            let id: [u8; SOCKID_LEN] = p[4..4 + SOCKID_LEN].try_into().unwrap();
            let cookie = u32_at(&id, 40) as u64 | (u32_at(&id, 44) as u64) << 32;
            out.push(DiagSock { family, id, cookie });
            None
        })?;
        Ok(out)
    }

    /// Destroys one socket. The kernel finds it by 4-tuple and interface and checks the
    /// cookie, so a socket that closed or reconnected meanwhile is never hit: `Ok(false)`.
    fn destroy(&self, s: &DiagSock) -> io::Result<bool> {
        match self.destroy_id(s.family, &s.id) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn destroy_id(&self, family: u8, id: &[u8; SOCKID_LEN]) -> io::Result<()> {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let mut msg = Vec::new();
        req(
            &mut msg,
            SOCK_DESTROY,
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            family,
            0,
            id,
        );
        self.send(&msg)?;
        // The ack is an NLMSG_ERROR with error 0; recv_until turns a non-zero one into Err.
        self.recv_until(seq, |kind, _| (kind == NLMSG_ERROR).then_some(Ok(())))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_addr_maps_ipv4_and_keeps_ipv6() {
        let v4: IpAddr = "10.1.2.3".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert_eq!(map_addr(v4), map_addr(mapped));
        assert_eq!(
            map_addr(v4),
            addr_from_v4_be(u32::from_be_bytes([10, 1, 2, 3]).to_be())
        );
        let v6: IpAddr = "fd00:1:2::2".parse().unwrap();
        let a = map_addr(v6);
        assert_eq!(u32::from_be(a[0]), 0xfd00_0001);
        assert_eq!(u32::from_be(a[3]), 2);
    }

    #[test]
    fn request_layout() {
        let mut b = Vec::new();
        req(
            &mut b,
            SOCK_DESTROY,
            NLM_F_REQUEST | NLM_F_ACK,
            7,
            2,
            0,
            &[0xaa; SOCKID_LEN],
        );
        assert_eq!(b.len(), 72);
        assert_eq!(u32_at(&b, 0), 72);
        assert_eq!(u16_at(&b, 4), SOCK_DESTROY);
        assert_eq!(u32_at(&b, 8), 7);
        assert_eq!(&b[16..20], &[2, libc::IPPROTO_UDP as u8, 0, 0]);
        assert!(b[24..].iter().all(|&x| x == 0xaa));
    }

    #[test]
    fn sockid_addresses() {
        let mut id = [0u8; SOCKID_LEN];
        id[0..2].copy_from_slice(&1000u16.to_be_bytes());
        id[2..4].copy_from_slice(&5353u16.to_be_bytes());
        id[4..8].copy_from_slice(&[10, 0, 0, 1]);
        id[20..24].copy_from_slice(&[10, 1, 1, 2]);
        let s = DiagSock {
            family: libc::AF_INET as u8,
            id,
            cookie: 1,
        };
        assert_eq!(s.local(), "10.0.0.1:1000".parse().unwrap());
        assert_eq!(s.peer(), "10.1.1.2:5353".parse().unwrap());
        let mut id6 = [0u8; SOCKID_LEN];
        id6[2..4].copy_from_slice(&53u16.to_be_bytes());
        let mapped: Ipv6Addr = "::ffff:10.1.1.2".parse().unwrap();
        id6[20..36].copy_from_slice(&mapped.octets());
        let s = DiagSock {
            family: libc::AF_INET6 as u8,
            id: id6,
            cookie: 1,
        };
        assert_eq!(s.peer(), "10.1.1.2:53".parse().unwrap());
    }
}
