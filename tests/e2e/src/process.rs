//! A child process running in one of the harness's namespaces (`ip netns exec`, which
//! execs the program itself, so the child's pid is the program's). Output goes to a log
//! file; dropping the handle kills the process and reaps it.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use nix::{sys::signal::Signal, unistd::Pid};

/// A running (or exited) child.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    stdout: Option<PathBuf>,
}

impl Proc {
    /// Starts `program args` in namespace `ns`; stderr (and stdout, unless `stdout` is
    /// given) to `log`.
    pub fn spawn(
        name: &str,
        ns: &str,
        program: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        log: &Path,
        stdout: Option<&Path>,
    ) -> anyhow::Result<Proc> {
        let err =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let out = match stdout {
            Some(p) => {
                std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?
            }
            None => err.try_clone()?,
        };
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(program)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {} in {ns}", program.display()))?;
        Ok(Proc {
            name: name.to_owned(),
            child: Some(child),
            log: log.to_owned(),
            stdout: stdout.map(Path::to_owned),
        })
    }

    /// Its name, for messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its pid, while not reaped.
    pub fn pid(&self) -> Option<Pid> {
        self.child
            .as_ref()
            .and_then(|c| i32::try_from(c.id()).ok())
            .map(Pid::from_raw)
    }

    /// Sends `sig` (no-op once reaped).
    pub fn signal(&self, sig: Signal) -> anyhow::Result<()> {
        if let Some(pid) = self.pid() {
            nix::sys::signal::kill(pid, sig)
                .with_context(|| format!("sending {sig} to {}", self.name))?;
        }
        Ok(())
    }

    /// Waits up to `timeout` for it to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// What it wrote on stdout (when started with a separate stdout file).
    pub fn stdout(&self) -> String {
        self.stdout
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // Already gone is fine: only reaping matters then.
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Lets it run on after the handle is dropped (the demo's `--keep`).
    pub fn detach(mut self) {
        self.child = None;
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}
