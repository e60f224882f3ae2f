//! Step 4 of the hand-over for a client that sent on behind its hello: what landed in A
//! while the entries went in ([`Probe`], [`Landed`]) and B carrying it on to the pod
//! ([`Rewriter::fill`]), with the fill map that hands B the pod's acknowledgement of it.

use std::{io, os::fd::AsRawFd as _};

use tracing::debug;
use waypoint_common::REWRITE_FIN;

use super::*;

/// What step 3 compares, read when the sequence numbers were.
#[derive(Clone, Copy)]
pub(super) enum Probe {
    /// A's and B's `rcv_nxt`, read from their selected receive queues ([`snapshot`]).
    Queues { a_rcv: u32, b_rcv: u32 },
    /// A's and B's `TCP_INFO` byte counters (sequence numbers from the records).
    Received { a: u64, b: u64 },
}

/// What landed in A or B during the hand-over ([`Probe::landed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Landed {
    Nothing,
    /// In A only: this much sequence space (data, and a FIN).
    Client(u32),
    /// In B, or the sockets could not be read.
    Other,
}

impl Probe {
    /// What A and B received since the probe was taken.
    pub(super) fn landed(self, downstream: &Socket, upstream: &Socket) -> Landed {
        let (a, b) = match self {
            Probe::Queues { a_rcv, b_rcv } => {
                match (
                    selected_seq(downstream.as_raw_fd()),
                    selected_seq(upstream.as_raw_fd()),
                ) {
                    (Ok(a), Ok(b)) => (a.wrapping_sub(a_rcv), b != b_rcv),
                    _ => return Landed::Other,
                }
            }
            Probe::Received { a, b } => match (info(downstream), info(upstream)) {
                (Ok(x), Ok(y)) => (
                    x.bytes_received.wrapping_sub(a) as u32,
                    y.bytes_received != b,
                ),
                _ => return Landed::Other,
            },
        };
        match (a, b) {
            (0, false) => Landed::Nothing,
            (k, false) => Landed::Client(k),
            (_, true) => Landed::Other,
        }
    }
}

/// What B sent on the client's behalf at the hand-over ([`Rewriter::fill`]).
#[derive(Clone, Copy, Default)]
pub(super) struct Fill {
    /// Data bytes (at most [`MAX_FILL`]).
    pub(super) data: u32,
    /// And the client's FIN.
    pub(super) fin: bool,
    /// The program's fill map got an element.
    pub(super) filled: bool,
}

/// The most sequence space B carries for the client at a hand-over ([`Rewriter::fill`]);
/// more cannot have landed in A in the moment before the entries went in (a segment,
/// or a GSO packet of up to 64 KiB, or a few), and is reset instead.
pub(super) const MAX_FILL: usize = 4 << 20;

/// Room left in B's send buffer beside what it carries for the client: the hello, which
/// may still be unacknowledged, and the kernel's overhead per buffer.
const FILL_HEADROOM: usize = 256 << 10;

impl Rewriter {
    /// Step 4 for bytes that landed in A (`landed`: their sequence space, a FIN
    /// included): B sends them on, right behind the hello, where the client's entry put
    /// them in the pod's number space (it maps A's `rcv_nxt` as read at step 2 to the
    /// hello's end). The client's later packets went to the pod directly meanwhile and
    /// wait there behind the gap B fills. A acknowledged these bytes to the client, so
    /// nobody else ever would send them. Every acknowledgement of them goes to the
    /// client, so B would resend them for ever: the program hands B the pod's first pure
    /// ACK that covers them (`REWRITE_FILLS_MAP`). A FIN among them is B's to send too,
    /// and the client's entry is marked as having sent it, so that the program sees the
    /// connection end at the pod's FIN.
    ///
    /// None if B cannot carry them (A holds other than `landed` bytes in order, a map
    /// update or the write failed, or B's send buffer would not take them at once): the
    /// hand-over then resets both ends.
    pub(super) fn fill(
        &self,
        downstream: &Socket,
        upstream: &Socket,
        landed: u32,
        entries: &Entries,
        slot: u32,
        hello_end: u32,
    ) -> Option<Fill> {
        let a = downstream.as_raw_fd();
        let landed_len = landed as usize;
        if landed_len > MAX_FILL {
            debug!(landed, "rewrite hand-over: more landed in A than B carries");
            return None;
        }
        let state = info(downstream).ok()?.state;
        let mut bytes = vec![0u8; landed_len];
        // A is in repair mode, where only its selected queue can be peeked at.
        let peeked = set_repair(a, 1)
            .and_then(|()| setsockopt_int(a, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE))
            .and_then(|()| peek(a, &mut bytes));
        let (data, fin) = match peeked {
            Ok(n) if n == landed_len && state == TCP_ESTABLISHED => (n, false),
            Ok(n) if n + 1 == landed_len && state == TCP_CLOSE_WAIT => (n, true),
            other => {
                debug!(landed, state, peeked = ?other, "rewrite hand-over: A's queue is not what landed");
                return None;
            }
        };
        bytes.truncate(data);
        if let Err(e) =
            lock(&self.fills).insert(entries.from_pod, hello_end.wrapping_add(landed), 0)
        {
            debug!(error = %e, "rewrite hand-over: the fill map refused");
            return None;
        }
        if fin && !self.mark_client_fin(entries, slot) {
            self.forget_fill(entries);
            return None;
        }
        // B must take them at once: nothing would make room later (every ACK but the
        // fill's goes to the client), so waiting for room would wait for ever.
        let room = socket2::SockRef::from(upstream)
            .send_buffer_size()
            .unwrap_or(0);
        if room < 2 * data + FILL_HEADROOM {
            // SO_SNDBUFFORCE takes half: the kernel doubles it. (B's send buffer stays
            // that size; it sends nothing after this.)
            let _ = nix::sys::socket::setsockopt(
                upstream,
                nix::sys::socket::sockopt::SndBufForce,
                &(data + FILL_HEADROOM),
            );
        }
        let sent = match super::super::write_now(upstream, &bytes) {
            Ok(n) if n == data => {
                if fin {
                    super::super::shutdown_write(upstream)
                } else {
                    Ok(())
                }
            }
            Ok(n) => Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("B's send buffer took {n} of {data} bytes"),
            )),
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            debug!(error = %e, "rewrite hand-over: B could not carry what landed in A");
            self.forget_fill(entries);
            return None;
        }
        Some(Fill {
            data: data as u32,
            fin,
            filled: true,
        })
    }

    /// Marks the client's entry as having sent its FIN, which B sends on its behalf
    /// ([`Rewriter::fill`]). Userspace replaces the entry whole: a packet of the client
    /// rewritten meanwhile (only ACKs follow its FIN) may have its count or the learnt
    /// timestamp offset overwritten, which the next packet learns again. False if the
    /// entry is gone or no longer `slot`'s.
    fn mark_client_fin(&self, entries: &Entries, slot: u32) -> bool {
        let mut map = lock(&self.map);
        let Ok(mut c) = map.get(&entries.from_client, 0) else {
            return false;
        };
        if c.slot != slot {
            return false;
        }
        c.flags |= REWRITE_FIN;
        // BPF_EXIST: only if it is still there.
        map.insert(entries.from_client, c, 2).is_ok()
    }

    /// Takes out the fill of a connection that had one ([`Rewriter::fill`]), if the
    /// program has not already: B's 4-tuple may serve another connection later.
    pub(super) fn forget_fill(&self, entries: &Entries) {
        let _ = lock(&self.fills).remove(&entries.from_pod);
    }
}
