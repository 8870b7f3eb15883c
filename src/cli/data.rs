use std::path::PathBuf;

use align::data::synth::{write_synth, SynthSpec};
use align::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};
use align::data::{spec, stats};
use align::util::progress::Progress;
use anyhow::{bail, Result};
use clap::Args;

use super::table::Table;

#[derive(Args)]
pub struct SynthArgs {
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Training shards to write.
    #[arg(long, default_value_t = 8)]
    pub train_shards: usize,
    /// Samples per shard.
    #[arg(long, default_value_t = 1000)]
    pub samples_per_shard: usize,
    /// Held-out samples (five captions each) in test-00000.tar.
    #[arg(long, default_value_t = 720)]
    pub test_samples: usize,
    /// Image side in pixels.
    #[arg(long, default_value_t = 64)]
    pub image_size: u32,
    /// Seed of the scenes and captions.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn synth(a: &SynthArgs) -> Result<()> {
    let out = write_synth(
        &a.out,
        &SynthSpec {
            train_shards: a.train_shards,
            samples_per_shard: a.samples_per_shard,
            test_samples: a.test_samples,
            image_size: a.image_size,
            seed: a.seed,
        },
    )?;
    if a.json {
        return super::print_json(&out);
    }
    let mut t = Table::new("Synthetic data");
    t.row("train shards", out.train.clone()).row("train samples", out.train_samples.to_string());
    t.row("test shard", out.test.clone()).row("test samples", out.test_samples.to_string());
    t.row("classes", out.classes.display().to_string()).row("templates", out.templates.display().to_string());
    t.print();
    Ok(())
}

#[derive(Args)]
pub struct StatsArgs {
    /// Shard spec.
    #[arg(long)]
    pub data: String,
    /// Skip images whose header claims more pixels than this.
    #[arg(long, default_value_t = 89_478_485)]
    pub max_pixels: u64,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn stats(a: &StatsArgs) -> Result<()> {
    let shards = spec::expand(&a.data)?;
    let bar = Progress::bar(shards.len() as u64, "reading shards", a.json);
    let s = stats::compute(&shards, a.max_pixels, || bar.inc(1));
    bar.finish();
    if a.json {
        return super::print_json(&s);
    }
    let mut t = Table::new(&format!("Data: {}", a.data));
    t.row("shards", s.shards.to_string()).row("usable samples", s.samples.to_string()).row("skipped", s.skipped.summary());
    t.row("labelled samples", s.labels.to_string());
    t.row("fields", s.fields.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", "));
    let d = |x: &stats::Distribution| format!("min {} / median {} / p90 {} / max {} (mean {:.1})", x.min, x.p50, x.p90, x.max, x.mean);
    t.row("caption words", d(&s.caption_words)).row("image width", d(&s.image_width)).row("image height", d(&s.image_height));
    t.print();
    Ok(())
}

#[derive(Args)]
pub struct TokenizerTrainArgs {
    /// Shards whose captions to learn from.
    #[arg(long)]
    pub data: String,
    /// WordPiece vocabulary size (ALIGN: 100k; BERT: 30,522).
    #[arg(long, default_value_t = 30522)]
    pub vocab_size: usize,
    /// Output tokenizer.json.
    #[arg(long)]
    pub out: PathBuf,
    /// Read at most this many captions (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Keep case (default: lower-case, as BERT uncased).
    #[arg(long)]
    pub cased: bool,
    /// Tokens must occur this often to enter the vocabulary.
    #[arg(long, default_value_t = 2)]
    pub min_frequency: u64,
}

pub fn tokenizer_train(a: &TokenizerTrainArgs) -> Result<()> {
    let shards = spec::expand(&a.data)?;
    let captions = captions_from_shards(&shards, a.limit);
    if captions.is_empty() {
        bail!("no caption found in {}", a.data);
    }
    let tok = TextTokenizer::new(train_wordpiece(captions.iter(), a.vocab_size, !a.cased, a.min_frequency)?, 64)?;
    tok.save(&a.out)?;
    println!("trained a {}-token vocabulary on {} captions: {}", tok.vocab_size(), captions.len(), a.out.display());
    Ok(())
}

#[derive(Args)]
pub struct FromKarpathyArgs {
    /// `dataset_flickr30k.json` or `dataset_coco.json`.
    #[arg(long)]
    pub karpathy: PathBuf,
    /// The image folder the file refers to.
    #[arg(long)]
    pub images: PathBuf,
    /// Splits to include, comma separated (ALIGN fine-tunes COCO on `train,restval`).
    #[arg(long, default_value = "train")]
    pub split: String,
    /// Output directory for `{split}-{00000..}.tar`.
    #[arg(long)]
    pub out: PathBuf,
    /// Samples per shard.
    #[arg(long, default_value_t = 2000)]
    pub samples_per_shard: usize,
}

/// Writes a Karpathy split as webdataset shards: the image file's bytes under its extension and
/// every caption as a line of `txt` (the training loader picks one per epoch; evaluation uses all).
pub fn from_karpathy(a: &FromKarpathyArgs) -> Result<()> {
    use align::data::folders::karpathy;
    use align::data::shard_writer::ShardWriter;
    let mut files = Vec::new();
    for split in a.split.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        files.extend(karpathy(&a.karpathy, &a.images, split)?);
    }
    std::fs::create_dir_all(&a.out)?;
    let name = a.split.replace(',', "+");
    let bar = Progress::bar(files.len() as u64, "writing shards", false);
    let mut written = Vec::new();
    let mut missing = 0usize;
    for (s, chunk) in files.chunks(a.samples_per_shard.max(1)).enumerate() {
        let path = a.out.join(format!("{name}-{s:05}.tar"));
        let mut w = ShardWriter::create(&path)?;
        for (i, f) in chunk.iter().enumerate() {
            bar.inc(1);
            let bytes = match std::fs::read(&f.path) {
                Ok(b) => b,
                Err(e) => {
                    align::util::log::warn(format!("{}: {e}; skipped", f.path.display()));
                    missing += 1;
                    continue;
                }
            };
            let ext = f.path.extension().map(|e| e.to_string_lossy().to_lowercase()).unwrap_or_else(|| "jpg".into());
            let key = format!("{s:05}{i:05}");
            let json = serde_json::to_vec(
                &serde_json::json!({"file": f.path.file_name().map(|n| n.to_string_lossy().to_string()), "captions": f.captions}),
            )?;
            w.write_sample(
                &key,
                &[(ext.as_str(), bytes.as_slice()), ("txt", f.captions.join("\n").as_bytes()), ("json", json.as_slice())],
            )?;
        }
        written.push(w.finish()?);
    }
    bar.finish();
    if written.is_empty() {
        bail!("no image in split {}", a.split);
    }
    let last = written.len() - 1;
    println!("{} images ({} missing) → {}/{name}-{{00000..{last:05}}}.tar", files.len() - missing, missing, a.out.display());
    Ok(())
}

#[derive(Args)]
pub struct BuildArgs {
    /// img2dataset shards (a shard spec), or a `.tsv` / `.csv` of `caption, image path` rows.
    #[arg(long)]
    pub input: String,
    /// Where the table's image paths are relative to (default: the table's folder).
    #[arg(long)]
    pub image_root: Option<PathBuf>,
    /// Output directory for `00000.tar`, `00001.tar`, ... and `build-report.json`.
    #[arg(long)]
    pub out: PathBuf,
    /// Filter file, e.g. `configs/filters/align.toml`.
    #[arg(long)]
    pub filters: PathBuf,
    /// Evaluation images to keep out of training (and their near-duplicates): a shard spec or an
    /// image folder; repeatable.
    #[arg(long)]
    pub exclude_near: Vec<String>,
    /// Samples per output shard (overrides the filter file's `output.samples_per_shard`).
    #[arg(long)]
    pub samples_per_shard: Option<usize>,
    /// Resize so the longer side is at most this, re-encoding as JPEG.
    #[arg(long)]
    pub resize_longer: Option<u32>,
    /// Shuffle samples across all output shards.
    #[arg(long)]
    pub shuffle: bool,
    /// Seed of the output shuffle (overrides `output.seed`).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn build(a: &BuildArgs) -> Result<()> {
    use align::data::build::{self, filters::Filters, BuildOptions};
    let mut filters = Filters::load(&a.filters)?;
    if let Some(n) = a.samples_per_shard {
        filters.output.samples_per_shard = n;
    }
    if let Some(n) = a.resize_longer {
        filters.output.resize_longer = n;
    }
    if let Some(s) = a.seed {
        filters.output.seed = s;
    }
    filters.output.shuffle |= a.shuffle;
    let r = build::build(&BuildOptions {
        input: a.input.clone(),
        image_root: a.image_root.clone(),
        out: a.out.clone(),
        filters,
        exclude_near: a.exclude_near.clone(),
        quiet: a.json,
    })?;
    if a.json {
        return super::print_json(&r);
    }
    if r.kept == 0 {
        let why: Vec<String> = r.removed.iter().filter(|x| x.samples > 0).map(|x| format!("{} {}", x.filter, x.samples)).collect();
        anyhow::bail!(
            "the build kept none of {} input samples (removed: {}); see {}",
            r.input_samples,
            if why.is_empty() { "none".to_string() } else { why.join(", ") },
            a.out.join("build-report.json").display()
        );
    }
    let mut t = Table::new(&format!("Built {} ({})", a.out.display(), a.filters.display()));
    t.row("input samples", r.input_samples.to_string());
    for rm in r.removed.iter().filter(|r| r.samples > 0) {
        let share = 100.0 * rm.samples as f64 / r.input_samples.max(1) as f64;
        t.row(format!("  removed: {}", rm.filter), format!("{} ({share:.1}%)", rm.samples));
    }
    t.row("kept", format!("{} ({:.1}%)", r.kept, 100.0 * r.kept as f64 / r.input_samples.max(1) as f64));
    let d = |x: &stats::Distribution| format!("median {} / p90 {} / max {}", x.p50, x.p90, x.max);
    t.row("caption words before → after", format!("{} → {}", d(&r.before.caption_words), d(&r.after.caption_words)));
    t.row("shorter side before → after", format!("{} → {}", d(&r.before.shorter_side), d(&r.after.shorter_side)));
    let cos = |x: &stats::Distribution| format!("min {:.3} / median {:.3} / p90 {:.3}", x.min, x.p50, x.p90);
    if let Some(c) = &r.clip_score {
        t.row("CLIP score threshold", format!("{:.4}", c.threshold));
        t.row("CLIP score before → after", format!("{} → {}", cos(&c.before), cos(&c.after)));
    }
    if let Some(i) = &r.image_based {
        t.row(
            "image-based clusters kept",
            format!("{} of {} (nearest to {} target images)", i.target_clusters, i.clusters, i.target_images),
        );
    }
    if let Some(m) = &r.metaclip {
        t.row(
            "MetaCLIP head share before → after",
            format!("{:.1}% → {:.1}% (t = {})", 100.0 * m.head_share_before, 100.0 * m.head_share_after, m.t),
        );
    }
    if let Some(s) = &r.semdedup {
        t.row("near-duplicate groups", format!("{} ({} copies removed)", s.groups, s.duplicates));
    }
    t.row("shards written", r.shards.len().to_string());
    t.row("time", format!("{:.1} s", r.seconds));
    t.print();
    Ok(())
}

#[derive(Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub precision: super::precision::PrecisionArg,
    #[command(flatten)]
    pub stall: super::stall::StallArg,
    /// The scoring model: any checkpoint align reads (an align run, a Hugging Face or open_clip
    /// folder, `hf:ORG/NAME`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The shards to score (a shard spec).
    #[arg(long)]
    pub data: String,
    /// Output directory: one `SHARD.parquet` per input shard.
    #[arg(long)]
    pub out: PathBuf,
    /// Also keep each sample's image and text embeddings (for deduplication).
    #[arg(long)]
    pub embeddings: bool,
    /// Images (and captions) per forward pass (default: the model's, 64 or 32).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `align data score`: each sample's image-text cosine, as Parquet files beside the shards'.
pub fn score(a: &ScoreArgs) -> Result<()> {
    let precision = a.precision.apply()?;
    a.stall.apply()?;
    let device = super::default_device();
    let mut m = align::io::load::load_model(&a.checkpoint, &device)?;
    m.set_precision(precision);
    let shards = align::data::spec::expand(&a.data)?;
    let o = align::eval::score::ScoreOptions {
        out: a.out.clone(),
        embeddings: a.embeddings,
        batch: a.batch.unwrap_or(align::eval::embed::auto_batch(m.spec())),
        quiet: a.json,
        checkpoint: a.checkpoint.display().to_string(),
        model: m.dir.canonicalize().unwrap_or_else(|_| m.dir.clone()).display().to_string(),
    };
    let r = align::eval::score::score_shards(&m, &shards, &o, &device)?;
    align::util::files::write_atomic(&a.out.join(align::eval::score::REPORT), serde_json::to_string_pretty(&r)?.as_bytes())?;
    if a.json {
        return super::print_json(&r);
    }
    let mut t = Table::new(&format!("Scored {} with {}", a.data, a.checkpoint.display()));
    t.row("shards", format!("{} ({} already scored)", r.shards, r.already_scored));
    t.row("samples scored", r.samples.to_string());
    t.row("skipped", r.skipped.summary());
    t.row("images/s", format!("{:.1}", r.images_per_s));
    t.row("score files", a.out.display().to_string());
    t.print();
    Ok(())
}
