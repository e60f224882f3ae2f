//! The rewrite's unit tests (root, eBPF): the hand-over against the loaded program.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
use super::*;
use crate::dataplane::ebpf::{Config, Ebpf};

fn key(i: u32) -> RewriteKey {
    RewriteKey {
        saddr: i,
        daddr: i,
        sport: 1,
        dport: 2,
    }
}

/// The eBPF dataplane with the rewrite program loaded. Needs root.
fn loaded() -> Ebpf {
    assert!(nix::unistd::geteuid().is_root(), "needs root (eBPF)");
    Ebpf::load(Config {
        rewrite_splice: true,
        ..Config::default()
    })
    .expect("the eBPF dataplane with the rewrite program loads")
}

/// Queues ended connection `i` to linger until `due`, with its entries in the map if
/// `in_map`; any descriptor stands in for its B.
fn linger(r: &Rewriter, i: u32, due: Instant, in_map: bool, b: OwnedFd) {
    let entries = Entries {
        from_client: key(2 * i),
        from_pod: key(2 * i + 1),
    };
    if in_map {
        let value = Rewrite {
            slot: i,
            ..Rewrite::default()
        };
        let mut map = lock(&r.map);
        map.insert(entries.from_client, value, 0).unwrap();
        map.insert(entries.from_pod, value, 0).unwrap();
    }
    r.live.fetch_add(1, Relaxed);
    lock(&r.lingering).push_back(Lingering {
        due,
        entries,
        slot: i,
        upstream: b,
        filled: false,
    });
}

/// The sweep ends the lingering connections whose linger is over, in one batch that
/// an entry already gone does not stop, and leaves the others. Needs root; never
/// skipped.
#[test]
fn the_sweep_ends_what_lingered_long_enough() {
    let dp = loaded();
    let r = dp.rewriter().expect("the rewrite splice is on");
    let now = Instant::now();
    // Four ended connections. The program removed the second's entries (a SYN
    // reused its client's 4-tuple); the fourth's linger is not over.
    for i in 0..4u32 {
        let due = now + Duration::from_secs(if i == 3 { 60 } else { 0 });
        let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        linger(r, i, due, i != 1, b.into());
    }
    r.sweep(now + Duration::from_millis(1));
    assert_eq!(r.entries(), 2, "only the fourth connection's entries stay");
    assert!(r.get(&key(6)).is_some() && r.get(&key(7)).is_some());
    assert_eq!(r.live.load(Relaxed), 1);
    assert_eq!(lock(&r.lingering).len(), 1);
}

/// Past the limit, the sweep ends the oldest lingering connections before their linger
/// is over, and counts them. Needs root; never skipped.
#[test]
fn the_sweep_cuts_the_oldest_lingers_beyond_the_limit() {
    let dp = loaded();
    let r = dp.rewriter().expect("the rewrite splice is on");
    let limit = r.counts().linger_limit as usize;
    let now = Instant::now();
    // The first one's linger is over; the limit+3 behind it linger 60 s more.
    for i in 0..limit as u32 + 4 {
        let due = now + Duration::from_secs(if i == 0 { 0 } else { 60 });
        // The limit is at most a quarter of what this process may open.
        let b = std::fs::File::open("/dev/null").unwrap();
        linger(r, i, due, i < 6, b.into());
    }
    r.sweep(now + Duration::from_millis(1));
    assert_eq!(lock(&r.lingering).len(), limit);
    assert_eq!(r.counts().lingers_cut, 3, "three cut, one over");
    assert_eq!(r.live.load(Relaxed), limit as u64);
    for i in 0..4 {
        assert!(r.get(&key(2 * i)).is_none() && r.get(&key(2 * i + 1)).is_none());
    }
    assert!(r.get(&key(8)).is_some() && r.get(&key(9)).is_some());
    // Within the limit nothing more goes.
    r.sweep(now + Duration::from_millis(2));
    assert_eq!(lock(&r.lingering).len(), limit);
    assert_eq!(r.counts().lingers_cut, 3);
}

/// When the rewriter goes, the lingering connections' entries go before their B
/// frees its port: the program outlives the rewriter (for a moment, or while the next
/// daemon's dials reuse those ports), and would rewrite a new dial's packets into the
/// old conversation. Needs root; never skipped.
#[test]
fn lingering_entries_go_before_their_ports_when_the_rewriter_goes() {
    let dp = loaded();
    let r = dp.rewriter().expect("the rewrite splice is on");
    let far = Instant::now() + Duration::from_secs(60);
    for i in 0..3u32 {
        let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        linger(r, i, far, true, b.into());
    }
    // The map as the program holds it, past the dataplane's drop.
    let id = lock(&r.map).map().info().unwrap().id();
    let map: HashMap<MapData, RewriteKey, Rewrite> =
        HashMap::try_from(aya::maps::Map::HashMap(MapData::from_id(id).unwrap())).unwrap();
    assert_eq!(map.keys().count(), 6);
    drop(dp);
    assert_eq!(
        map.keys().count(),
        0,
        "the lingering connections' entries outlived their B"
    );
}

#[test]
fn the_linger_limit_is_a_quarter_of_ports_and_descriptors() {
    // The kernel's default range, and a limit of open files raised high.
    assert_eq!(linger_limit((32768, 60999), 1 << 20), 7058);
    // A service's default of 1,024 open files; a floor under that.
    assert_eq!(linger_limit((32768, 60999), 4096), 1024);
    assert_eq!(linger_limit((32768, 60999), 1024), MIN_LINGERING);
    assert_eq!(linger_limit((40000, 40000), 1 << 20), MIN_LINGERING);
}
