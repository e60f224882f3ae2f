//! Child processes (the routers under test) in their own process groups, killed on every
//! way out: drop, error, panic, and SIGINT/SIGTERM/SIGHUP to the benchmark.
//!
//! Each child leads its own process group so that killing the group also takes nginx's
//! worker; the groups are registered in one process-wide list that the signal thread
//! empties before exiting.

use std::{
    collections::BTreeSet,
    os::unix::process::CommandExt as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{killpg, SigSet, Signal},
    unistd::Pid,
};

/// Errors starting a child.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The program could not be started.
    #[error("starting {program}: {source} (is it installed? see deploy/setup.sh)")]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The signal mask could not be set up.
    #[error("blocking termination signals: {0}")]
    Mask(nix::Error),
}

/// Process groups still alive.
static GROUPS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

fn groups() -> std::sync::MutexGuard<'static, BTreeSet<i32>> {
    // A panic while holding the lock leaves a plain set behind: still usable.
    GROUPS.lock().unwrap_or_else(|p| p.into_inner())
}

fn kill_group(pgid: i32) {
    // ESRCH (already gone) is the common case at the end of a run.
    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread (every thread spawned later inherits
/// the mask) and starts a thread that waits for them, kills every registered group and
/// exits. Call first thing in `main`. std's `Command` resets the mask in children.
pub fn install_signal_cleanup() -> Result<(), Error> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGHUP);
    set.thread_block().map_err(Error::Mask)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let sig = set.wait();
            eprintln!("\nwaypoint-bench: {sig:?}: stopping every router and exiting");
            kill_all();
            std::process::exit(130);
        })
        .map_err(|e| Error::Spawn {
            program: "signal thread".into(),
            source: e,
        })?;
    Ok(())
}

/// Kills every registered process group (used on signals and at the end of `main`).
pub fn kill_all() {
    let all: Vec<i32> = std::mem::take(&mut *groups()).into_iter().collect();
    for g in all {
        kill_group(g);
    }
}

/// A child process leading its own group; the group is killed on drop (and then its
/// cgroup removed, if it has one).
pub struct Group {
    child: Child,
    /// Removed on drop, after `drop` stopped the group (fields drop after the body).
    _cgroup: Option<Cgroup>,
}

/// A cgroup (v2) of the benchmark's own for one router, as a Kubernetes pod's container
/// has one: what a router attaches to its cgroup then applies to its own sockets only.
/// (The waypoint's handshake-recording program runs at the callbacks of every TCP
/// socket in its cgroup; in the benchmark's cgroup it would run for the load generator's
/// and the servers' connections too, and for every other router's.)
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    /// Creates `name` under this process's cgroup v2 directory.
    pub fn create(name: &str) -> std::io::Result<Cgroup> {
        let own = std::fs::read_to_string("/proc/self/cgroup")?;
        let own = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or_else(|| std::io::Error::other("no cgroup v2 in /proc/self/cgroup"))?;
        // The host's mount (field 5 of mountinfo), not a container's: the benchmark runs
        // on the machine it measures.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
        let mount = mounts
            .lines()
            .find(|l| {
                l.split_once(" - ")
                    .is_some_and(|(_, r)| r.starts_with("cgroup2 "))
            })
            .and_then(|l| l.split(' ').nth(4))
            .ok_or_else(|| std::io::Error::other("no cgroup2 mount"))?;
        let path = PathBuf::from(mount)
            .join(own.trim_start_matches('/'))
            .join(name);
        std::fs::create_dir(&path)?;
        Ok(Cgroup { path })
    }

    /// Makes the process `cmd` starts join this cgroup before it runs.
    pub fn enter_on_exec(&self, cmd: &mut Command) {
        let procs = std::ffi::CString::new(
            self.path
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        );
        let Ok(procs) = procs else { return };
        // SAFETY: between fork and exec the closure only makes async-signal-safe system
        // calls (open, write, close) on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // "0": the writing process itself.
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if n != 1 {
                    return Err(err);
                }
                Ok(())
            });
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Empty once the group's processes are reaped, which `Group::stop` waited for.
        let deadline = Instant::now() + Duration::from_secs(2);
        while std::fs::remove_dir(&self.path).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Group {
    /// Starts `cmd` in a new process group, stdout discarded, stderr to `log` (a file),
    /// in `cgroup` if given.
    pub fn spawn(
        mut cmd: Command,
        log: &std::path::Path,
        cgroup: Option<Cgroup>,
    ) -> Result<Group, Error> {
        let program = cmd.get_program().to_string_lossy().into_owned();
        let stderr = std::fs::File::create(log)
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::null());
        cmd.process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        if let Some(c) = &cgroup {
            c.enter_on_exec(&mut cmd);
        }
        // Registered under the lock, so a signal between spawn and insert cannot orphan it.
        let mut g = groups();
        let child = cmd
            .spawn()
            .map_err(|source| Error::Spawn { program, source })?;
        let pid = child.id() as i32;
        g.insert(pid);
        Ok(Group {
            child,
            _cgroup: cgroup,
        })
    }

    /// Like `spawn`, with pipes to the child's stdin and from its stdout.
    pub fn spawn_piped(
        mut cmd: Command,
        log: &std::path::Path,
    ) -> Result<(Group, std::process::ChildStdin, std::process::ChildStdout), Error> {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let program = cmd.get_program().to_string_lossy().into_owned();
        let stderr = std::fs::File::create(log)
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::null());
        cmd.process_group(0).stderr(stderr);
        let mut g = groups();
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            program: program.clone(),
            source,
        })?;
        g.insert(child.id() as i32);
        drop(g);
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let mut group = Group {
                child,
                _cgroup: None,
            };
            group.stop();
            return Err(Error::Spawn {
                program,
                source: std::io::Error::other("no pipes to the child"),
            });
        };
        Ok((
            Group {
                child,
                _cgroup: None,
            },
            stdin,
            stdout,
        ))
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Whether the child has exited (with its status).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills the group and reaps the leader (bounded: SIGKILL cannot be ignored).
    pub fn stop(&mut self) {
        let pid = self.pid();
        kill_group(pid);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        groups().remove(&pid);
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop();
    }
}
