//! What one soak connection does, as a pure function of its seed, and the bytes it
//! carries: a deterministic pattern either side can check at any offset.
//!
//! The seed decides everything (the scenario, its sizes, the message sizes of a ping-pong,
//! where an abort cuts), through splitmix64 rather than a library generator, so that a
//! seed printed by a failure replays the same connection in any later build.

/// splitmix64: one step of the sequence (also a good 64-bit mixer).
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small deterministic generator (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// Log-uniform in `lo..=hi` (`lo` ≥ 1): every order of magnitude equally likely.
    pub fn log_range(&mut self, lo: u64, hi: u64) -> u64 {
        let bits = 64 - hi.leading_zeros();
        loop {
            let b = self.range(0, u64::from(bits));
            let v = if b == 0 {
                1
            } else {
                self.range(1 << (b - 1), (1 << b) - 1)
            };
            if (lo..=hi).contains(&v) {
                return v;
            }
        }
    }
}

/// The kinds of connection the soak mixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scenario {
    /// One small request and its echo, then the close: most connections of a mesh.
    Short,
    /// 1 to 200 messages of up to 16 KiB, each echoed before the next is sent.
    PingPong,
    /// 1 B to 32 MiB sent while the echo streams back, both directions at once; the
    /// client half-closes as soon as it has written everything.
    Bulk,
    /// Up to 4 MiB sent whole before the server answers with as much.
    SendThenWait,
    /// The server sends up to 2 MiB; the client reads 4 KiB every 2 ms.
    SlowReader,
    /// Bulk echo cut by a reset from the client part way through.
    Abort,
}

impl Scenario {
    pub const ALL: [Scenario; 6] = [
        Scenario::Short,
        Scenario::PingPong,
        Scenario::Bulk,
        Scenario::SendThenWait,
        Scenario::SlowReader,
        Scenario::Abort,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Short => "short",
            Scenario::PingPong => "ping-pong",
            Scenario::Bulk => "bulk",
            Scenario::SendThenWait => "send-then-wait",
            Scenario::SlowReader => "slow-reader",
            Scenario::Abort => "abort",
        }
    }

    fn code(self) -> u8 {
        match self {
            Scenario::Short => 1,
            Scenario::PingPong => 2,
            Scenario::Bulk => 3,
            Scenario::SendThenWait => 4,
            Scenario::SlowReader => 5,
            Scenario::Abort => 6,
        }
    }

    fn from_code(c: u8) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.code() == c)
    }
}

/// Which direction a pattern is for: the client's bytes, or the server's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Up,
    Down,
}

/// One connection's plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub seed: u64,
    pub scenario: Scenario,
    /// Bytes the client sends (short, bulk, send-then-wait, abort), or the server sends
    /// (slow reader); for a ping-pong, the number of messages.
    pub size: u64,
    /// Abort only: the echoed bytes the client reads before its reset (at least one, so
    /// that the pod has read the header and knows the reset for an abort).
    pub cut: u64,
}

impl Spec {
    /// The plan a seed stands for. Short connections are the most frequent, as in a
    /// mesh; bulk ones carry most of the bytes.
    pub fn from_seed(seed: u64) -> Spec {
        let mut r = Rng::new(seed);
        let scenario = match r.range(0, 99) {
            0..=39 => Scenario::Short,
            40..=54 => Scenario::PingPong,
            55..=69 => Scenario::Bulk,
            70..=79 => Scenario::SendThenWait,
            80..=87 => Scenario::SlowReader,
            _ => Scenario::Abort,
        };
        let size = match scenario {
            Scenario::Short => r.range(1, 4096),
            Scenario::PingPong => r.range(1, 200),
            Scenario::Bulk => r.log_range(1, 32 << 20),
            Scenario::SendThenWait => r.log_range(1, 4 << 20),
            Scenario::SlowReader => r.log_range(1, 2 << 20),
            Scenario::Abort => r.log_range(2, 8 << 20),
        };
        let cut = if scenario == Scenario::Abort {
            r.range(1, size - 1)
        } else {
            0
        };
        Spec {
            seed,
            scenario,
            size,
            cut,
        }
    }

    /// The message sizes of a ping-pong (1 B to 16 KiB each).
    pub fn messages(&self) -> impl Iterator<Item = usize> {
        let mut r = Rng::new(mix(self.seed ^ 0x6d65_7373));
        let n = if self.scenario == Scenario::PingPong {
            self.size
        } else {
            0
        };
        (0..n).map(move |_| r.log_range(1, 16 << 10) as usize)
    }
}

/// The header a client sends first, after its hello (raw) or handshake (TLS).
pub const HEADER_LEN: usize = 32;
const MAGIC: [u8; 4] = *b"SOAK";

/// The first byte of every header: a connection that starts otherwise is a probe.
pub const MAGIC_FIRST: u8 = MAGIC[0];

/// A connection's header: its id (to find it in the server's records) and its plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub id: u64,
    pub spec: Spec,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4] = self.spec.scenario.code();
        h[8..16].copy_from_slice(&self.id.to_le_bytes());
        h[16..24].copy_from_slice(&self.spec.seed.to_le_bytes());
        h[24..32].copy_from_slice(&self.spec.size.to_le_bytes());
        h
    }

    /// None for bytes that are no header of this version.
    pub fn decode(h: &[u8; HEADER_LEN]) -> Option<Header> {
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&h[at..at + 8]);
            u64::from_le_bytes(w)
        };
        if h[..4] != MAGIC || h[5..8] != [0; 3] {
            return None;
        }
        let scenario = Scenario::from_code(h[4])?;
        let seed = word(16);
        // The header carries the seed's plan, and the plan must be the seed's: a header
        // damaged in transit fails here rather than as a confusing mismatch later.
        let spec = Spec::from_seed(seed);
        (spec.scenario == scenario && spec.size == word(24)).then_some(Header { id: word(8), spec })
    }
}

/// The pattern of one direction of one connection: byte `i` is byte `i % 8` of
/// `mix(key + i / 8)`, so either side fills or checks any stretch without state.
#[derive(Clone, Copy, Debug)]
pub struct Pattern {
    key: u64,
}

impl Pattern {
    pub fn new(seed: u64, dir: Dir) -> Pattern {
        let salt = match dir {
            Dir::Up => 0x7570,
            Dir::Down => 0x646f_776e,
        };
        Pattern {
            key: mix(seed ^ salt),
        }
    }

    fn word(self, block: u64) -> [u8; 8] {
        mix(self.key.wrapping_add(block)).to_le_bytes()
    }

    /// Fills `buf` with the pattern's bytes from `offset` on.
    pub fn fill(self, offset: u64, buf: &mut [u8]) {
        let mut pos = offset;
        let mut rest = buf;
        while !rest.is_empty() {
            let word = self.word(pos / 8);
            let start = (pos % 8) as usize;
            let n = (8 - start).min(rest.len());
            rest[..n].copy_from_slice(&word[start..start + n]);
            rest = &mut rest[n..];
            pos += n as u64;
        }
    }

    /// The offset of the first byte of `buf` that differs from the pattern at `offset`.
    pub fn mismatch(self, offset: u64, buf: &[u8]) -> Option<u64> {
        let mut pos = offset;
        let mut rest = buf;
        while !rest.is_empty() {
            let word = self.word(pos / 8);
            let start = (pos % 8) as usize;
            let n = (8 - start).min(rest.len());
            if rest[..n] != word[start..start + n] {
                let i = (0..n).find(|&i| rest[i] != word[start + i]).unwrap_or(0);
                return Some(pos + i as u64);
            }
            rest = &rest[n..];
            pos += n as u64;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn headers_round_trip_and_damage_is_refused() {
        for seed in 0..500 {
            let h = Header {
                id: seed * 7,
                spec: Spec::from_seed(seed),
            };
            let bytes = h.encode();
            assert_eq!(Header::decode(&bytes), Some(h));
            let mut bad = bytes;
            bad[24] ^= 1;
            assert_eq!(Header::decode(&bad), None, "seed {seed}");
        }
    }

    #[test]
    fn the_pattern_is_the_same_whatever_the_cut() {
        let p = Pattern::new(42, Dir::Up);
        let mut whole = vec![0u8; 1000];
        p.fill(0, &mut whole);
        for (at, len) in [(0, 1), (3, 17), (8, 8), (999, 1), (5, 990)] {
            let mut part = vec![0u8; len];
            p.fill(at as u64, &mut part);
            assert_eq!(part, whole[at..at + len]);
            assert_eq!(p.mismatch(at as u64, &part), None);
        }
        let mut bad = whole.clone();
        bad[333] ^= 0x80;
        assert_eq!(p.mismatch(0, &bad), Some(333));
        assert_eq!(p.mismatch(1, &whole[1..]), None);
        assert_eq!(p.mismatch(2, &whole[1..]), Some(2));
        assert_ne!(
            Pattern::new(42, Dir::Down).mismatch(0, &whole),
            None,
            "the directions must differ"
        );
    }

    #[test]
    fn plans_cover_every_scenario_within_their_bounds() {
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..5_000 {
            let s = Spec::from_seed(seed);
            seen.insert(s.scenario);
            assert!(s.size >= 1, "{s:?}");
            match s.scenario {
                Scenario::Bulk => assert!(s.size <= 32 << 20),
                Scenario::Abort => assert!((1..s.size).contains(&s.cut)),
                Scenario::PingPong => {
                    assert!(s.size <= 200);
                    assert_eq!(s.messages().count() as u64, s.size);
                    assert!(s.messages().all(|m| (1..=16 << 10).contains(&m)));
                }
                _ => {}
            }
            assert_eq!(Spec::from_seed(seed), s, "a seed is one plan");
        }
        assert_eq!(seen.len(), Scenario::ALL.len());
    }
}
