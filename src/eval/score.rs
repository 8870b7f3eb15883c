//! `align data score`: the CLIP score of every sample of a corpus (the cosine between its image's
//! and its caption's embeddings) with any checkpoint align reads, through its own preprocessing
//! and tokenizer, one Parquet file per input shard (`data::curate::scores`). It runs the
//! forward-only path evaluation runs (decoding on the reader's thread, images and captions
//! interleaved), so it goes at the speed of `align bench embed`.
//!
//! A shard whose score file exists for the same checkpoint is skipped: a killed run, run again,
//! scores what was left and gives the same files.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;
use serde::Serialize;

use crate::data::curate::scores::{self, Scorer, ShardScores};
use crate::data::eval_reader::{EvalSource, Needs};
use crate::data::skips::SkipCounts;
use crate::data::spec::ShardSource;
use crate::io::load::LoadedModel;
use crate::util::log;
use crate::util::progress::Progress;

#[derive(Debug, Clone)]
pub struct ScoreOptions {
    pub out: PathBuf,
    /// Also keep the image and text embeddings (for deduplication and clustering).
    pub embeddings: bool,
    pub batch: usize,
    pub quiet: bool,
    /// The checkpoint as the user named it, recorded in each file.
    pub checkpoint: String,
    /// The model's directory as loaded: what the score files name as their model.
    pub model: String,
}

#[derive(Debug, Serialize)]
pub struct ScoreReport {
    pub checkpoint: String,
    /// The model's directory as loaded: what the score files name as their model.
    pub model: String,
    /// The towers' products: `f32`, or `bf16` (`--precision bf16`).
    pub precision: &'static str,
    pub shards: usize,
    /// Shards whose score file was already there (a resumed run).
    pub already_scored: usize,
    pub samples: u64,
    /// Shards that gave no usable sample (each named in a warning).
    pub empty_shards: usize,
    pub skipped: SkipCounts,
    pub seconds: f64,
    pub images_per_s: f64,
    pub out: PathBuf,
}

/// Whether `path` already holds the scores of `shard` by this scorer (with embeddings and the
/// scorer's logit scale, when embeddings are asked for: what a distillation run needs).
fn done(path: &Path, shard: &str, scorer: &Scorer, embeddings: bool) -> bool {
    scores::read_meta(path).is_ok_and(|s| {
        s.meta("shard") == Some(shard)
            && Scorer::of(&s) == *scorer
            && (!embeddings || (s.meta("embeddings") == Some("true") && s.meta("logit_scale").is_some()))
    })
}

/// The name of the lock file that keeps two scorers out of one directory (hidden, as pandas and
/// pyarrow skip such files when they read the directory).
const LOCK: &str = ".align-score.lock";

/// The report `align data score` leaves beside the score files; its leading underscore keeps it
/// out of `pd.read_parquet(DIR)`, which skips such names.
pub const REPORT: &str = "_score-report.json";

/// Takes the directory's lock and refuses a directory that holds score files of another model
/// or precision: one directory is one scorer's, so that `data build` never mixes two.
fn claim(out: &Path, scorer: &Scorer) -> Result<std::fs::File> {
    let lock = match crate::util::files::try_lock(&out.join(LOCK))? {
        crate::util::files::Lock::Held(file) => file,
        crate::util::files::Lock::Busy(_) => anyhow::bail!("another align data score is writing into {} now", out.display()),
    };
    for file in scores::files(out)? {
        let theirs = Scorer::of(&scores::read_meta(&file)?);
        if theirs != *scorer {
            anyhow::bail!(
                "{} holds scores by {theirs} ({}), and this run scores with {scorer}: one directory holds one model's scores; choose another --out",
                out.display(),
                file.display()
            );
        }
    }
    Ok(lock)
}

/// Scores every shard of `shards` with `m` into `o.out`.
pub fn score_shards(m: &LoadedModel, shards: &[ShardSource], o: &ScoreOptions, device: &Device) -> Result<ScoreReport> {
    std::fs::create_dir_all(&o.out).with_context(|| format!("creating {}", o.out.display()))?;
    let scorer = Scorer { model: o.model.clone(), precision: m.precision.name().to_string() };
    let _lock = claim(&o.out, &scorer)?;
    let started = Instant::now();
    let mut report = ScoreReport {
        checkpoint: o.checkpoint.clone(),
        model: o.model.clone(),
        precision: m.precision.name(),
        shards: shards.len(),
        already_scored: 0,
        samples: 0,
        empty_shards: 0,
        skipped: SkipCounts::default(),
        seconds: 0.0,
        images_per_s: 0.0,
        out: o.out.clone(),
    };
    let mut names: std::collections::HashMap<PathBuf, String> = std::collections::HashMap::new();
    let bar = Progress::bar(shards.len() as u64, "scoring shards", o.quiet);
    let dim = m.spec().embed_dim;
    // The scorer's own logit scale (and bias), so that its embeddings can teach: a distillation
    // run scales the teacher's similarities by them.
    let scalar = |t: candle_core::Tensor| -> Result<f64> { Ok(t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?) };
    let logit_scale = scalar(m.model.logit_scale()?)?;
    let logit_bias = m.model.logit_bias()?.map(scalar).transpose()?;
    for shard in shards {
        let name = shard.to_string();
        let path = scores::score_path(&o.out, &name);
        if let Some(other) = names.insert(path.clone(), name.clone()) {
            anyhow::bail!("shards {other} and {name} would both be scored into {}: give shards distinct file names", path.display());
        }
        if done(&path, &name, &scorer, o.embeddings) {
            report.already_scored += 1;
            bar.inc(1);
            continue;
        }
        let needs = Needs { image: true, captions: true, label: false };
        let e = crate::eval::embed::Embedder::of(m, o.batch, device, true)
            .pairs_of_part(EvalSource::Shards(vec![shard.clone()]), needs)
            .with_context(|| format!("scoring {name}"))?;
        let texts = e.caption_embeddings.as_ref().expect("pairs embeds the captions");
        // Each image's first caption is the one scored (web pairs have one).
        let mut s = ShardScores { dim, ..Default::default() };
        let mut at = 0;
        let (mut image_rows, mut text_rows) = (Vec::new(), Vec::new());
        for (i, caps) in e.captions.iter().enumerate() {
            let img = &e.embeddings.data[i * dim..(i + 1) * dim];
            let txt = &texts.data[at * dim..(at + 1) * dim];
            at += caps.len();
            s.keys.push(e.keys[i].clone());
            s.captions.push(caps[0].clone());
            s.scores.push(img.iter().zip(txt).map(|(a, b)| a * b).sum());
            if o.embeddings {
                image_rows.extend_from_slice(img);
                text_rows.extend_from_slice(txt);
            }
        }
        if o.embeddings {
            s.image_embeddings = Some(image_rows);
            s.text_embeddings = Some(text_rows);
        }
        if s.keys.is_empty() {
            report.empty_shards += 1;
            log::warn(format!("{name}: no usable sample to score (skipped: {})", e.skipped.summary()));
        }
        s.meta = vec![
            ("shard".into(), name.clone()),
            ("checkpoint".into(), o.checkpoint.clone()),
            ("model".into(), o.model.clone()),
            ("precision".into(), m.precision.name().into()),
            ("embeddings".into(), o.embeddings.to_string()),
            ("logit_scale".into(), logit_scale.to_string()),
            ("samples".into(), s.keys.len().to_string()),
            ("skipped".into(), e.skipped.summary()),
        ];
        if let Some(b) = logit_bias {
            s.meta.push(("logit_bias".into(), b.to_string()));
        }
        scores::write(&path, &s)?;
        report.samples += s.keys.len() as u64;
        report.skipped.merge(&e.skipped);
        if !e.skipped.is_empty() {
            log::warn(format!("{name}: skipped {}", e.skipped.summary()));
        }
        bar.inc(1);
    }
    bar.finish();
    if report.samples == 0 && report.already_scored == 0 {
        anyhow::bail!(
            "no sample of {} shard(s) could be scored (skipped: {}): check the shards with `align data stats`",
            shards.len(),
            report.skipped.summary()
        );
    }
    report.seconds = started.elapsed().as_secs_f64();
    report.images_per_s = report.samples as f64 / report.seconds.max(1e-9);
    Ok(report)
}
