//! What the datapath benchmarks create, registered the moment it exists, so that it is
//! removed when its guard drops (normal end, error, panic) and also on Ctrl-C, when
//! Drop does not run.

use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::Mutex,
    time::Duration,
};

use ferry_tests::bin;

#[derive(Clone, Debug)]
pub(crate) enum Res {
    /// A process this benchmark started.
    Pid(i32),
    /// A bpffs directory: `ferry cleanup` detaches and unpins, then rmdir.
    Pins(PathBuf),
    /// A cgroup v2 directory: its processes are killed, then rmdir.
    Cgroup(PathBuf),
    /// A network namespace (its devices, routes, iptables and nft tables go with it).
    Netns(String),
    /// A scratch directory.
    Dir(PathBuf),
    /// A sysctl file and the value to put back.
    Sysctl(PathBuf, String),
}

static REGISTRY: Mutex<Vec<(u64, Res)>> = Mutex::new(Vec::new());
static SEQ: Mutex<u64> = Mutex::new(0);
/// Held while `release_all` runs, and by the signal thread until the process exits: a
/// main thread that fails because the signal thread killed its processes waits in
/// `release_all` instead of exiting half-way through the removal.
static RELEASING: Mutex<()> = Mutex::new(());

/// Removes its resource when dropped.
pub(crate) struct Guard(u64);

pub(crate) fn hold(res: Res) -> Guard {
    let id = {
        let mut s = SEQ.lock().unwrap_or_else(|e| e.into_inner());
        *s += 1;
        *s
    };
    REGISTRY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((id, res));
    Guard(id)
}

impl Drop for Guard {
    fn drop(&mut self) {
        let res = {
            let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
            reg.iter()
                .position(|(id, _)| *id == self.0)
                .map(|i| reg.remove(i).1)
        };
        if let Some(r) = res {
            release(&r);
        }
    }
}

fn quiet(cmd: &mut Command) {
    let _ = cmd.stdout(Stdio::null()).stderr(Stdio::null()).status();
}

fn release(r: &Res) {
    match r {
        Res::Pid(pid) => {
            // SAFETY: signalling a process this benchmark started.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        Res::Pins(dir) => {
            quiet(
                Command::new(bin("ferry"))
                    .arg("cleanup")
                    .arg("--bpffs")
                    .arg(dir),
            );
            let _ = fs::remove_dir(dir);
        }
        Res::Cgroup(dir) => {
            for _ in 0..100 {
                if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
                    for pid in procs.split_whitespace().filter_map(|p| p.parse().ok()) {
                        // SAFETY: a process in the benchmark's own cgroup.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
                if fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Res::Netns(ns) => quiet(Command::new("ip").args(["netns", "del", ns])),
        Res::Dir(d) => {
            let _ = fs::remove_dir_all(d);
        }
        Res::Sysctl(path, old) => {
            let _ = fs::write(path, old);
        }
    }
}

/// Removes everything still registered: processes first, then pins, cgroups,
/// namespaces, directories and sysctls (so nothing is still using what goes next).
pub(crate) fn release_all() {
    let _releasing = RELEASING.lock().unwrap_or_else(|e| e.into_inner());
    release_registered();
}

fn release_registered() {
    let mut all: Vec<Res> = REGISTRY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain(..)
        .map(|(_, r)| r)
        .collect();
    let rank = |r: &Res| match r {
        Res::Pid(_) => 0,
        Res::Pins(_) => 1,
        Res::Cgroup(_) => 2,
        Res::Netns(_) => 3,
        Res::Dir(_) => 4,
        Res::Sysctl(..) => 5,
    };
    all.sort_by_key(rank);
    for r in &all {
        release(r);
    }
}

/// A child process that is killed and reaped when dropped.
pub(crate) struct Proc {
    pub(crate) child: Child,
    _guard: Option<Guard>,
}

impl Proc {
    pub(crate) fn new(child: Child) -> Proc {
        let pid = child.id() as i32;
        Proc {
            child,
            _guard: Some(hold(Res::Pid(pid))),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Unregister before reaping, so the pid is never signalled once it may be reused.
        if let Some(g) = self._guard.take() {
            let mut reg = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
            reg.retain(|(id, _)| *id != g.0);
            std::mem::forget(g);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One thread receives SIGINT and SIGTERM for the whole benchmark: it removes what the
/// control-plane benchmark and the registry hold, then exits with 130.
pub(crate) fn install_signal_handler() {
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: plain sigset manipulation on our own stack value; blocking the signals in
    // every thread so that only the waiter below receives them (children get a clean
    // mask from std's spawn).
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: waits on the signals blocked above.
        unsafe { libc::sigwait(&set, &mut sig) };
        eprintln!("\nferry-bench: interrupted, removing agents, pins, cgroups and namespaces");
        // Kept until the exit below.
        let _releasing = RELEASING.lock().unwrap_or_else(|e| e.into_inner());
        crate::control_plane::on_signal();
        release_registered();
        std::process::exit(130);
    });
}
