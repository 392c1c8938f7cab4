//! The relay and consumer processes: started, signalled, watched and restarted.

use std::ffi::{OsStr, OsString};
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a process may take to exit after SIGTERM before it counts as unanswered.
pub(crate) const TERM_TIMEOUT: Duration = Duration::from_secs(30);

/// `program` wrapped in `setpriv --pdeathsig KILL`: the kernel kills it when the harness
/// dies, even by SIGKILL, so no process outlives the run. `setpriv` execs the program,
/// so the child's pid is the program's.
pub(crate) fn with_parent_death(program: impl AsRef<OsStr>) -> Command {
    let mut c = Command::new("setpriv");
    c.args(["--pdeathsig", "KILL", "--"]).arg(program);
    c
}

/// Sends `sig` (`KILL`, `TERM`, `STOP`, `CONT`) to `child`. A child not yet waited for
/// keeps its pid, so the signal cannot reach another process.
pub(crate) fn signal(child: &Child, sig: &str) -> std::io::Result<()> {
    // `kill(1)` rather than libc: the workspace forbids unsafe code.
    let status = Command::new("kill")
        .args(["-s", sig, &child.id().to_string()])
        .stderr(Stdio::null())
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "kill -s {sig} {} failed",
            child.id()
        )))
    }
}

/// How long after its exec a process is left alone by SIGTERM (see
/// [`Proc::sigterm`]): the loader and the runtime's start, on a loaded machine.
const EXEC_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Role {
    Relay,
    Consumer,
}

impl Role {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Relay => "relay",
            Self::Consumer => "consumer",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Running,
    /// SIGSTOPped until then.
    Stopped(Instant),
    /// SIGTERM sent then.
    Terminating(Instant),
    /// Not running; started again at that time.
    Down(Instant),
}

/// What happened to a process on its own.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// Exited without being told to.
    UnexpectedExit(String, ExitStatus),
    /// Exited after SIGTERM, after that long.
    TermAnswered(String, ExitStatus, Duration),
    /// Did not exit within [`TERM_TIMEOUT`] of SIGTERM (then killed).
    TermIgnored(String),
}

pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) role: Role,
    program: PathBuf,
    args: Vec<OsString>,
    log: PathBuf,
    child: Option<Child>,
    pub(crate) state: State,
    starts: u32,
    /// When it was last started.
    pub(crate) started: Instant,
    /// The loopback port of its HTTP probes (the relay's `--admin-addr`, the consumer's
    /// `/healthz` and `/readyz`).
    pub(crate) admin_port: u16,
}

impl Proc {
    pub(crate) fn new(
        name: String,
        role: Role,
        program: PathBuf,
        args: Vec<OsString>,
        log: PathBuf,
        admin_port: u16,
    ) -> Self {
        Self {
            name,
            role,
            program,
            args,
            log,
            child: None,
            state: State::Down(Instant::now()),
            starts: 0,
            started: Instant::now(),
            admin_port,
        }
    }

    pub(crate) fn log_path(&self) -> &std::path::Path {
        &self.log
    }

    pub(crate) fn start(&mut self) -> std::io::Result<()> {
        self.starts += 1;
        self.started = Instant::now();
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        writeln!(log, "=== chaos: start #{} of {}", self.starts, self.name)?;
        let child = with_parent_death(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        self.state = State::Running;
        Ok(())
    }

    fn note(&self, what: &str) {
        if let Ok(mut log) = OpenOptions::new().append(true).open(&self.log) {
            let _ = writeln!(log, "=== chaos: {what}");
        }
    }

    /// Looks after the process: resumes it at the end of a stop, reaps an exit, restarts
    /// it when due (if `restart`).
    pub(crate) fn poll(&mut self, now: Instant, restart: bool) -> std::io::Result<Option<Event>> {
        match self.state {
            State::Stopped(until) if now >= until => self.resume()?,
            State::Down(at) if restart && now >= at => {
                self.start()?;
                return Ok(None);
            }
            State::Terminating(since) if now.duration_since(since) > TERM_TIMEOUT => {
                self.kill()?;
                self.state = State::Down(now);
                return Ok(Some(Event::TermIgnored(self.name.clone())));
            }
            _ => {}
        }
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        let Some(status) = child.try_wait()? else {
            return Ok(None);
        };
        self.child = None;
        let event = match self.state {
            State::Terminating(since) => {
                Event::TermAnswered(self.name.clone(), status, now.duration_since(since))
            }
            _ => Event::UnexpectedExit(self.name.clone(), status),
        };
        self.note(&format!("exited: {status}"));
        self.state = State::Down(now + Duration::from_secs(1));
        Ok(Some(event))
    }

    pub(crate) fn is_running(&self) -> bool {
        self.state == State::Running
    }

    pub(crate) fn is_stopped(&self) -> bool {
        matches!(self.state, State::Stopped(_))
    }

    /// SIGKILL, reaped at once; started again at `restart_at`.
    pub(crate) fn sigkill(&mut self, restart_at: Instant) -> std::io::Result<()> {
        self.note("SIGKILL");
        self.kill()?;
        self.state = State::Down(restart_at);
        Ok(())
    }

    fn kill(&mut self) -> std::io::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// SIGTERM; [`poll`](Self::poll) reports the exit. Not within [`EXEC_GRACE`] of its
    /// start: until the program's `main` has run, no program can answer a signal but by
    /// dying of it (the relay installs its handlers first thing, before it connects, and
    /// exits 0 from there on).
    pub(crate) fn sigterm(&mut self, now: Instant) -> std::io::Result<()> {
        std::thread::sleep((self.started + EXEC_GRACE).saturating_duration_since(Instant::now()));
        if let Some(child) = &self.child {
            self.note("SIGTERM");
            signal(child, "TERM")?;
            self.state = State::Terminating(now);
        }
        Ok(())
    }

    /// SIGSTOP until `until`.
    pub(crate) fn sigstop(&mut self, until: Instant) -> std::io::Result<()> {
        if let Some(child) = &self.child {
            self.note("SIGSTOP");
            signal(child, "STOP")?;
            self.state = State::Stopped(until);
        }
        Ok(())
    }

    /// SIGCONT if stopped.
    pub(crate) fn resume(&mut self) -> std::io::Result<()> {
        if let (State::Stopped(_), Some(child)) = (self.state, &self.child) {
            self.note("SIGCONT");
            signal(child, "CONT")?;
            self.state = State::Running;
        }
        Ok(())
    }

    /// Whether the process is down, and when it comes back.
    pub(crate) fn restart_due(&self) -> Option<Instant> {
        match self.state {
            State::Down(at) => Some(at),
            _ => None,
        }
    }

    /// Makes a down process due for a restart now.
    pub(crate) fn restart_now(&mut self, now: Instant) {
        if let State::Down(_) = self.state {
            self.state = State::Down(now);
        }
    }

    /// The final stop: SIGTERM and wait up to [`TERM_TIMEOUT`] for the exit. `None` if
    /// the process was not running.
    pub(crate) fn terminate_and_wait(&mut self) -> std::io::Result<Option<Event>> {
        self.resume()?;
        let now = Instant::now();
        self.sigterm(now)?;
        if self.child.is_none() {
            return Ok(None);
        }
        loop {
            if let Some(e) = self.poll(Instant::now(), false)? {
                self.state = State::Down(Instant::now() + Duration::from_secs(3600));
                return Ok(Some(e));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            let _ = signal(child, "CONT");
        }
        let _ = self.kill();
    }
}
