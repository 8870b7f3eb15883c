//! Where `align data build`'s kept samples go: output shards written under temporary names and
//! renamed when complete, straight or (`output.shuffle`) through random buckets shuffled in
//! memory at the end; a failed build removes what it wrote.

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::filters::Filters;
use super::input::Input;
use crate::data::shard_writer::ShardWriter;
use crate::data::spec::ShardSource;
use crate::data::tar_read::{read_shard_events, ShardEvent};
use crate::util::progress::Progress;
use crate::util::rng::{hash_str, mix64, Rng};

/// Where kept samples go: straight into output shards, or (to shuffle globally) into random
/// buckets that are each shuffled in memory afterwards.
struct ShardSink {
    dir: PathBuf,
    per_shard: usize,
    current: Option<ShardWriter>,
    shards: Vec<PathBuf>,
}

impl ShardSink {
    fn write(&mut self, key: &str, fields: &[(&str, &[u8])]) -> Result<()> {
        if self.current.is_none() {
            let path = self.dir.join(format!("{:05}.tar", self.shards.len()));
            self.current = Some(ShardWriter::create(&path)?);
        }
        let w = self.current.as_mut().expect("just created");
        w.write_sample(key, fields)?;
        if w.samples() as usize >= self.per_shard {
            self.close()?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if let Some(w) = self.current.take() {
            self.shards.push(w.finish()?);
        }
        Ok(())
    }

    /// Removes every shard this build wrote, finished or not.
    fn abandon(&mut self) {
        if self.current.take().is_some() {
            let _ = std::fs::remove_file(self.dir.join(format!("{:05}.tar.tmp", self.shards.len())));
        }
        for path in self.shards.drain(..) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Where kept samples go: straight into the output shards, or (`output.shuffle`) first into
/// random buckets, each shuffled in memory and written out at the end.
pub(super) struct Output {
    sink: ShardSink,
    staging: PathBuf,
    buckets: Vec<Option<ShardWriter>>,
}

impl Output {
    pub(super) fn new(out: &Path, f: &Filters, input: &Input, total: Option<u64>) -> Result<Output> {
        let staging = out.join(".build");
        let buckets = if f.output.shuffle {
            std::fs::create_dir_all(&staging)?;
            let per_part = if matches!(input, Input::Table { .. }) { 1 } else { f.output.samples_per_shard as u64 };
            let estimate = total.unwrap_or(0).max(input.parts() as u64 * per_part);
            (estimate.div_ceil(f.output.samples_per_shard as u64)).max(1) as usize
        } else {
            0
        };
        let sink = ShardSink { dir: out.to_path_buf(), per_shard: f.output.samples_per_shard, current: None, shards: Vec::new() };
        Ok(Output { sink, staging, buckets: (0..buckets).map(|_| None).collect() })
    }

    /// Writes the `kept`-th kept sample.
    pub(super) fn write(&mut self, key: &str, fields: &[(&str, &[u8])], kept: u64, seed: u64) -> Result<()> {
        if self.buckets.is_empty() {
            return self.sink.write(key, fields);
        }
        let b = (mix64(hash_str(key) ^ mix64(kept ^ seed)) % self.buckets.len() as u64) as usize;
        if self.buckets[b].is_none() {
            self.buckets[b] = Some(ShardWriter::create(&self.staging.join(format!("bucket-{b:05}.tar")))?);
        }
        self.buckets[b].as_mut().expect("just created").write_sample(key, fields)
    }

    /// A build that fails after its pass (scores that do not fit the input) leaves no shard:
    /// what it wrote is removed, staging included.
    pub(super) fn abandon(mut self) {
        self.buckets.clear();
        let _ = std::fs::remove_dir_all(&self.staging);
        self.sink.abandon();
    }

    /// Shuffles each bucket into the output shards, closes the last one, and names them.
    pub(super) fn finish(mut self, seed: u64, quiet: bool) -> Result<Vec<PathBuf>> {
        if !self.buckets.is_empty() {
            let bar = Progress::bar(self.buckets.len() as u64, "shuffling", quiet);
            for (b, w) in std::mem::take(&mut self.buckets).into_iter().enumerate() {
                bar.inc(1);
                let Some(w) = w else { continue };
                let path = w.finish()?;
                let mut samples: Vec<_> = read_shard_events(&ShardSource::File(path.clone()))
                    .into_iter()
                    .filter_map(|e| if let ShardEvent::Sample(s) = e { Some(s) } else { None })
                    .collect();
                Rng::derived(seed, &[b as u64]).shuffle(&mut samples);
                for s in &samples {
                    let fields: Vec<(&str, &[u8])> = s.fields.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
                    self.sink.write(&s.key, &fields)?;
                }
                std::fs::remove_file(&path)?;
            }
            bar.finish();
            let _ = std::fs::remove_dir(&self.staging);
        }
        self.sink.close()?;
        Ok(self.sink.shards)
    }
}
