//! RCU grace periods for hand-overs: one `membarrier` for every hand-over waiting when
//! it starts, on a thread of its own (the call blocks).

use std::{
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use tracing::warn;

use super::*;
use crate::dataplane::background::{Background, JOIN_WITHIN};

/// RCU grace periods for hand-overs, one `membarrier` for every hand-over waiting when it
/// starts (about 8 ms each here). A thread of its own, as the call blocks.
pub(super) struct Grace {
    pub(super) state: Mutex<GraceState>,
    pub(super) wake: Condvar,
    pub(super) done: tokio::sync::watch::Sender<u64>,
    /// The thread, joined by [`Grace::stop`].
    thread: Mutex<Option<Background>>,
}

/// What hand-overs and the grace thread share.
#[derive(Default)]
pub(super) struct GraceState {
    /// Grace periods asked for so far.
    pub(super) requested: u64,
    /// The thread waits on the condition variable: only then does a request notify it
    /// (a system call). Busy or pausing between grace periods, the thread looks at
    /// `requested` before it waits again.
    pub(super) waiting: bool,
    /// Set by [`Grace::stop`]: the thread exits.
    pub(super) stopping: bool,
}

impl Grace {
    pub(super) fn start() -> Arc<Grace> {
        let grace = Arc::new(Grace {
            state: Mutex::new(GraceState::default()),
            wake: Condvar::new(),
            done: tokio::sync::watch::Sender::new(0),
            thread: Mutex::new(None),
        });
        let weak = Arc::downgrade(&grace);
        match Background::spawn("waypoint-grace", move || Grace::run(&weak)) {
            Ok(t) => *lock(&grace.thread) = Some(t),
            // Without the thread every hand-over would wait for ever: say so, and let
            // `wait` fall back to a grace period of its own.
            Err(e) => warn!(error = %e, "starting the rewrite grace thread failed"),
        }
        grace
    }

    /// Makes the thread exit and joins it.
    pub(super) fn stop(&self) {
        lock(&self.state).stopping = true;
        self.wake.notify_all();
        let thread = lock(&self.thread).take();
        if let Some(mut t) = thread {
            t.join(JOIN_WITHIN);
        }
    }

    pub(super) fn run(weak: &std::sync::Weak<Grace>) {
        let mut done = 0;
        loop {
            let Some(grace) = weak.upgrade() else { return };
            let target = {
                let mut state = lock(&grace.state);
                while state.requested == done {
                    if state.stopping {
                        return;
                    }
                    state.waiting = true;
                    let (g, timeout) = grace
                        .wake
                        .wait_timeout(state, Duration::from_secs(1))
                        .unwrap_or_else(|p| p.into_inner());
                    state = g;
                    state.waiting = false;
                    if timeout.timed_out()
                        && state.requested == done
                        && Arc::strong_count(&grace) == 1
                    {
                        return;
                    }
                }
                state.requested
            };
            let started = Instant::now();
            membarrier();
            done = target;
            grace.done.send_replace(done);
            // Back to back, forced grace periods keep RCU busy on every CPU and cost
            // the machine's other work a tail (measured: setup p99 1.15 ms instead of
            // 0.28 ms pinned). Hand-overs can wait: nothing but the check waits on it.
            drop(grace);
            std::thread::sleep(GRACE_INTERVAL.saturating_sub(started.elapsed()));
        }
    }

    /// Returns once a grace period that started after this call has ended.
    pub(super) async fn wait(&self) {
        let (mine, waiting) = {
            let mut state = lock(&self.state);
            state.requested += 1;
            (state.requested, state.waiting)
        };
        if waiting {
            self.wake.notify_one();
        }
        let mut rx = self.done.subscribe();
        if tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|d| *d >= mine))
            .await
            .is_err()
        {
            // The thread is gone or stuck: one grace period of this task's own.
            let _ = tokio::task::spawn_blocking(membarrier).await;
        }
    }
}

pub(super) fn membarrier() {
    if let Err(error) = crate::sys::membarrier_global() {
        warn!(%error, "membarrier failed; sleeping 50 ms instead");
        std::thread::sleep(Duration::from_millis(50));
    }
}
