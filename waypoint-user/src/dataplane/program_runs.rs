//! The rewrite program run on packets built here (`BPF_PROG_TEST_RUN`), without
//! interfaces or sockets: for what traffic through veths cannot provoke on demand, such
//! as two CPUs rewriting packets of one direction at the same moment.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    net::Ipv4Addr,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    sync::{
        atomic::{AtomicU32, Ordering::SeqCst},
        Barrier,
    },
};

use aya::{
    maps::{Array, HashMap, MapData, RingBuf},
    programs::{SchedClassifier, SkSkb},
    EbpfLoader,
};
use waypoint_common::{
    Rewrite, RewriteEnd, RewriteKey, ENDS_MAP, END_CLIENT_RST, PORT_CLIENT_TO, PORT_POD_FROM,
    REWRITES_MAP, REWRITE_FILLS_MAP, REWRITE_FROM_POD, REWRITE_PORTS_MAP, REWRITE_PROG,
    TS_ADD_LEARNED, VERDICT_PROG,
};

use super::{bpf_cmd, ebpf::OBJECT};

/// `BPF_PROG_TEST_RUN`'s part of `union bpf_attr` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct TestRun {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// Runs the program once on `packet` (on the calling CPU); its return value.
fn run(prog: BorrowedFd<'_>, packet: &[u8]) -> i32 {
    run_out(prog, packet, 1).retval
}

/// What a run of the program did to a packet.
struct Ran {
    /// The return value (the last run's).
    retval: i32,
    /// The packet as the program left it.
    out: Vec<u8>,
    /// The mean time of a run in nanoseconds, as the kernel measures it.
    ns: u32,
}

/// Runs the program `repeat` times on `packet`, each run on a fresh copy of it.
fn run_out(prog: BorrowedFd<'_>, packet: &[u8], repeat: u32) -> Ran {
    let mut out = [0u8; 256];
    let mut attr = TestRun {
        prog_fd: prog.as_raw_fd() as u32,
        data_size_in: packet.len() as u32,
        data_size_out: out.len() as u32,
        data_in: packet.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ..TestRun::default()
    };
    // SAFETY: `TestRun` is the command's part of `bpf_attr`; the buffers it points to
    // live for the call and have the sizes it gives.
    if let Err(e) = unsafe { bpf_cmd::call(BPF_PROG_TEST_RUN, &mut attr) } {
        panic!("BPF_PROG_TEST_RUN: {e}");
    }
    Ran {
        retval: attr.retval as i32,
        out: out[..(attr.data_size_out as usize).min(out.len())].to_vec(),
        ns: attr.duration,
    }
}

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 1);
const WAYPOINT: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 2);
const POD: Ipv4Addr = Ipv4Addr::new(10, 9, 1, 3);

/// An Ethernet frame with a TCP segment (ACK, no options) of `payload` bytes at `seq`,
/// from the client to the waypoint's port 15443. Checksums are left zero: the program
/// updates them by difference and does not check them.
fn segment(seq: u32, payload: usize) -> Vec<u8> {
    packet((CLIENT, 40000), (WAYPOINT, 15443), seq, 1, payload)
}

/// As [`segment`], between any two ends, with its acknowledgement number.
fn packet(
    (src, sport): (Ipv4Addr, u16),
    (dst, dport): (Ipv4Addr, u16),
    seq: u32,
    ack: u32,
    payload: usize,
) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 20 + 20 + payload];
    p[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut p[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let tcp = &mut p[34..54];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&dport.to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[8..12].copy_from_slice(&ack.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = 0x10;
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    p
}

/// Loads the rewrite program of `loaded` (after its maps were taken and set) and returns
/// its descriptor, for [`run`] and [`run_out`].
fn load_rewrite(loaded: &mut aya::Ebpf) -> std::os::fd::OwnedFd {
    let prog: &mut SchedClassifier = loaded
        .program_mut(REWRITE_PROG)
        .unwrap()
        .try_into()
        .unwrap();
    prog.load().unwrap();
    prog.fd().unwrap().as_fd().try_clone_to_owned().unwrap()
}

fn key(saddr: Ipv4Addr, daddr: Ipv4Addr, sport: u16, dport: u16) -> RewriteKey {
    RewriteKey {
        saddr: u32::from_ne_bytes(saddr.octets()),
        daddr: u32::from_ne_bytes(daddr.octets()),
        sport: sport.to_be(),
        dport: dport.to_be(),
    }
}

fn pin_to(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
}

/// The object loaded (its other maps still to take), its entries and the loaded rewrite
/// program, for a test that runs the program on two CPUs at once.
fn for_two_cpus() -> (
    aya::Ebpf,
    HashMap<MapData, RewriteKey, Rewrite>,
    std::os::fd::OwnedFd,
) {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    assert!(cpus >= 2, "needs two CPUs, has {cpus}");
    let mut loaded = EbpfLoader::new().load(OBJECT).unwrap();
    let map = HashMap::try_from(loaded.take_map(REWRITES_MAP).unwrap()).unwrap();
    let fd = load_rewrite(&mut loaded);
    (loaded, map, fd)
}

/// Two CPUs run the program on the same segments of one direction, in step: each
/// segment's bytes are counted once, however the two runs interleave. (A plain
/// read-modify-write of `next_seq` and `bytes` counts a segment twice whenever both CPUs
/// read the old `next_seq` before either wrote the new one.)
#[test]
fn concurrent_runs_count_each_byte_once() {
    let (mut loaded, mut map, fd) = for_two_cpus();

    const START: u32 = 0xffff_0000; // wraps past 2^32 halfway
    const SEGMENTS: u32 = 20_000;
    const LEN: u32 = 100;
    let client = key(CLIENT, WAYPOINT, 40000, 15443);
    let entry = Rewrite {
        to: key(WAYPOINT, POD, 41000, 15008),
        next_seq: START,
        ..Rewrite::default()
    };
    map.insert(client, entry, 0).unwrap();
    let mut ports: Array<MapData, u8> =
        Array::try_from(loaded.take_map(REWRITE_PORTS_MAP).unwrap()).unwrap();
    ports.set(15443, PORT_CLIENT_TO, 0).unwrap();

    let packets: Vec<Vec<u8>> = (0..SEGMENTS)
        .map(|k| segment(START.wrapping_add(k * LEN), LEN as usize))
        .collect();
    // Both threads run segment k only once both are ready for it: their runs overlap
    // as often as the two syscalls' entry times allow.
    let step = Barrier::new(2);
    let ready = AtomicU32::new(0);
    std::thread::scope(|s| {
        for cpu in 0..2 {
            let (packets, step, ready, fd) = (&packets, &step, &ready, &fd);
            s.spawn(move || {
                pin_to(cpu);
                step.wait();
                for (k, p) in packets.iter().enumerate() {
                    // A spinning rendezvous: a sleeping barrier would wake the threads
                    // tens of microseconds apart.
                    let k = k as u32;
                    ready.fetch_add(1, SeqCst);
                    while ready.load(SeqCst) < 2 * (k + 1) {
                        std::hint::spin_loop();
                    }
                    run(fd.as_fd(), p);
                }
            });
        }
    });
    let after = map.get(&client, 0).unwrap();
    assert_eq!(
        after.bytes,
        u64::from(SEGMENTS * LEN),
        "bytes counted twice (or lost) under concurrent runs"
    );
    assert_eq!(after.next_seq, START.wrapping_add(SEGMENTS * LEN));
    assert_eq!(after.packets, u64::from(2 * SEGMENTS), "packets lost");
}

/// As [`segment`] (no payload), from client port `sport`, with the timestamps option in
/// Linux's layout (NOP, NOP, TSval, TSecr).
fn timestamped(sport: u16, tsval: u32, tsecr: u32) -> Vec<u8> {
    let mut p = packet((CLIENT, sport), (WAYPOINT, 15443), 1, 1, 12);
    p[46] = 8 << 4;
    p[54..58].copy_from_slice(&[1, 1, 8, 10]);
    p[58..62].copy_from_slice(&tsval.to_be_bytes());
    p[62..66].copy_from_slice(&tsecr.to_be_bytes());
    p
}

/// TSval of a frame built by [`timestamped`].
fn tsval_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes(frame[58..62].try_into().unwrap())
}

/// The first timestamped packets of a connection, rewritten on two CPUs at once, take
/// one TSval addend between them, and the reverse direction echoes with that one. (With
/// the addend learned by plain stores, each CPU applied the one it computed from its own
/// packet, and the last store won: two TSvals apart by the packets' difference in delay,
/// the smaller one dropped by the receiver's PAWS check.) The two packets here carry
/// TSvals a million apart, so two learners would differ by about that.
#[test]
fn concurrent_first_timestamps_learn_one_clock_offset() {
    let (mut loaded, mut map, fd) = for_two_cpus();
    let mut ports: Array<MapData, u8> =
        Array::try_from(loaded.take_map(REWRITE_PORTS_MAP).unwrap()).unwrap();
    ports.set(15443, PORT_CLIENT_TO, 0).unwrap();

    // One fresh connection per round, so that every round learns anew.
    const ROUNDS: u16 = 4000;
    const TSVALS: [u32; 2] = [1_000, 1_001_000];
    let sport = |round: u16| 20000 + round;
    let to = |round: u16| key(WAYPOINT, POD, 20000 + round, 15008);
    let reverse = |round: u16| key(POD, WAYPOINT, 15008, 20000 + round);
    for round in 0..ROUNDS {
        let entry = Rewrite {
            to: to(round),
            ts_off: 77,
            ..Rewrite::default()
        };
        map.insert(key(CLIENT, WAYPOINT, sport(round), 15443), entry, 0)
            .unwrap();
        let back = Rewrite {
            to: key(WAYPOINT, CLIENT, 15443, sport(round)),
            flags: REWRITE_FROM_POD,
            ..Rewrite::default()
        };
        map.insert(reverse(round), back, 0).unwrap();
    }

    let ready = AtomicU32::new(0);
    let added: Vec<Vec<u32>> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..2)
            .map(|cpu| {
                let (ready, fd) = (&ready, &fd);
                s.spawn(move || {
                    pin_to(cpu);
                    (0..ROUNDS)
                        .map(|round| {
                            let p = timestamped(sport(round), TSVALS[cpu], 0);
                            // The spinning rendezvous of `concurrent_runs_count_each_byte_once`.
                            ready.fetch_add(1, SeqCst);
                            while ready.load(SeqCst) < 2 * (u32::from(round) + 1) {
                                std::hint::spin_loop();
                            }
                            let ran = run_out(fd.as_fd(), &p, 1);
                            tsval_of(&ran.out).wrapping_sub(TSVALS[cpu])
                        })
                        .collect()
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });

    let mut split = 0;
    for round in 0..ROUNDS {
        let i = usize::from(round);
        let entry = map
            .get(&key(CLIENT, WAYPOINT, sport(round), 15443), 0)
            .unwrap();
        let back = map.get(&reverse(round), 0).unwrap();
        assert_eq!(entry.ts_add & !u64::from(u32::MAX), TS_ADD_LEARNED);
        let learned = entry.ts_add as u32;
        if added[0][i] != added[1][i] {
            split += 1;
        }
        assert_eq!(
            (added[0][i], added[1][i], back.ecr_sub),
            (learned, learned, learned),
            "round {round}: the two packets' addends and the reverse's ({split} rounds split so far)"
        );
    }
}

/// The verifier walks every path of a program, up to a million instructions in all
/// (`BPF_COMPLEXITY_LIMIT_INSNS`); a small change in the code LLVM emits can multiply the
/// count (the rewrite program, built for 32-bit ALU instructions before its entry updates
/// became atomic, went past the limit). Each program must stay at a quarter of it.
#[test]
fn both_programs_verify_well_below_the_complexity_limit() {
    const LIMIT: u32 = 1_000_000;
    let mut loaded = EbpfLoader::new().load(OBJECT).unwrap();
    let verdict: &mut SkSkb = loaded
        .program_mut(VERDICT_PROG)
        .unwrap()
        .try_into()
        .unwrap();
    verdict.load().unwrap();
    let verdict = verdict
        .info()
        .unwrap()
        .verified_instruction_count()
        .unwrap();
    let rewrite: &mut SchedClassifier = loaded
        .program_mut(REWRITE_PROG)
        .unwrap()
        .try_into()
        .unwrap();
    rewrite.load().unwrap();
    let rewrite = rewrite
        .info()
        .unwrap()
        .verified_instruction_count()
        .unwrap();
    println!("instructions verified: verdict {verdict}, rewrite {rewrite}");
    assert!(verdict < LIMIT / 4, "verdict: {verdict}");
    assert!(rewrite < LIMIT / 4, "rewrite: {rewrite}");
}

/// The acknowledgement number of a frame built by [`packet`].
fn ack_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes(frame[42..46].try_into().unwrap())
}

/// The source address of a frame built by [`packet`]: the pod's while the program
/// leaves the packet as it is (diverted to B), A's once it rewrote it for the client.
fn source_of(frame: &[u8]) -> Ipv4Addr {
    Ipv4Addr::from(<[u8; 4]>::try_from(&frame[26..30]).unwrap())
}

/// B carried bytes that landed in A at the hand-over, up to `END` in its own sequence
/// space (`REWRITE_FILLS`): the pod's pure ACKs below `END` go to B unchanged and leave
/// the element; the first at or past it goes to B with its ack lowered to `END` and takes
/// the element out; the ones after it are the client's again (rewritten). Prints the
/// program's time per run (its own clock, 10^6 runs) on a pod's pure ACK that is
/// rewritten (the fill map empty: the common case) and on one diverted to B.
#[test]
fn the_pure_ack_that_covers_what_b_carried_goes_to_b_once() {
    let mut loaded = EbpfLoader::new().load(OBJECT).unwrap();
    let mut map: HashMap<MapData, RewriteKey, Rewrite> =
        HashMap::try_from(loaded.take_map(REWRITES_MAP).unwrap()).unwrap();
    let mut fills: HashMap<MapData, RewriteKey, u32> =
        HashMap::try_from(loaded.take_map(REWRITE_FILLS_MAP).unwrap()).unwrap();
    let mut ports: Array<MapData, u8> =
        Array::try_from(loaded.take_map(REWRITE_PORTS_MAP).unwrap()).unwrap();
    ports.set(15008, PORT_POD_FROM, 0).unwrap();
    let fd = load_rewrite(&mut loaded);

    // The pod's packets to B, rewritten to come from A to the client.
    let pod = key(POD, WAYPOINT, 15008, 41000);
    let entry = Rewrite {
        to: key(WAYPOINT, CLIENT, 15443, 40000),
        ack_add: 7,
        flags: REWRITE_FROM_POD,
        ..Rewrite::default()
    };
    map.insert(pod, entry, 0).unwrap();
    const END: u32 = 5000;
    let ack = |n: u32| packet((POD, 15008), (WAYPOINT, 41000), 1, n, 0);

    let rewritten = run_out(fd.as_fd(), &ack(END), 1_000_000);
    assert_eq!(
        (source_of(&rewritten.out), ack_of(&rewritten.out)),
        (WAYPOINT, END + 7),
        "no fill: the client's, rewritten"
    );

    fills.insert(pod, END, 0).unwrap();
    let below = run_out(fd.as_fd(), &ack(END - 100), 1);
    assert_eq!(
        (source_of(&below.out), ack_of(&below.out)),
        (POD, END - 100),
        "below the fill's end: to B as it is"
    );
    assert_eq!(fills.get(&pod, 0).ok(), Some(END), "the element stays");
    let diverted = run_out(fd.as_fd(), &ack(END - 100), 1_000_000);

    let past = run_out(fd.as_fd(), &ack(END + 300), 1);
    assert_eq!(
        (source_of(&past.out), ack_of(&past.out)),
        (POD, END),
        "past the fill's end: to B, its ack lowered to the end"
    );
    assert!(fills.get(&pod, 0).is_err(), "the element is taken out");
    let after = run_out(fd.as_fd(), &ack(END + 300), 1);
    assert_eq!(
        (source_of(&after.out), ack_of(&after.out)),
        (WAYPOINT, END + 307),
        "after it, the client's again"
    );
    println!(
        "a pod's pure ACK: {} ns per run rewritten (the fill map empty), {} ns diverted to B",
        rewritten.ns, diverted.ns
    );
}

/// As [`segment`], with the TCP flags `flags` (RST is 0x04, FIN 0x01; ACK is kept).
fn flagged(seq: u32, payload: usize, flags: u8) -> Vec<u8> {
    let mut p = segment(seq, payload);
    p[14 + 20 + 13] |= flags;
    p
}

/// A reset or a FIN lies at the end of what its sender sent: it counts the bytes before
/// it, though their segments come later (their sender migrated, and they wait in another
/// CPU's backlog while the end goes through this one), and those segments then add
/// nothing. Without it, the end reported undercounted what the receiver read (by up to
/// 96 KB in `client_reset_while_flowing::auto` under a loaded test run).
#[test]
fn an_end_counts_the_bytes_before_it_that_come_later() {
    let mut loaded = EbpfLoader::new().load(OBJECT).unwrap();
    let mut map: HashMap<MapData, RewriteKey, Rewrite> =
        HashMap::try_from(loaded.take_map(REWRITES_MAP).unwrap()).unwrap();
    let mut ports: Array<MapData, u8> =
        Array::try_from(loaded.take_map(REWRITE_PORTS_MAP).unwrap()).unwrap();
    ports.set(15443, PORT_CLIENT_TO, 0).unwrap();
    let mut ends = RingBuf::try_from(loaded.take_map(ENDS_MAP).unwrap()).unwrap();
    let fd = load_rewrite(&mut loaded);

    const START: u32 = 0xffff_ff00; // the end wraps past 2^32
    const LEN: u32 = 100;
    let client = key(CLIENT, WAYPOINT, 40000, 15443);
    for (flag, name) in [(0x04, "reset"), (0x01, "FIN")] {
        let entry = Rewrite {
            to: key(WAYPOINT, POD, 41000, 15008),
            next_seq: START,
            slot: 7,
            ..Rewrite::default()
        };
        map.insert(client, entry, 0).unwrap();
        run(fd.as_fd(), &segment(START, LEN as usize));
        run(fd.as_fd(), &flagged(START.wrapping_add(3 * LEN), 0, flag));
        assert_eq!(
            map.get(&client, 0).unwrap().bytes,
            u64::from(3 * LEN),
            "the {name} counts the two segments still to come"
        );
        run(fd.as_fd(), &segment(START.wrapping_add(LEN), LEN as usize));
        run(
            fd.as_fd(),
            &segment(START.wrapping_add(2 * LEN), LEN as usize),
        );
        assert_eq!(
            map.get(&client, 0).unwrap().bytes,
            u64::from(3 * LEN),
            "the late segments after the {name} add nothing"
        );
    }
    // The reset ended the connection, and its record counts the late bytes (the FIN
    // alone ends nothing: the pod has not closed).
    let end = ends.next().expect("the reset's end");
    // SAFETY: the program writes whole `RewriteEnd` records; read unaligned.
    let end: RewriteEnd = unsafe { std::ptr::read_unaligned(end.as_ptr().cast()) };
    assert_eq!(
        (end.slot, end.how, end.client_bytes),
        (7, END_CLIENT_RST, u64::from(3 * LEN))
    );
}
