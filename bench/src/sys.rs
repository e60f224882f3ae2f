//! What the benchmark reads from and sets on the machine: /proc/stat CPU time, the CPU
//! time of processes that are not ours (to tell a busy machine), RSS of a process tree,
//! CPU affinity and RLIMIT_NOFILE.

use std::{collections::HashMap, time::Duration};

/// Errors talking to the kernel.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// /proc could not be read or parsed.
    #[error("reading {path}: {detail}")]
    Proc {
        /// The file.
        path: String,
        /// What went wrong.
        detail: String,
    },
    /// A process refused its CPU affinity.
    #[error("sched_setaffinity of process {pid} ({comm}): {source}")]
    Affinity {
        /// The process.
        pid: i32,
        /// Its name.
        comm: String,
        /// The cause.
        source: nix::Error,
    },
    /// A system call failed.
    #[error("{call}: {source}")]
    Sys {
        /// The call.
        call: &'static str,
        /// The cause.
        source: nix::Error,
    },
}

fn read(path: &str) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|e| Error::Proc {
        path: path.to_owned(),
        detail: e.to_string(),
    })
}

/// Jiffies of the aggregate `cpu` line of /proc/stat.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuStat {
    pub user: u64,
    pub nice: u64,
    pub system: u64,
    pub idle: u64,
    pub iowait: u64,
    pub irq: u64,
    pub softirq: u64,
    pub steal: u64,
}

impl CpuStat {
    pub fn read() -> Result<CpuStat, Error> {
        let text = read("/proc/stat")?;
        let line = text.lines().next().unwrap_or_default();
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        if v.len() < 8 {
            return Err(Error::Proc {
                path: "/proc/stat".into(),
                detail: format!("unexpected first line {line:?}"),
            });
        }
        Ok(CpuStat {
            user: v[0],
            nice: v[1],
            system: v[2],
            idle: v[3],
            iowait: v[4],
            irq: v[5],
            softirq: v[6],
            steal: v[7],
        })
    }

    pub fn since(&self, before: &CpuStat) -> CpuStat {
        CpuStat {
            user: self.user.saturating_sub(before.user),
            nice: self.nice.saturating_sub(before.nice),
            system: self.system.saturating_sub(before.system),
            idle: self.idle.saturating_sub(before.idle),
            iowait: self.iowait.saturating_sub(before.iowait),
            irq: self.irq.saturating_sub(before.irq),
            softirq: self.softirq.saturating_sub(before.softirq),
            steal: self.steal.saturating_sub(before.steal),
        }
    }

    /// Jiffies doing work, softirq and irq included: the eBPF path works there.
    pub fn busy(&self) -> u64 {
        self.user + self.nice + self.system + self.irq + self.softirq
    }

    pub fn total(&self) -> u64 {
        self.busy() + self.idle + self.iowait + self.steal
    }

    /// Share of CPU time idle, in percent.
    pub fn idle_pct(&self) -> f64 {
        if self.total() == 0 {
            return 100.0;
        }
        100.0 * (self.idle + self.iowait) as f64 / self.total() as f64
    }
}

/// Online CPUs of the machine. Not `available_parallelism`: that reads this thread's
/// affinity, which pinning narrows.
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// Clock ticks per second (the unit of /proc/stat).
pub fn hz() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// The 1-minute load average and the whole /proc/loadavg line.
pub fn loadavg() -> (f64, String) {
    let text = read("/proc/loadavg").unwrap_or_default();
    let one = text
        .split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .unwrap_or(0.0);
    (one, text.trim().to_owned())
}

/// `(ppid, utime + stime jiffies, comm)` of one process, from /proc/PID/stat.
fn proc_stat(pid: i32) -> Option<(i32, u64, String)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ..."; comm may hold spaces and parens, so split at the last ')'.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let rest: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let ppid = rest.get(1)?.parse().ok()?;
    let utime: u64 = rest.get(11)?.parse().ok()?;
    let stime: u64 = rest.get(12)?.parse().ok()?;
    Some((ppid, utime + stime, stat.get(open + 1..close)?.to_owned()))
}

fn all_pids() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// `pid` and all its descendants.
pub fn tree(pid: i32) -> Vec<i32> {
    let parents: HashMap<i32, i32> = all_pids()
        .into_iter()
        .filter_map(|p| Some((p, proc_stat(p)?.0)))
        .collect();
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        out.extend(
            parents
                .iter()
                .filter(|(_, pp)| **pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    out
}

/// CPU time, in nanoseconds, that the threads of process `pid` have run: the first field
/// of each `/proc/PID/task/TID/schedstat` (the scheduler's own clock, not ticks, so a
/// few thousand short connections add up exactly). Without IRQ time accounting (Debian's
/// kernels), softirq work done in a thread's context (a loopback packet's whole receive
/// path, for one) is that thread's. Threads alive now only; 0 when the process is gone.
pub fn cpu_ns(pid: i32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let text = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            text.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

/// [`cpu_ns`] of `pid` and all its descendants (nginx's master and worker).
pub fn cpu_ns_tree(pid: i32) -> u64 {
    tree(pid).into_iter().map(cpu_ns).sum()
}

/// CPU time this process has used, in nanoseconds, threads that ended included
/// (`getrusage`; the routers keep their threads, [`cpu_ns`] suits them).
pub fn cpu_ns_self() -> u64 {
    let Ok(u) = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF) else {
        return 0;
    };
    let ns = |t: nix::sys::time::TimeVal| {
        u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(t.tv_usec()).unwrap_or(0) * 1_000
    };
    ns(u.user_time()) + ns(u.system_time())
}

/// A snapshot that tells, over an interval, how much CPU other processes took.
pub struct Foreign {
    ours: Vec<i32>,
    /// Processes seen at the start: a process born in the interval counts from zero.
    by_pid: HashMap<i32, u64>,
}

impl Foreign {
    pub fn start(ours: &[i32]) -> Foreign {
        Foreign {
            ours: ours.to_vec(),
            by_pid: Self::snapshot(ours),
        }
    }

    fn snapshot(ours: &[i32]) -> HashMap<i32, u64> {
        let mut mine = std::collections::HashSet::new();
        for &p in ours {
            mine.extend(tree(p));
        }
        // Kernel threads (children of kthreadd, pid 2): softirq and kworker time is our
        // own traffic's and already in /proc/stat.
        mine.extend(tree(2));
        all_pids()
            .into_iter()
            .filter(|p| !mine.contains(p))
            .filter_map(|p| Some((p, proc_stat(p)?.1)))
            .collect()
    }

    /// CPU seconds other processes used since `start`.
    pub fn seconds(&self, hz: f64) -> f64 {
        let now = Self::snapshot(&self.ours);
        let mut used = 0u64;
        for (pid, j) in &now {
            used += j.saturating_sub(self.by_pid.get(pid).copied().unwrap_or(0));
        }
        used as f64 / hz
    }
}

/// Resident set size of a process tree, in bytes (VmRSS of each process, summed).
pub fn rss_tree(pid: i32) -> u64 {
    tree(pid).into_iter().map(rss).sum()
}

/// VmRSS of one process, in bytes; 0 when it is gone.
pub fn rss(pid: i32) -> u64 {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return 0;
    };
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Sets the CPU affinity of every thread of every process in the trees rooted at `pids`.
/// `cpu` None: all online CPUs. Returns the threads that refused (EINVAL: kernel-owned
/// helper threads such as io workers, or threads exiting); a process leader refusing is
/// an error.
pub fn pin(pids: &[i32], cpu: Option<usize>) -> Result<Vec<String>, Error> {
    let mut set = nix::sched::CpuSet::new();
    for c in 0..online_cpus() {
        if cpu.is_none_or(|want| want == c) {
            set.set(c).map_err(|source| Error::Sys {
                call: "CPU_SET",
                source,
            })?;
        }
    }
    let mut refused = Vec::new();
    for &root in pids {
        for pid in tree(root) {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
                continue;
            };
            for task in tasks.flatten() {
                let Some(tid) = task
                    .file_name()
                    .to_str()
                    .and_then(|t| t.parse::<i32>().ok())
                else {
                    continue;
                };
                // A thread may exit between the listing and the call: ESRCH is fine.
                match nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set) {
                    Ok(()) | Err(nix::Error::ESRCH) => {}
                    Err(nix::Error::EINVAL) if tid != pid => {
                        let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                            .unwrap_or_default();
                        refused.push(format!("{pid}/{tid} {}", comm.trim()));
                    }
                    Err(source) => {
                        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                            .unwrap_or_default();
                        return Err(Error::Affinity {
                            pid,
                            comm: comm.trim().to_owned(),
                            source,
                        });
                    }
                }
            }
        }
    }
    Ok(refused)
}

/// Raises this process's RLIMIT_NOFILE (children inherit it) towards `want`; returns the
/// soft limit reached. Without CAP_SYS_RESOURCE (containers) only the soft limit can rise,
/// up to the hard one: callers size their runs by the result.
pub fn raise_nofile(want: u64) -> Result<u64, Error> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|source| Error::Sys {
        call: "getrlimit",
        source,
    })?;
    if soft >= want {
        return Ok(soft);
    }
    let nr_open: u64 = read("/proc/sys/fs/nr_open")?.trim().parse().unwrap_or(hard);
    let new = want.min(nr_open);
    if new > hard && setrlimit(Resource::RLIMIT_NOFILE, new, new).is_ok() {
        return Ok(new);
    }
    let new = new.min(hard);
    setrlimit(Resource::RLIMIT_NOFILE, new, hard).map_err(|source| Error::Sys {
        call: "setrlimit(RLIMIT_NOFILE)",
        source,
    })?;
    Ok(new)
}

/// Idle share of the machine over `window`, in percent, while the benchmark does nothing.
pub fn idle_probe(window: Duration) -> Result<f64, Error> {
    let a = CpuStat::read()?;
    std::thread::sleep(window);
    Ok(CpuStat::read()?.since(&a).idle_pct())
}

/// Names of the busiest other processes over `window`, for the busy warning.
pub fn top_foreign(ours: &[i32], window: Duration, hz: f64) -> Vec<(String, f64)> {
    let before: HashMap<i32, (u64, String)> = all_pids()
        .into_iter()
        .filter_map(|p| {
            let (_, j, c) = proc_stat(p)?;
            Some((p, (j, c)))
        })
        .collect();
    std::thread::sleep(window);
    let mut mine = std::collections::HashSet::new();
    for &p in ours {
        mine.extend(tree(p));
    }
    mine.extend(tree(2));
    let mut by_name: HashMap<String, f64> = HashMap::new();
    for p in all_pids() {
        if mine.contains(&p) {
            continue;
        }
        let Some((_, j, comm)) = proc_stat(p) else {
            continue;
        };
        let j0 = before.get(&p).map_or(0, |(j, _)| *j);
        *by_name.entry(comm).or_default() += j.saturating_sub(j0) as f64 / hz;
    }
    let mut v: Vec<_> = by_name.into_iter().filter(|(_, s)| *s > 0.0).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v.truncate(5);
    v
}

/// Whether conntrack tracks loopback flows here, and its table size: at 100k proxied
/// connections a full table drops SYNs.
pub fn conntrack() -> Option<(u64, u64)> {
    let count = read("/proc/sys/net/netfilter/nf_conntrack_count")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let max = read("/proc/sys/net/netfilter/nf_conntrack_max")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some((count, max))
}

/// The machine's speed at what routers do most: enter the kernel, and hand work to
/// another thread on the same CPU. Runs differ by machine far more than by router (a
/// pinned loopback round trip took 4.8 µs on one machine and 25 µs on another), so the
/// report prints these beside its figures.
#[derive(Clone, Copy, Debug)]
pub struct Calibration {
    /// One `getppid` system call, ns.
    pub syscall_ns: f64,
    /// One byte there and back through two pipes between two threads pinned to the last
    /// CPU, µs: two context switches and four system calls.
    pub pipe_round_trip_us: f64,
}

/// Measures [`Calibration`] (about 0.2 s).
pub fn calibrate() -> Result<Calibration, Error> {
    use std::{
        fs::File,
        io::{Read, Write},
        time::Instant,
    };
    const CALLS: u32 = 200_000;
    const TRIPS: u32 = 10_000;
    let sys = |call| move |source| Error::Sys { call, source };
    let t = Instant::now();
    for _ in 0..CALLS {
        std::hint::black_box(nix::unistd::getppid());
    }
    let syscall_ns = t.elapsed().as_nanos() as f64 / f64::from(CALLS);

    let mut set = nix::sched::CpuSet::new();
    set.set(online_cpus().saturating_sub(1))
        .map_err(sys("CPU_SET"))?;
    let pin_me = move || nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    let (ping_r, ping_w) = nix::unistd::pipe().map_err(sys("pipe"))?;
    let (pong_r, pong_w) = nix::unistd::pipe().map_err(sys("pipe"))?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        pin_me()?;
        let (mut r, mut w) = (File::from(ping_r), File::from(pong_w));
        let mut b = [0u8; 1];
        for _ in 0..TRIPS {
            r.read_exact(&mut b)?;
            w.write_all(&b)?;
        }
        Ok(())
    });
    // The caller's own affinity comes back after the loop.
    let before = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .map_err(sys("sched_getaffinity"))?;
    pin_me().map_err(sys("sched_setaffinity"))?;
    let (mut r, mut w) = (File::from(pong_r), File::from(ping_w));
    let mut b = [0u8; 1];
    let t = Instant::now();
    let mut trips = 0u32;
    for _ in 0..TRIPS {
        if w.write_all(&b).and_then(|()| r.read_exact(&mut b)).is_err() {
            break;
        }
        trips += 1;
    }
    let elapsed = t.elapsed();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &before)
        .map_err(sys("sched_setaffinity"))?;
    // Closing our ends ends the echo thread's loop if ours stopped early.
    drop((r, w));
    let _ = echo.join();
    if trips < TRIPS {
        return Err(Error::Sys {
            call: "pipe round trip",
            source: nix::Error::EPIPE,
        });
    }
    Ok(Calibration {
        syscall_ns,
        pipe_round_trip_us: elapsed.as_secs_f64() * 1e6 / f64::from(TRIPS),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn calibration_measures_and_gives_the_affinity_back() {
        let before = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        let c = calibrate().unwrap();
        assert!(c.syscall_ns > 0.0 && c.syscall_ns < 1e6, "{c:?}");
        // Two context switches cost more than one system call.
        assert!(c.pipe_round_trip_us * 1e3 > c.syscall_ns, "{c:?}");
        let after = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
        assert!((0..online_cpus()).all(|i| before.is_set(i).unwrap() == after.is_set(i).unwrap()));
    }

    #[test]
    fn cpu_time_counts_every_thread_and_the_children() {
        let before = cpu_ns_self();
        // 50 ms of CPU in a thread that then ends: by its own clock, so that a busy
        // machine only makes it take longer.
        std::thread::spawn(|| {
            let own = || {
                let t =
                    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).unwrap();
                Duration::from(t)
            };
            while own() < Duration::from_millis(50) {
                std::hint::black_box(0u64);
            }
        })
        .join()
        .unwrap();
        let used = cpu_ns_self() - before;
        assert!(used >= 50_000_000, "{used} ns");
        // A shell that waits on a child of its own that spins: the tree's time is the
        // child's, the shell's own next to nothing. (Not this process's tree: the other
        // tests' threads run and end meanwhile, and an ended thread leaves the sum.)
        let mut root = std::process::Command::new("sh")
            .args([
                "-c",
                "sh -c 'i=0; while [ $i -lt 100000000 ]; do i=$((i+1)); done' & wait",
            ])
            .spawn()
            .unwrap();
        let pid = root.id() as i32;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while cpu_ns_tree(pid) < 100_000_000 {
            assert!(
                std::time::Instant::now() < deadline,
                "the tree never ran 100 ms ({} ns)",
                cpu_ns_tree(pid)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let own = cpu_ns(pid);
        for p in tree(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        root.wait().unwrap();
        assert!(own < 50_000_000, "the waiting shell alone ran {own} ns");
        assert_eq!(cpu_ns(i32::MAX), 0);
    }
}
