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
use crate::model::dual_encoder::{forward_pass, DualEncoder};
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
    let values = forward_pass(device, || {
        model.image_embeddings(&x, &crate::model::Ctx::EVAL)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()
    })?;
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
    let dim = model.spec.embed_dim;
    let mut data = Vec::with_capacity(texts.len() * dim);
    // A tower that masks its padding gives the same embedding for a text whatever the batch
    // around it and however far it is padded on the right: a batch then runs as groups of
    // similar lengths, each cut to its longest (web captions are a fraction of the padded
    // length, and a batch's longest is well above its mean).
    let regroup = model.spec.text.masks_padding() && !tokenizer.pads_left();
    for chunk in texts.chunks(batch.max(1)) {
        let tb = tokenizer.encode_batch(chunk)?;
        let lens: Vec<usize> = tb.mask.chunks(tb.max_len.max(1)).map(|row| row.iter().filter(|&&m| m == 1).count().max(1)).collect();
        let groups = if regroup { length_groups(&lens, GROUP_COST) } else { vec![(0..chunk.len()).collect()] };
        let mut out = vec![0f32; chunk.len() * dim];
        for rows in groups {
            let width = if regroup { rows.iter().map(|&r| lens[r]).max().unwrap_or(1) } else { tb.max_len };
            let pick =
                |values: &[u32]| -> Vec<u32> { rows.iter().flat_map(|&r| values[r * tb.max_len..][..width].iter().copied()).collect() };
            let shape = (rows.len(), width);
            let ids = Tensor::from_vec(pick(&tb.ids), shape, device)?;
            let mask = Tensor::from_vec(pick(&tb.mask), shape, device)?;
            let e = forward_pass(device, || model.text_embeddings(&ids, &mask)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>())?;
            check_finite(&e, dim, |row| format!("text {:?}", chunk[rows[row]]))?;
            for (i, &r) in rows.iter().enumerate() {
                out[r * dim..(r + 1) * dim].copy_from_slice(&e[i * dim..(i + 1) * dim]);
            }
        }
        data.extend(out);
        progress(chunk.len());
    }
    Ok(Embeddings { data, dim })
}

/// What one more forward pass costs beside its tokens, in tokens: the weights are read (and for
/// bf16 and int8 products converted) once per pass, about as much work as a few dozen tokens'
/// products.
const GROUP_COST: usize = 32;

/// The rows of a batch (`lens`: each row's tokens) as groups of consecutive lengths, shortest
/// first, chosen to make the padded tokens (each group's rows × its longest) plus `cost` per
/// group least: an exact partition of the sorted lengths by dynamic programming.
fn length_groups(lens: &[usize], cost: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| (lens[i], i));
    let n = order.len();
    // best[j]: least cost of the first j sorted rows; cut[j]: where the last group of them starts.
    let (mut best, mut cut) = (vec![0usize; n + 1], vec![0usize; n + 1]);
    for j in 1..=n {
        let longest = lens[order[j - 1]];
        (best[j], cut[j]) = (0..j).map(|i| (best[i] + (j - i) * longest + cost, i)).min().expect("j > 0");
    }
    let mut groups = Vec::new();
    let mut j = n;
    while j > 0 {
        groups.push(order[cut[j]..j].to_vec());
        j = cut[j];
    }
    groups.reverse();
    groups
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
        with_images(self.embed(source, needs, false, None)?)
    }

    /// [`Embedder::images`] with each batch's captions embedded right after its images, while the
    /// reader prepares the next batch: images and texts go through the towers interleaved, and
    /// neither waits for all of the other.
    pub fn pairs(&self, source: EvalSource, needs: Needs) -> Result<EmbeddedImages> {
        with_images(self.embed(source, needs, true, None)?)
    }

    /// [`Embedder::pairs`] on the source's first `batches` batches only, the embeddings dropped:
    /// a benchmark's untimed warm-up, after which the weights' packed forms and the working
    /// memory of a batch exist, as they do for every batch after the first in a long run.
    pub fn warm_up(&self, source: EvalSource, needs: Needs, batches: usize) -> Result<()> {
        if batches > 0 {
            self.embed(source, needs, true, Some(batches))?;
        }
        Ok(())
    }

    /// [`Embedder::pairs`] without the error for data that holds no usable image (a shard of a
    /// corpus may have none; the corpus's report counts why).
    pub fn pairs_of_part(&self, source: EvalSource, needs: Needs) -> Result<EmbeddedImages> {
        self.embed(source, needs, true, None)
    }

    /// The source's batches embedded, or only its first `batches`.
    fn embed(&self, source: EvalSource, needs: Needs, with_texts: bool, batches: Option<usize>) -> Result<EmbeddedImages> {
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
        for b in reader.by_ref().take(batches.unwrap_or(usize::MAX)) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer::train_wordpiece;
    use crate::model::dual_encoder::TextSpec;
    use crate::model::init::SeededVars;

    fn padded_cost(lens: &[usize], groups: &[Vec<usize>], cost: usize) -> usize {
        groups.iter().map(|g| g.len() * g.iter().map(|&i| lens[i]).max().unwrap() + cost).sum()
    }

    /// Against every way of cutting the sorted lengths into runs (2ⁿ⁻¹ of them), on seeded
    /// batches: the groups hold each row once, are runs of the sorted order, and cost the least.
    #[test]
    fn length_groups_are_the_cheapest_partition_of_the_sorted_lengths() {
        let mut rng = crate::util::rng::Rng::new(7);
        for case in 0..200 {
            let n = 1 + case % 10;
            let lens: Vec<usize> = (0..n).map(|_| 1 + (rng.next_u64() % 30) as usize).collect();
            let cost = [0, 4, 32, 1000][case % 4];
            let groups = length_groups(&lens, cost);
            let mut seen: Vec<usize> = groups.concat();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "{lens:?}");
            let mut sorted = lens.clone();
            sorted.sort_unstable();
            let brute = (0..1usize << (n - 1))
                .map(|cuts| {
                    let (mut total, mut start) = (0, 0);
                    for j in 1..=n {
                        if j == n || cuts >> (j - 1) & 1 == 1 {
                            total += (j - start) * sorted[j - 1] + cost;
                            start = j;
                        }
                    }
                    total
                })
                .min()
                .unwrap();
            assert_eq!(padded_cost(&lens, &groups, cost), brute, "{lens:?} at cost {cost}");
        }
        // Equal lengths stay one pass; a prohibitive cost keeps the batch whole.
        assert_eq!(length_groups(&[5, 5, 5], 32).len(), 1);
        assert_eq!(length_groups(&[1, 2, 30, 3], 1_000_000).len(), 1);
        assert!(length_groups(&[], 32).is_empty());
    }

    /// A batch run as length groups gives every text the embedding it has alone, in the batch's
    /// order.
    #[test]
    fn regrouped_batches_embed_each_text_as_it_is_alone() {
        let dev = Device::Cpu;
        let mut spec = crate::model::dual_encoder::tests::tiny_spec();
        if let TextSpec::Bert(c) = &mut spec.text {
            c.vocab_size = 200;
        }
        let vm = candle_nn::VarMap::new();
        let model = DualEncoder::new(&spec, SeededVars::builder(&vm, 11, &dev)).unwrap();
        assert!(model.spec.text.masks_padding());
        let texts: Vec<String> = [
            "a dog",
            "a photo of a small red car parked by the river at night",
            "cat",
            "two people walking on the beach",
            "a photo of thing",
            "an old map of the city with many streets and a river",
            "sky",
        ]
        .iter()
        .cycle()
        .take(28)
        .map(|s| s.to_string())
        .collect();
        let tok = TextTokenizer::new(train_wordpiece(texts.iter(), 200, true, 1).unwrap(), 16).unwrap();
        let lens: Vec<usize> = texts.iter().map(|t| tok.encode_batch(&[t]).unwrap().mask.iter().filter(|&&m| m == 1).count()).collect();
        assert!(length_groups(&lens, GROUP_COST).len() > 1, "{lens:?}");
        let batched = embed_texts(&model, &tok, &texts, 28, &dev, |_| {}).unwrap();
        for (i, t) in texts.iter().enumerate().take(7) {
            let alone = embed_texts(&model, &tok, std::slice::from_ref(t), 1, &dev, |_| {}).unwrap();
            let row = &batched.data[i * batched.dim..(i + 1) * batched.dim];
            let diff = row.iter().zip(&alone.data).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-6, "text {i} {t:?}: {diff}");
        }
    }
}
