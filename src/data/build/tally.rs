//! The pass's bookkeeping, in input order: each checked sample counted against the filters that
//! need the whole build's state (exact duplicates, the score table, the image-based selection,
//! MetaCLIP's balance, semantic duplicates), and the ones to keep handed back to be written.

use std::collections::HashSet;

use super::corpus::Counts;
use super::curation::{Curation, ScoreFit};
use super::filter::{Filter, Removals};
use super::filters::Filters;
use super::report::Dists;
use super::rules::{Checked, Prepared};
use crate::data::curate::scores::{passes, Lookup};
use crate::util::log;

/// Counts of the build so far: samples read and kept, removals by filter, the distributions
/// before and after filtering, and the images already kept (exact duplicates).
pub(super) struct Tally {
    pub removed: Removals,
    pub before: Dists,
    pub after: Dists,
    pub seen_images: HashSet<u128>,
    pub input_samples: u64,
    pub kept: u64,
    /// Scores of the kept samples, for the report.
    pub scores_after: Vec<f64>,
    /// Matches per MetaCLIP entry among the kept samples.
    pub metaclip_after: Vec<u64>,
    /// How the samples met the score files (checked before the pass too; an input that reads
    /// differently the second time is caught here).
    pub scores: ScoreFit,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            removed: Removals::default(),
            before: Dists::new(1),
            after: Dists::new(2),
            seen_images: HashSet::new(),
            input_samples: 0,
            kept: 0,
            scores_after: Vec::new(),
            metaclip_after: Vec::new(),
            scores: ScoreFit::default(),
        }
    }
}

impl Tally {
    /// Counts a checked sample; the ones to keep come back with what to write. A removed sample
    /// is charged to the first filter it fails; exact duplicates and near-duplicates of the
    /// evaluation images come last.
    pub(super) fn admit(
        &mut self,
        c: Result<Checked, (String, String, String)>,
        f: &Filters,
        cur: &Curation,
        counts: &Counts,
    ) -> Option<(Checked, Prepared)> {
        self.input_samples += 1;
        let mut c = match c {
            Ok(c) => c,
            Err((origin, key, reason)) => {
                self.removed.add(Filter::Unreadable);
                log::warn(format!("{origin}: sample {key}: {reason}"));
                return None;
            }
        };
        self.before.add(c.words, c.dims);
        let verdict = std::mem::replace(&mut c.verdict, Err((Filter::Unreadable, String::new())));
        let p = match verdict {
            Ok(p) => p,
            Err((filter, detail)) => {
                self.removed.add(filter);
                if filter == Filter::Undecodable {
                    log::warn_sample(&c.origin, filter.name(), format!("{}: sample {}: {detail}", c.origin, c.key));
                }
                return None;
            }
        };
        if f.dedup.exact_images && !self.seen_images.insert(p.image_hash) {
            self.removed.add(Filter::DuplicateImage);
            return None;
        }
        if p.near_eval.is_some() {
            self.removed.add(Filter::NearDuplicateEval);
            return None;
        }
        let mut score = None;
        if let Some(table) = &cur.table {
            let lookup = table.lookup(&c.key, &c.caption);
            self.scores.add(&lookup, &c.key, &c.origin);
            let s = match lookup {
                Lookup::Score(s) => s,
                Lookup::Missing => return None,
                Lookup::OtherCaption => {
                    self.removed.add(Filter::OtherCaption);
                    return None;
                }
            };
            if !s.is_finite() {
                self.removed.add(Filter::UnusableScore);
                return None;
            }
            if !passes(s, cur.threshold) {
                self.removed.add(Filter::ClipScore);
                return None;
            }
            score = Some(s);
        }
        if cur.off_target.contains(&c.key) {
            self.removed.add(Filter::ImageBased);
            return None;
        }
        let mc = &f.curate.metaclip;
        if mc.t > 0 && !crate::data::curate::metaclip::keep(&c.key, &p.matched, &counts.metaclip, mc.t, mc.seed) {
            self.removed.add(Filter::MetaclipBalance);
            return None;
        }
        if cur.duplicates.contains(&c.key) {
            self.removed.add(Filter::SemanticDuplicate);
            return None;
        }
        if let Some(s) = score {
            self.scores_after.push(s as f64);
        }
        if mc.t > 0 {
            self.metaclip_after.resize(counts.metaclip.len(), 0);
            for &e in &p.matched {
                self.metaclip_after[e as usize] += 1;
            }
        }
        self.kept += 1;
        self.after.add(c.words, c.dims);
        Some((c, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::build::filters::Filters;

    fn prepared(image_hash: u128, near_eval: Option<u32>) -> Prepared {
        Prepared { matched: Vec::new(), caption: "c".into(), image: Vec::new(), ext: "jpg", json: None, image_hash, near_eval }
    }

    fn checked(key: &str, verdict: Result<Prepared, (Filter, String)>) -> Checked {
        Checked { key: key.into(), origin: "in".into(), caption: "c".into(), words: 1, dims: Some((4, 4)), verdict }
    }

    /// Input order decides which exact duplicate is kept; every sample is counted once, under the
    /// first filter it fails.
    #[test]
    fn samples_are_counted_once_under_the_first_filter_they_fail() {
        let mut f = Filters::default();
        f.dedup.exact_images = true;
        let (cur, counts) = (Curation::default(), Counts::default());
        let mut t = Tally::default();
        let inputs = [
            Ok(checked("a", Ok(prepared(1, None)))),
            Ok(checked("b", Ok(prepared(1, None)))),
            Ok(checked("c", Ok(prepared(2, Some(3))))),
            Ok(checked("d", Err((Filter::WordCount, "1 words".into())))),
            Err(("in".to_string(), "e".to_string(), "no image file".to_string())),
            Ok(checked("f", Ok(prepared(4, None)))),
        ];
        let kept: Vec<String> = inputs.into_iter().filter_map(|c| t.admit(c, &f, &cur, &counts)).map(|(c, _)| c.key).collect();
        assert_eq!(kept, ["a", "f"]);
        assert_eq!((t.input_samples, t.kept), (6, 2));
        let removed: Vec<(Filter, u64)> = t.removed.iter().filter(|(_, n)| *n > 0).collect();
        assert_eq!(removed, [(Filter::Unreadable, 1), (Filter::WordCount, 1), (Filter::DuplicateImage, 1), (Filter::NearDuplicateEval, 1)]);
    }
}
