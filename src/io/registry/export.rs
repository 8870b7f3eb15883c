//! Writing a model into a directory without ever destroying what was there: the format writes into
//! a new temporary directory beside `out`, which is renamed into place only when complete. A
//! non-empty `out` is refused unless forced, and then replaced whole (never a mix of two models)
//! and only when it holds nothing but an earlier export's files;
//! nothing is written inside an align run directory; an advisory lock beside `out` makes a second
//! export to the same place fail at once instead of interleaving.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::io::format::{Format, ModelFiles};
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

/// The file an export leaves in its directory listing what it wrote, so that a forced export
/// later knows which files are align's to replace.
pub const MANIFEST: &str = ".align-export.json";

/// What an export wrote, by path relative to its directory, sorted.
#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    format: String,
    files: Vec<String>,
}

/// Writes `model` in `format` to `out`, atomically. With `force` an existing non-empty `out` is
/// replaced whole, but only when everything in it is an earlier export's; without, it is an error.
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
    let _lock = ExportLock::acquire(&parent, &name, out)?;
    clean_debris(&parent, &name, out)?;
    let existing = match std::fs::read_dir(out) {
        Ok(mut entries) => Some(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => bail!("{} exists and is not a directory", out.display()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", out.display())),
    };
    if existing == Some(true) {
        if !force {
            bail!("{} is not empty: choose a new directory, or add --force to replace it whole", out.display());
        }
        replaceable(out)?;
    }
    let stamp = format!("{}-{}", std::process::id(), std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos());
    // The model is written under its final name inside the temporary directory: formats that
    // record their directory's name (open_clip's tokenizer) record the real one.
    let tmp = parent.join(format!(".{name}.partial-{stamp}"));
    let staged = tmp.join(&name);
    std::fs::create_dir_all(&staged).with_context(|| format!("creating {}", staged.display()))?;
    let written = format.write(model, &staged).and_then(|()| write_manifest(format, &staged)).and_then(|()| sync_tree(&staged));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("writing {} (nothing was changed there)", out.display())));
    }
    let old = parent.join(format!(".{name}.old-{stamp}"));
    if existing.is_some() {
        std::fs::rename(out, &old).with_context(|| format!("moving the old {} aside", out.display()))?;
    }
    if let Err(e) = std::fs::rename(&staged, out) {
        if existing.is_some() {
            let _ = std::fs::rename(&old, out);
        }
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e).with_context(|| format!("moving the export into {}", out.display()));
    }
    sync_dir(&parent);
    let _ = std::fs::remove_dir_all(&tmp);
    if existing.is_some() {
        std::fs::remove_dir_all(&old).with_context(|| format!("removing the replaced {}", old.display()))?;
    }
    Ok(())
}

/// The advisory lock beside `out` that keeps two exports apart; its file goes when the export
/// ends, however it ends short of a kill.
struct ExportLock {
    path: PathBuf,
    _file: File,
}

impl ExportLock {
    fn acquire(parent: &Path, name: &str, out: &Path) -> Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let path = parent.join(format!(".{name}.export-lock"));
        loop {
            let file = match crate::util::files::try_lock(&path)? {
                crate::util::files::Lock::Held(file) => file,
                crate::util::files::Lock::Busy(_) => bail!("another export is writing {} now", out.display()),
            };
            // The previous holder removes the file as it finishes: a lock taken on a file that is
            // no longer at the path keeps nobody out, so take the one that is.
            let held = file.metadata().with_context(|| format!("reading {}", path.display()))?;
            match std::fs::metadata(&path) {
                Ok(now) if now.ino() == held.ino() && now.dev() == held.dev() => return Ok(ExportLock { path, _file: file }),
                _ => continue,
            }
        }
    }
}

impl Drop for ExportLock {
    fn drop(&mut self) {
        // Removed while still held, so no other export can lock this file after it is gone.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes what killed exports to `out` left beside it. Called under the lock, so no export to
/// `out` is running: every temporary directory found is a dead process's. A kill between moving
/// the old export aside and moving the new one in leaves no `out`: the old one is put back.
fn clean_debris(parent: &Path, name: &str, out: &Path) -> Result<()> {
    let (partial, old) = (format!(".{name}.partial-"), format!(".{name}.old-"));
    let mut found: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(parent).with_context(|| format!("reading {}", parent.display()))? {
        let entry = entry?;
        let file = entry.file_name().to_string_lossy().into_owned();
        if file.starts_with(&partial) || file.starts_with(&old) {
            found.push(entry.path());
        }
    }
    found.sort();
    for path in found {
        let file = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        if file.starts_with(&old) && !out.exists() {
            std::fs::rename(&path, out).with_context(|| format!("restoring {} from {}", out.display(), path.display()))?;
            crate::util::log::info(format!("restored {} from {}, left by an export that was killed", out.display(), path.display()));
            continue;
        }
        std::fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        crate::util::log::info(format!("removed {}, left by an export that was killed", path.display()));
    }
    Ok(())
}

/// Refuses to replace `out` unless everything in it is what an earlier export listed in its
/// manifest: no align run at any depth, no file of anyone else's.
fn replaceable(out: &Path) -> Result<()> {
    let mut files = Vec::new();
    let mut dirs = vec![out.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        if is_run_dir(&dir) {
            bail!("{} holds the align run directory {}: --force replaces only an earlier export", out.display(), dir.display());
        }
        for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                dirs.push(entry.path());
            } else {
                files.push(entry.path());
            }
        }
    }
    let manifest_path = out.join(MANIFEST);
    let listed: Vec<String> = match std::fs::read(&manifest_path) {
        Ok(bytes) => {
            serde_json::from_slice::<Manifest>(&bytes)
                .with_context(|| format!("{} is damaged: --force replaces only an earlier export", manifest_path.display()))?
                .files
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", manifest_path.display())),
    };
    let mut foreign: Vec<String> = files
        .iter()
        .map(|f| f.strip_prefix(out).unwrap_or(f).to_string_lossy().into_owned())
        .filter(|f| f != MANIFEST && !listed.contains(f))
        .collect();
    foreign.sort();
    if let Some(first) = foreign.first() {
        bail!(
            "{} holds {} file(s) align did not write there ({first}{}): --force replaces only an earlier export; move them or choose another directory",
            out.display(),
            foreign.len(),
            if foreign.len() > 1 { ", ..." } else { "" }
        );
    }
    Ok(())
}

/// Lists every file the format wrote into `dir`.
fn write_manifest(format: &dyn Format, dir: &Path) -> Result<()> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                dirs.push(entry.path());
            } else {
                files.push(entry.path().strip_prefix(dir).unwrap_or(&entry.path()).to_string_lossy().into_owned());
            }
        }
    }
    files.sort();
    let manifest = Manifest { format: format.name().to_string(), files };
    std::fs::write(dir.join(MANIFEST), serde_json::to_string_pretty(&manifest)? + "\n")
        .with_context(|| format!("writing {}", dir.join(MANIFEST).display()))
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
