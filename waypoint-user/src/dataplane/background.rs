//! The dataplane's background threads (signals, links, linger, grace): each is started
//! with a name and, when its owner goes, told to stop and joined within a bound. A thread
//! that has not ended by then (stuck in the kernel, say) is left to end by itself, with
//! a warning: a shutdown never hangs on one.

use std::{
    io,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tracing::warn;

/// How long an owner waits for its thread to end: each of them looks at its stop flag
/// at least every 100 ms.
pub(super) const JOIN_WITHIN: Duration = Duration::from_secs(2);

/// A named background thread, joined by [`Background::join`].
#[derive(Debug)]
pub(super) struct Background {
    name: &'static str,
    handle: Option<JoinHandle<()>>,
}

impl Background {
    /// Starts `f` on a thread called `name`.
    pub(super) fn spawn(
        name: &'static str,
        f: impl FnOnce() + Send + 'static,
    ) -> io::Result<Background> {
        let handle = std::thread::Builder::new().name(name.into()).spawn(f)?;
        Ok(Background {
            name,
            handle: Some(handle),
        })
    }

    /// Wakes the thread if it is parked (`std::thread::park_timeout`).
    pub(super) fn unpark(&self) {
        if let Some(h) = &self.handle {
            h.thread().unpark();
        }
    }

    /// Waits up to `within` for the thread to end (the caller has told it to) and
    /// joins it. True if it ended; a second call does nothing.
    pub(super) fn join(&mut self, within: Duration) -> bool {
        let Some(handle) = self.handle.take() else {
            return true;
        };
        if handle.thread().id() == std::thread::current().id() {
            // The thread is dropping its own owner: it ends right after.
            return true;
        }
        let deadline = Instant::now() + within;
        while !handle.is_finished() {
            if Instant::now() >= deadline {
                warn!(
                    thread = self.name,
                    "a background thread did not end in time; leaving it to end by itself"
                );
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if handle.join().is_err() {
            warn!(thread = self.name, "a background thread panicked");
        }
        true
    }
}
