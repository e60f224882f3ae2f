//! The run's settings, from the bench's command line: `--quick`, `--eager`, `--json`
//! and `--only`, and the repetitions and durations each mode implies.

use std::time::Duration;

pub(crate) struct Settings {
    pub(crate) quick: bool,
    /// Bulk clients stream right after the hello instead of waiting for the reply.
    pub(crate) eager: bool,
    pub(crate) json: Option<String>,
    pub(crate) only: Option<Vec<String>>,
    pub(crate) reps: usize,
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
    pub(crate) pings_warmup: usize,
    pub(crate) pings: usize,
}

pub(crate) fn settings() -> Settings {
    let mut quick = false;
    let mut eager = false;
    let mut json = None;
    let mut only = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--eager" => eager = true,
            "--json" => json = Some(args.next().expect("--json needs a path")),
            "--only" => {
                only = Some(
                    args.next()
                        .expect("--only needs a comma-separated list of variants")
                        .split(',')
                        .map(str::to_owned)
                        .collect(),
                );
            }
            // `cargo bench` passes `--bench`; ignore it and any libtest-style filters.
            _ => {}
        }
    }
    if quick {
        Settings {
            quick,
            eager,
            json,
            only,
            reps: 1,
            warmup: Duration::from_millis(250),
            duration: Duration::from_secs(1),
            pings_warmup: 200,
            pings: 2_000,
        }
    } else {
        Settings {
            quick,
            eager,
            json,
            only,
            reps: 3,
            warmup: Duration::from_millis(500),
            duration: Duration::from_secs(3),
            pings_warmup: 2_000,
            pings: 20_000,
        }
    }
}
