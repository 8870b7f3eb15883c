//! `align data stats`: what a shard set holds, and what of it is unusable.

use std::collections::BTreeMap;

use rayon::prelude::*;
use serde::Serialize;

use super::sample;
use super::skips::SkipCounts;
use super::spec::ShardSource;
use super::tar_read::{read_shard, ShardEvent};
use super::transform::decode;
use crate::util::log;

#[derive(Debug, Clone, Serialize, Default)]
pub struct Distribution {
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub max: f64,
    pub mean: f64,
}

impl Distribution {
    pub fn of(mut xs: Vec<f64>) -> Self {
        if xs.is_empty() {
            return Self::default();
        }
        xs.sort_by(f64::total_cmp);
        let q = |p: f64| xs[((xs.len() - 1) as f64 * p).round() as usize];
        Distribution { min: xs[0], p50: q(0.5), p90: q(0.9), max: xs[xs.len() - 1], mean: xs.iter().sum::<f64>() / xs.len() as f64 }
    }
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct DataStats {
    pub shards: usize,
    pub samples: u64,
    pub skipped: SkipCounts,
    pub fields: BTreeMap<String, u64>,
    pub caption_words: Distribution,
    pub image_width: Distribution,
    pub image_height: Distribution,
    pub labels: u64,
}

#[derive(Default)]
struct ShardStats {
    samples: u64,
    skipped: SkipCounts,
    fields: BTreeMap<String, u64>,
    words: Vec<f64>,
    widths: Vec<f64>,
    heights: Vec<f64>,
    labels: u64,
}

/// Reads every sample fully (decoding each image, so corrupt ones are found) in parallel over
/// shards. `on_shard` is called after each shard (for progress).
pub fn compute(shards: &[ShardSource], max_pixels: u64, on_shard: impl Fn() + Sync) -> DataStats {
    let per: Vec<ShardStats> = shards
        .par_iter()
        .map(|src| {
            let mut st = ShardStats::default();
            read_shard(src, |ev| {
                match ev {
                    ShardEvent::Sample(s) => {
                        for k in s.fields.keys() {
                            *st.fields.entry(k.clone()).or_default() += 1;
                        }
                        let checked = (|| {
                            let caps = sample::captions(&s)?;
                            let label = sample::label(&s)?;
                            let bytes = sample::image_bytes(&s)?;
                            let img = decode(bytes, u32::MAX, max_pixels, crate::data::transform::Alpha::Drop)
                                .map_err(|e| sample::Rejected { reason: e.reason, detail: e.detail })?;
                            Ok::<_, sample::Rejected>((caps, label, img.dimensions()))
                        })();
                        match checked {
                            Ok((caps, label, (w, h))) => {
                                st.samples += 1;
                                st.words.extend(caps.iter().map(|c| c.split_whitespace().count() as f64));
                                st.widths.push(w as f64);
                                st.heights.push(h as f64);
                                st.labels += label.is_some() as u64;
                            }
                            Err(rej) => {
                                st.skipped.add(rej.reason);
                                log::warn_sample(&src.to_string(), rej.reason, format!("shard {src}: sample {}: {}", s.key, rej.detail));
                            }
                        }
                    }
                    ShardEvent::BadSample { key, reason, detail, .. } => {
                        st.skipped.add(reason);
                        log::warn_sample(&src.to_string(), reason, format!("shard {src}: sample {key}: {detail}"));
                    }
                    ShardEvent::Failed { reason, detail } => {
                        st.skipped.add(reason);
                        log::warn(format!("shard {src}: {detail}"));
                    }
                }
                true
            });
            on_shard();
            st
        })
        .collect();
    let mut out = DataStats { shards: shards.len(), ..Default::default() };
    let (mut words, mut widths, mut heights) = (Vec::new(), Vec::new(), Vec::new());
    for s in per {
        out.samples += s.samples;
        out.skipped.merge(&s.skipped);
        for (k, v) in s.fields {
            *out.fields.entry(k).or_default() += v;
        }
        words.extend(s.words);
        widths.extend(s.widths);
        heights.extend(s.heights);
        out.labels += s.labels;
    }
    out.caption_words = Distribution::of(words);
    out.image_width = Distribution::of(widths);
    out.image_height = Distribution::of(heights);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_of_a_small_list() {
        let d = Distribution::of(vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((d.min, d.p50, d.max, d.mean), (1.0, 3.0, 5.0, 3.0));
    }
}
