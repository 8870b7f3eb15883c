//! The perceptual hashes of the evaluation sets (`--exclude-near`: shard specs or image folders,
//! each image with its mirror), which the pass keeps training samples away from.

use std::path::Path;

use anyhow::{Context, Result};
use rayon::prelude::*;

use super::phash::{self, NearIndex};
use crate::data::tar_read::{read_shard_events, ShardEvent};
use crate::data::transform;
use crate::util::log;
use crate::util::progress::Progress;

/// Every evaluation image's hash (and its mirror's), for `--exclude-near`.
pub(super) fn index_eval_sets(specs: &[String], max_pixels: u64, quiet: bool) -> Result<NearIndex> {
    let mut index = NearIndex::default();
    for spec in specs {
        let path = Path::new(spec);
        let bar = Progress::spinner("hashing eval images", quiet);
        let hashes: Vec<u64> = if path.is_dir() {
            let mut files = Vec::new();
            let mut stack = vec![path.to_path_buf()];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).with_context(|| format!("listing {}", d.display()))? {
                    let p = e?.path();
                    if p.is_dir() {
                        stack.push(p);
                    } else if image::ImageFormat::from_path(&p).is_ok() {
                        files.push(p);
                    }
                }
            }
            files.sort();
            files
                .par_iter()
                .flat_map_iter(|p| {
                    bar.inc(1);
                    let img = std::fs::read(p).ok().and_then(|b| transform::decode(&b, 64, max_pixels, transform::Alpha::Drop).ok());
                    if img.is_none() {
                        log::warn(format!("--exclude-near {}: cannot decode {}; not indexed", spec, p.display()));
                    }
                    img.map(|i| phash::phash_with_mirror(&i)).into_iter().flatten()
                })
                .collect()
        } else {
            let shards = crate::data::spec::expand(spec)?;
            shards
                .par_iter()
                .flat_map_iter(|src| {
                    let mut out = Vec::new();
                    for ev in read_shard_events(src) {
                        if let ShardEvent::Sample(s) = ev {
                            bar.inc(1);
                            match crate::data::sample::image_bytes(&s)
                                .ok()
                                .and_then(|b| transform::decode(b, 64, max_pixels, transform::Alpha::Drop).ok())
                            {
                                Some(img) => out.extend(phash::phash_with_mirror(&img)),
                                None => log::warn(format!("--exclude-near {src}: sample {}: no decodable image; not indexed", s.key)),
                            }
                        }
                    }
                    out
                })
                .collect()
        };
        bar.finish();
        index.extend(hashes);
    }
    Ok(index)
}
