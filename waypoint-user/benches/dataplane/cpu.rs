//! Machine and process CPU accounting: /proc/stat's jiffies, this process's rusage, the
//! proxy runtime's threads' CPU time, and the load average.

use serde_json::{json, Value};

use crate::PROXY_THREAD;

/// Jiffies from the aggregate `cpu` line of /proc/stat.
#[derive(Clone, Copy, Default)]
pub(crate) struct CpuStat {
    user: u64,
    nice: u64,
    system: u64,
    pub(crate) idle: u64,
    pub(crate) iowait: u64,
    irq: u64,
    softirq: u64,
    steal: u64,
}

impl CpuStat {
    pub(crate) fn read() -> CpuStat {
        let text = std::fs::read_to_string("/proc/stat").expect("read /proc/stat");
        let line = text.lines().next().expect("/proc/stat has a cpu line");
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().expect("/proc/stat field is a number"))
            .collect();
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        CpuStat {
            user: at(0),
            nice: at(1),
            system: at(2),
            idle: at(3),
            iowait: at(4),
            irq: at(5),
            softirq: at(6),
            steal: at(7),
        }
    }

    pub(crate) fn delta(&self, before: &CpuStat) -> CpuStat {
        CpuStat {
            user: self.user - before.user,
            nice: self.nice - before.nice,
            system: self.system - before.system,
            idle: self.idle - before.idle,
            iowait: self.iowait - before.iowait,
            irq: self.irq - before.irq,
            softirq: self.softirq - before.softirq,
            steal: self.steal - before.steal,
        }
    }

    /// Jiffies spent doing work (guest time is already inside user).
    pub(crate) fn busy(&self) -> u64 {
        self.user + self.nice + self.system + self.irq + self.softirq
    }

    pub(crate) fn total(&self) -> u64 {
        self.busy() + self.idle + self.iowait + self.steal
    }

    pub(crate) fn json(&self, hz: f64) -> Value {
        let s = |j: u64| j as f64 / hz;
        json!({
            "user_s": s(self.user), "nice_s": s(self.nice), "system_s": s(self.system),
            "idle_s": s(self.idle), "iowait_s": s(self.iowait), "irq_s": s(self.irq),
            "softirq_s": s(self.softirq), "steal_s": s(self.steal),
        })
    }
}

pub(crate) fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// User + system CPU seconds of this whole process (load generator, servers and proxy).
pub(crate) fn process_cpu() -> f64 {
    // SAFETY: rusage is plain old data; getrusage writes one struct through the pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: see above; RUSAGE_SELF is always valid.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds (user + system) of the proxy runtime's threads only.
///
/// Threads that exited are not counted; the runtime's workers live for the whole run.
pub(crate) fn proxy_threads_cpu(hz: f64) -> f64 {
    let mut jiffies = 0u64;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    for task in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // Format: "tid (comm) state ..."; comm may contain spaces, so split at the parens.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with(PROXY_THREAD) {
            continue;
        }
        // After ")": field 3 (state) is index 0, so utime (14) and stime (15) are 11, 12.
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let field = |i: usize| rest.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
        jiffies += field(11) + field(12);
    }
    jiffies as f64 / hz
}

pub(crate) fn loadavg() -> (f64, String) {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let one = text
        .split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .unwrap_or(0.0);
    (one, text.trim().to_owned())
}
