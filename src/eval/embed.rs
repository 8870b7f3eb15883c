//! Turning images and texts into embedding matrices with a model, batch by batch.
//!
//! An embedding that is not finite is an error naming the first sample that gave one: a NaN
//! compares false with everything, so ranks and accuracies computed from it would come out as
//! perfect scores instead of failing.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

use super::metrics::Embeddings;
use crate::data::eval_reader::{EvalReader, EvalSource, Needs};
use crate::data::skips::SkipCounts;
use crate::data::tokenizer::TextTokenizer;
use crate::data::transform::ImageConfig;
use crate::model::dual_encoder::DualEncoder;
use crate::util::progress::Progress;

/// Embeds `n` preprocessed images (`n × 3 × S × S` floats); `names` names them in an error.
pub fn embed_images(model: &DualEncoder, pixels: &[f32], image_size: usize, device: &Device, names: &[&str]) -> Result<Tensor> {
    let per = 3 * image_size * image_size;
    let n = pixels.len() / per;
    let x = Tensor::from_slice(pixels, (n, 3, image_size, image_size), &Device::Cpu)?.to_device(device)?;
    let e = model.image_embeddings(&x, &crate::model::Ctx::EVAL)?.to_device(&Device::Cpu)?;
    let values = e.flatten_all()?.to_vec1::<f32>()?;
    check_finite(&values, model.spec.embed_dim, |row| format!("image {}", names.get(row).copied().unwrap_or("?")))?;
    Ok(e)
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
        let shape = (chunk.len(), tb.max_len);
        let ids = Tensor::from_vec(tb.ids, shape, device)?;
        let mask = Tensor::from_vec(tb.mask, shape, device)?;
        let e = model.text_embeddings(&ids, &mask)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        check_finite(&e, model.spec.embed_dim, |row| format!("text {:?}", chunk[row]))?;
        data.extend(e);
        progress(chunk.len());
    }
    Ok(Embeddings { data, dim: model.spec.embed_dim })
}

/// The images of a data source embedded, in the data's order, with what came with them.
pub struct EmbeddedImages {
    pub embeddings: Embeddings,
    pub keys: Vec<String>,
    pub captions: Vec<Vec<String>>,
    pub labels: Vec<Option<i64>>,
    pub skipped: SkipCounts,
}

pub fn embed_source(
    model: &DualEncoder,
    source: EvalSource,
    image_cfg: &ImageConfig,
    needs: Needs,
    batch: usize,
    device: &Device,
    quiet: bool,
) -> Result<EmbeddedImages> {
    let mut reader = EvalReader::from_source(source, image_cfg.clone(), Needs { image: true, ..needs }, batch);
    let bar = Progress::spinner("embedding images", quiet);
    let mut out = EmbeddedImages {
        embeddings: Embeddings { data: Vec::new(), dim: model.spec.embed_dim },
        keys: Vec::new(),
        captions: Vec::new(),
        labels: Vec::new(),
        skipped: SkipCounts::default(),
    };
    for items in reader.by_ref() {
        let pixels: Vec<f32> = items.iter().flat_map(|it| it.image.iter().copied()).collect();
        let names: Vec<&str> = items.iter().map(|it| it.key.as_str()).collect();
        let e = embed_images(model, &pixels, image_cfg.image_size, device, &names)?;
        out.embeddings.data.extend(e.flatten_all()?.to_vec1::<f32>()?);
        for it in items {
            out.keys.push(it.key);
            out.captions.push(it.captions);
            out.labels.push(it.label);
        }
        bar.set_position(out.keys.len() as u64);
    }
    bar.finish();
    out.skipped = reader.skips().clone();
    if out.keys.is_empty() {
        bail!("no usable image (skipped: {})", out.skipped.summary());
    }
    Ok(out)
}
