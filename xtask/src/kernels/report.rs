//! A guest's results and the matrix's table: each test binary's (and the soak's) passed
//! and failed counts, read from their logs, and the Markdown table of every run.

use std::{fmt::Write as _, fs, path::Path};

use super::{guest::Exit, Kernel, SOAKS, TESTS};

/// One guest's results: per test binary (and the soak), passed and failed counts, or
/// why there are none.
pub(super) struct Row {
    kernel: &'static str,
    /// Which of `--repeat`'s runs (None: one run only).
    pub(super) run: Option<u32>,
    /// Whether the eBPF dataplane is claimed (and tested) on it.
    ebpf: bool,
    cells: Vec<(String, Cell)>,
}

enum Cell {
    Counts {
        passed: u32,
        failed: u32,
    },
    Exit(i32),
    /// Killed by the guest's watchdog after `--hang-after`.
    Hung,
    Missing,
}

impl Row {
    pub(super) fn ok(&self) -> bool {
        self.cells.iter().all(|(_, c)| c.ok())
    }
}

impl Cell {
    fn ok(&self) -> bool {
        match self {
            Cell::Counts { failed, .. } => *failed == 0,
            Cell::Exit(code) => *code == 0,
            Cell::Hung | Cell::Missing => false,
        }
    }

    fn show(&self) -> String {
        match self {
            Cell::Counts { passed, failed } => format!("{passed}/{}", passed + failed),
            Cell::Exit(0) => "passed".into(),
            Cell::Exit(code) => format!("failed ({code})"),
            Cell::Hung => "hung (see .hang)".into(),
            Cell::Missing => "did not run".into(),
        }
    }
}

/// A guest's row: counts from each test binary's log, the soak's exit.
pub(super) fn results(k: &Kernel, dir: &Path, exits: &[(String, Exit)], no_soak: bool) -> Row {
    let mut cells = Vec::new();
    for t in TESTS {
        let exit = exits.iter().find(|(n, _)| n == t).map(|(_, c)| *c);
        let log = fs::read_to_string(dir.join(format!("{t}.log"))).unwrap_or_default();
        let cell = match (exit, counts(&log)) {
            (None, _) => Cell::Missing,
            (Some(Exit::Hung), _) => Cell::Hung,
            (Some(_), Some((passed, failed))) => Cell::Counts { passed, failed },
            (Some(Exit::Code(code)), None) => Cell::Exit(code),
        };
        cells.push(((*t).to_owned(), cell));
    }
    for soak in SOAKS.iter().filter(|_| !no_soak) {
        let log = fs::read_to_string(dir.join(format!("{soak}.log"))).unwrap_or_default();
        let cell = match (exits.iter().find(|(n, _)| n == soak), soak_counts(&log)) {
            (None, _) => Cell::Missing,
            (Some((_, Exit::Hung)), _) => Cell::Hung,
            (Some(_), Some((passed, failed))) => Cell::Counts { passed, failed },
            (Some((_, Exit::Code(code))), None) => Cell::Exit(*code),
        };
        cells.push(((*soak).to_owned(), cell));
    }
    Row {
        kernel: k.name,
        run: None,
        ebpf: k.ebpf,
        cells,
    }
}

/// Passed and failed tests from a test binary's closing line.
fn counts(log: &str) -> Option<(u32, u32)> {
    let line = log.lines().rev().find(|l| l.starts_with("test result:"))?;
    let number = |word: &str| {
        line.split(';')
            .find(|p| p.contains(word))
            .and_then(|p| p.split_whitespace().rev().nth(1))
            .and_then(|n| n.parse().ok())
    };
    Some((number("passed")?, number("failed")?))
}

/// Passed and failed connections from the soak's closing line (`soak: N passed, N
/// failed`).
fn soak_counts(log: &str) -> Option<(u32, u32)> {
    let line = log.lines().rev().find_map(|l| l.strip_prefix("soak: "))?;
    let (passed, failed) = line.split_once(" passed, ")?;
    Some((
        passed.trim().parse().ok()?,
        failed.strip_suffix(" failed")?.trim().parse().ok()?,
    ))
}

pub(super) fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let Some(first) = rows.first() else {
        return out;
    };
    let _ = write!(out, "| kernel | ebpf, rewrite splice |");
    for (name, _) in &first.cells {
        let _ = write!(out, " {name} |");
    }
    let _ = write!(out, "\n|---|---|");
    for _ in &first.cells {
        let _ = write!(out, "---|");
    }
    for r in rows {
        let ebpf = if r.ebpf {
            "claimed, tested"
        } else {
            "not claimed: `auto`'s choice tested"
        };
        let kernel = match r.run {
            Some(n) => format!("{} (run {n})", r.kernel),
            None => r.kernel.to_owned(),
        };
        let _ = write!(out, "\n| {kernel} | {ebpf} |");
        for (_, c) in &r.cells {
            let _ = write!(out, " {} |", c.show());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_come_from_the_closing_line() {
        let log = "running 3 tests\n...\ntest result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s\n";
        assert_eq!(counts(log), Some((2, 1)));
        assert_eq!(counts("no result"), None);
    }

    #[test]
    fn soak_counts_come_from_its_closing_line() {
        let log = "soak: 20 s per dataplane, 24 connections at once\n| copy | raw |\nsoak: 2299 passed, 1 failed\n";
        assert_eq!(soak_counts(log), Some((2299, 1)));
        assert_eq!(soak_counts("soak: 20 s per dataplane"), None);
    }
}
