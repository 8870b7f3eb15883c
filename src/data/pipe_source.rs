//! `pipe:CMD` shards read so that nothing waits silently: the command's output is read on a thread
//! of its own and handed over in chunks, so the reader can give up on a command that sends nothing
//! for [`stall_timeout`] (a stalled download: the shard is abandoned with an error naming it and
//! counted as a skip) and stops waiting at once when a stop signal arrives. Every command started
//! is registered, and killed when its shard is abandoned, stopped or read, and by
//! [`kill_all`] when the process exits early.

use std::collections::HashSet;
use std::io::{self, Read};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds a pipe may send nothing before its shard is abandoned (`data.stall_timeout_s`).
static STALL_TIMEOUT_MS: AtomicU64 = AtomicU64::new(300_000);

/// How long after a stop signal a pipe read gives up: longer than the loader waits for a batch
/// after one (5 s), so a step that can still finish does.
const STOP_GRACE: Duration = Duration::from_secs(7);

/// The shell around every pipe command (`$1`): on SIGTERM, the signal a dying align sends it, it
/// kills its process group, the command and all it started.
const GUARD: &str = r#"trap 'kill -KILL 0' TERM; sh -c "$1" & wait $!"#;

/// The process ids of the pipe commands running now.
static RUNNING: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

pub fn set_stall_timeout(d: Duration) {
    STALL_TIMEOUT_MS.store(d.as_millis().max(1) as u64, Ordering::Relaxed);
}

pub fn stall_timeout() -> Duration {
    Duration::from_millis(STALL_TIMEOUT_MS.load(Ordering::Relaxed))
}

fn register(pid: u32, running: bool) {
    let mut set = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    let set = set.get_or_insert_with(HashSet::new);
    if running {
        set.insert(pid);
    } else {
        set.remove(&pid);
    }
}

/// Kills every pipe command still running (on an early exit: a second stop signal, an error).
pub fn kill_all() {
    let pids: Vec<u32> =
        RUNNING.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|s| s.iter().copied().collect()).unwrap_or_default();
    for pid in pids {
        kill_group(pid);
    }
}

/// Kills a pipe command's whole process group: `sh -c` may run the command as a child of its
/// own, which killing the shell alone would leave running.
fn kill_group(pid: u32) {
    // SAFETY: kill(2) on the process group a command of ours leads (it was started as its own
    // group and is not reaped yet: a reaped one is unregistered first), so it cannot name an
    // unrelated process.
    unsafe {
        libc::kill(-(pid as libc::pid_t), libc::SIGKILL);
    }
}

/// A running `sh -c CMD`'s standard output.
pub struct PipeReader {
    child: Option<Child>,
    chunks: Receiver<io::Result<Vec<u8>>>,
    buf: Vec<u8>,
    pos: usize,
    pub cmd: String,
}

impl PipeReader {
    pub fn spawn(cmd: &str) -> io::Result<PipeReader> {
        use std::os::unix::process::CommandExt;
        // The command runs under a shell that kills its whole group when align dies, even by
        // SIGKILL: the kernel sends that shell SIGTERM on its parent's death, and because the
        // command runs in the background, `wait` returns at once to run the trap.
        let parent = std::process::id() as libc::pid_t;
        let mut command = Command::new("sh");
        command.arg("-c").arg(GUARD).arg("align-pipe").arg(cmd).stdout(Stdio::piped()).stdin(Stdio::null()).process_group(0);
        // SAFETY: prctl and getppid are async-signal-safe, and the closure allocates nothing.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // align died between the fork and the prctl: nobody would send the signal.
                if libc::getppid() != parent {
                    return Err(io::Error::other("align exited while starting a pipe command"));
                }
                Ok(())
            });
        }
        let mut child = command.spawn()?;
        register(child.id(), true);
        let mut stdout = child.stdout.take().expect("piped stdout");
        let (tx, chunks) = sync_channel(4);
        std::thread::Builder::new().name("pipe-reader".into()).spawn(move || loop {
            let mut chunk = vec![0u8; 1 << 20];
            match stdout.read(&mut chunk) {
                Ok(n) => {
                    chunk.truncate(n);
                    if tx.send(Ok(chunk)).is_err() || n == 0 {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            }
        })?;
        Ok(PipeReader { child: Some(child), chunks, buf: Vec::new(), pos: 0, cmd: cmd.to_string() })
    }

    /// Kills the command (a stopped, broken or abandoned read).
    pub fn kill(mut self) {
        self.end(true);
    }

    /// The command's exit status if it has ended (or ends within a moment: its output broke off
    /// because it is exiting), else `None`.
    pub fn ended(&mut self) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + Duration::from_millis(300);
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                _ => return None,
            }
        }
    }

    /// Waits for the command after its output ended: its exit status.
    pub fn wait(mut self) -> io::Result<std::process::ExitStatus> {
        let mut child = self.child.take().expect("a running command");
        let status = child.wait();
        register(child.id(), false);
        status
    }

    fn end(&mut self, kill: bool) {
        if let Some(mut child) = self.child.take() {
            if kill {
                kill_group(child.id());
            }
            let _ = child.wait();
            register(child.id(), false);
        }
    }
}

impl Drop for PipeReader {
    fn drop(&mut self) {
        self.end(true);
    }
}

impl Read for PipeReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.buf.len() {
            let limit = stall_timeout();
            let started = Instant::now();
            loop {
                match self.chunks.recv_timeout(Duration::from_millis(200).min(limit)) {
                    Ok(Ok(chunk)) => {
                        if chunk.is_empty() {
                            return Ok(0);
                        }
                        self.buf = chunk;
                        self.pos = 0;
                        break;
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(RecvTimeoutError::Disconnected) => return Ok(0),
                    Err(RecvTimeoutError::Timeout) => {
                        // Past the loader's own grace after a stop signal: nobody waits for this
                        // shard any more, and its thread must end for the process to.
                        if crate::util::interrupt::requested_for().is_some_and(|d| d >= STOP_GRACE) {
                            return Err(io::Error::new(io::ErrorKind::Interrupted, "the run was stopped while waiting for the command"));
                        }
                        if started.elapsed() >= limit {
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("the command sent nothing for {:.0} s (data.stall_timeout_s); abandoned", limit.as_secs_f64()),
                            ));
                        }
                    }
                }
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
