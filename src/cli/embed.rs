//! `align embed` writes embeddings for an index; `align search` queries one with a text, an image,
//! or an image plus / minus a text (ALIGN §7).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use align::data::eval_reader::{EvalSource, Needs};
use align::data::spec;
use align::data::transform::{decode, eval_transform};
use align::eval::embed::{embed_images, embed_texts, Embedder};
use align::eval::knn::top_k;
use align::eval::metrics::Embeddings;
use align::eval::zeroshot::read_lines;
use align::io::load::load_model_with;
use align::util::progress::Progress;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use serde::{Deserialize, Serialize};

#[derive(Args)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub model: super::precision::ModelArgs,
    #[command(flatten)]
    pub stall: super::stall::StallArg,
    /// Shards to embed: every image, and every caption it carries.
    #[arg(long, conflicts_with = "texts")]
    pub data: Option<String>,
    /// A text file to embed, one text per line.
    #[arg(long)]
    pub texts: Option<PathBuf>,
    /// Output `.safetensors` (a `.json` sidecar is written beside it).
    #[arg(long)]
    pub out: PathBuf,
    /// Images (and texts) per forward pass (default: the model's, 64 or 32).
    #[arg(long)]
    pub batch: Option<usize>,
}

/// What the sidecar says about the rows of the embedding matrices.
#[derive(Debug, Serialize, Deserialize, Default)]
pub struct Sidecar {
    pub image_keys: Vec<String>,
    pub texts: Vec<String>,
    /// For each text, the row of the image it came with (None for texts from a file).
    pub text_image: Vec<Option<usize>>,
    /// The checkpoint directory that embedded the rows (as loaded), whether its moving average
    /// did, and the embedding dimension: a search with another model is refused. Absent in
    /// indexes written before they were recorded.
    #[serde(default)]
    pub checkpoint: Option<PathBuf>,
    #[serde(default)]
    pub ema: bool,
    #[serde(default)]
    pub dim: Option<usize>,
    /// The towers' products: `f32`, `bf16` or `int8` (absent: f32).
    #[serde(default)]
    pub precision: Option<String>,
}

fn sidecar_path(out: &Path) -> PathBuf {
    out.with_extension("json")
}

fn canonical(dir: &Path) -> PathBuf {
    dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf())
}

/// Refuses to search an index with another model than the one that wrote it: the scores would be
/// meaningless (or, across dimensions, fail inside the matrix product).
fn check_same_model(side: &Sidecar, index: &Path, dir: &Path, ema: bool, dim: usize, rows_dim: usize) -> Result<()> {
    let written = side.dim.unwrap_or(rows_dim);
    if written != dim || rows_dim != dim {
        bail!(
            "{} holds {written}-dimensional embeddings and {} embeds in {dim}: search with the checkpoint that wrote the index{}",
            index.display(),
            dir.display(),
            side.checkpoint.as_ref().map_or(String::new(), |c| format!(" ({})", c.display()))
        );
    }
    if let Some(c) = &side.checkpoint {
        if *c != canonical(dir) || side.ema != ema {
            let avg = |e: bool| if e { " (its moving average)" } else { "" };
            bail!(
                "{} was embedded with {}{}, not {}{}: search with the same checkpoint, or embed again",
                index.display(),
                c.display(),
                avg(side.ema),
                canonical(dir).display(),
                avg(ema)
            );
        }
    }
    Ok(())
}

fn to_tensor(e: &Embeddings) -> Result<Tensor> {
    Ok(Tensor::from_slice(&e.data, (e.rows(), e.dim), &Device::Cpu)?)
}

pub fn embed(a: &EmbedArgs) -> Result<()> {
    a.stall.apply()?;
    let device = super::default_device();
    let m = a.model.load(&device)?;
    let batch = a.batch.unwrap_or(align::eval::embed::auto_batch(m.spec()));
    let mut tensors = HashMap::new();
    let mut side = Sidecar {
        checkpoint: Some(canonical(&m.dir)),
        ema: a.model.ema,
        dim: Some(m.spec().embed_dim),
        precision: Some(m.precision.name().into()),
        ..Default::default()
    };
    match (&a.data, &a.texts) {
        (Some(d), _) => {
            let mut images = Embedder::of(&m, batch, &device, false)
                .pairs(EvalSource::Shards(spec::expand(d)?), Needs { image: true, captions: false, label: false })
                .with_context(|| format!("embedding with {}", m.dir.display()))?;
            for (i, caps) in images.captions.iter().enumerate() {
                for c in caps {
                    side.texts.push(c.clone());
                    side.text_image.push(Some(i));
                }
            }
            tensors.insert("image_embeddings".to_string(), to_tensor(&images.embeddings)?);
            if let Some(t) = images.caption_embeddings.take().filter(|t| !t.data.is_empty()) {
                tensors.insert("text_embeddings".to_string(), to_tensor(&t)?);
            }
            side.image_keys = images.keys;
            if !images.skipped.is_empty() {
                eprintln!("skipped: {}", images.skipped.summary());
            }
        }
        (None, Some(path)) => {
            side.texts = read_lines(path)?;
            side.text_image = vec![None; side.texts.len()];
        }
        (None, None) => bail!("give --data SPEC or --texts FILE"),
    }
    if !side.texts.is_empty() && !tensors.contains_key("text_embeddings") {
        let bar = Progress::bar(side.texts.len() as u64, "embedding texts", false);
        let t = embed_texts(&m.model, &m.tokenizer, &side.texts, batch, &device, |n| bar.inc(n as u64))
            .with_context(|| format!("embedding with {}", m.dir.display()))?;
        bar.finish();
        tensors.insert("text_embeddings".to_string(), to_tensor(&t)?);
    }
    if let Some(parent) = a.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    align::io::tensors::write_tensors(&tensors, &a.out)?;
    let sidecar = sidecar_path(&a.out);
    align::io::tensors::write_atomic(&sidecar, serde_json::to_string(&side)?.as_bytes())?;
    println!("{} images, {} texts → {} (+ {})", side.image_keys.len(), side.texts.len(), a.out.display(), sidecar_path(&a.out).display());
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    Images,
    Texts,
}

#[derive(Args)]
pub struct SearchArgs {
    /// An index written by `align embed`.
    #[arg(long)]
    pub index: PathBuf,
    /// The checkpoint the index was embedded with.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Use the weights' moving average the checkpoint holds (`train.ema_decay`).
    #[arg(long)]
    pub ema: bool,
    /// A text query.
    #[arg(long)]
    pub text: Option<String>,
    /// An image query (a file).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// With --image: add this text to the query.
    #[arg(long)]
    pub plus: Option<String>,
    /// With --image: subtract this text from the query.
    #[arg(long)]
    pub minus: Option<String>,
    /// Weight of the text in image ± text queries (ALIGN found 2 best, 1 also works).
    #[arg(long, default_value_t = 2.0)]
    pub text_weight: f32,
    /// What to search (default: images when the index has them).
    #[arg(long, value_enum)]
    pub target: Option<Target>,
    /// Hits to return.
    #[arg(short, long, default_value_t = 10)]
    pub k: usize,
    /// Print the result as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Hit {
    rank: usize,
    score: f32,
    row: usize,
    item: String,
}

fn normalise(v: &mut [f32]) {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= n);
}

/// `normalise(image + w·plus − w·minus)`, each part normalised first (ALIGN §7, footnote 4).
pub fn combine(image: &[f32], plus: Option<&[f32]>, minus: Option<&[f32]>, w: f32) -> Vec<f32> {
    let mut q = image.to_vec();
    normalise(&mut q);
    for (t, sign) in [(plus, 1.0f32), (minus, -1.0)] {
        if let Some(t) = t {
            let mut t = t.to_vec();
            normalise(&mut t);
            q.iter_mut().zip(&t).for_each(|(a, b)| *a += sign * w * b);
        }
    }
    normalise(&mut q);
    q
}

pub fn search(a: &SearchArgs) -> Result<()> {
    let device = super::default_device();
    let m = load_model_with(&a.checkpoint, &device, a.ema)?;
    let index = candle_core::safetensors::load(&a.index, &Device::Cpu).with_context(|| format!("reading {}", a.index.display()))?;
    let side: Sidecar = serde_json::from_str(
        &std::fs::read_to_string(sidecar_path(&a.index)).with_context(|| format!("reading {}", sidecar_path(&a.index).display()))?,
    )?;
    let text_vec = |t: &str| -> Result<Vec<f32>> { Ok(embed_texts(&m.model, &m.tokenizer, &[t.to_string()], 1, &device, |_| {})?.data) };
    let query = match (&a.text, &a.image) {
        (Some(t), None) => text_vec(t)?,
        (None, Some(path)) => {
            let cfg = &m.usage.image;
            let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            let img = decode(&bytes, align::data::transform::FULL_RESOLUTION, cfg.max_pixels, cfg.alpha)
                .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.detail))?;
            let mut pixels = vec![0.0; cfg.numel()];
            eval_transform(&img, cfg, &mut pixels);
            let image =
                embed_images(&m.model, &pixels, align::data::batch::ImageLayout::of(cfg), &device, &[path.to_string_lossy().as_ref()])?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
            let plus = a.plus.as_deref().map(text_vec).transpose()?;
            let minus = a.minus.as_deref().map(text_vec).transpose()?;
            combine(&image, plus.as_deref(), minus.as_deref(), a.text_weight)
        }
        _ => bail!("give exactly one of --text or --image"),
    };
    let target = a.target.unwrap_or(if index.contains_key("image_embeddings") { Target::Images } else { Target::Texts });
    let (name, labels): (&str, &Vec<String>) = match target {
        Target::Images => ("image_embeddings", &side.image_keys),
        Target::Texts => ("text_embeddings", &side.texts),
    };
    let matrix = index.get(name).with_context(|| format!("{} has no {name}", a.index.display()))?;
    check_same_model(&side, &a.index, &m.dir, a.ema, query.len(), matrix.dims().last().copied().unwrap_or(0))?;
    let scores = matrix.matmul(&Tensor::from_slice(&query, (query.len(), 1), &Device::Cpu)?)?.flatten_all()?.to_vec1::<f32>()?;
    let hits: Vec<Hit> = top_k(&scores, a.k)
        .into_iter()
        .enumerate()
        .map(|(rank, row)| Hit { rank: rank + 1, score: scores[row], row, item: labels.get(row).cloned().unwrap_or_default() })
        .collect();
    if a.json {
        return super::print_json(&hits);
    }
    for h in &hits {
        println!("{:>3}  {:.4}  {}", h.rank, h.score, h.item);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_plus_text_by_hand() {
        // image [1,0], text [0,3] normalised to [0,1]; weight 2 → [1,2] / √5.
        let q = combine(&[2.0, 0.0], Some(&[0.0, 3.0]), None, 2.0);
        let s5 = 5f32.sqrt();
        assert!((q[0] - 1.0 / s5).abs() < 1e-6 && (q[1] - 2.0 / s5).abs() < 1e-6);
        let q = combine(&[1.0, 1.0], None, Some(&[0.0, 1.0]), 1.0);
        // [1,1]/√2 − [0,1] = [0.707, -0.293], renormalised.
        let n = (0.5f32 + (0.70710677f32 - 1.0).powi(2)).sqrt();
        assert!((q[0] - 0.70710677 / n).abs() < 1e-5);
    }
}

#[derive(Args)]
pub struct ExportArgs {
    /// The model to export: an align checkpoint or run directory, or anything `--checkpoint`
    /// reads (a Hugging Face or open_clip folder, `hf:ORG/NAME`).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Use the weights' moving average the checkpoint holds (`train.ema_decay`).
    #[arg(long)]
    pub ema: bool,
    /// A new (or empty) directory to write. It is written beside itself and renamed into place
    /// when complete.
    #[arg(long)]
    pub out: PathBuf,
    /// `hf`: the Hugging Face layout of the model's towers (`AlignModel` for EfficientNet + BERT,
    /// `VisionTextDualEncoderModel` for ViT + BERT, `CLIPModel`, `SiglipModel`); `open_clip`:
    /// open_clip's `open_clip_config.json` + `open_clip_model.safetensors` (CLIP towers), for
    /// `open_clip.create_model_and_transforms("local-dir:DIR")` and CLIP_benchmark.
    #[arg(long, default_value = "hf")]
    pub format: String,
    /// Replace a non-empty `--out` whole (never a mix of old and new files).
    #[arg(long)]
    pub force: bool,
}

pub fn export(a: &ExportArgs) -> Result<()> {
    let m = load_model_with(&a.checkpoint, &Device::Cpu, a.ema)?;
    let format = align::io::registry::writer(&a.format, m.spec())?;
    align::io::registry::export::export(&m.files()?, format, &a.out, a.force)?;
    let how = if format.name() == "open_clip" {
        format!("open_clip.create_model_and_transforms(\"local-dir:{}\")", a.out.display())
    } else {
        format!("transformers.{}.from_pretrained and AutoProcessor.from_pretrained", format.name())
    };
    println!("wrote {} as {} (load it with {how})", a.out.display(), format.name());
    Ok(())
}
