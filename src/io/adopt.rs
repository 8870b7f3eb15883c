//! A run that starts from a checkpoint (`model.init`) takes the checkpoint's way of being used as
//! its defaults: image size, resize mode, crop, filter, mean and std, text length, and the loss
//! family (SigLIP's sigmoid with its bias trained; CLIP's and ALIGN's softmax). Training
//! augmentation follows the family's recipe at that size: ALIGN's square resize, random crop and
//! flip for an EfficientNet start, open_clip's random resized crop (scale 0.9-1, bicubic, no
//! flip) for the others. A setting the user made explicitly wins; where it differs from the
//! checkpoint, a warning names it. The run's `config.toml` then records what was used, towers
//! included.

use anyhow::{Context, Result};

use super::format::{loss_of, Usage};
use crate::config::{Config, LossKind};
use crate::data::transform::{ImageConfig, ResizeMode, TrainCrop};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};

/// What adopting a start did: settings taken (for the log) and explicit settings kept against the
/// checkpoint's (warnings).
#[derive(Debug, Default)]
pub struct Adopted {
    pub taken: Vec<String>,
    pub kept: Vec<String>,
}

/// Applies `model.init`'s settings to `cfg` as defaults (nothing without `model.init`).
pub fn adopt(cfg: &mut Config) -> Result<Adopted> {
    let Some(start) = super::init_from::start(cfg)? else { return Ok(Adopted::default()) };
    let (dir, format) = (&start.located.dir, start.located.format);
    let usage = format.usage(dir, &start.spec).with_context(|| format!("model.init {}", cfg.model.init))?;
    Ok(adopt_usage(cfg, &start.spec, &usage, format.name()))
}

/// The training transform a family trains with, at the evaluation settings `eval`.
fn train_image(eval: &ImageConfig, spec: &ModelSpec) -> ImageConfig {
    let mut image = eval.clone();
    if matches!(spec.image, ImageSpec::EfficientNet(_)) {
        // ALIGN §5: the square resize, a random crop and a horizontal flip.
        image.train_crop = TrainCrop::RandomCrop;
        image.hflip = true;
        if image.resize_mode != ResizeMode::Square {
            image.resize_mode = ResizeMode::Square;
        }
    } else {
        // open_clip's training transform: RandomResizedCrop(scale=(0.9, 1.0)), bicubic, no flip.
        image.train_crop = TrainCrop::RandomResizedCrop;
        image.rrc_scale = [0.9, 1.0];
        image.rrc_ratio = [3.0 / 4.0, 4.0 / 3.0];
        image.hflip = false;
    }
    image
}

fn adopt_usage(cfg: &mut Config, spec: &ModelSpec, usage: &Usage, format: &str) -> Adopted {
    let mut done = Adopted::default();
    let from = format!("model.init ({format})");
    let want = train_image(&usage.image, spec);
    // Every image field, in the order a person reads them.
    let mut image = cfg.data.image.clone();
    macro_rules! field {
        ($name:ident) => {{
            let path = concat!("data.image.", stringify!($name));
            if cfg.is_explicit(path) {
                if image.$name != want.$name {
                    done.kept.push(format!("{path} = {:?} (the checkpoint's is {:?})", image.$name, want.$name));
                }
            } else if image.$name != want.$name {
                done.taken.push(format!("{path} = {:?}", want.$name));
                image.$name = want.$name.clone();
            }
        }};
    }
    field!(image_size);
    // A chosen image size scales the checkpoint's resize with it (346/289 for ALIGN, 1 for CLIP).
    let resize = if cfg.is_explicit("data.image.image_size") && image.image_size != usage.image.image_size {
        ((image.image_size * usage.image.resize) as f64 / usage.image.image_size as f64).round() as usize
    } else {
        want.resize
    };
    if cfg.is_explicit("data.image.resize") {
        if image.resize != resize {
            done.kept.push(format!("data.image.resize = {} (the checkpoint's is {resize})", image.resize));
        }
    } else if image.resize != resize {
        done.taken.push(format!("data.image.resize = {resize}"));
        image.resize = resize;
    }
    field!(resize_mode);
    field!(crop_offset);
    field!(interpolation);
    field!(mean);
    field!(std);
    field!(train_crop);
    field!(rrc_scale);
    field!(rrc_ratio);
    field!(hflip);
    cfg.data.image = image;

    if cfg.is_explicit("text.max_len") {
        if cfg.text.max_len != usage.text_len {
            done.kept.push(format!("text.max_len = {} (the checkpoint's is {})", cfg.text.max_len, usage.text_len));
        }
    } else if cfg.text.max_len != usage.text_len {
        done.taken.push(format!("text.max_len = {}", usage.text_len));
        cfg.text.max_len = usage.text_len;
    }

    let loss = usage.loss;
    if cfg.is_explicit("loss.kind") {
        if cfg.loss.kind != loss {
            let why = match (loss_of(spec), cfg.loss.kind) {
                (LossKind::Sigmoid, LossKind::Softmax) => ": its logit_bias stays unused and untrained",
                (LossKind::Softmax, LossKind::Sigmoid) => ": a bias starts at loss.init_logit_bias",
                _ => "",
            };
            done.kept.push(format!("loss.kind = {:?} (the checkpoint was trained with {loss:?}{why})", cfg.loss.kind));
        }
    } else if cfg.loss.kind != loss {
        done.taken.push(format!("loss.kind = {loss:?}"));
        cfg.loss.kind = loss;
    }

    // For the record: the run's config names the towers it trains.
    let (image_tower, text_tower) = tower_names(spec);
    cfg.model.image_tower = image_tower;
    cfg.model.text_tower = text_tower;
    cfg.model.embed_dim = spec.embed_dim;
    cfg.model.image_projection = spec.image_projection;
    cfg.model.text_projection_bias = spec.text_projection_bias;
    cfg.model.text_pooling = spec.text_pooling;
    for line in done.taken.iter_mut() {
        *line = format!("{line} from {from}");
    }
    done
}

/// Names for the towers of a pretrained model, as the run's `config.toml` records them: a preset's
/// name where one matches, else the architecture and its size.
pub fn tower_names(spec: &ModelSpec) -> (String, String) {
    let image = match &spec.image {
        ImageSpec::EfficientNet(e) => {
            crate::model::efficientnet::EfficientNetConfig::preset_name(e).map_or_else(|| "efficientnet".to_string(), str::to_string)
        }
        ImageSpec::Vit(v) => format!("vit-{}x{}/{}", v.width, v.depth, v.patch_size),
        ImageSpec::Clip(v) => format!("clip-vit-{}x{}/{}", v.encoder.width, v.encoder.layers, v.patch_size),
        ImageSpec::Siglip(v) => format!("siglip-vit-{}x{}/{}", v.encoder.width, v.encoder.layers, v.patch_size),
    };
    let text = match &spec.text {
        TextSpec::Bert(b) => format!("bert-{}x{}", b.hidden, b.layers),
        TextSpec::Clip(t) => format!("clip-text-{}x{}", t.encoder.width, t.encoder.layers),
        TextSpec::Siglip(t) => format!("siglip-text-{}x{}", t.encoder.width, t.encoder.layers),
    };
    (image, text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::transform::Interpolation;

    fn clip_like() -> (ModelSpec, Usage) {
        let mut spec = crate::model::dual_encoder::tests::tiny_spec();
        spec.logit_bias = Some(-10.0);
        let image = ImageConfig {
            image_size: 8,
            resize: 8,
            resize_mode: ResizeMode::Shorter,
            interpolation: Interpolation::Bicubic,
            mean: [0.48, 0.46, 0.41],
            std: [0.27, 0.26, 0.28],
            ..Default::default()
        };
        (spec, Usage { image, text_len: 16, loss: LossKind::Sigmoid })
    }

    #[test]
    fn a_start_sets_the_defaults_and_an_explicit_setting_wins_with_a_warning() {
        let (spec, usage) = clip_like();
        let mut cfg = Config::from_str_with_overrides("[data.image]\nmean = [0.5, 0.5, 0.5]\n", "t", &[]).unwrap();
        let done = adopt_usage(&mut cfg, &spec, &usage, "CLIPModel");
        let im = &cfg.data.image;
        assert_eq!((im.image_size, im.resize, im.resize_mode, im.interpolation), (8, 8, ResizeMode::Shorter, Interpolation::Bicubic));
        assert_eq!((im.train_crop, im.rrc_scale, im.hflip), (TrainCrop::RandomResizedCrop, [0.9, 1.0], false));
        assert_eq!(im.mean, [0.5; 3], "the explicit mean stays");
        assert_eq!(im.std, usage.image.std);
        assert_eq!((cfg.text.max_len, cfg.loss.kind), (16, LossKind::Sigmoid));
        assert!(done.kept.iter().any(|k| k.starts_with("data.image.mean")), "{done:?}");
        assert!(done.taken.iter().any(|k| k.starts_with("loss.kind") && k.contains("CLIPModel")), "{done:?}");
        assert_eq!(cfg.model.image_tower, "vit-16x1/4");
    }

    #[test]
    fn a_chosen_image_size_scales_the_resize_and_an_explicit_loss_is_warned_about() {
        let (spec, mut usage) = clip_like();
        usage.image.resize = 10;
        let mut cfg =
            Config::from_str_with_overrides("", "t", &["data.image.image_size=16".into(), "loss.kind=\"softmax\"".into()]).unwrap();
        let done = adopt_usage(&mut cfg, &spec, &usage, "SiglipModel");
        assert_eq!((cfg.data.image.image_size, cfg.data.image.resize), (16, 20));
        assert_eq!(cfg.loss.kind, LossKind::Softmax);
        assert!(done.kept.iter().any(|k| k.contains("logit_bias stays unused")), "{done:?}");
    }
}
