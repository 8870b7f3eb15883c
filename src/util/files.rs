//! Files written whole or not at all, and the lock files that keep two writers apart.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Writes a result file whole or not at all: into a temporary file beside `path`, synced, then
/// renamed over it. A full disk or a kill leaves the previous file (or none), never a truncated
/// one that a reader such as CLIP_benchmark's `build` would take for a result.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| Ok(f.write_all(bytes)?))
}

/// [`write_atomic`] for writers that need the file itself (Parquet's): `fill` writes it, then it
/// is synced and renamed onto `path`; on any error the temporary file is removed.
pub fn write_atomic_with(path: &Path, fill: impl FnOnce(&mut std::fs::File) -> Result<()>) -> Result<()> {
    let tmp = temporary_beside(path)?;
    let written = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        fill(&mut f)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    })()
    .with_context(|| format!("writing {}", path.display()));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A temporary path in `path`'s directory (so that a rename onto `path` is atomic).
pub fn temporary_beside(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().with_context(|| format!("{} names no file", path.display()))?.to_string_lossy();
    Ok(path.with_file_name(format!(".{name}.tmp-{}", std::process::id())))
}

/// A lock file opened (created if need be) and locked without waiting: `Held` holds an advisory
/// lock (`flock`) on it, which the kernel drops when the holder exits, however it exits; `Busy`
/// is the file another process holds, open for reading what it wrote there.
pub enum Lock {
    Held(std::fs::File),
    Busy(std::fs::File),
}

pub fn try_lock(path: &Path) -> Result<Lock> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(Lock::Held(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(Lock::Busy(file)),
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("locking {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("result.json");
        write_atomic(&path, b"{\"a\": 1}").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\": 1}");
        // A directory in the way of the rename: the write fails and the file stays as it was.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir_all(blocked.join("x")).unwrap();
        let err = format!("{:#}", write_atomic(&blocked, b"new").unwrap_err());
        assert!(err.contains("blocked"), "{err}");
        let names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");
    }
}
