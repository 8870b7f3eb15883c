//! Writing a model into a directory without ever destroying what was there: the format writes into
//! a new temporary directory beside `out`, which is renamed into place only when complete. A
//! non-empty `out` is refused unless forced, and then replaced whole (never a mix of two models);
//! nothing is written inside an align run directory; an advisory lock beside `out` makes a second
//! export to the same place fail at once instead of interleaving.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::{Format, ModelFiles};
use crate::io::run_dir::{LATEST, SPEC_FILE, STATE_FILE};
use crate::io::run_lock::LOCK_FILE;
use crate::io::tensors::sync_dir;

/// The align run directory or checkpoint that `out` is, or lies inside, if any.
pub fn inside_run(out: &Path) -> Option<PathBuf> {
    let absolute = std::path::absolute(out).unwrap_or_else(|_| out.to_path_buf());
    absolute.ancestors().find(|p| is_run_dir(p)).map(Path::to_path_buf)
}

fn is_run_dir(p: &Path) -> bool {
    p.join(LATEST).is_file() || p.join(LOCK_FILE).is_file() || (p.join(SPEC_FILE).is_file() && p.join(STATE_FILE).is_file())
}

/// Writes `model` in `format` to `out`, atomically. With `force` an existing non-empty `out` is
/// replaced whole; without, it is an error.
pub fn export(model: &ModelFiles, format: &dyn Format, out: &Path, force: bool) -> Result<()> {
    if let Some(run) = inside_run(out) {
        bail!("{} is inside the align run directory {}: export into a directory of its own", out.display(), run.display());
    }
    format.can_write(model.spec).map_err(|why| anyhow::anyhow!("cannot export as {}: {why}", format.name()))?;
    let name = out.file_name().with_context(|| format!("{} names no directory", out.display()))?.to_string_lossy().into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    let lock_path = parent.join(format!(".{name}.export-lock"));
    let lock = File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
    if let Err(e) = lock.try_lock() {
        match e {
            std::fs::TryLockError::WouldBlock => bail!("another export is writing {} now", out.display()),
            std::fs::TryLockError::Error(e) => return Err(e).with_context(|| format!("locking {}", lock_path.display())),
        }
    }
    let existing = match std::fs::read_dir(out) {
        Ok(mut entries) => Some(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => bail!("{} exists and is not a directory", out.display()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", out.display())),
    };
    if existing == Some(true) && !force {
        bail!("{} is not empty: choose a new directory, or add --force to replace it whole", out.display());
    }
    let stamp = format!("{}-{}", std::process::id(), std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos());
    let tmp = parent.join(format!(".{name}.partial-{stamp}"));
    std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let written = format.write(model, &tmp).and_then(|()| sync_tree(&tmp));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("writing {} (nothing was changed there)", out.display())));
    }
    let old = parent.join(format!(".{name}.old-{stamp}"));
    if existing.is_some() {
        std::fs::rename(out, &old).with_context(|| format!("moving the old {} aside", out.display()))?;
    }
    if let Err(e) = std::fs::rename(&tmp, out) {
        if existing.is_some() {
            let _ = std::fs::rename(&old, out);
        }
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e).with_context(|| format!("moving the export into {}", out.display()));
    }
    sync_dir(&parent);
    if existing.is_some() {
        std::fs::remove_dir_all(&old).with_context(|| format!("removing the replaced {}", old.display()))?;
    }
    drop(lock);
    let _ = std::fs::remove_file(&lock_path);
    Ok(())
}

/// Syncs every file of a freshly written directory and the directory itself.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            File::open(&path).and_then(|f| f.sync_all()).with_context(|| format!("syncing {}", path.display()))?;
        }
    }
    sync_dir(dir);
    Ok(())
}
