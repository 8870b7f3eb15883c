//! `align data build`: raw image / alt-text pairs in, clean training shards out, with a report of
//! what each filter removed.
//!
//! Filters that need corpus statistics (rare tokens, caption and image frequencies), and score
//! files (matched to every sample by key and caption before anything is written), get a first,
//! decode-free pass that only counts; the second pass decodes in parallel and applies every
//! filter in a fixed order, so each removed sample is charged to the first filter it fails.
//! Output shards are written under temporary names and renamed when complete; the same input and
//! filter file always give the same shards, so an interrupted build is simply run again.
//!
//! The stages, each in its own module: `near_eval` (the evaluation sets' hashes), `curation` (the
//! model-based filters' preparation, and how the score files fit the input), `corpus` (the
//! counting pass), `rules` (each sample's verdict, in
//! parallel), `tally` (the filters that need the build's state, in input order), `output` (the
//! shards) and `report`; `filter` names the filters in the order they apply.

mod corpus;
mod curation;
pub mod filter;
pub mod filters;
pub mod input;
mod near_eval;
mod output;
pub mod phash;
mod report;
mod rules;
mod tally;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use rayon::prelude::*;

pub use self::report::{BuildReport, DedupReport, Distributions, ImageBasedReport, MetaClipReport, Removed, ScoreFilterReport};

use self::corpus::{count_corpus, Counts};
use self::curation::Curation;
use self::filters::Filters;
use self::input::{Input, Item};
use self::near_eval::index_eval_sets;
use self::output::Output;
use self::phash::NearIndex;
use self::report::metaclip_report;
use self::rules::{check, Checked};
use self::tally::Tally;
use crate::data::stats::Distribution;
use crate::util::progress::Progress;

pub struct BuildOptions {
    pub input: String,
    pub image_root: Option<PathBuf>,
    pub out: PathBuf,
    pub filters: Filters,
    /// Evaluation sets whose images (and near-duplicates) must not be trained on: shard specs or
    /// image folders.
    pub exclude_near: Vec<String>,
    pub quiet: bool,
}

/// What the pass works with, prepared before it: the options, the evaluation sets' hashes, the
/// model-based filters' state, the corpus counts and the input's size where counted.
struct Stages<'a> {
    o: &'a BuildOptions,
    near: NearIndex,
    curation: Curation,
    counts: Counts,
    total: Option<u64>,
}

pub fn build(o: &BuildOptions) -> Result<BuildReport> {
    let t0 = Instant::now();
    let f = &o.filters;
    f.validate()?;
    let input = Input::open(&o.input, o.image_root.as_deref())?;
    std::fs::create_dir_all(&o.out).with_context(|| format!("creating {}", o.out.display()))?;
    let near = index_eval_sets(&o.exclude_near, f.image.max_pixels, o.quiet)?;
    let curation = Curation::prepare(f, o.quiet)?;
    // The counting pass also matches every sample to the score files, so that files that do not
    // fit the input are refused before anything is written.
    let (counts, total) = if f.needs_counts() || curation.table.is_some() {
        let (c, n, fit) = count_corpus(&input, f, curation.matcher.as_ref(), curation.table.as_ref(), o.quiet);
        if curation.table.is_some() {
            fit.check(f)?;
        }
        (c, Some(n))
    } else {
        (Counts::default(), None)
    };
    let stages = Stages { o, near, curation, counts, total };
    let mut output = Output::new(&o.out, f, &input, total)?;
    let mut tally = Tally::default();
    if let Err(e) = stages.pass(&input, &mut tally, &mut output) {
        output.abandon();
        return Err(e);
    }
    let shards = output.finish(f.output.seed, o.quiet)?;
    let report = stages.report(tally, shards, t0.elapsed().as_secs_f64())?;
    let path = o.out.join("build-report.json");
    crate::util::files::write_atomic(&path, serde_json::to_string_pretty(&report)?.as_bytes())?;
    Ok(report)
}

impl Stages<'_> {
    /// The second pass: every sample checked in parallel chunks, then counted and written in
    /// input order. Score files that turn out not to fit the input fail it.
    fn pass(&self, input: &Input, tally: &mut Tally, output: &mut Output) -> Result<()> {
        let f = &self.o.filters;
        let bar = match self.total {
            Some(n) => Progress::bar(n, "filtering", self.o.quiet),
            None => Progress::spinner("filtering", self.o.quiet),
        };
        let rx = input.stream();
        loop {
            let chunk: Vec<Item> = rx.iter().take(256).collect();
            if chunk.is_empty() {
                break;
            }
            let checked: Vec<Result<Checked, (String, String, String)>> = chunk
                .into_par_iter()
                .map(|item| match item {
                    Item::Sample(s) => Ok(check(s, f, &self.counts, &self.near, self.curation.matcher.as_ref())),
                    Item::Bad { origin, key, reason } => Err((origin, key, reason)),
                })
                .collect();
            bar.inc(checked.len() as u64);
            for c in checked {
                if let Some((c, p)) = tally.admit(c, f, &self.curation, &self.counts) {
                    let json = p.json.unwrap_or_else(|| {
                        serde_json::to_vec(&serde_json::json!({"key": c.key, "caption": p.caption})).unwrap_or_default()
                    });
                    let fields: [(&str, &[u8]); 3] = [(p.ext, &p.image), ("txt", p.caption.as_bytes()), ("json", &json)];
                    output.write(&c.key, &fields, tally.kept, f.output.seed)?;
                }
            }
        }
        bar.finish();
        if self.curation.table.is_some() {
            tally.scores.samples = tally.input_samples;
            tally.scores.check(f)?;
        }
        Ok(())
    }

    fn report(&self, mut tally: Tally, shards: Vec<PathBuf>, seconds: f64) -> Result<BuildReport> {
        let (f, curation) = (&self.o.filters, &self.curation);
        let clip_score = curation.table.as_ref().map(|t| ScoreFilterReport {
            scorer: t.scorer.to_string(),
            threshold: curation.threshold.unwrap_or(f32::NEG_INFINITY),
            unusable_scores: t.unusable,
            before: Distribution::of(t.scores.iter().filter(|x| x.is_finite()).map(|&x| x as f64).collect()),
            after: Distribution::of(std::mem::take(&mut tally.scores_after)),
        });
        let metaclip = match &curation.matcher {
            Some(m) => Some(metaclip_report(&self.o.out, m, &self.counts, &tally.metaclip_after, f.curate.metaclip.t)?),
            None => None,
        };
        let semdedup = (f.curate.semdedup.clusters > 0).then_some(DedupReport {
            clusters: f.curate.semdedup.clusters.min(curation.table.as_ref().map_or(0, |t| t.scores.len())),
            groups: curation.dedup_groups,
            duplicates: curation.duplicates.len(),
        });
        Ok(BuildReport {
            filters: f.description.clone(),
            input_samples: tally.input_samples,
            kept: tally.kept,
            removed: tally.removed.iter().map(|(f, n)| Removed { filter: f.name().to_string(), samples: n }).collect(),
            before: tally.before.finish(),
            after: tally.after.finish(),
            eval_hashes: self.near.len(),
            clip_score,
            image_based: curation.image_based.clone(),
            metaclip,
            semdedup,
            shards,
            seconds,
        })
    }
}
