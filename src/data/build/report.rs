//! What `align data build` reports: removals by filter, the distributions before and after, each
//! model-based filter's part, and the kept shards (`build-report.json`, and the CLI's table).

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::Serialize;

use super::corpus::Counts;
use crate::data::curate::metaclip::Matcher;
use crate::data::stats::Distribution;
use crate::util::rng::Rng;

#[derive(Debug, Clone, Serialize)]
pub struct Removed {
    pub filter: String,
    pub samples: u64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Distributions {
    pub caption_words: Distribution,
    pub shorter_side: Distribution,
    pub aspect_ratio: Distribution,
}

/// The CLIP-score filters' part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct ScoreFilterReport {
    /// The model and precision that wrote the score files.
    pub scorer: String,
    /// The score a sample needed: `min_score`, or the top fraction's cut, whichever is higher.
    pub threshold: f32,
    /// Rows of the score files whose score is NaN, infinite or null.
    pub unusable_scores: u64,
    pub before: Distribution,
    pub after: Distribution,
}

/// MetaCLIP balancing's part of the report (per-entry counts in `metaclip-counts.tsv`).
#[derive(Debug, Clone, Serialize)]
pub struct MetaClipReport {
    pub entries: usize,
    pub t: u64,
    /// Input samples whose caption matched at least one entry.
    pub matched_samples: u64,
    /// The share of all matches that went to head entries (count above t), before and after.
    pub head_share_before: f64,
    pub head_share_after: f64,
    pub counts_file: PathBuf,
}

/// The image-based filter's part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct ImageBasedReport {
    pub clusters: usize,
    pub target_images: usize,
    /// Clusters nearest to at least one target image: their members are kept.
    pub target_clusters: usize,
}

/// Semantic deduplication's part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct DedupReport {
    /// The k-means clusters used: `curate.semdedup.clusters`, or the samples' count where that
    /// is smaller (each sample then its own cluster, with nothing to compare).
    pub clusters: usize,
    /// Groups of near-duplicates among the scored samples, and the members they drop.
    pub groups: usize,
    pub duplicates: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct BuildReport {
    pub filters: String,
    pub input_samples: u64,
    pub kept: u64,
    pub removed: Vec<Removed>,
    pub before: Distributions,
    pub after: Distributions,
    pub eval_hashes: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_score: Option<ScoreFilterReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_based: Option<ImageBasedReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metaclip: Option<MetaClipReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub semdedup: Option<DedupReport>,
    pub shards: Vec<PathBuf>,
    pub seconds: f64,
}

/// A uniform sample of at most `CAP` values (deterministic), for the report's quantiles without
/// keeping a value per sample of a billion-sample corpus.
struct Reservoir {
    seen: u64,
    values: Vec<f64>,
    rng: Rng,
}

const CAP: usize = 1 << 20;

impl Reservoir {
    fn new(seed: u64) -> Self {
        Reservoir { seen: 0, values: Vec::new(), rng: Rng::new(seed) }
    }

    fn push(&mut self, v: f64) {
        self.seen += 1;
        if self.values.len() < CAP {
            self.values.push(v);
        } else {
            let j = (self.rng.next_u64() % self.seen) as usize;
            if j < CAP {
                self.values[j] = v;
            }
        }
    }

    fn distribution(self) -> Distribution {
        Distribution::of(self.values)
    }
}

pub(super) struct Dists {
    words: Reservoir,
    shorter: Reservoir,
    aspect: Reservoir,
}

impl Dists {
    pub(super) fn new(seed: u64) -> Self {
        Dists { words: Reservoir::new(seed), shorter: Reservoir::new(seed ^ 1), aspect: Reservoir::new(seed ^ 2) }
    }

    pub(super) fn add(&mut self, words: usize, dims: Option<(u32, u32)>) {
        self.words.push(words as f64);
        if let Some((w, h)) = dims {
            self.shorter.push(w.min(h) as f64);
            self.aspect.push(w.max(h) as f64 / w.min(h).max(1) as f64);
        }
    }

    pub(super) fn finish(self) -> Distributions {
        Distributions {
            caption_words: self.words.distribution(),
            shorter_side: self.shorter.distribution(),
            aspect_ratio: self.aspect.distribution(),
        }
    }
}

/// MetaCLIP's report, with every entry's count before and after in `metaclip-counts.tsv`.
pub(super) fn metaclip_report(out: &Path, m: &Matcher, counts: &Counts, after: &[u64], t: u64) -> Result<MetaClipReport> {
    let after: Vec<u64> = (0..m.entries.len()).map(|e| after.get(e).copied().unwrap_or(0)).collect();
    let head = |c: &[u64]| -> f64 {
        let total: u64 = c.iter().sum();
        let head: u64 = c.iter().zip(&counts.metaclip).filter(|(_, &n)| n > t).map(|(x, _)| x).sum();
        head as f64 / total.max(1) as f64
    };
    let mut tsv = String::from("entry\tbefore\tafter\n");
    for (e, entry) in m.entries.iter().enumerate() {
        tsv.push_str(&format!("{entry}\t{}\t{}\n", counts.metaclip[e], after[e]));
    }
    let counts_file = out.join("metaclip-counts.tsv");
    crate::util::files::write_atomic(&counts_file, tsv.as_bytes())?;
    Ok(MetaClipReport {
        entries: m.entries.len(),
        t,
        matched_samples: counts.metaclip_matched,
        head_share_before: head(&counts.metaclip),
        head_share_after: head(&after),
        counts_file,
    })
}
