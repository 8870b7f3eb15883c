//! `align data build`: raw image / alt-text pairs in, clean training shards out, with a report of
//! what each filter removed.
//!
//! Filters that need corpus statistics (rare tokens, caption and image frequencies) get a first,
//! decode-free pass that only counts; the second pass decodes in parallel and applies every
//! filter in a fixed order, so each removed sample is charged to the first filter it fails.
//! Output shards are written under temporary names and renamed when complete; the same input and
//! filter file always give the same shards, so an interrupted build is simply run again.

pub mod filters;
pub mod input;
pub mod phash;

use std::collections::{HashMap, HashSet};
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use rayon::prelude::*;
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_128;

use self::filters::Filters;
use self::input::{Candidate, Input, Item};
use self::phash::NearIndex;
use super::curate::metaclip::Matcher;
use super::curate::scores::{passes, Lookup, ScoreTable};
use super::shard_writer::ShardWriter;
use super::spec::ShardSource;
use super::stats::Distribution;
use super::tar_read::{read_shard_events, ShardEvent};
use super::transform::{self, Interpolation};
use crate::util::log;
use crate::util::progress::Progress;
use crate::util::rng::{hash_str, mix64, Rng};

/// The filters in the order they are applied; the report lists removals in this order.
pub const FILTER_ORDER: [&str; 20] = [
    "unreadable",
    "image_format",
    "image_size",
    "aspect_ratio",
    "boilerplate",
    "word_count",
    "repeated_words",
    "capitalization",
    "rare_tokens",
    "caption_frequency",
    "image_frequency",
    "undecodable",
    "duplicate_image",
    "near_duplicate_eval",
    "clip_score",
    "unusable_score",
    "other_caption",
    "image_based",
    "metaclip_balance",
    "semantic_duplicate",
];

fn filter_index(name: &str) -> usize {
    FILTER_ORDER.iter().position(|f| *f == name).expect("a known filter")
}

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

/// What the model-based filters read before the pass: the score table and its threshold, the
/// samples away from the image-based target, the duplicates to drop, the MetaCLIP matcher.
#[derive(Default)]
struct Curation {
    table: Option<ScoreTable>,
    threshold: Option<f32>,
    off_target: HashSet<String>,
    image_based: Option<ImageBasedReport>,
    duplicates: HashSet<String>,
    dedup_groups: usize,
    matcher: Option<Matcher>,
}

impl Curation {
    fn prepare(f: &Filters, quiet: bool) -> Result<Curation> {
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

struct Dists {
    words: Reservoir,
    shorter: Reservoir,
    aspect: Reservoir,
}

impl Dists {
    fn new(seed: u64) -> Self {
        Dists { words: Reservoir::new(seed), shorter: Reservoir::new(seed ^ 1), aspect: Reservoir::new(seed ^ 2) }
    }

    fn add(&mut self, words: usize, dims: Option<(u32, u32)>) {
        self.words.push(words as f64);
        if let Some((w, h)) = dims {
            self.shorter.push(w.min(h) as f64);
            self.aspect.push(w.max(h) as f64 / w.min(h).max(1) as f64);
        }
    }

    fn finish(self) -> Distributions {
        Distributions {
            caption_words: self.words.distribution(),
            shorter_side: self.shorter.distribution(),
            aspect_ratio: self.aspect.distribution(),
        }
    }
}

/// Corpus statistics from the first pass.
#[derive(Default)]
struct Counts {
    words: HashMap<String, u64>,
    /// The allowed unigrams and bigrams under `rare.top_ngrams`; None when every one is allowed.
    top_ngrams: Option<HashSet<String>>,
    caption_images: HashMap<u64, u32>,
    image_captions: HashMap<u128, u32>,
    /// Matches per MetaCLIP entry over the whole input, and input samples matching any.
    metaclip: Vec<u64>,
    metaclip_matched: u64,
}

fn caption_key(caption: &str) -> u64 {
    hash_str(&caption.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase())
}

fn count_corpus(input: &Input, f: &Filters, matcher: Option<&Matcher>, quiet: bool) -> (Counts, u64) {
    let mut c = Counts::default();
    if let Some(m) = matcher {
        c.metaclip = vec![0; m.entries.len()];
    }
    let mut ngrams: HashMap<String, u64> = HashMap::new();
    let mut pairs: HashSet<u128> = HashSet::new();
    let rare = &f.text.rare;
    let freq = f.frequency.max_images_per_caption > 0 || f.frequency.max_captions_per_image > 0;
    let bar = Progress::spinner("counting", quiet);
    let mut items = 0u64;
    for item in input.stream() {
        items += 1;
        bar.inc(1);
        let Item::Sample(s) = item else { continue };
        let caption = filters::trim_boilerplate(&s.caption, &f.text.trim_boilerplate);
        if let Some(m) = matcher {
            let matched = m.matches(&caption);
            c.metaclip_matched += u64::from(!matched.is_empty());
            for e in matched {
                c.metaclip[e as usize] += 1;
            }
        }
        let words = filters::norm_words(&caption);
        if rare.min_count > 0 {
            for w in &words {
                *c.words.entry(w.clone()).or_default() += 1;
            }
        }
        if rare.top_ngrams > 0 {
            for g in filters::ngrams(&words) {
                *ngrams.entry(g).or_default() += 1;
            }
        }
        if freq {
            let (ck, ik) = (caption_key(&caption), xxh3_128(&s.image));
            // Each distinct (caption, image) pair counts once on both sides.
            if pairs.insert(ik ^ (mix64(ck) as u128) << 64 ^ ck as u128) {
                *c.caption_images.entry(ck).or_default() += 1;
                *c.image_captions.entry(ik).or_default() += 1;
            }
        }
    }
    bar.finish();
    if rare.top_ngrams > 0 && ngrams.len() as u64 > rare.top_ngrams {
        let mut ranked: Vec<(String, u64)> = ngrams.into_iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        ranked.truncate(rare.top_ngrams as usize);
        c.top_ngrams = Some(ranked.into_iter().map(|(g, _)| g).collect());
    }
    (c, items)
}

/// The result of the per-sample (parallel) part of the filtering.
struct Checked {
    key: String,
    origin: String,
    /// The input's caption as it came, which a score must have been computed on.
    caption: String,
    words: usize,
    dims: Option<(u32, u32)>,
    verdict: Result<Prepared, Failed>,
}

struct Prepared {
    /// The MetaCLIP entries the caption matches.
    matched: Vec<u32>,
    caption: String,
    image: Vec<u8>,
    ext: &'static str,
    json: Option<Vec<u8>>,
    image_hash: u128,
    near_eval: Option<u32>,
}

fn format_name(fmt: image::ImageFormat) -> &'static str {
    fmt.extensions_str().first().copied().unwrap_or("img")
}

/// A filter's verdict against a sample: the filter's name and what it found.
type Failed = (&'static str, String);

/// The image's format and size, read from its header.
struct Header {
    fmt: image::ImageFormat,
    name: &'static str,
    w: u32,
    h: u32,
}

impl Header {
    fn sides(&self) -> (u32, u32) {
        (self.w.min(self.h), self.w.max(self.h))
    }
}

fn check(s: Candidate, f: &Filters, counts: &Counts, near: &NearIndex, matcher: Option<&Matcher>) -> Checked {
    let caption = filters::trim_boilerplate(&s.caption, &f.text.trim_boilerplate);
    let words = filters::word_count(&caption);
    let mut out = Checked {
        key: s.key,
        origin: s.origin,
        caption: s.caption.clone(),
        words,
        dims: None,
        verdict: Err(("unreadable", String::new())),
    };
    let header = match read_header(&s.image, f) {
        Ok(h) => h,
        Err(e) => {
            out.verdict = Err(e);
            return out;
        }
    };
    out.dims = Some((header.w, header.h));
    let (image, json) = (s.image, s.json);
    out.verdict = check_geometry(&header, f)
        .and_then(|()| check_caption(&caption, words, f, counts))
        .and_then(|()| check_frequency(&caption, xxh3_128(&image), f, counts))
        .and_then(|image_hash| {
            let (image, ext, near_eval) = pixels(image, &header, f, near)?;
            let matched = matcher.map(|m| m.matches(&caption)).unwrap_or_default();
            Ok(Prepared { matched, caption, image, ext, json, image_hash, near_eval })
        });
    out
}

/// The format (one of the allowed ones) and size from the image's header.
fn read_header(image: &[u8], f: &Filters) -> Result<Header, Failed> {
    let fmt = image::guess_format(image).map_err(|_| ("undecodable", "unrecognised image format".to_string()))?;
    let name = format_name(fmt);
    if !f.image.formats.is_empty() && !f.image.formats.iter().any(|x| image::ImageFormat::from_extension(x) == Some(fmt)) {
        return Err(("image_format", format!("{name} is not among {:?}", f.image.formats)));
    }
    let (w, h) = image::ImageReader::with_format(Cursor::new(image), fmt)
        .into_dimensions()
        .map_err(|_| ("undecodable", format!("unreadable {name} header")))?;
    Ok(Header { fmt, name, w, h })
}

/// The shorter side and the aspect ratio.
fn check_geometry(header: &Header, f: &Filters) -> Result<(), Failed> {
    let (w, h) = (header.w, header.h);
    let (short, long) = header.sides();
    if short <= f.image.min_shorter_side {
        return Err(("image_size", format!("{w}×{h}: shorter side not above {}", f.image.min_shorter_side)));
    }
    let aspect = long as f64 / short.max(1) as f64;
    let limit = f.image.max_aspect_ratio;
    if limit > 0.0 && (aspect > limit || (!f.image.aspect_ratio_inclusive && aspect >= limit)) {
        return Err(("aspect_ratio", format!("{w}×{h}: aspect ratio {aspect:.2} over {limit}")));
    }
    Ok(())
}

/// The caption's filters, in order: boilerplate, word count, repeated words, capitalisation,
/// rare tokens.
fn check_caption(caption: &str, words: usize, f: &Filters, counts: &Counts) -> Result<(), Failed> {
    let t = &f.text;
    if filters::has_boilerplate(caption, &t.drop_boilerplate) {
        return Err(("boilerplate", format!("{caption:?} starts or ends with boilerplate")));
    }
    if words < t.min_words.max(1) || (t.max_words > 0 && words > t.max_words) {
        return Err(("word_count", format!("{words} words")));
    }
    if t.max_repeated_fraction > 0.0 && filters::repeated_fraction(caption) > t.max_repeated_fraction {
        return Err(("repeated_words", format!("{:.2} of the words repeat", filters::repeated_fraction(caption))));
    }
    if (t.require_capitalized_first_word && !filters::first_word_capitalized(caption))
        || (t.max_capitalized_fraction > 0.0 && filters::capitalized_fraction(caption) > t.max_capitalized_fraction)
    {
        return Err(("capitalization", format!("{caption:?}")));
    }
    let normed = filters::norm_words(caption);
    if t.rare.min_count > 0 {
        if let Some(w) = normed.iter().find(|w| counts.words.get(*w).copied().unwrap_or(0) < t.rare.min_count) {
            return Err(("rare_tokens", format!("{w:?} occurs fewer than {} times", t.rare.min_count)));
        }
    }
    if let Some(top) = &counts.top_ngrams {
        if let Some(g) = filters::ngrams(&normed).find(|g| !top.contains(g)) {
            return Err(("rare_tokens", format!("{g:?} is not among the {} most frequent n-grams", t.rare.top_ngrams)));
        }
    }
    Ok(())
}

/// Captions shared by too many images, images with too many captions; the image's hash.
fn check_frequency(caption: &str, image_hash: u128, f: &Filters, counts: &Counts) -> Result<u128, Failed> {
    let fq = &f.frequency;
    if fq.max_images_per_caption > 0 {
        let n = counts.caption_images.get(&caption_key(caption)).copied().unwrap_or(0);
        if n as u64 > fq.max_images_per_caption {
            return Err(("caption_frequency", format!("caption shared by {n} images")));
        }
    }
    if fq.max_captions_per_image > 0 {
        let n = counts.image_captions.get(&image_hash).copied().unwrap_or(0);
        if n as u64 > fq.max_captions_per_image {
            return Err(("image_frequency", format!("image has {n} captions")));
        }
    }
    Ok(image_hash)
}

/// What needs the pixels: decodability, the near-duplicate index, resizing and re-encoding.
/// Returns the bytes to write, their extension and the nearest evaluation image, if any.
fn pixels(image: Vec<u8>, header: &Header, f: &Filters, near: &NearIndex) -> Result<(Vec<u8>, &'static str, Option<u32>), Failed> {
    let o = &f.output;
    let (w, h) = (header.w, header.h);
    let long = header.sides().1;
    let resize = o.resize_longer > 0 && long > o.resize_longer;
    let ext = if header.fmt == image::ImageFormat::Jpeg { "jpg" } else { header.name };
    if !(f.image.require_decodable || resize || o.reencode_jpeg || !near.is_empty()) {
        return Ok((image, ext, None));
    }
    // Full resolution only when writing pixels; the checks are fine at reduced DCT scale.
    let min_side = if resize || o.reencode_jpeg { u32::MAX } else { 64 };
    let pixels = transform::decode(&image, min_side, f.image.max_pixels).map_err(|e| ("undecodable", e.detail))?;
    let near_eval = if near.is_empty() { None } else { near.nearest_within(phash::phash(&pixels), f.dedup.near_max_distance) };
    if !(resize || o.reencode_jpeg) {
        return Ok((image, ext, near_eval));
    }
    let pixels = if resize {
        let scale = o.resize_longer as f64 / long as f64;
        let (nw, nh) = (((w as f64 * scale).round() as u32).max(1), ((h as f64 * scale).round() as u32).max(1));
        transform::resize(&pixels, nw, nh, Interpolation::Bicubic)
    } else {
        pixels
    };
    let mut buf = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut buf, o.jpeg_quality)
        .encode_image(&pixels)
        .map_err(|e| ("undecodable", format!("re-encoding: {e}")))?;
    Ok((buf, "jpg", near_eval))
}

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

fn index_eval_sets(specs: &[String], max_pixels: u64, quiet: bool) -> Result<NearIndex> {
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
                    let img = std::fs::read(p).ok().and_then(|b| transform::decode(&b, 64, max_pixels).ok());
                    if img.is_none() {
                        log::warn(format!("--exclude-near {}: cannot decode {}; not indexed", spec, p.display()));
                    }
                    img.map(|i| phash::phash_with_mirror(&i)).into_iter().flatten()
                })
                .collect()
        } else {
            let shards = super::spec::expand(spec)?;
            shards
                .par_iter()
                .flat_map_iter(|src| {
                    let mut out = Vec::new();
                    for ev in read_shard_events(src) {
                        if let ShardEvent::Sample(s) = ev {
                            bar.inc(1);
                            match super::sample::image_bytes(&s).ok().and_then(|b| transform::decode(b, 64, max_pixels).ok()) {
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

pub fn build(o: &BuildOptions) -> Result<BuildReport> {
    let t0 = Instant::now();
    let f = &o.filters;
    f.validate()?;
    let input = Input::open(&o.input, o.image_root.as_deref())?;
    std::fs::create_dir_all(&o.out).with_context(|| format!("creating {}", o.out.display()))?;
    let near = index_eval_sets(&o.exclude_near, f.image.max_pixels, o.quiet)?;
    let curation = Curation::prepare(f, o.quiet)?;
    let (counts, total) = if f.needs_counts() {
        let (c, n) = count_corpus(&input, f, curation.matcher.as_ref(), o.quiet);
        (c, Some(n))
    } else {
        (Counts::default(), None)
    };
    let mut output = Output::new(o, &input, total)?;
    let mut tally = Tally::default();
    let bar = match total {
        Some(n) => Progress::bar(n, "filtering", o.quiet),
        None => Progress::spinner("filtering", o.quiet),
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
                Item::Sample(s) => Ok(check(s, f, &counts, &near, curation.matcher.as_ref())),
                Item::Bad { origin, key, reason } => Err((origin, key, reason)),
            })
            .collect();
        bar.inc(checked.len() as u64);
        for c in checked {
            if let Some((c, p)) = tally.admit(c, f, &curation, &counts) {
                let json = p
                    .json
                    .unwrap_or_else(|| serde_json::to_vec(&serde_json::json!({"key": c.key, "caption": p.caption})).unwrap_or_default());
                let fields: [(&str, &[u8]); 3] = [(p.ext, &p.image), ("txt", p.caption.as_bytes()), ("json", &json)];
                output.write(&c.key, &fields, tally.kept, f.output.seed)?;
            }
        }
    }
    bar.finish();
    if tally.missing_scores > 0 {
        output.abandon();
        anyhow::bail!(
            "{} input samples have no score in {} (the first: {}): score this input with `align data score --data ... --out {}`",
            tally.missing_scores,
            f.curate.scores.display(),
            tally.first_missing.clone().unwrap_or_default(),
            f.curate.scores.display()
        );
    }
    let other = tally.removed[filter_index("other_caption")];
    if other as f64 > f.curate.max_caption_mismatch * tally.input_samples as f64 {
        output.abandon();
        anyhow::bail!(
            "{other} of {} input samples were scored with another caption under the same key (the first: {}): {} scores another input; score this one, or raise curate.max_caption_mismatch",
            tally.input_samples,
            tally.first_other_caption.clone().unwrap_or_default(),
            f.curate.scores.display()
        );
    }
    let shards = output.finish(f.output.seed, o.quiet)?;
    let clip_score = curation.table.as_ref().map(|t| ScoreFilterReport {
        scorer: t.scorer.to_string(),
        threshold: curation.threshold.unwrap_or(f32::NEG_INFINITY),
        unusable_scores: t.unusable,
        before: Distribution::of(t.scores.iter().filter(|x| x.is_finite()).map(|&x| x as f64).collect()),
        after: Distribution::of(std::mem::take(&mut tally.scores_after)),
    });
    let metaclip = match &curation.matcher {
        Some(m) => Some(metaclip_report(o, m, &counts, &tally.metaclip_after, f.curate.metaclip.t)?),
        None => None,
    };
    let semdedup = (f.curate.semdedup.clusters > 0).then_some(DedupReport {
        clusters: f.curate.semdedup.clusters.min(curation.table.as_ref().map_or(0, |t| t.scores.len())),
        groups: curation.dedup_groups,
        duplicates: curation.duplicates.len(),
    });
    let report = BuildReport {
        filters: f.description.clone(),
        input_samples: tally.input_samples,
        kept: tally.kept,
        removed: FILTER_ORDER.iter().zip(tally.removed).map(|(f, n)| Removed { filter: f.to_string(), samples: n }).collect(),
        before: tally.before.finish(),
        after: tally.after.finish(),
        eval_hashes: near.len(),
        clip_score,
        image_based: curation.image_based.clone(),
        metaclip,
        semdedup,
        shards,
        seconds: t0.elapsed().as_secs_f64(),
    };
    let path = o.out.join("build-report.json");
    crate::util::files::write_atomic(&path, serde_json::to_string_pretty(&report)?.as_bytes())?;
    Ok(report)
}

/// MetaCLIP's report, with every entry's count before and after in `metaclip-counts.tsv`.
fn metaclip_report(o: &BuildOptions, m: &Matcher, counts: &Counts, after: &[u64], t: u64) -> Result<MetaClipReport> {
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
    let counts_file = o.out.join("metaclip-counts.tsv");
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

/// Counts of the build so far: samples read and kept, removals by filter, the distributions
/// before and after filtering, and the images already kept (exact duplicates).
struct Tally {
    removed: [u64; FILTER_ORDER.len()],
    before: Dists,
    after: Dists,
    seen_images: HashSet<u128>,
    input_samples: u64,
    kept: u64,
    /// Scores of the kept samples, for the report.
    scores_after: Vec<f64>,
    /// Matches per MetaCLIP entry among the kept samples.
    metaclip_after: Vec<u64>,
    /// Samples the score files have no score for, and the first of them.
    missing_scores: u64,
    first_missing: Option<String>,
    first_other_caption: Option<String>,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            removed: [0; FILTER_ORDER.len()],
            before: Dists::new(1),
            after: Dists::new(2),
            seen_images: HashSet::new(),
            input_samples: 0,
            kept: 0,
            scores_after: Vec::new(),
            metaclip_after: Vec::new(),
            missing_scores: 0,
            first_missing: None,
            first_other_caption: None,
        }
    }
}

impl Tally {
    /// Counts a checked sample; the ones to keep come back with what to write. A removed sample
    /// is charged to the first filter it fails; exact duplicates and near-duplicates of the
    /// evaluation images come last.
    fn admit(
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
                self.removed[filter_index("unreadable")] += 1;
                log::warn(format!("{origin}: sample {key}: {reason}"));
                return None;
            }
        };
        self.before.add(c.words, c.dims);
        let verdict = std::mem::replace(&mut c.verdict, Err(("unreadable", String::new())));
        let p = match verdict {
            Ok(p) => p,
            Err((filter, detail)) => {
                self.removed[filter_index(filter)] += 1;
                if filter == "undecodable" {
                    log::warn_sample(&c.origin, filter, format!("{}: sample {}: {detail}", c.origin, c.key));
                }
                return None;
            }
        };
        if f.dedup.exact_images && !self.seen_images.insert(p.image_hash) {
            self.removed[filter_index("duplicate_image")] += 1;
            return None;
        }
        if p.near_eval.is_some() {
            self.removed[filter_index("near_duplicate_eval")] += 1;
            return None;
        }
        let mut score = None;
        if let Some(table) = &cur.table {
            let s = match table.lookup(&c.key, &c.caption) {
                Lookup::Score(s) => s,
                Lookup::Missing => {
                    self.missing_scores += 1;
                    self.first_missing.get_or_insert_with(|| format!("{} in {}", c.key, c.origin));
                    return None;
                }
                Lookup::OtherCaption => {
                    self.removed[filter_index("other_caption")] += 1;
                    self.first_other_caption.get_or_insert_with(|| format!("{} in {}", c.key, c.origin));
                    return None;
                }
            };
            if !s.is_finite() {
                self.removed[filter_index("unusable_score")] += 1;
                return None;
            }
            if !passes(s, cur.threshold) {
                self.removed[filter_index("clip_score")] += 1;
                return None;
            }
            score = Some(s);
        }
        if cur.off_target.contains(&c.key) {
            self.removed[filter_index("image_based")] += 1;
            return None;
        }
        let mc = &f.curate.metaclip;
        if mc.t > 0 && !super::curate::metaclip::keep(&c.key, &p.matched, &counts.metaclip, mc.t, mc.seed) {
            self.removed[filter_index("metaclip_balance")] += 1;
            return None;
        }
        if cur.duplicates.contains(&c.key) {
            self.removed[filter_index("semantic_duplicate")] += 1;
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

/// Where kept samples go: straight into the output shards, or (`output.shuffle`) first into
/// random buckets, each shuffled in memory and written out at the end.
struct Output {
    sink: ShardSink,
    staging: PathBuf,
    buckets: Vec<Option<ShardWriter>>,
}

impl Output {
    fn new(o: &BuildOptions, input: &Input, total: Option<u64>) -> Result<Output> {
        let f = &o.filters;
        let staging = o.out.join(".build");
        let buckets = if f.output.shuffle {
            std::fs::create_dir_all(&staging)?;
            let per_part = if matches!(input, Input::Table { .. }) { 1 } else { f.output.samples_per_shard as u64 };
            let estimate = total.unwrap_or(0).max(input.parts() as u64 * per_part);
            (estimate.div_ceil(f.output.samples_per_shard as u64)).max(1) as usize
        } else {
            0
        };
        let sink = ShardSink { dir: o.out.clone(), per_shard: f.output.samples_per_shard, current: None, shards: Vec::new() };
        Ok(Output { sink, staging, buckets: (0..buckets).map(|_| None).collect() })
    }

    /// Writes the `kept`-th kept sample.
    fn write(&mut self, key: &str, fields: &[(&str, &[u8])], kept: u64, seed: u64) -> Result<()> {
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
    fn abandon(mut self) {
        self.buckets.clear();
        let _ = std::fs::remove_dir_all(&self.staging);
        self.sink.abandon();
    }

    /// Shuffles each bucket into the output shards, closes the last one, and names them.
    fn finish(mut self, seed: u64, quiet: bool) -> Result<Vec<PathBuf>> {
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
