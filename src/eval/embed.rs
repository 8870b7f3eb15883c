//! Turning images and texts into embedding matrices with a model, batch by batch.
//!
//! An embedding that is not finite is an error naming the first sample that gave one: a NaN
//! compares false with everything, so ranks and accuracies computed from it would come out as
//! perfect scores instead of failing.

use crate::data::batch::ImageLayout;
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

use super::metrics::Embeddings;
use crate::data::eval_reader::{EvalReader, EvalSource, Needs};
use crate::data::skips::SkipCounts;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::io::load::LoadedModel;
use crate::model::dual_encoder::DualEncoder;
use crate::util::progress::Progress;

/// The forward-only batch for a model: 64 images (and texts), the fastest measured on the CPU
/// for ViT-B/32, ViT-B/16 and BERT-base, in less memory than PyTorch at the same batch; 32 for
/// an EfficientNet at 256 px or more, whose early expanded activations take 10+ MB per image
/// (B3 at 300 px ran as fast at 32 as at 64, in 2.8 GB against 4.5 GB; BENCHMARKS.md).
pub fn auto_batch(spec: &crate::model::dual_encoder::ModelSpec) -> usize {
    match &spec.image {
        crate::model::dual_encoder::ImageSpec::EfficientNet(e) if e.image_size >= 256 => 32,
        _ => 64,
    }
}

/// Embeds `n` preprocessed images (`n × numel` floats, laid out as `image`); `names` names them
/// in an error.
pub fn embed_images(model: &DualEncoder, pixels: &[f32], image: ImageLayout, device: &Device, names: &[&str]) -> Result<Tensor> {
    embed_pixels(model, pixels.to_vec(), image, device, names).and_then(|v| {
        let n = v.len() / model.spec.embed_dim.max(1);
        Ok(Tensor::from_vec(v, (n, model.spec.embed_dim), &Device::Cpu)?)
    })
}

/// The embeddings (row-major) of a batch buffer of preprocessed images, which becomes the input
/// tensor without a copy.
fn embed_pixels(model: &DualEncoder, pixels: Vec<f32>, image: ImageLayout, device: &Device, names: &[&str]) -> Result<Vec<f32>> {
    let n = pixels.len() / image.numel;
    let x = image.tensor(pixels, n, &Device::Cpu)?.to_device(device)?;
    let values = model.image_embeddings(&x, &crate::model::Ctx::EVAL)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    check_finite(&values, model.spec.embed_dim, |row| format!("image {}", names.get(row).copied().unwrap_or("?")))?;
    Ok(values)
}

/// Fails on the first row of `values` (rows of `dim`) holding NaN or ±inf, naming it.
pub fn check_finite(values: &[f32], dim: usize, name: impl Fn(usize) -> String) -> Result<()> {
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        let row = i / dim.max(1);
        bail!(
            "the embedding of {} is not finite ({}): the model's weights (or this input) give NaN or infinity, so no score is computed from it",
            name(row),
            values[i]
        );
    }
    Ok(())
}

/// Embeds texts in batches of `batch`, calling `progress` with the count done.
pub fn embed_texts(
    model: &DualEncoder,
    tokenizer: &TextTokenizer,
    texts: &[String],
    batch: usize,
    device: &Device,
    mut progress: impl FnMut(usize),
) -> Result<Embeddings> {
    let mut data = Vec::with_capacity(texts.len() * model.spec.embed_dim);
    for chunk in texts.chunks(batch.max(1)) {
        let tb = tokenizer.encode_batch(chunk)?;
        // A tower that masks its padding gives the same embeddings for a batch cut to its longest
        // text; web captions are a fraction of the padded length.
        let width = if model.spec.text.masks_padding() { longest(&tb.mask, tb.max_len) } else { tb.max_len };
        let (ids, mask) = (narrow_rows(&tb.ids, tb.max_len, width), narrow_rows(&tb.mask, tb.max_len, width));
        let shape = (chunk.len(), width);
        let ids = Tensor::from_vec(ids, shape, device)?;
        let mask = Tensor::from_vec(mask, shape, device)?;
        let e = model.text_embeddings(&ids, &mask)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        check_finite(&e, model.spec.embed_dim, |row| format!("text {:?}", chunk[row]))?;
        data.extend(e);
        progress(chunk.len());
    }
    Ok(Embeddings { data, dim: model.spec.embed_dim })
}

/// The length of the longest row of a padding mask (`rows × width`, ones then zeros).
fn longest(mask: &[u32], width: usize) -> usize {
    mask.chunks(width.max(1)).map(|row| row.iter().filter(|&&m| m == 1).count()).max().unwrap_or(0).max(1)
}

/// The first `keep` columns of each row of a `rows × width` matrix.
fn narrow_rows(values: &[u32], width: usize, keep: usize) -> Vec<u32> {
    if keep == width {
        return values.to_vec();
    }
    values.chunks(width.max(1)).flat_map(|row| row[..keep].iter().copied()).collect()
}

/// The images of a data source embedded, in the data's order, with what came with them.
pub struct EmbeddedImages {
    pub embeddings: Embeddings,
    pub keys: Vec<String>,
    pub captions: Vec<Vec<String>>,
    pub labels: Vec<Option<i64>>,
    pub skipped: SkipCounts,
    /// The captions' embeddings, every caption of every image in order, when asked for
    /// ([`Embedder::pairs`]).
    pub caption_embeddings: Option<Embeddings>,
}

/// How a model embeds a data source: its towers and tokenizer, the image preprocessing, the
/// batch, the device, and whether progress is shown.
#[derive(Clone, Copy)]
pub struct Embedder<'a> {
    pub model: &'a DualEncoder,
    pub tokenizer: &'a TextTokenizer,
    pub image: &'a ImageConfig,
    pub batch: usize,
    pub device: &'a Device,
    pub quiet: bool,
}

impl<'a> Embedder<'a> {
    /// A loaded checkpoint's model, tokenizer and preprocessing.
    pub fn of(m: &'a LoadedModel, batch: usize, device: &'a Device, quiet: bool) -> Embedder<'a> {
        Embedder { model: &m.model, tokenizer: &m.tokenizer, image: &m.usage.image, batch, device, quiet }
    }

    /// The source's images embedded; an evaluation set must hold a usable one.
    pub fn images(&self, source: EvalSource, needs: Needs) -> Result<EmbeddedImages> {
        with_images(self.embed(source, needs, false)?)
    }

    /// [`Embedder::images`] with each batch's captions embedded right after its images, while the
    /// reader prepares the next batch: images and texts go through the towers interleaved, and
    /// neither waits for all of the other.
    pub fn pairs(&self, source: EvalSource, needs: Needs) -> Result<EmbeddedImages> {
        with_images(self.embed(source, needs, true)?)
    }

    /// [`Embedder::pairs`] without the error for data that holds no usable image (a shard of a
    /// corpus may have none; the corpus's report counts why).
    pub fn pairs_of_part(&self, source: EvalSource, needs: Needs) -> Result<EmbeddedImages> {
        self.embed(source, needs, true)
    }

    fn embed(&self, source: EvalSource, needs: Needs, with_texts: bool) -> Result<EmbeddedImages> {
        let (model, batch, device) = (self.model, self.batch, self.device);
        let total = match &source {
            EvalSource::Files(f) => Some(f.len() as u64),
            EvalSource::Shards(_) => None,
        };
        let mut reader = EvalReader::from_source(source, self.image.clone(), Needs { image: true, ..needs }, batch);
        let bar = match total {
            Some(n) => Progress::bar(n, "embedding images", self.quiet),
            None => Progress::spinner("embedding images", self.quiet),
        };
        let dim = model.spec.embed_dim;
        let mut out = EmbeddedImages {
            embeddings: Embeddings { data: Vec::new(), dim },
            keys: Vec::new(),
            captions: Vec::new(),
            labels: Vec::new(),
            skipped: SkipCounts::default(),
            caption_embeddings: with_texts.then(|| Embeddings { data: Vec::new(), dim }),
        };
        for b in reader.by_ref() {
            let names: Vec<&str> = b.items.iter().map(|it| it.key.as_str()).collect();
            out.embeddings.data.extend(embed_pixels(model, b.pixels, ImageLayout::of(self.image), device, &names)?);
            if let Some(texts) = out.caption_embeddings.as_mut() {
                let captions: Vec<String> = b.items.iter().flat_map(|it| it.captions.iter().cloned()).collect();
                texts.data.extend(embed_texts(model, self.tokenizer, &captions, batch, device, |_| {})?.data);
            }
            for it in b.items {
                out.keys.push(it.key);
                out.captions.push(it.captions);
                out.labels.push(it.label);
            }
            bar.set_position(out.keys.len() as u64);
        }
        bar.finish();
        out.skipped = reader.skips().clone();
        Ok(out)
    }
}

/// An evaluation set must hold a usable image.
fn with_images(out: EmbeddedImages) -> Result<EmbeddedImages> {
    if out.keys.is_empty() {
        bail!("no usable image (skipped: {})", out.skipped.summary());
    }
    Ok(out)
}
