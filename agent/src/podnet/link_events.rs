//! Wakes the fast path's veth scan when a link appears, changes or goes (rtnetlink's
//! link group), so that a new pod's veth carries the program milliseconds after the CNI
//! plugin made it instead of at the next periodic scan.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use tokio::io::{Interest, unix::AsyncFd};

/// `RTMGRP_LINK`: link added, changed or deleted.
const RTMGRP_LINK: u32 = 1;

pub struct LinkEvents {
    fd: AsyncFd<OwnedFd>,
    buf: Vec<u8>,
}

impl LinkEvents {
    /// A netlink socket in this network namespace subscribed to link notifications.
    pub fn open() -> io::Result<LinkEvents> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_ROUTE,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: an all-zero sockaddr_nl is valid; bind(2) reads it for its size.
        let rc = unsafe {
            let mut sa: libc::sockaddr_nl = std::mem::zeroed();
            sa.nl_family = libc::AF_NETLINK as u16;
            sa.nl_groups = RTMGRP_LINK;
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the AsyncFd owns the OwnedFd, which stays open and the same until it is
        // dropped with it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(LinkEvents {
            fd,
            buf: vec![0; 1 << 16],
        })
    }

    /// Returns once one or more notifications arrived, having read all that are queued.
    /// What they say does not matter: the scan lists the links itself. A lost
    /// notification (the socket's queue overflowed) counts as one.
    pub async fn changed(&mut self) -> io::Result<()> {
        loop {
            let mut ready = self.fd.readable().await?;
            let mut any = false;
            loop {
                // SAFETY: receives into a live buffer of its own length.
                let n = unsafe {
                    libc::recv(
                        self.fd.get_ref().as_raw_fd(),
                        self.buf.as_mut_ptr().cast(),
                        self.buf.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if n >= 0 {
                    any = true;
                    continue;
                }
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => break,
                    Some(libc::EINTR) => continue,
                    Some(libc::ENOBUFS) => any = true,
                    _ => return Err(e),
                }
            }
            ready.clear_ready();
            if any {
                return Ok(());
            }
        }
    }
}
