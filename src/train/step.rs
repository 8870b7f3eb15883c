//! One optimisation step's gradients: forward, the gathered loss, backward, and the data-parallel
//! all-reduce. With several micro-batches it accumulates without losing negatives (GradCache,
//! Gao et al. 2021; open_clip's `--accum-freq`):
//! 1. embed every micro-batch without gradient (BatchNorm statistics not updated);
//! 2. compute the loss over all of them (and over every rank) and its gradient with respect to
//!    the cached embeddings;
//! 3. re-run each micro-batch with gradient and back-propagate its cached embedding gradient.
//!
//! The parameter gradients equal those of one batch holding every micro-batch; only one
//! micro-batch's activations are alive at a time.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, Var};

use super::collective::Collective;
use super::distill_loss::{distill_loss, DistillLoss, TeacherLogits};
use super::gather::{distributed_loss, gradient_scale, row_counts, row_offset, GatherOptions};
use super::loss::LossParts;
use super::optim::{Grads, Optimizer};
use super::sigmoid_loss::{sigmoid_loss, Exchange};
use crate::config::LossKind;
use crate::model::dual_encoder::DualEncoder;
use crate::model::{Ctx, Masking};
use crate::util::rng::derive_seed;

/// Tags the patch-dropout stream apart from the micro-batches' stochastic-depth seeds.
const PATCH_DROPOUT_STREAM: u64 = u64::MAX;

pub struct MicroBatch {
    pub images: Tensor,
    pub ids: Tensor,
    pub mask: Tensor,
    /// A distillation teacher's rows for the same samples.
    pub teacher: Option<TeacherMicro>,
}

/// A micro-batch's teacher side: its inputs for an online teacher, or its stored embeddings.
pub enum TeacherMicro {
    Inputs { images: Tensor, ids: Tensor, mask: Tensor },
    Embeddings { image: Tensor, text: Tensor },
}

/// Distillation in a step (`train::distill_loss`): the online teacher (None when the batches
/// bring stored embeddings), its logit scale and bias, and how its loss joins the contrastive one.
pub struct Distill<'a> {
    pub teacher: Option<&'a DualEncoder>,
    pub logits: TeacherLogits,
    pub weight: f64,
    pub contrastive: bool,
    pub kind: DistillLoss,
    /// The online teacher's large products in bf16.
    pub bf16: bool,
}

impl Distill<'_> {
    /// The teacher's embeddings of a micro-batch's samples, constants of the student's graph.
    fn embeddings(&self, m: &MicroBatch) -> Result<(Tensor, Tensor)> {
        match (&m.teacher, self.teacher) {
            (Some(TeacherMicro::Inputs { images, ids, mask }), Some(t)) => {
                let _profile = crate::util::profile::region("forward/teacher");
                let embed = || -> Result<(Tensor, Tensor)> {
                    Ok((t.image_embeddings(images, &Ctx::EVAL)?.detach(), t.text_embeddings(ids, mask)?.detach()))
                };
                if self.bf16 {
                    crate::ops::kernels::bf16_gemm::with_bf16_products(embed)
                } else {
                    crate::ops::kernels::bf16_gemm::with_f32_products(embed)
                }
            }
            (Some(TeacherMicro::Embeddings { image, text }), _) => Ok((image.clone(), text.clone())),
            _ => candle_core::bail!("a distillation step's batch came without its teacher's rows"),
        }
    }
}

pub struct StepOutput {
    /// The global batch's loss and its two halves, identical on every rank.
    pub loss: f64,
    pub i2t: f64,
    pub t2i: f64,
    /// All-reduced and scaled: the gradient of the global batch's loss.
    pub grads: Grads,
    /// Pairs in the global batch (ranks may hold different batches).
    pub pairs: u64,
    /// The distillation loss of the global batch (unweighted), when the step distils.
    pub distill: Option<f64>,
}

/// The loss a step differentiates, with its distribution settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepLoss {
    /// ALIGN's softmax loss over gathered embeddings.
    Softmax { opts: GatherOptions, smoothing: f64, mean: bool },
    /// SigLIP's sigmoid loss, texts exchanged as `exchange` says.
    Sigmoid { exchange: Exchange },
}

impl StepLoss {
    pub fn from_config(cfg: &crate::config::Config) -> StepLoss {
        match cfg.loss.kind {
            LossKind::Softmax => StepLoss::Softmax {
                opts: GatherOptions { gather_with_grad: cfg.train.gather_with_grad, local_loss: cfg.train.local_loss },
                smoothing: cfg.loss.label_smoothing,
                mean: cfg.loss.directions == crate::config::Directions::Mean,
            },
            LossKind::Sigmoid => StepLoss::Sigmoid { exchange: cfg.loss.dist_impl },
        }
    }

    /// Whether each rank's value is its share of the loss (averaged over ranks to report).
    fn per_rank_share(self) -> bool {
        match self {
            StepLoss::Softmax { opts, .. } => opts.local_loss,
            StepLoss::Sigmoid { .. } => true,
        }
    }

    /// The factor the summed parameter gradients are multiplied by.
    fn gradient_scale(self, world: usize) -> f64 {
        match self {
            StepLoss::Softmax { opts, .. } => gradient_scale(opts, world),
            StepLoss::Sigmoid { .. } => 1.0 / world as f64,
        }
    }

    fn loss(self, model: &DualEncoder, img: &Tensor, txt: &Tensor, group: &Arc<dyn Collective>) -> Result<LossParts> {
        match self {
            StepLoss::Softmax { opts, smoothing, mean } => {
                let parts = distributed_loss(img, txt, &model.logit_scale()?, smoothing, group, opts)?;
                Ok(if mean { parts.mean_of_directions()? } else { parts })
            }
            StepLoss::Sigmoid { exchange } => {
                let bias = model
                    .logit_bias()?
                    .ok_or_else(|| candle_core::Error::Msg("the sigmoid loss needs a model with a logit bias".into()))?;
                sigmoid_loss(img, txt, &model.logit_scale()?, &bias, group, exchange)
            }
        }
    }
}

/// The step's reported loss: when each rank holds its share, average over ranks.
fn global_values(parts: &LossParts, group: &Arc<dyn Collective>, loss: StepLoss) -> Result<[f64; 3]> {
    let v =
        Tensor::stack(&[parts.total.to_dtype(DType::F64)?, parts.i2t.to_dtype(DType::F64)?, parts.t2i.to_dtype(DType::F64)?], 0)?.detach();
    let v = if loss.per_rank_share() { group.all_reduce_mean(&v)? } else { v };
    let v: Vec<f64> = v.to_vec1()?;
    Ok([v[0], v[1], v[2]])
}

/// What a step differentiates: the contrastive loss (unless distillation alone is asked for) plus
/// the weighted distillation loss against the teacher's embeddings `teacher`; and the values it
/// reports (loss, its halves, the distillation loss), identical on every rank.
fn objective(
    model: &DualEncoder,
    img: &Tensor,
    txt: &Tensor,
    teacher: Option<(&Tensor, &Tensor)>,
    group: &Arc<dyn Collective>,
    loss_kind: StepLoss,
    distill: Option<&Distill>,
) -> Result<(Tensor, [f64; 3], Option<f64>)> {
    let mut total = None;
    let mut values = [0.0; 3];
    if distill.is_none_or(|d| d.contrastive) {
        let parts = loss_kind.loss(model, img, txt, group)?;
        values = global_values(&parts, group, loss_kind)?;
        total = Some(parts.total);
    }
    let mut distilled = None;
    if let (Some(d), Some((t_img, t_txt))) = (distill, teacher) {
        let bias = match loss_kind {
            StepLoss::Sigmoid { .. } => model.logit_bias()?,
            StepLoss::Softmax { .. } => None,
        };
        let share = distill_loss(img, txt, t_img, t_txt, &model.logit_scale()?, bias.as_ref(), d.logits, d.kind, group)?;
        let value = group.all_reduce_mean(&share.to_dtype(DType::F64)?.detach())?.to_scalar::<f64>()?;
        distilled = Some(value);
        values[0] += d.weight * value;
        // The share's gradients averaged over ranks are exact; the step scales the summed
        // gradients by the contrastive loss's factor instead.
        let world = group.world_size();
        let part = (share * (d.weight / (world as f64 * loss_kind.gradient_scale(world))))?;
        total = Some(match total {
            Some(t) => (&t + part.to_dtype(t.dtype())?)?,
            None => part,
        });
    }
    let total = total.ok_or_else(|| candle_core::Error::Msg("a step with neither a contrastive nor a distillation loss".into()))?;
    Ok((total, values, distilled))
}

/// The parameter gradients of one backward pass: the loss's own store plus those of the blocks
/// that activation checkpointing recomputed during it.
pub fn backward(model: &DualEncoder, opt: &Optimizer, loss: &Tensor) -> Result<Grads> {
    let store = crate::model::recompute::detached(crate::util::profile::timed("backward", || loss.backward())?);
    let mut grads = opt.gather(&store);
    for g in model.take_checkpoint_grads() {
        grads.accumulate(opt.gather(&g))?;
    }
    Ok(grads)
}

/// The gradients of one optimisation step over `micro` (this rank's micro-batches), `seed` drawing
/// the step's stochastic depth and, with `patch_dropout`, the patches each image keeps.
pub fn compute(
    model: &DualEncoder,
    opt: &Optimizer,
    micro: &[MicroBatch],
    group: &Arc<dyn Collective>,
    loss_kind: StepLoss,
    seed: u64,
    patch_dropout: bool,
) -> Result<StepOutput> {
    compute_with(model, opt, micro, group, loss_kind, seed, patch_dropout, None)
}

/// [`compute`], distilling from a teacher when `distill` says so.
#[allow(clippy::too_many_arguments)]
pub fn compute_with(
    model: &DualEncoder,
    opt: &Optimizer,
    micro: &[MicroBatch],
    group: &Arc<dyn Collective>,
    loss_kind: StepLoss,
    seed: u64,
    patch_dropout: bool,
    distill: Option<&Distill>,
) -> Result<StepOutput> {
    let scale = loss_kind.gradient_scale(group.world_size());
    // Rows are numbered as in the global batch (rank-major, then micro-batch), so an image keeps
    // the same patches however the batch is split.
    let sizes: Vec<usize> = micro.iter().map(|m| m.images.dim(0)).collect::<Result<_>>()?;
    let counts = row_counts(sizes.iter().sum(), group)?;
    let pairs = counts.iter().sum::<usize>() as u64;
    let first_rows: Vec<u64> =
        sizes.iter().scan(row_offset(&counts, group.rank()) as u64, |row, &n| Some(std::mem::replace(row, *row + n as u64))).collect();
    let masking_seed = derive_seed(seed, &[PATCH_DROPOUT_STREAM]);
    let ctx = |k: usize| Ctx {
        masking: patch_dropout.then_some(Masking { seed: masking_seed, first_row: first_rows[k] }),
        ..Ctx::train(derive_seed(seed, &[k as u64]))
    };
    if micro.len() == 1 {
        let m = &micro[0];
        let teacher = distill.map(|d| d.embeddings(m)).transpose()?;
        let img = model.image_embeddings(&m.images, &ctx(0))?;
        let txt = model.text_embeddings(&m.ids, &m.mask)?;
        let (total, [loss, i2t, t2i], distilled) =
            objective(model, &img, &txt, teacher.as_ref().map(|(a, b)| (a, b)), group, loss_kind, distill)?;
        let grads = backward(model, opt, &total)?;
        let grads = crate::util::profile::timed("all-reduce", || opt.reduce_gradients(grads, group, scale))?;
        return Ok(StepOutput { loss, i2t, t2i, grads, pairs, distill: distilled });
    }

    // 1. Embeddings of every micro-batch, no graph kept.
    let mut imgs = Vec::with_capacity(micro.len());
    let mut txts = Vec::with_capacity(micro.len());
    for (k, m) in micro.iter().enumerate() {
        let c = Ctx { update_stats: false, ..ctx(k) };
        imgs.push(model.image_embeddings(&m.images, &c)?.detach());
        txts.push(model.text_embeddings(&m.ids, &m.mask)?.detach());
    }
    // 2. The loss over the accumulated (and gathered) batch, differentiated to the embeddings.
    let img_all = Var::from_tensor(&Tensor::cat(&imgs, 0)?)?;
    let txt_all = Var::from_tensor(&Tensor::cat(&txts, 0)?)?;
    let teacher = match distill {
        Some(d) => {
            let (ti, tt): (Vec<Tensor>, Vec<Tensor>) =
                micro.iter().map(|m| d.embeddings(m)).collect::<Result<Vec<_>>>()?.into_iter().unzip();
            Some((Tensor::cat(&ti, 0)?, Tensor::cat(&tt, 0)?))
        }
        None => None,
    };
    let (total, [loss, i2t, t2i], distilled) =
        objective(model, img_all.as_tensor(), txt_all.as_tensor(), teacher.as_ref().map(|(a, b)| (a, b)), group, loss_kind, distill)?;
    let loss_grads = crate::util::profile::timed("backward", || total.backward())?;
    // The loss's own parameters' gradients (temperature, bias) join the first micro-batch's.
    let mut pending = Some(opt.gather(&loss_grads));
    // Sharded gradients: each micro-batch's reduced to the owners at once, so the accumulated
    // gradient is only this rank's part (its sums then add micro-batches of summed ranks rather
    // than ranks of summed micro-batches: the same sum in another order).
    let each = opt.reduces_each_micro_batch();
    let mut grads: Option<Grads> = None;
    // Detached: a gradient tensor keeps the graph it was computed through (the gathered
    // embeddings included), which the micro-batches' backward passes must not walk again.
    let d_img = loss_grads.get(img_all.as_tensor()).map(|d| d.detach());
    let d_txt = loss_grads.get(txt_all.as_tensor()).map(|d| d.detach());
    // 3. Each micro-batch again, with gradient, pulled by its cached embedding gradient.
    let mut row = 0;
    for (k, m) in micro.iter().enumerate() {
        let n = m.images.dim(0)?;
        let img = model.image_embeddings(&m.images, &ctx(k))?;
        let txt = model.text_embeddings(&m.ids, &m.mask)?;
        let mut surrogate = Tensor::zeros((), img.dtype(), img.device())?;
        if let Some(d) = &d_img {
            surrogate = (surrogate + (img * d.narrow(0, row, n)?)?.sum_all()?)?;
        }
        if let Some(d) = &d_txt {
            surrogate = (surrogate + (txt * d.narrow(0, row, n)?)?.sum_all()?)?;
        }
        let mut g = backward(model, opt, &surrogate)?;
        if let Some(mut first) = pending.take() {
            first.accumulate(g)?;
            g = first;
        }
        if each {
            g = crate::util::profile::timed("all-reduce", || opt.reduce_gradients(g, group, scale))?;
        }
        match &mut grads {
            Some(acc) => acc.accumulate(g)?,
            None => grads = Some(g),
        }
        row += n;
    }
    let grads = grads.expect("at least two micro-batches");
    let grads = if each { grads } else { crate::util::profile::timed("all-reduce", || opt.reduce_gradients(grads, group, scale))? };
    Ok(StepOutput { loss, i2t, t2i, grads, pairs, distill: distilled })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dual_encoder::tests::tiny_spec;
    use crate::model::init::SeededVars;
    use crate::train::collective::{on_thread_ranks, SingleProcess};
    use crate::train::optim::OptimizerConfig;
    use candle_core::Device;

    const SOFTMAX: StepLoss =
        StepLoss::Softmax { opts: GatherOptions { gather_with_grad: true, local_loss: true }, smoothing: 0.1, mean: false };
    const SIGMOID: StepLoss = StepLoss::Sigmoid { exchange: Exchange::Shift };

    /// The tiny model, with a logit bias (SigLIP's −10) for the sigmoid loss.
    fn model_for(seed: u64, loss: StepLoss) -> (DualEncoder, Optimizer) {
        model_dropping(seed, loss, 0.0)
    }

    /// [`model_for`] with a ViT dropping `patch_dropout` of its 4 patches in training.
    fn model_dropping(seed: u64, loss: StepLoss, patch_dropout: f64) -> (DualEncoder, Optimizer) {
        let vm = candle_nn::VarMap::new();
        let mut spec = tiny_spec();
        if let StepLoss::Sigmoid { .. } = loss {
            spec.logit_bias = Some(-10.0);
        }
        if let crate::model::dual_encoder::ImageSpec::Vit(v) = &mut spec.image {
            v.patch_dropout = patch_dropout;
        }
        let model = DualEncoder::new(&spec, SeededVars::builder(&vm, seed, &Device::Cpu)).unwrap();
        let vars = vm.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        (model, Optimizer::new(vars, OptimizerConfig::default()).unwrap())
    }

    /// `n` samples: images, token ids and masks, deterministic.
    fn batch(n: usize, offset: usize) -> MicroBatch {
        let dev = Device::Cpu;
        let mut rng = crate::util::rng::Rng::new(77);
        let all: Vec<f32> = (0..(offset + n) * 3 * 64).map(|_| rng.normal() as f32).collect();
        let images = Tensor::from_vec(all[offset * 192..].to_vec(), (n, 3, 8, 8), &dev).unwrap();
        let ids: Vec<u32> =
            (0..n).flat_map(|i| [2u32, 5 + ((offset + i) * 7 % 20) as u32, 6 + ((offset + i) * 3 % 19) as u32, 3]).collect();
        MicroBatch {
            images,
            ids: Tensor::from_vec(ids, (n, 4), &dev).unwrap(),
            mask: Tensor::ones((n, 4), DType::U32, &dev).unwrap(),
            teacher: None,
        }
    }

    fn concat(parts: &[MicroBatch]) -> MicroBatch {
        let cat = |f: &dyn Fn(&MicroBatch) -> Tensor| Tensor::cat(&parts.iter().map(f).collect::<Vec<_>>(), 0).unwrap();
        MicroBatch { images: cat(&|m| m.images.clone()), ids: cat(&|m| m.ids.clone()), mask: cat(&|m| m.mask.clone()), teacher: None }
    }

    fn assert_grads_close(a: &Grads, b: &Grads, what: &str) {
        for (i, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
            let (x, y) = (
                x.as_ref().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y.as_ref().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let scale = y.iter().map(|v| v.abs()).fold(0.0f32, f32::max).max(1e-6);
            for (p, q) in x.iter().zip(&y) {
                assert!((p - q).abs() <= 1e-5 * scale + 1e-7, "{what}: parameter {i}: {p} vs {q} (max |g| {scale})");
            }
        }
    }

    /// bf16 products on the CPU (every product, however small, through the AVX-512 BF16 kernel,
    /// forward and backward) against f32: each parameter's gradient within 10% (relative L2) of
    /// the f32 one and pointing its way (cosine ≥ 0.995), the whole gradient within 5%, and not
    /// equal to f32's, so the products really ran in bf16. Measured here: at most 4.7% on one
    /// 16-wide LayerNorm scale (a sum of terms that cancel), cosines ≥ 0.9991. Each bf16 operand
    /// errs by up to 2^-9 ≈ 0.2%, and the errors of the forward and backward products compound
    /// through the layers; the bounds leave about twice the measured room. Gradients that are
    /// zero in exact arithmetic (attention's key biases: softmax ignores a shift common to a
    /// query's scores), where f32 holds only rounding noise, are left out.
    #[test]
    fn bf16_products_give_the_f32_gradients_within_rounding() {
        use crate::ops::kernels::bf16_gemm;
        if !bf16_gemm::available() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        bf16_gemm::set_min_macs(1);
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let (model, opt) = model_for(3, SOFTMAX);
        let b = batch(8, 0);
        let full = compute(&model, &opt, std::slice::from_ref(&b), &single, SOFTMAX, 5, false).unwrap();
        let half = bf16_gemm::with_bf16_products(|| compute(&model, &opt, std::slice::from_ref(&b), &single, SOFTMAX, 5, false)).unwrap();
        assert!((full.loss - half.loss).abs() < 1e-2 * full.loss, "loss {} against {}", full.loss, half.loss);
        let values = |g: &Option<Tensor>| g.as_ref().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let global = full.grads.norm().unwrap();
        let (mut differs, mut sq_err) = (false, 0.0);
        for ((p, x), y) in opt.params().iter().zip(&full.grads.0).zip(&half.grads.0) {
            let (x, y) = (values(x), values(y));
            let e: f64 = x.iter().zip(&y).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
            sq_err += e;
            differs |= x != y;
            let (nx, ny) = (norm(&x), norm(&y));
            if nx <= 1e-6 * global {
                continue;
            }
            let cosine = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (nx * ny);
            assert!(e.sqrt() <= 0.1 * nx && cosine >= 0.995, "{}: relative error {:.1e}, cosine {cosine:.5}", p.name, e.sqrt() / nx);
        }
        assert!(sq_err.sqrt() <= 0.05 * global, "the whole gradient errs by {:.1e}", sq_err.sqrt() / global);
        assert!(differs, "no gradient changed: the products did not run in bf16");
    }

    #[test]
    fn accumulated_micro_batches_give_the_gradient_of_one_big_batch() {
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let parts: Vec<MicroBatch> = (0..3).map(|k| batch(4, 4 * k)).collect();
        for loss in [SOFTMAX, SIGMOID] {
            let (model, opt) = model_for(1, loss);
            let big = compute(&model, &opt, &[concat(&parts)], &single, loss, 9, true).unwrap();
            let acc = compute(&model, &opt, &parts, &single, loss, 9, true).unwrap();
            assert!((big.loss - acc.loss).abs() < 1e-5 * big.loss, "{loss:?}: {} vs {}", big.loss, acc.loss);
            assert!(acc.grads.0.iter().all(|g| g.is_some()), "{loss:?}: a parameter got no gradient");
            assert_grads_close(&acc.grads, &big.grads, &format!("accumulation, {loss:?}"));
        }
    }

    /// `world` thread ranks, each computing `loss` over its `per_rank` samples in `split`
    /// micro-batches, give the loss and parameter gradients of one device holding all of them.
    fn assert_ranks_match_one_big_batch(world: usize, loss: StepLoss, per_rank: usize, split: usize) {
        assert_ranks_match_one_big_batch_dropping(world, loss, per_rank, split, 0.0)
    }

    fn assert_ranks_match_one_big_batch_dropping(world: usize, loss: StepLoss, per_rank: usize, split: usize, patch_dropout: f64) {
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let (model, opt) = model_dropping(1, loss, patch_dropout);
        let all: Vec<MicroBatch> = (0..world).map(|r| batch(per_rank, per_rank * r)).collect();
        let want = compute(&model, &opt, &[concat(&all)], &single, loss, 9, true).unwrap();
        let results = on_thread_ranks(world, |r, group| {
            let (model, opt) = model_dropping(1, loss, patch_dropout);
            let n = per_rank / split;
            let micro: Vec<MicroBatch> = (0..split).map(|k| batch(n, per_rank * r + n * k)).collect();
            let out = compute(&model, &opt, &micro, &group, loss, 9, true).unwrap();
            (out.loss, out.grads)
        });
        for (got, grads) in results {
            assert!((got - want.loss).abs() < 1e-5 * want.loss, "W={world} {loss:?}: {got} vs {}", want.loss);
            assert_grads_close(&grads, &want.grads, &format!("W={world} {loss:?}"));
        }
    }

    /// The sigmoid loss over ranks (the ring and the gathered form, GradCache accumulation on
    /// each rank) gives the single-device loss and parameter gradients, the bias's included.
    #[test]
    fn sigmoid_loss_ranks_give_the_gradient_of_one_big_batch() {
        for world in [2usize, 3] {
            for exchange in [Exchange::Shift, Exchange::Gather] {
                assert_ranks_match_one_big_batch(world, StepLoss::Sigmoid { exchange }, 4, 2);
            }
        }
    }

    /// Under patch dropout an image keeps the same patches whichever rank and micro-batch hold
    /// it, so sharding and accumulation still give the big batch's gradient; and the patches do
    /// change the gradient (against the unmasked step and another step's draws).
    #[test]
    fn patch_dropout_follows_the_image_not_the_split() {
        for world in [1usize, 2, 3] {
            assert_ranks_match_one_big_batch_dropping(world, SOFTMAX, 4, 2, 0.5);
        }
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let (model, opt) = model_dropping(1, SOFTMAX, 0.5);
        let b = batch(6, 0);
        let masked = compute(&model, &opt, std::slice::from_ref(&b), &single, SOFTMAX, 9, true).unwrap();
        let unmasked = compute(&model, &opt, std::slice::from_ref(&b), &single, SOFTMAX, 9, false).unwrap();
        let other_step = compute(&model, &opt, std::slice::from_ref(&b), &single, SOFTMAX, 10, true).unwrap();
        let (model0, opt0) = model_dropping(1, SOFTMAX, 0.0);
        let plain = compute(&model0, &opt0, std::slice::from_ref(&b), &single, SOFTMAX, 9, true).unwrap();
        assert_eq!(unmasked.loss, plain.loss, "without masking the rate does not matter");
        assert_ne!(masked.loss, unmasked.loss);
        assert_ne!(masked.loss, other_step.loss);
    }

    /// Ranks holding different batches, split into micro-batches of different sizes (as
    /// token-budget batches can leave them), with patch dropout: each loss still gives the loss
    /// and parameter gradients of one device holding every sample, and the step counts them all.
    #[test]
    fn unequal_batches_over_ranks_give_the_gradient_of_one_big_batch() {
        let splits: [&[usize]; 3] = [&[3, 1], &[2], &[1, 2, 2]];
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let local_softmax =
            StepLoss::Softmax { opts: GatherOptions { gather_with_grad: true, local_loss: true }, smoothing: 0.1, mean: true };
        for loss in [local_softmax, SOFTMAX, SIGMOID, StepLoss::Sigmoid { exchange: Exchange::Gather }] {
            let (model, opt) = model_dropping(1, loss, 0.5);
            let want = compute(&model, &opt, &[batch(11, 0)], &single, loss, 9, true).unwrap();
            let results = on_thread_ranks(splits.len(), |r, group| {
                let (model, opt) = model_dropping(1, loss, 0.5);
                let mut from: usize = splits[..r].iter().flat_map(|s| s.iter()).sum();
                let micro: Vec<MicroBatch> = splits[r]
                    .iter()
                    .map(|&n| {
                        from += n;
                        batch(n, from - n)
                    })
                    .collect();
                let out = compute(&model, &opt, &micro, &group, loss, 9, true).unwrap();
                (out.loss, out.grads, out.pairs)
            });
            for (got, grads, pairs) in results {
                assert_eq!(pairs, 11);
                assert!((got - want.loss).abs() < 1e-5 * want.loss, "{loss:?}: {got} vs {}", want.loss);
                assert_grads_close(&grads, &want.grads, &format!("unequal ranks, {loss:?}"));
            }
        }
    }

    /// Stored teacher embeddings for the samples `offset..offset + n` of [`batch`].
    fn with_teacher(mut m: MicroBatch, offset: usize) -> MicroBatch {
        let n = m.images.dim(0).unwrap();
        let all = |seed| {
            crate::train::gather::tests::normalised(offset + n, 6, seed)[offset..].iter().flatten().map(|&v| v as f32).collect::<Vec<f32>>()
        };
        let t = |v: Vec<f32>| Tensor::from_vec(v, (n, 6), &Device::Cpu).unwrap();
        m.teacher = Some(TeacherMicro::Embeddings { image: t(all(41)), text: t(all(42)) });
        m
    }

    /// Distillation beside either loss, and alone: ranks (equal and unequal batches) and
    /// accumulated micro-batches give the loss, the distillation loss and the parameter
    /// gradients of one device holding every sample.
    #[test]
    fn distillation_over_ranks_and_micro_batches_gives_the_gradient_of_one_big_batch() {
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let splits: [&[&[usize]]; 3] = [&[&[2, 2], &[2, 2]], &[&[1, 3], &[2], &[3]], &[&[4]]];
        for (loss, bias) in [(SOFTMAX, None), (SIGMOID, Some(-4.0))] {
            for contrastive in [true, false] {
                let distill = Distill {
                    teacher: None,
                    logits: TeacherLogits { scale: 15.0, bias },
                    weight: 0.7,
                    contrastive,
                    kind: DistillLoss::CrossEntropy,
                    bf16: false,
                };
                for ranks in splits {
                    let total: usize = ranks.iter().flat_map(|r| r.iter()).sum();
                    let (model, opt) = model_for(1, loss);
                    let want =
                        compute_with(&model, &opt, &[with_teacher(batch(total, 0), 0)], &single, loss, 9, true, Some(&distill)).unwrap();
                    let results = on_thread_ranks(ranks.len(), |r, group| {
                        let (model, opt) = model_for(1, loss);
                        let mut from: usize = ranks[..r].iter().flat_map(|s| s.iter()).sum();
                        let micro: Vec<MicroBatch> = ranks[r]
                            .iter()
                            .map(|&n| {
                                from += n;
                                with_teacher(batch(n, from - n), from - n)
                            })
                            .collect();
                        let out = compute_with(&model, &opt, &micro, &group, loss, 9, true, Some(&distill)).unwrap();
                        (out.loss, out.distill.unwrap(), out.grads)
                    });
                    let what = format!("{loss:?} contrastive={contrastive} {ranks:?}");
                    for (got, d, grads) in results {
                        assert!((got - want.loss).abs() < 1e-5 * want.loss.abs(), "{what}: {got} vs {}", want.loss);
                        assert!((d - want.distill.unwrap()).abs() < 1e-5 * d.abs(), "{what}: distillation {d} vs {:?}", want.distill);
                        assert_grads_close(&grads, &want.grads, &what);
                    }
                    if !contrastive {
                        assert!(
                            (want.loss - 0.7 * want.distill.unwrap()).abs() < 1e-12,
                            "{what}: the loss is the weighted distillation loss"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn data_parallel_ranks_give_the_gradient_of_one_big_batch() {
        for world in [2usize, 3, 4] {
            for local_loss in [true, false] {
                let opts = GatherOptions { gather_with_grad: true, local_loss };
                assert_ranks_match_one_big_batch(world, StepLoss::Softmax { opts, smoothing: 0.1, mean: false }, 3, 1);
            }
        }
    }

    /// Checkpointed towers give the gradients of the plain ones, for a ViT and for an
    /// EfficientNet with stochastic depth (the recomputation must draw the same masks) and
    /// training-mode BatchNorm (whose running statistics must be updated once, not twice), with
    /// one batch and with accumulated micro-batches.
    #[test]
    fn activation_checkpointing_leaves_the_gradients_unchanged() {
        use crate::model::dual_encoder::ImageSpec;
        use crate::model::efficientnet::EfficientNetConfig;
        let single: Arc<dyn Collective> = Arc::new(SingleProcess);
        let opts = GatherOptions::default();
        let mut effnet = tiny_spec();
        let mut e = EfficientNetConfig::preset("efficientnet-b0", 32).unwrap();
        e.width_coefficient = 0.25;
        e.depth_coefficient = 0.5;
        e.drop_path = 0.5;
        effnet.embed_dim = e.width();
        effnet.image = ImageSpec::EfficientNet(e);
        for (name, spec, side) in [("vit", tiny_spec(), 8), ("efficientnet", effnet, 32)] {
            let parts: Vec<MicroBatch> = (0..2)
                .map(|k| {
                    let mut m = batch(4, 4 * k);
                    m.images = crate::util::rng::randn(300 + k as u64, 0.0, 1.0, (4, 3, side, side), DType::F32, &Device::Cpu).unwrap();
                    m
                })
                .collect();
            let run = |checkpointing: bool, micro: &[MicroBatch]| {
                let vm = candle_nn::VarMap::new();
                let model =
                    DualEncoder::new(&spec, SeededVars::builder(&vm, 5, &Device::Cpu)).unwrap().with_grad_checkpointing(checkpointing);
                let opt = Optimizer::new(crate::model::batch_norm::trainable_vars(&vm), OptimizerConfig::default()).unwrap();
                let out = compute(&model, &opt, micro, &single, StepLoss::Softmax { opts, smoothing: 0.1, mean: false }, 9, true).unwrap();
                let data = vm.data().lock().unwrap();
                let mut names: Vec<&String> = data.keys().filter(|k| crate::model::batch_norm::is_running_stat(k)).collect();
                names.sort();
                let stats: Vec<f32> = names
                    .iter()
                    .flat_map(|k| data[*k].flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap())
                    .collect();
                drop(data);
                (out, stats)
            };
            for micro in [vec![concat(&parts)], parts] {
                let (plain, plain_stats) = run(false, &micro);
                let (ckpt, ckpt_stats) = run(true, &micro);
                assert!((plain.loss - ckpt.loss).abs() < 1e-6 * plain.loss, "{name}: {} vs {}", plain.loss, ckpt.loss);
                assert!(ckpt.grads.0.iter().all(|g| g.is_some()), "{name}: a parameter got no gradient");
                assert_grads_close(&ckpt.grads, &plain.grads, name);
                let worst = plain_stats.iter().zip(&ckpt_stats).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(plain_stats.len() == ckpt_stats.len() && worst < 1e-6, "{name}: BatchNorm running statistics differ by {worst}");
            }
        }
    }
}
