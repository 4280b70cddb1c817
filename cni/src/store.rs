//! The IPAM store on the node: `<dataDir>/<network name>/`.
//!
//! - `lock`: every invocation that reads or changes allocations holds an exclusive
//!   `flock` on it, so two concurrent ADDs never pick the same address; the kernel drops
//!   the lock when a process dies.
//! - one file per allocated address, named by the address (`10.244.1.7`,
//!   `fd00:10:244:1::7`), containing `containerID\nifname\n`;
//! - `last.v4`, `last.v6`: the last address handed out per family (the search cursor).
//!
//! Every file is written to a temporary name, synced and renamed, then the directory is
//! synced: after a crash a file is either whole or absent. ADD persists its allocation
//! before it makes any interface, so an ADD that dies half-way leaves at most an
//! allocation (and interfaces) that DEL or GC of that attachment frees.

use std::{
    collections::BTreeSet,
    fs::{self, File, OpenOptions},
    io::{ErrorKind, Write},
    net::IpAddr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use crate::{
    config::Attachment,
    error::{self, Error, Result},
    ipam::{Cidr, next_free},
};

/// One allocated address and its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub ip: IpAddr,
    pub owner: Attachment,
}

/// The store of one network, locked for as long as it lives.
pub struct Store {
    dir: PathBuf,
    _lock: File,
}

impl Store {
    /// Opens (creating it) `<data_dir>/<network>` and takes its lock, waiting for other
    /// invocations to finish.
    pub fn lock(data_dir: &Path, network: &str) -> Result<Store> {
        let dir = data_dir.join(network);
        fs::create_dir_all(&dir)
            .map_err(|e| Error::store(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join("lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::store(format!("opening {}: {e}", path.display())))?;
        loop {
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(Error::new(
                    error::TRY_AGAIN,
                    "IPAM store busy",
                    format!("locking {}: {e}", path.display()),
                ));
            }
        }
        Ok(Store { dir, _lock: lock })
    }

    /// Every allocation of the network.
    pub fn allocations(&self) -> Result<Vec<Allocation>> {
        let entries = fs::read_dir(&self.dir)
            .map_err(|e| Error::store(format!("reading {}: {e}", self.dir.display())))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry =
                entry.map_err(|e| Error::store(format!("reading {}: {e}", self.dir.display())))?;
            let Some(ip) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let text = match fs::read_to_string(entry.path()) {
                Ok(t) => t,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(Error::store(format!(
                        "reading {}: {e}",
                        entry.path().display()
                    )));
                }
            };
            let mut lines = text.lines();
            let owner = Attachment {
                container_id: lines.next().unwrap_or_default().trim().to_string(),
                ifname: lines.next().unwrap_or_default().trim().to_string(),
            };
            out.push(Allocation { ip, owner });
        }
        out.sort_by_key(|a| a.ip);
        Ok(out)
    }

    /// The addresses of one attachment.
    pub fn of(&self, a: &Attachment) -> Result<Vec<IpAddr>> {
        Ok(self
            .allocations()?
            .into_iter()
            .filter(|x| &x.owner == a)
            .map(|x| x.ip)
            .collect())
    }

    /// One address per range for `a`: the one it already has (a retried ADD), or the next
    /// free one, persisted before this returns. On exhaustion nothing new stays
    /// allocated.
    pub fn allocate(&self, ranges: &[Cidr], a: &Attachment) -> Result<Vec<IpAddr>> {
        let all = self.allocations()?;
        let mut used: BTreeSet<IpAddr> = all.iter().map(|x| x.ip).collect();
        let mut out = Vec::new();
        let mut fresh = Vec::new();
        for range in ranges {
            if let Some(x) = all.iter().find(|x| &x.owner == a && range.contains(x.ip)) {
                out.push(x.ip);
                continue;
            }
            let cursor = self.cursor(range.is_v4());
            let Some(ip) = next_free(range, &used, cursor) else {
                for ip in fresh {
                    let _ = self.release(ip);
                }
                let (lo, hi) = range.usable();
                return Err(Error::new(
                    error::EXHAUSTED,
                    format!("no free address in pod CIDR {range}"),
                    format!(
                        "all {} assignable addresses of {range} are allocated (the network, node and broadcast addresses are never handed out); free some with DEL or GC",
                        hi - lo + 1
                    ),
                ));
            };
            let persisted = self
                .write(
                    &ip.to_string(),
                    &format!("{}\n{}\n", a.container_id, a.ifname),
                )
                .and_then(|()| self.write(cursor_file(range.is_v4()), &format!("{ip}\n")));
            if let Err(e) = persisted {
                for ip in fresh.into_iter().chain([ip]) {
                    let _ = self.release(ip);
                }
                return Err(e);
            }
            used.insert(ip);
            fresh.push(ip);
            out.push(ip);
        }
        Ok(out)
    }

    /// Frees an address; an address already free is fine.
    pub fn release(&self, ip: IpAddr) -> Result<()> {
        let path = self.dir.join(ip.to_string());
        match fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::store(format!("removing {}: {e}", path.display()))),
        }
    }

    /// Whether every range still has a free address (for STATUS); the exhausted range
    /// otherwise.
    pub fn exhausted(&self, ranges: &[Cidr]) -> Result<Option<Cidr>> {
        let used: BTreeSet<IpAddr> = self.allocations()?.into_iter().map(|x| x.ip).collect();
        Ok(ranges
            .iter()
            .find(|r| next_free(r, &used, None).is_none())
            .copied())
    }

    fn cursor(&self, v4: bool) -> Option<IpAddr> {
        fs::read_to_string(self.dir.join(cursor_file(v4)))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// Writes `name` atomically: temporary file, fsync, rename, fsync of the directory.
    fn write(&self, name: &str, content: &str) -> Result<()> {
        let path = self.dir.join(name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let written = File::create(&tmp).and_then(|mut f| {
            f.write_all(content.as_bytes())?;
            f.sync_all()
        });
        if let Err(e) = written.and_then(|()| fs::rename(&tmp, &path)) {
            let _ = fs::remove_file(&tmp);
            return Err(Error::store(format!("writing {}: {e}", path.display())));
        }
        self.sync_dir()
    }

    fn sync_dir(&self) -> Result<()> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::store(format!("syncing {}: {e}", self.dir.display())))
    }
}

fn cursor_file(v4: bool) -> &'static str {
    if v4 { "last.v4" } else { "last.v6" }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn att(c: &str) -> Attachment {
        Attachment {
            container_id: c.into(),
            ifname: "eth0".into(),
        }
    }

    #[test]
    fn allocates_reuses_releases_and_reports_exhaustion() {
        let dir = std::env::temp_dir().join(format!("ferry-cni-store-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let ranges: Vec<Cidr> = ["10.0.0.0/30", "fd00::/64"]
            .map(|s| s.parse().unwrap())
            .to_vec();
        let store = Store::lock(&dir, "net").unwrap();
        let a = store.allocate(&ranges, &att("a")).unwrap();
        assert_eq!(
            a,
            ["10.0.0.2", "fd00::2"].map(|s| s.parse::<IpAddr>().unwrap())
        );
        assert_eq!(
            store.allocate(&ranges, &att("a")).unwrap(),
            a,
            "a retried ADD"
        );
        assert_eq!(
            fs::read_to_string(dir.join("net/10.0.0.2")).unwrap(),
            "a\neth0\n"
        );
        let e = store.allocate(&ranges, &att("b")).unwrap_err();
        assert_eq!(e.code, error::EXHAUSTED);
        assert!(e.msg.contains("10.0.0.0/30"), "{e}");
        assert_eq!(
            store.allocations().unwrap().len(),
            2,
            "an exhausted ADD kept an address"
        );
        assert_eq!(store.exhausted(&ranges).unwrap(), Some(ranges[0]));
        for ip in a {
            store.release(ip).unwrap();
            store.release(ip).unwrap();
        }
        assert!(store.of(&att("a")).unwrap().is_empty());
        // The cursor sits after the freed IPv6 address.
        let b = store.allocate(&ranges, &att("b")).unwrap();
        assert_eq!(b[1].to_string(), "fd00::3");
        drop(store);
        fs::remove_dir_all(&dir).unwrap();
    }
}
