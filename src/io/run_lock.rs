//! One writer per run directory: a trainer holds an advisory lock (`File::try_lock`, an `flock`
//! on Unix) on `RUN/.lock` for
//! its whole run, and a second trainer on the same directory refuses at once, naming the holder
//! (pid, host, start time) that the lock file records. The kernel drops the lock when its holder
//! exits, however it exits, so a lock left by a killed process never blocks the next run; the
//! stale file's contents are simply overwritten.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

pub const LOCK_FILE: &str = ".lock";

/// The held lock; dropping it (or exiting) releases it.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Takes the lock of `run_dir` (which must exist), or fails naming who holds it.
    pub fn acquire(run_dir: &Path) -> Result<RunLock> {
        let path = run_dir.join(LOCK_FILE);
        let mut file = match crate::util::files::try_lock(&path)? {
            crate::util::files::Lock::Held(file) => file,
            crate::util::files::Lock::Busy(mut file) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let holder = if holder.is_empty() { "another process" } else { holder };
                bail!(
                    "{} is in use by {holder}: another trainer writes to this run directory (set run.name or run.out_dir for a new run, or wait for it to finish)",
                    run_dir.display()
                );
            }
        };
        let me = format!("pid {} on host {} since {}", std::process::id(), crate::util::host::name(), crate::util::clock::utc_now());
        file.set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| writeln!(file, "{me}"))
            .and_then(|_| file.flush())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(RunLock { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_by_name_and_a_released_lock_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        let err = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&format!("pid {}", std::process::id())) && err.contains("in use"), "{err}");
        drop(first);
        // The file stays behind with the old holder's name; it does not block.
        assert!(dir.path().join(LOCK_FILE).is_file());
        let again = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(again.path(), dir.path().join(LOCK_FILE));
    }
}
