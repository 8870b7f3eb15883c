//! A run that starts from a checkpoint (`model.init`) takes the checkpoint's way of being used as
//! its defaults: image size, resize mode, crop, filter, mean and std, text length, the loss
//! family (SigLIP's sigmoid with its bias trained; CLIP's and ALIGN's softmax), and the family's
//! training recipe (open_clip's objective and AdamW settings for a CLIP start, big_vision's for a
//! SigLIP one). Training
//! augmentation follows the family's recipe at that size: ALIGN's square resize, random crop and
//! flip for an EfficientNet start, open_clip's random resized crop (scale 0.9-1, bicubic, no
//! flip) for the others. A setting the user made explicitly wins; where it differs from the
//! checkpoint, a warning names it. The run's `config.toml` then records what was used, towers
//! included.

use anyhow::Result;

use crate::config::{as_written, section_of, value_at, Config, LossKind};
use crate::data::transform::{ImageConfig, ResizeMode, TrainCrop};
use crate::io::format::{loss_of, Usage};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};

/// What adopting a start did: settings taken (for the log) and explicit settings kept against the
/// checkpoint's (warnings).
#[derive(Debug, Default)]
pub struct Adopted {
    pub taken: Vec<String>,
    pub kept: Vec<String>,
    /// Explicit settings of the architecture that the start's own replaces: errors.
    pub conflicts: Vec<String>,
}

/// The training transform a family trains with, at the evaluation settings `eval`.
pub fn train_image(eval: &ImageConfig, spec: &ModelSpec) -> ImageConfig {
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

/// `format` names the start's family (a format's name); `origin` is what the log says it came
/// from.
pub(super) fn from_start(cfg: &mut Config, spec: &ModelSpec, usage: &Usage, format: &str, origin: &str) -> Adopted {
    let mut done = Adopted::default();
    adopt_image(cfg, spec, usage, &mut done);
    adopt_text_and_loss(cfg, spec, usage, &mut done);
    family_recipe(cfg, format, &mut done);
    adopt_architecture(cfg, spec, &mut done);
    for line in done.taken.iter_mut() {
        *line = format!("{line} from {origin}");
    }
    done
}

/// Every image field, in the order a person reads them: the start's training transform at its
/// size, a chosen size scaling the resize with it.
fn adopt_image(cfg: &mut Config, spec: &ModelSpec, usage: &Usage, done: &mut Adopted) {
    let want = train_image(&usage.image, spec);
    let mut image = cfg.data.image.clone();
    macro_rules! field {
        ($name:ident) => {{
            let path = concat!("data.image.", stringify!($name));
            if cfg.is_explicit(path) {
                if image.$name != want.$name {
                    done.kept.push(format!("{path} = {} (the checkpoint's is {})", as_written(&image.$name), as_written(&want.$name)));
                }
            } else if image.$name != want.$name {
                done.taken.push(format!("{path} = {}", as_written(&want.$name)));
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
    field!(alpha);
    field!(naflex);
    cfg.data.image = image;
}

/// The start's text length and loss family.
fn adopt_text_and_loss(cfg: &mut Config, spec: &ModelSpec, usage: &Usage, done: &mut Adopted) {
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
            done.kept.push(format!(
                "loss.kind = {} (the checkpoint was trained with {}{why})",
                as_written(&cfg.loss.kind),
                as_written(&loss)
            ));
        }
    } else if cfg.loss.kind != loss {
        done.taken.push(format!("loss.kind = {}", as_written(&loss)));
        cfg.loss.kind = loss;
    }
}

/// For the record: the run's config names the towers it trains. A size the user set that the
/// start's differs from cannot be honoured: it is a conflict, rather than training something else.
fn adopt_architecture(cfg: &mut Config, spec: &ModelSpec, done: &mut Adopted) {
    let (image_tower, text_tower) = tower_names(spec);
    macro_rules! architecture {
        ($path:literal, $field:ident, $value:expr) => {{
            let value = $value;
            if cfg.is_explicit($path) && cfg.model.$field != value {
                done.conflicts.push(format!("{} = {} (the start's is {})", $path, as_written(&cfg.model.$field), as_written(&value)));
            }
            cfg.model.$field = value;
        }};
    }
    // Tower names describe (`vit-768x12/16` for a start, `vit-b16` as a preset): a named tower of
    // another family, or another EfficientNet preset, is what cannot be honoured.
    for (path, set, start) in
        [("model.image_tower", &cfg.model.image_tower, &image_tower), ("model.text_tower", &cfg.model.text_tower, &text_tower)]
    {
        let family = |n: &str| n.split('-').next().unwrap_or_default().to_string();
        let presets = crate::model::presets::EFFICIENTNET_PRESETS;
        let other_preset = presets.contains(&set.as_str()) && presets.contains(&start.as_str()) && set != start;
        if cfg.is_explicit(path) && (family(set) != family(start) || other_preset) {
            done.conflicts.push(format!("{path} = {} (the start's is {})", as_written(set), as_written(start)));
        }
    }
    cfg.model.image_tower = image_tower;
    cfg.model.text_tower = text_tower;
    architecture!("model.embed_dim", embed_dim, spec.embed_dim);
    architecture!("model.image_projection", image_projection, spec.image_projection);
    architecture!("model.text_projection_bias", text_projection_bias, spec.text_projection_bias);
    architecture!("model.text_pooling", text_pooling, spec.text_pooling);
}

/// Every field adopting a start may set: what a resumed run takes back from its own
/// `config.toml` (the start that set them may be gone by then).
const ADOPTED: [&str; 29] = [
    "data.image.image_size",
    "data.image.resize",
    "data.image.resize_mode",
    "data.image.crop_offset",
    "data.image.interpolation",
    "data.image.mean",
    "data.image.std",
    "data.image.train_crop",
    "data.image.rrc_scale",
    "data.image.rrc_ratio",
    "data.image.hflip",
    "data.image.alpha",
    "data.image.naflex",
    "text.max_len",
    "loss.kind",
    "loss.label_smoothing",
    "loss.directions",
    "optimizer.kind",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.weight_decay",
    "optimizer.grad_clip",
    "model.image_tower",
    "model.text_tower",
    "model.embed_dim",
    "model.image_projection",
    "model.text_projection_bias",
    "model.text_pooling",
];

/// A resumed run's start settings, from the config its checkpoint was trained with: what the
/// start gave the first run, taken again where this run does not set it; an explicit setting
/// wins, with a warning where it differs (`--resume` then judges whether it may change).
pub(super) fn from_saved(cfg: &mut Config, saved: &Config) -> Result<Adopted> {
    let mut done = Adopted::default();
    let (mut now, before) = (toml::Table::try_from(&*cfg)?, toml::Table::try_from(saved)?);
    for path in ADOPTED {
        let (old, new) = (value_at(&before, path).cloned(), value_at(&now, path).cloned());
        if old == new {
            continue;
        }
        let show = |v: &Option<toml::Value>| v.as_ref().map_or("(none)".to_string(), as_written);
        if cfg.is_explicit(path) {
            done.kept.push(format!("{path} = {} (the run's checkpoint has {})", show(&new), show(&old)));
            continue;
        }
        done.taken.push(format!("{path} = {} from the run's checkpoint", show(&old)));
        let (section, leaf) = section_of(&mut now, path).expect("every adopted field is in a section of the config");
        match old {
            Some(v) => section.insert(leaf.to_string(), v),
            None => section.remove(leaf),
        };
    }
    let explicit = cfg.explicit.clone();
    *cfg = now.try_into()?;
    cfg.explicit = explicit;
    Ok(done)
}

/// The family a start was trained in, by the format it came in: its objective and optimizer are
/// what a fine-tune of it should keep unless told otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// ALIGN's recipe: the defaults (LAMB, label smoothing 0.1, the sum of both directions).
    Align,
    /// CLIP as open_clip and transformers train it (`CLIPModel`, open_clip's folders,
    /// `VisionTextDualEncoderModel`, whose `clip_loss` is the same).
    Clip,
    /// SigLIP as big_vision trains it (`SiglipModel`).
    Siglip,
}

impl Family {
    fn of(format: &str) -> Family {
        match format {
            "CLIPModel" | "open_clip" | "VisionTextDualEncoderModel" => Family::Clip,
            "SiglipModel" | "Siglip2Model" => Family::Siglip,
            _ => Family::Align,
        }
    }
}

/// The family's objective and optimizer as defaults: an explicit setting wins, with a warning
/// where it differs.
/// - CLIP: open_clip's `ClipLoss` (no label smoothing, the mean of the two directions) and its
///   optimizer defaults for ViTs (`--beta1 0.9 --beta2 0.98 --eps 1e-6 --wd 0.2`), AdamW, with
///   gains, biases, norms and the logit scale not decayed (tensors of fewer than two dimensions,
///   as open_clip exempts them).
/// - SigLIP: big_vision's SigLIP recipes: Adam with optax's defaults (β 0.9 / 0.999, ε 1e-8) and
///   gradient clipping at global norm 1.0; decoupled weight decay 1e-4.
fn family_recipe(cfg: &mut Config, format: &str, done: &mut Adopted) {
    use crate::config::{Directions, OptimizerKind};
    macro_rules! recipe {
        ($path:literal, $($field:ident).+, $want:expr) => {{
            let want = $want;
            if cfg.is_explicit($path) {
                if cfg.$($field).+ != want {
                    done.kept.push(format!("{} = {} (the start's recipe has {})", $path, as_written(&cfg.$($field).+), as_written(&want)));
                }
            } else if cfg.$($field).+ != want {
                done.taken.push(format!("{} = {}", $path, as_written(&want)));
                cfg.$($field).+ = want;
            }
        }};
    }
    match Family::of(format) {
        Family::Align => {}
        Family::Clip => {
            if cfg.loss.kind == LossKind::Softmax {
                recipe!("loss.label_smoothing", loss.label_smoothing, 0.0);
                recipe!("loss.directions", loss.directions, Directions::Mean);
            }
            recipe!("optimizer.kind", optimizer.kind, OptimizerKind::Adamw);
            recipe!("optimizer.beta1", optimizer.beta1, 0.9);
            recipe!("optimizer.beta2", optimizer.beta2, 0.98);
            recipe!("optimizer.eps", optimizer.eps, 1e-6);
            recipe!("optimizer.weight_decay", optimizer.weight_decay, 0.2);
        }
        Family::Siglip => {
            recipe!("optimizer.kind", optimizer.kind, OptimizerKind::Adamw);
            recipe!("optimizer.beta1", optimizer.beta1, 0.9);
            recipe!("optimizer.beta2", optimizer.beta2, 0.999);
            recipe!("optimizer.eps", optimizer.eps, 1e-8);
            recipe!("optimizer.weight_decay", optimizer.weight_decay, 1e-4);
            recipe!("optimizer.grad_clip", optimizer.grad_clip, 1.0);
        }
    }
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
        ImageSpec::Naflex(v) => format!("siglip2-naflex-{}x{}/{}", v.encoder.width, v.encoder.layers, v.patch_size),
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
        let done = from_start(&mut cfg, &spec, &usage, "CLIPModel", &format!("model.init ({})", "CLIPModel"));
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
        let done = from_start(&mut cfg, &spec, &usage, "SiglipModel", &format!("model.init ({})", "SiglipModel"));
        assert_eq!((cfg.data.image.image_size, cfg.data.image.resize), (16, 20));
        assert_eq!(cfg.loss.kind, LossKind::Softmax);
        assert!(done.kept.iter().any(|k| k.contains("logit_bias stays unused")), "{done:?}");
    }

    /// A CLIP start trains open_clip's objective with its AdamW settings, a SigLIP start
    /// big_vision's, an ALIGN start ALIGN's; an explicit setting wins, warned about in the
    /// spelling a config uses.
    #[test]
    fn a_start_brings_its_familys_recipe() {
        use crate::config::{Directions, OptimizerKind};
        let (spec, mut usage) = clip_like();
        usage.loss = LossKind::Softmax;
        let mut cfg = Config::from_str_with_overrides("", "t", &["optimizer.weight_decay=0.05".into()]).unwrap();
        let done = from_start(&mut cfg, &spec, &usage, "open_clip", &format!("model.init ({})", "open_clip"));
        let (o, l) = (&cfg.optimizer, &cfg.loss);
        assert_eq!((o.kind, o.beta1, o.beta2, o.eps), (OptimizerKind::Adamw, 0.9, 0.98, 1e-6));
        assert_eq!((l.label_smoothing, l.directions, o.weight_decay), (0.0, Directions::Mean, 0.05));
        assert!(done.taken.iter().any(|t| t == "optimizer.kind = \"adamw\" from model.init (open_clip)"), "{done:?}");
        assert!(done.kept.iter().any(|k| k.starts_with("optimizer.weight_decay = 0.05 (the start's recipe has 0.2)")), "{done:?}");

        let mut cfg = Config::default();
        from_start(
            &mut cfg,
            &spec,
            &Usage { loss: LossKind::Sigmoid, ..usage.clone() },
            "SiglipModel",
            &format!("model.init ({})", "SiglipModel"),
        );
        assert_eq!((cfg.optimizer.kind, cfg.optimizer.grad_clip, cfg.optimizer.eps), (OptimizerKind::Adamw, 1.0, 1e-8));

        let mut cfg = Config::default();
        from_start(&mut cfg, &spec, &usage, "AlignModel", &format!("model.init ({})", "AlignModel"));
        assert_eq!((cfg.optimizer, cfg.loss.label_smoothing, cfg.loss.directions), (Config::default().optimizer, 0.1, Directions::Sum));
    }

    /// An architecture setting the start replaces is an error naming it, not a silent change.
    #[test]
    fn an_explicit_architecture_setting_a_start_replaces_is_a_conflict() {
        let (spec, usage) = clip_like();
        let mut cfg = Config::from_str_with_overrides(
            "",
            "t",
            &["model.embed_dim=64".into(), "model.image_tower=\"efficientnet-b0\"".into(), "model.text_tower=\"bert\"".into()],
        )
        .unwrap();
        let done = from_start(&mut cfg, &spec, &usage, "CLIPModel", &format!("model.init ({})", "CLIPModel"));
        assert_eq!(done.conflicts.len(), 2, "{done:?}");
        assert!(done.conflicts.iter().any(|c| c == "model.embed_dim = 64 (the start's is 8)"), "{done:?}");
        assert!(done.taken.iter().any(|t| t.starts_with("data.image.mean = [0.48, 0.46, 0.41]")), "{done:?}");
        // The names a run's own config.toml records are the start's: no conflict.
        let mut recorded = Config::from_str_with_overrides(&cfg.to_toml().unwrap(), "t", &[]).unwrap();
        assert!(from_start(&mut recorded, &spec, &usage, "CLIPModel", &format!("model.init ({})", "CLIPModel")).conflicts.is_empty());
    }

    /// Every leaf field of a config as a line `path = value`.
    fn leaves(cfg: &Config) -> std::collections::BTreeMap<String, String> {
        fn walk(t: &toml::Table, prefix: &str, out: &mut std::collections::BTreeMap<String, String>) {
            for (k, v) in t {
                let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                match v {
                    toml::Value::Table(t) => walk(t, &path, out),
                    v => {
                        out.insert(path, v.to_string());
                    }
                }
            }
        }
        let mut out = Default::default();
        walk(&toml::Table::try_from(cfg).unwrap(), "", &mut out);
        out
    }

    /// What adopting a start changes is what a resume takes back: a field adoption sets but the
    /// list leaves out would be lost once the start is gone.
    #[test]
    fn every_field_a_start_sets_is_one_a_resume_takes_back() {
        let (clip, usage) = clip_like();
        let mut effnet = clip.clone();
        effnet.image = ImageSpec::EfficientNet(crate::model::efficientnet::EfficientNetConfig::preset("efficientnet-b0", 16).unwrap());
        let mut seen = std::collections::BTreeSet::new();
        for (spec, format, loss) in [
            (&clip, "CLIPModel", LossKind::Softmax),
            (&clip, "SiglipModel", LossKind::Sigmoid),
            (&effnet, "AlignModel", LossKind::Softmax),
            (&clip, "open_clip", LossKind::Sigmoid),
        ] {
            let mut cfg = Config::default();
            let before = leaves(&cfg);
            from_start(&mut cfg, spec, &Usage { loss, ..usage.clone() }, format, &format!("model.init ({})", format));
            let after = leaves(&cfg);
            for (path, value) in &after {
                if before.get(path) != Some(value) {
                    assert!(ADOPTED.contains(&path.as_str()), "{format}: {path} = {value} is adopted but not listed");
                    seen.insert(path.clone());
                }
            }
        }
        assert!(seen.len() >= 20, "the starts above change most listed fields: {seen:?}");
    }

    /// A resume takes the start's settings back from the run's own config, where the run does not
    /// set them; an explicit setting stays, with a warning.
    #[test]
    fn a_resume_takes_the_start_settings_from_the_saved_config() {
        let (spec, usage) = clip_like();
        let mut first = Config::from_str_with_overrides("[model]\ninit = \"start\"\n", "t", &[]).unwrap();
        from_start(&mut first, &spec, &usage, "CLIPModel", &format!("model.init ({})", "CLIPModel"));
        let saved = Config::from_str_with_overrides(&first.to_toml().unwrap(), "saved", &[]).unwrap();

        let mut again = Config::from_str_with_overrides("[model]\ninit = \"start\"\n[data.image]\nhflip = true\n", "t", &[]).unwrap();
        let done = from_saved(&mut again, &saved).unwrap();
        assert_eq!(again.data.image, ImageConfig { hflip: true, ..first.data.image.clone() });
        assert_eq!((again.text.max_len, again.loss.kind, &again.optimizer), (first.text.max_len, first.loss.kind, &first.optimizer));
        assert_eq!((&again.model.image_tower, again.model.embed_dim), (&first.model.image_tower, first.model.embed_dim));
        assert_eq!(done.kept, ["data.image.hflip = true (the run's checkpoint has false)"]);
        assert!(done.taken.iter().any(|t| t == "text.max_len = 16 from the run's checkpoint"), "{done:?}");
        assert!(again.is_explicit("data.image.hflip") && !again.is_explicit("text.max_len"));
    }
}
