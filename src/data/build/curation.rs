//! The model-based filters' preparation before the pass: the score table and its threshold, the
//! image-based filter's selection, semantic deduplication, MetaCLIP's matcher; and whether the
//! score files fit the input (every sample scored, with its own caption).

use std::collections::HashSet;

use anyhow::Result;

use super::filters::Filters;
use super::report::ImageBasedReport;
use crate::data::curate::metaclip::Matcher;
use crate::data::curate::scores::{Lookup, ScoreTable};
use crate::util::log;
use crate::util::progress::Progress;

/// What the model-based filters read before the pass: the score table and its threshold, the
/// samples away from the image-based target, the duplicates to drop, the MetaCLIP matcher.
#[derive(Default)]
pub(super) struct Curation {
    pub table: Option<ScoreTable>,
    pub threshold: Option<f32>,
    pub off_target: HashSet<String>,
    pub image_based: Option<ImageBasedReport>,
    pub duplicates: HashSet<String>,
    pub dedup_groups: usize,
    pub matcher: Option<Matcher>,
}

impl Curation {
    pub(super) fn prepare(f: &Filters, quiet: bool) -> Result<Curation> {
        let c = &f.curate;
        let mut cur = Curation::default();
        if c.needs_scores() {
            let table = ScoreTable::load(&c.scores, c.needs_embeddings())?;
            let mut threshold = None;
            if c.min_score > 0.0 {
                threshold = Some(c.min_score as f32);
            }
            if c.top_fraction > 0.0 {
                let cut = table.quantile_threshold(c.top_fraction);
                threshold = Some(threshold.map_or(cut, |t: f32| t.max(cut)));
            }
            let keys = table.keys();
            let embeddings = table.image_embeddings.as_deref().unwrap_or_default();
            if c.image_based.clusters > 0 {
                let (target, dim) = crate::data::curate::image_based::read_target(&c.image_based.target)?;
                anyhow::ensure!(
                    dim == table.dim,
                    "the target embeddings {} have {dim} dimensions, the scores in {} {}: embed the target with the checkpoint that scored the input",
                    c.image_based.target.display(),
                    c.scores.display(),
                    table.dim
                );
                let embedded_by = crate::data::curate::image_based::target_model(&c.image_based.target);
                anyhow::ensure!(
                    embedded_by.as_deref() == Some(table.scorer.model.as_str()),
                    "the target embeddings {} were embedded by {}, the scores in {} by {}: embed the target with the checkpoint that scored the input",
                    c.image_based.target.display(),
                    embedded_by.as_deref().unwrap_or("a model its sidecar does not name"),
                    c.scores.display(),
                    table.scorer.model
                );
                let bar = Progress::spinner("clustering for the image-based filter", quiet);
                let s = crate::data::curate::image_based::select(embeddings, &target, dim, c.image_based.clusters, c.image_based.seed);
                bar.finish();
                cur.off_target = keys.iter().zip(&s.keep).filter(|(_, &k)| !k).map(|(k, _)| k.clone()).collect();
                cur.image_based =
                    Some(ImageBasedReport { clusters: s.clusters, target_images: s.target_images, target_clusters: s.target_clusters });
            }
            for (setting, k) in [("curate.semdedup.clusters", c.semdedup.clusters), ("curate.image_based.clusters", c.image_based.clusters)]
            {
                if k > 0 && k >= keys.len() {
                    log::warn(format!(
                        "{setting} = {k} but the score files hold {} samples: each sample is a cluster of its own, so {}",
                        keys.len(),
                        if setting.contains("semdedup") {
                            "no duplicate can be found"
                        } else {
                            "every sample is kept only if a target image is nearest to it"
                        }
                    ));
                }
            }
            if c.semdedup.clusters > 0 {
                let bar = Progress::spinner("deduplicating", quiet);
                let d = crate::data::curate::semdedup::semdedup(
                    &keys,
                    embeddings,
                    table.dim,
                    c.semdedup.clusters,
                    c.semdedup.threshold,
                    c.semdedup.seed,
                );
                bar.finish();
                cur.dedup_groups = d.groups;
                cur.duplicates = keys.into_iter().zip(d.removed).filter(|(_, r)| *r).map(|(k, _)| k).collect();
            }
            cur.threshold = threshold;
            cur.table = Some(table);
        }
        if c.metaclip.t > 0 {
            cur.matcher = Some(Matcher::from_file(&c.metaclip.entries)?);
        }
        Ok(cur)
    }
}

/// How the input's samples meet the score files: samples without a score, samples scored with
/// another caption under their key, the first of each, and the samples read.
#[derive(Debug, Default)]
pub(super) struct ScoreFit {
    pub samples: u64,
    pub missing: u64,
    pub first_missing: Option<String>,
    pub other_caption: u64,
    pub first_other_caption: Option<String>,
}

impl ScoreFit {
    /// Counts one sample's lookup.
    pub fn add(&mut self, lookup: &Lookup, key: &str, origin: &str) {
        match lookup {
            Lookup::Score(_) => {}
            Lookup::Missing => {
                self.missing += 1;
                self.first_missing.get_or_insert_with(|| format!("{key} in {origin}"));
            }
            Lookup::OtherCaption => {
                self.other_caption += 1;
                self.first_other_caption.get_or_insert_with(|| format!("{key} in {origin}"));
            }
        }
    }

    /// Refuses score files that do not fit the input: any sample without a score, or more samples
    /// scored with another caption than `curate.max_caption_mismatch` allows.
    pub fn check(&self, f: &Filters) -> Result<()> {
        let scores = f.curate.scores.display();
        if self.missing > 0 {
            anyhow::bail!(
                "{} input samples have no score in {scores} (the first: {}): score this input with `align data score --data ... --out {scores}`",
                self.missing,
                self.first_missing.clone().unwrap_or_default(),
            );
        }
        if self.other_caption as f64 > f.curate.max_caption_mismatch * self.samples as f64 {
            anyhow::bail!(
                "{} of {} input samples were scored with another caption under the same key (the first: {}): {scores} scores another input; score this one, or raise curate.max_caption_mismatch",
                self.other_caption,
                self.samples,
                self.first_other_caption.clone().unwrap_or_default(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any sample without a score refuses the table; captions scored under another key are allowed
    /// up to `curate.max_caption_mismatch` of the input, and the first of each is named.
    #[test]
    fn score_files_fit_the_input_or_are_refused_by_name() {
        let mut f = Filters::default();
        f.curate.max_caption_mismatch = 0.1;
        let mut fit = ScoreFit { samples: 20, ..Default::default() };
        fit.add(&Lookup::Score(0.3), "a", "x.tar");
        fit.add(&Lookup::OtherCaption, "b", "x.tar");
        fit.add(&Lookup::OtherCaption, "c", "x.tar");
        assert!(fit.check(&f).is_ok(), "2 of 20 is within 0.1");
        fit.add(&Lookup::OtherCaption, "d", "y.tar");
        let e = fit.check(&f).unwrap_err().to_string();
        assert!(e.starts_with("3 of 20 input samples were scored with another caption") && e.contains("(the first: b in x.tar)"), "{e}");
        fit.add(&Lookup::Missing, "e", "y.tar");
        let e = fit.check(&f).unwrap_err().to_string();
        assert!(e.starts_with("1 input samples have no score") && e.contains("e in y.tar"), "{e}");
    }
}
