//! The eBPF dataplane's background threads end with it: dropping the dataplane stops and
//! joins each (signals, linger, grace, links), so none outlives it. A binary of its own:
//! it counts the process's threads by name.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use waypoint::dataplane::ebpf;

const THREADS: [&str; 4] = [
    "waypoint-signal",
    "waypoint-linger",
    "waypoint-grace",
    "waypoint-links",
];

/// The process's threads whose names (`comm`, at most 15 bytes) are among [`THREADS`].
fn dataplane_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_owned())
        .filter(|c| THREADS.iter().any(|t| c.starts_with(t)))
        .collect()
}

#[test]
fn dropping_the_dataplane_joins_its_threads() {
    common::require_root();
    assert!(dataplane_threads().is_empty());
    for _ in 0..3 {
        let dp = ebpf::Ebpf::load(ebpf::Config {
            rewrite_splice: true,
            ..ebpf::Config::default()
        })
        .expect("the eBPF dataplane with the rewrite program must load (root, TCX kernel)");
        // A thread names itself once it runs: wait for all four.
        let named = std::time::Instant::now();
        while dataplane_threads().len() < THREADS.len()
            && named.elapsed() < std::time::Duration::from_secs(5)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let mut running = dataplane_threads();
        running.sort();
        assert_eq!(
            running,
            [
                "waypoint-grace",
                "waypoint-linger",
                "waypoint-links",
                "waypoint-signal"
            ],
            "the dataplane's threads"
        );
        drop(dp);
        // The drop returned once they had ended; the kernel may list an ended thread
        // for a moment longer, far less than the 100 ms an unjoined one can run on.
        let dropped = std::time::Instant::now();
        while !dataplane_threads().is_empty()
            && dropped.elapsed() < std::time::Duration::from_millis(20)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(dataplane_threads(), Vec::<String>::new(), "threads left");
    }
}
