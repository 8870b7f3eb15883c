//! Writing webdataset shards: one tar member per field, `KEY.FIELD`, members of a sample adjacent.
//!
//! Headers are ustar with GNU long-name records for paths over 100 bytes, which Python's
//! `tarfile` (and so the `webdataset` library) and GNU tar read. The shard is written under a
//! temporary name and renamed into place by `finish`, so a crash never leaves a half shard that
//! looks complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub struct ShardWriter {
    builder: tar::Builder<BufWriter<File>>,
    tmp: PathBuf,
    path: PathBuf,
    samples: u64,
}

impl ShardWriter {
    pub fn create(path: &Path) -> Result<Self> {
        let tmp = path.with_extension("tar.tmp");
        let file = File::create(&tmp).with_context(|| format!("creating shard {}", tmp.display()))?;
        Ok(Self { builder: tar::Builder::new(BufWriter::with_capacity(1 << 20, file)), tmp, path: path.to_path_buf(), samples: 0 })
    }

    /// Appends one sample; `fields` are (extension, bytes) pairs such as `("jpg", ...)`.
    pub fn write_sample<D: AsRef<[u8]>>(&mut self, key: &str, fields: &[(&str, D)]) -> Result<()> {
        for (field, data) in fields {
            let data = data.as_ref();
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_mtime(0);
            header.set_entry_type(tar::EntryType::Regular);
            let name = format!("{key}.{field}");
            self.builder.append_data(&mut header, &name, data).with_context(|| format!("writing {name} to {}", self.tmp.display()))?;
        }
        self.samples += 1;
        Ok(())
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    pub fn finish(self) -> Result<PathBuf> {
        let mut inner = self.builder.into_inner().with_context(|| format!("finishing {}", self.tmp.display()))?;
        inner.flush()?;
        inner.get_ref().sync_all()?;
        drop(inner);
        std::fs::rename(&self.tmp, &self.path).with_context(|| format!("renaming {} into place", self.tmp.display()))?;
        Ok(self.path)
    }
}
