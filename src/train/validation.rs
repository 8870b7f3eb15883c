//! The training loss on held-out pairs (`eval.validation`, open_clip's `--val-data`): every image
//! of the shards with its first caption, embedded by the model as it stands, in batches of
//! `eval.validation_batch` pairs whose other pairs are the negatives; each batch's loss is the
//! training loss's (softmax: image→text + text→image with the run's label smoothing; sigmoid: the
//! pairwise sigmoid loss with the model's scale and bias), and the result is their mean weighted
//! by batch size. Like open_clip's validation loss it depends on the batch size: compare runs at
//! the same `eval.validation_batch`.

use std::sync::Arc;

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};

use super::collective::{Collective, SingleProcess};
use super::loss::contrastive_loss;
use super::sigmoid_loss::sigmoid_loss;
use crate::config::{Config, Exchange, LossKind};
use crate::data::eval_reader::{EvalSource, Needs};
use crate::data::spec;
use crate::data::tokenizer::TextTokenizer;
use crate::eval::embed::Embedder;
use crate::eval::periodic::ValidationLoss;
use crate::model::dual_encoder::DualEncoder;

/// The validation loss of `model` on `cfg.eval.validation`.
pub fn run(model: &DualEncoder, tokenizer: &TextTokenizer, cfg: &Config, device: &Device) -> Result<ValidationLoss> {
    let shards = spec::expand(&cfg.eval.validation)?;
    // A held-out set is read whole or not at all: a validation loss over part of it would not
    // compare with the last one.
    for shard in &shards {
        if let crate::data::spec::ShardSource::File(path) = shard {
            let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            ensure!(len > 0, "eval.validation: {} is empty (0 bytes): the held-out set is damaged", path.display());
        }
    }
    let source = EvalSource::Shards(shards);
    let needs = Needs { image: true, captions: true, label: false };
    let embedder = Embedder { model, tokenizer, image: &cfg.data.image, batch: cfg.eval.batch_size, device, quiet: true };
    let e = embedder.pairs(source, needs)?;
    let texts = e.caption_embeddings.as_ref().expect("pairs embeds the captions");
    let dim = e.embeddings.dim;
    let mut first = Vec::with_capacity(e.captions.len() * dim);
    let mut at = 0;
    for caps in &e.captions {
        first.extend_from_slice(&texts.data[at * dim..(at + 1) * dim]);
        at += caps.len();
    }
    let pairs = e.captions.len();
    ensure!(pairs > 1, "eval.validation {} has {pairs} usable pair(s): a contrastive loss needs two or more", cfg.eval.validation);
    let images = Tensor::from_slice(&e.embeddings.data, (pairs, dim), &Device::Cpu)?;
    let captions = Tensor::from_vec(first, (pairs, dim), &Device::Cpu)?;
    let scale = model.logit_scale()?.to_device(&Device::Cpu)?;
    let bias = model.logit_bias()?.map(|b| b.to_device(&Device::Cpu)).transpose()?;
    let single: Arc<dyn Collective> = Arc::new(SingleProcess);
    let batch = cfg.eval.validation_batch;
    let (mut loss, mut i2t, mut t2i) = (0.0, 0.0, 0.0);
    let mut start = 0;
    while start < pairs {
        // A last batch of one pair has no negatives: it joins the batch before it.
        let mut n = batch.min(pairs - start);
        if pairs - start - n == 1 {
            n += 1;
        }
        let (img, txt) = (images.narrow(0, start, n)?, captions.narrow(0, start, n)?);
        let parts = match (cfg.loss.kind, &bias) {
            (LossKind::Sigmoid, Some(b)) => sigmoid_loss(&img, &txt, &scale, b, &single, Exchange::Gather)?,
            _ => {
                let parts = contrastive_loss(&img, &txt, &img, &txt, 0, &scale, cfg.loss.label_smoothing)?;
                if cfg.loss.directions == crate::config::Directions::Mean {
                    parts.mean_of_directions()?
                } else {
                    parts
                }
            }
        };
        let value = |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?) };
        let w = n as f64 / pairs as f64;
        loss += w * value(&parts.total)?;
        i2t += w * value(&parts.i2t)?;
        t2i += w * value(&parts.t2i)?;
        start += n;
    }
    Ok(ValidationLoss { loss, i2t, t2i, pairs, batch })
}
