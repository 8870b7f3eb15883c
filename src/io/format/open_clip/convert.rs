//! `open_clip_config.json`'s typed sections as align's model sizes and image preprocessing, and
//! back. Options that change the architecture in ways align's towers do not follow (a timm or
//! Hugging Face tower, a ResNet, layer scale, CoCa's pooling, ...) are errors naming the key.

use serde_json::{json, Value};

use super::config::{read, ActKwargs, Layers, ModelCfg, PerChannel, PreprocessCfg, Side, TextCfg, VisionCfg};
use super::timm::Shapes;
use crate::data::transform::{CropOffset, ImageConfig, Interpolation, ResizeMode};
use crate::io::format::config_error::ConfigError;
use crate::io::limits::{check_eps, check_key};
use crate::model::clip::{ClipTextConfig, ClipVisionConfig, TextPool, VisionPool};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::prenorm::{Act, EncoderConfig};
use crate::model::presets::{TemperatureKind, TextPooling};
use crate::model::siglip::SiglipTextConfig;

/// The text tower's kind: CLIP's transformer (causal or not, pooled where `pool_type` says)
/// projected by a matrix (`text_projection`, `x @ P`) or by a linear layer with a bias
/// (`proj_bias`), or a bidirectional one pooled at its last position through a linear head with
/// a bias (SigLIP-style text of a `CustomTextCLIP`, SigLIP's text tower in align).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextKind {
    Clip,
    ClipBiased,
    LastToken,
    /// A Hugging Face encoder (`text.transformer.*`) and its projection (`text.proj.*`).
    Hf,
}

/// What `model_cfg` says beyond the sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenClipModel {
    pub spec: ModelSpec,
    /// The image tower is a timm SigLIP trunk (`visual.trunk.*`) instead of open_clip's own.
    pub timm_trunk: bool,
    /// Keys of the text tower under `text.` (`CustomTextCLIP`) instead of the top level.
    pub custom_text: bool,
    pub text_kind: TextKind,
}

/// `model_cfg` as align's model sizes.
pub fn model_from(cfg: &Value) -> Result<OpenClipModel, ConfigError> {
    model_in(cfg, &Folder::default())
}

/// What a folder holds besides `open_clip_config.json` that sizes a tower.
#[derive(Default)]
pub struct Folder<'a> {
    /// The weights' tensor shapes, which size a timm trunk whose name timm's SigLIP family does
    /// not have.
    pub shapes: Option<&'a Shapes>,
    /// A Hugging Face text tower's `config.json`.
    pub hf_text_config: Option<&'a Value>,
}

/// `model_cfg` as align's model sizes, with what the folder holds.
pub fn model_in(cfg: &Value, folder: &Folder) -> Result<OpenClipModel, ConfigError> {
    if !cfg.is_object() {
        return Err(ConfigError::Invalid("open_clip_config.json has no model_cfg object".into()));
    }
    OpenClipModel::read(read::<ModelCfg>(cfg, "model_cfg")?, folder)
}

/// A Hugging Face text tower (`text_cfg.hf_model_name`) and its projection's hidden width.
fn hf_text_tower(t: &TextCfg, name: &str, folder: &Folder, embed_dim: usize) -> Result<(TextSpec, Option<usize>), ConfigError> {
    if t.hf_pooler_type != "mean_pooler" {
        return Err(ConfigError::Unsupported {
            key: "text_cfg.hf_pooler_type".into(),
            what: format!("{:?} (align pools a Hugging Face text tower by the mean, \"mean_pooler\")", t.hf_pooler_type),
        });
    }
    let bert = super::hf_text::encoder(name, folder.hf_text_config)?;
    let hidden = super::hf_text::projection(&t.hf_proj_type, bert.hidden, embed_dim)?;
    Ok((TextSpec::Bert(bert), hidden))
}

/// Whether reading `model_cfg` needs the weights' shapes: a timm trunk not named by timm's
/// SigLIP family.
pub fn needs_shapes(cfg: &Value) -> bool {
    let name = cfg.pointer("/vision_cfg/timm_model_name").and_then(Value::as_str);
    let size = |c: &Value| c.pointer("/vision_cfg/image_size").and_then(Value::as_u64).unwrap_or(224) as usize;
    name.is_some_and(|n| super::timm::trunk(n, size(cfg), None).is_err())
}

/// The image tower of a timm trunk, and whether it is projected.
fn timm_tower(v: &VisionCfg, name: &str, shapes: Option<&Shapes>, embed_dim: usize) -> Result<(ImageSpec, bool), ConfigError> {
    let image_size = match &v.image_size {
        Side::Square(n) => *n,
        Side::Pair(p) => match p[..] {
            [h, w] if h == w => h,
            _ => return Err(ConfigError::Invalid(format!("vision_cfg.image_size {p:?} is not square; align's towers take square images"))),
        },
    };
    let trunk = super::timm::trunk(name, image_size, shapes)?;
    let projected = match v.timm_proj.as_str() {
        "none" | "" => false,
        "linear" => true,
        other => {
            return Err(ConfigError::Unsupported { key: "vision_cfg.timm_proj".into(), what: format!("{other:?} after a timm trunk") })
        }
    };
    // With no projection open_clip asks timm for the pooling itself; "" there would pool nothing.
    let pool_ok = v.timm_pool == "map" || (projected && v.timm_pool.is_empty());
    if !pool_ok {
        return Err(ConfigError::Invalid(format!(
            "vision_cfg.timm_pool {:?}: align reads timm's SigLIP trunks with their attention pooling (\"map\")",
            v.timm_pool
        )));
    }
    unsupported(projected && v.timm_proj_bias, "vision_cfg.timm_proj_bias", "a projection with a bias after a timm trunk")?;
    if !projected && trunk.encoder.width != embed_dim {
        return Err(ConfigError::Invalid(format!(
            "vision_cfg.timm_proj \"none\" leaves the trunk's width {} as the embedding, but embed_dim is {embed_dim}",
            trunk.encoder.width
        )));
    }
    Ok((ImageSpec::Siglip(trunk), projected))
}

/// A size within align's bounds for its kind.
fn size(n: usize, ctx: &str, key: &str) -> Result<usize, ConfigError> {
    Ok(check_key(n, ctx, key)?)
}

fn unsupported(set: bool, key: &str, what: &str) -> Result<(), ConfigError> {
    if set {
        return Err(ConfigError::Unsupported { key: key.into(), what: what.into() });
    }
    Ok(())
}

/// The block options align's plain attention block does not have.
fn plain_block(b: &super::config::BlockOptions, ctx: &str) -> Result<(), ConfigError> {
    unsupported(b.block_type.is_some(), &format!("{ctx}.block_type"), "a custom block")?;
    for (set, key) in [
        (b.qk_norm, "qk_norm"),
        (b.scaled_cosine_attn, "scaled_cosine_attn"),
        (b.scale_heads, "scale_heads"),
        (b.scale_attn_inner, "scale_attn_inner"),
        (b.scale_attn, "scale_attn"),
        (b.scale_fc, "scale_fc"),
    ] {
        unsupported(set, &format!("{ctx}.{key}"), "a custom attention block")?;
    }
    Ok(())
}

/// Layer scale is off when unset or zero.
fn layer_scale(v: Option<f64>) -> bool {
    v.is_some_and(|x| x != 0.0)
}

fn eps(e: f64, ctx: &str) -> Result<f64, ConfigError> {
    Ok(check_eps(e, &format!("{ctx}.norm_kwargs.eps"))?)
}

fn act(kwargs: &ActKwargs, quick_gelu: bool, ctx: &str) -> Result<Act, ConfigError> {
    if quick_gelu {
        return Ok(Act::QuickGelu);
    }
    match kwargs.approximate.as_deref().unwrap_or("none") {
        "none" => Ok(Act::Gelu),
        "tanh" => Ok(Act::GeluTanh),
        other => Err(ConfigError::Invalid(format!("{ctx}.act_kwargs.approximate {other:?} is not \"none\" or \"tanh\""))),
    }
}

fn mlp(width: usize, ratio: f64, ctx: &str) -> Result<usize, ConfigError> {
    if !(ratio > 0.0 && ratio <= 64.0) {
        return Err(ConfigError::Invalid(format!("{ctx}.mlp_ratio is {ratio}")));
    }
    // open_clip truncates: int(width * mlp_ratio).
    Ok((width as f64 * ratio) as usize)
}

fn vision_tower(v: &VisionCfg, quick_gelu: bool) -> Result<ClipVisionConfig, ConfigError> {
    let ctx = "vision_cfg";
    let layers = match v.layers {
        Layers::Depth(n) => size(n, ctx, "layers")?,
        Layers::ResNet(_) => {
            return Err(ConfigError::Invalid(
                "vision_cfg.layers is a list: a ModifiedResNet image tower, which align does not build".into(),
            ))
        }
    };
    unsupported(layer_scale(v.ls_init_value), "vision_cfg.ls_init_value", "layer scale")?;
    unsupported(v.attentional_pool, "vision_cfg.attentional_pool", "CoCa's attentional pooling")?;
    unsupported(v.output_tokens, "vision_cfg.output_tokens", "token outputs")?;
    plain_block(&v.block, ctx)?;
    let pool = match v.pool_type.as_str() {
        "tok" => VisionPool::Tok,
        "avg" => VisionPool::Avg,
        other => {
            return Err(ConfigError::Invalid(format!(
                "vision_cfg.pool_type {other:?}: align pools the class token (\"tok\") or the mean of the patch tokens (\"avg\")"
            )))
        }
    };
    if v.pos_embed_type != "learnable" {
        return Err(ConfigError::Invalid("vision_cfg.pos_embed_type: align learns its position embeddings (\"learnable\")".into()));
    }
    let width = size(v.width, ctx, "width")?;
    let head_width = size(v.head_width, ctx, "head_width")?;
    if !width.is_multiple_of(head_width) {
        return Err(ConfigError::Invalid(format!("vision_cfg.width {width} is not a multiple of head_width {head_width}")));
    }
    let image_size = match &v.image_size {
        Side::Square(n) => *n,
        Side::Pair(p) => match p[..] {
            [h, w] if h == w => h,
            _ => return Err(ConfigError::Invalid(format!("vision_cfg.image_size {p:?} is not square; align's towers take square images"))),
        },
    };
    let vision = ClipVisionConfig {
        image_size: size(image_size, ctx, "image_size")?,
        patch_size: size(v.patch_size, ctx, "patch_size")?,
        pre_norm: !v.no_ln_pre,
        pool,
        norm_after_pool: v.final_ln_after_pool,
        encoder: EncoderConfig {
            width,
            layers,
            heads: width / head_width,
            mlp_dim: mlp(width, v.mlp_ratio, ctx)?,
            layer_norm_eps: eps(v.norm_kwargs.eps, ctx)?,
            act: act(&v.act_kwargs, quick_gelu, ctx)?,
        },
    };
    if !vision.image_size.is_multiple_of(vision.patch_size) {
        return Err(ConfigError::Invalid(format!(
            "vision_cfg.image_size {} is not a multiple of patch_size {}",
            vision.image_size, vision.patch_size
        )));
    }
    Ok(vision)
}

fn text_tower(t: &TextCfg, quick_gelu: bool, embed_dim: usize, custom_text: bool) -> Result<(TextSpec, TextKind), ConfigError> {
    let ctx = "text_cfg";
    unsupported(layer_scale(t.ls_init_value), "text_cfg.ls_init_value", "layer scale")?;
    unsupported(t.embed_cls, "text_cfg.embed_cls", "a class token")?;
    unsupported(t.output_tokens, "text_cfg.output_tokens", "token outputs")?;
    plain_block(&t.block, ctx)?;
    if t.proj_type != "linear" {
        return Err(ConfigError::Invalid("text_cfg.proj_type: align projects text linearly (\"linear\")".into()));
    }
    let width = size(t.width, ctx, "width")?;
    let heads = size(t.heads, ctx, "heads")?;
    if !width.is_multiple_of(heads) {
        return Err(ConfigError::Invalid(format!("text_cfg.width {width} is not divisible by heads {heads}")));
    }
    let encoder = EncoderConfig {
        width,
        layers: size(t.layers, ctx, "layers")?,
        heads,
        mlp_dim: mlp(width, t.mlp_ratio, ctx)?,
        layer_norm_eps: eps(t.norm_kwargs.eps, ctx)?,
        act: act(&t.act_kwargs, quick_gelu, ctx)?,
    };
    let vocab_size = size(t.vocab_size, ctx, "vocab_size")?;
    let positions = size(t.context_length, ctx, "context_length")?;
    let causal = !t.no_causal_mask;
    if custom_text && !causal && t.pool_type == "last" && t.proj_bias {
        return Ok((
            TextSpec::Siglip(SiglipTextConfig { vocab_size, max_position: positions, projection: embed_dim, encoder, masked: false }),
            TextKind::LastToken,
        ));
    }
    let pool = match t.pool_type.as_str() {
        "argmax" => TextPool::Argmax,
        "eos" => TextPool::Eos,
        "first" => TextPool::First,
        "last" => TextPool::Last,
        other => {
            return Err(ConfigError::Invalid(format!(
                "text_cfg.pool_type {other:?}: align pools one position (argmax, eos, first or last)"
            )))
        }
    };
    // With argmax pooling transformers' CLIP reads eos_token_id 2 as "the highest id".
    let eos_token_id = if pool == TextPool::Argmax { 2 } else { t.eos_id };
    let kind = if t.proj_bias { TextKind::ClipBiased } else { TextKind::Clip };
    Ok((TextSpec::Clip(ClipTextConfig { vocab_size, max_position: positions, encoder, eos_token_id, causal, pool: Some(pool) }), kind))
}

impl OpenClipModel {
    fn read(cfg: ModelCfg, folder: &Folder) -> Result<Self, ConfigError> {
        let v = cfg.vision_cfg.as_ref().ok_or(ConfigError::Invalid("model_cfg has no vision_cfg".into()))?;
        let t = cfg.text_cfg.as_ref().ok_or(ConfigError::Invalid("model_cfg has no text_cfg".into()))?;
        unsupported(cfg.multimodal_cfg.is_some(), "model_cfg.multimodal_cfg", "CoCa's captioning decoder")?;
        let embed_dim = size(cfg.embed_dim, "model_cfg", "embed_dim")?;
        let (image, image_projection) = match &v.timm_model_name {
            Some(name) => timm_tower(v, name, folder.shapes, embed_dim)?,
            None => (ImageSpec::Clip(vision_tower(v, cfg.quick_gelu)?), true),
        };
        let (text, text_kind, text_projection_hidden) = match t.hf_model_name.as_deref().filter(|n| !n.is_empty()) {
            Some(name) => {
                let (text, hidden) = hf_text_tower(t, name, folder, embed_dim)?;
                (text, TextKind::Hf, hidden)
            }
            None => {
                let (text, kind) = text_tower(t, cfg.quick_gelu, embed_dim, cfg.custom_text)?;
                (text, kind, None)
            }
        };
        if !cfg.init_logit_scale.is_finite() || cfg.init_logit_bias.is_some_and(|b| !b.is_finite()) {
            return Err(ConfigError::Invalid("model_cfg.init_logit_scale and init_logit_bias must be finite numbers".into()));
        }
        Ok(OpenClipModel {
            timm_trunk: v.timm_model_name.is_some(),
            spec: ModelSpec {
                image,
                text,
                embed_dim,
                image_projection,
                text_projection_bias: text_kind == TextKind::ClipBiased,
                text_projection_hidden,
                text_pooling: if text_kind == TextKind::Hf { TextPooling::Mean } else { TextPooling::Cls },
                temperature: TemperatureKind::Clip,
                temperature_init: (-cfg.init_logit_scale).exp(),
                logit_bias: cfg.init_logit_bias,
            },
            // open_clip builds every Hugging Face text tower as a CustomTextCLIP's.
            custom_text: cfg.custom_text || text_kind == TextKind::Hf,
            text_kind,
        })
    }
}

/// `preprocess_cfg` (absent: open_clip's defaults) as align's evaluation preprocessing at the
/// tower's `image_size` (open_clip ignores a `size` there: the model's image size wins).
pub fn preprocess_from(p: Option<&Value>, image_size: usize) -> Result<ImageConfig, ConfigError> {
    let p = match p {
        Some(v) => read::<PreprocessCfg>(v, "preprocess_cfg")?,
        None => PreprocessCfg::default(),
    };
    p.image_config(image_size)
}

impl PreprocessCfg {
    /// The evaluation preprocessing this describes, for a model of `image_size` pixels.
    pub fn image_config(&self, image_size: usize) -> Result<ImageConfig, ConfigError> {
        let three = |v: &PerChannel, key: &str| -> Result<[f32; 3], ConfigError> {
            let xs = match v {
                PerChannel::All(x) => vec![*x; 3],
                PerChannel::Each(xs) => xs.clone(),
            };
            match xs[..] {
                [a, b, c] if xs.iter().all(|x| x.is_finite()) => Ok([a as f32, b as f32, c as f32]),
                _ => Err(ConfigError::Invalid(format!("preprocess_cfg.{key} {xs:?} is not three numbers"))),
            }
        };
        let (mean, std) = (three(&self.mean, "mean")?, three(&self.std, "std")?);
        if std.iter().any(|&s| s <= 0.0) {
            return Err(ConfigError::Invalid(format!("preprocess_cfg.std {std:?} must be positive")));
        }
        let interpolation = match self.interpolation.as_str() {
            "bicubic" | "random" => Interpolation::Bicubic,
            "bilinear" => Interpolation::Bilinear,
            other => {
                return Err(ConfigError::Invalid(format!("preprocess_cfg.interpolation {other:?} is not bicubic, bilinear or random")))
            }
        };
        let resize_mode = match self.resize_mode.as_str() {
            "shortest" => ResizeMode::Shorter,
            "squash" => ResizeMode::Square,
            "longest" => ResizeMode::Longer,
            other => return Err(ConfigError::Invalid(format!("preprocess_cfg.resize_mode {other:?} is not shortest, squash or longest"))),
        };
        if self.fill_color != 0.0 {
            return Err(ConfigError::Invalid(format!("preprocess_cfg.fill_color {}: align pads with black (0)", self.fill_color)));
        }
        if self.mode != "RGB" {
            return Err(ConfigError::Invalid(format!("preprocess_cfg.mode {:?}: align reads RGB images", self.mode)));
        }
        Ok(ImageConfig {
            image_size,
            resize: image_size,
            resize_mode,
            interpolation,
            mean,
            std,
            crop_offset: CropOffset::Round,
            ..ImageConfig::default()
        })
    }
}

/// The `model_cfg` of a native CLIP model: open_clip refuses keys it does not know, so only its
/// own are written.
pub fn model_to(spec: &ModelSpec) -> Result<Value, ConfigError> {
    let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&spec.image, &spec.text) else {
        return Err(ConfigError::Unwritable("open_clip's native CLIP has CLIP's vision and text towers; this model does not (SigLIP's vision tower is a timm model in open_clip)".into()));
    };
    if !spec.image_projection || spec.temperature != TemperatureKind::Clip || spec.logit_bias.is_some() {
        return Err(ConfigError::Unwritable("open_clip's CLIP projects both towers and scales by exp(logit_scale) without a bias".into()));
    }
    if v.encoder.act != t.encoder.act || v.encoder.layer_norm_eps != t.encoder.layer_norm_eps {
        return Err(ConfigError::Unwritable("open_clip's CLIP has one activation and one LayerNorm epsilon for both towers".into()));
    }
    let quick_gelu = match v.encoder.act {
        Act::QuickGelu => true,
        Act::Gelu => false,
        Act::GeluTanh => {
            return Err(ConfigError::Unwritable("open_clip's CLIP uses GELU or quick-GELU, not GELU's tanh approximation".into()))
        }
    };
    if t.pool.is_none() && !t.pools_at_highest_id() && t.eos_token_id != t.vocab_size as u32 - 1 {
        return Err(ConfigError::Unwritable(format!(
            "the text tower pools at token {}, not at the highest id as open_clip's argmax pooling does",
            t.eos_token_id
        )));
    }
    let ratio = |e: &EncoderConfig| e.mlp_dim as f64 / e.width as f64;
    let mut vision = json!({"image_size": v.image_size, "patch_size": v.patch_size, "width": v.encoder.width, "layers": v.encoder.layers,
        "head_width": v.encoder.width / v.encoder.heads, "mlp_ratio": ratio(&v.encoder)});
    let mut text = json!({"context_length": t.max_position, "vocab_size": t.vocab_size, "width": t.encoder.width, "heads": t.encoder.heads,
        "layers": t.encoder.layers, "mlp_ratio": ratio(&t.encoder)});
    if v.encoder.layer_norm_eps != 1e-5 {
        vision["norm_kwargs"] = json!({"eps": v.encoder.layer_norm_eps});
        text["norm_kwargs"] = json!({"eps": t.encoder.layer_norm_eps});
    }
    // Only what differs from open_clip's defaults, as its own configs are written.
    if !v.pre_norm {
        vision["no_ln_pre"] = true.into();
    }
    if v.pool == VisionPool::Avg {
        vision["pool_type"] = "avg".into();
    }
    if v.norm_after_pool {
        vision["final_ln_after_pool"] = true.into();
    }
    if !t.causal {
        text["no_causal_mask"] = true.into();
    }
    match t.pool {
        Some(TextPool::Eos) => {
            text["pool_type"] = "eos".into();
            text["eos_id"] = t.eos_token_id.into();
        }
        Some(TextPool::First) => text["pool_type"] = "first".into(),
        Some(TextPool::Last) => text["pool_type"] = "last".into(),
        Some(TextPool::Argmax) | None => {}
    }
    if spec.text_projection_bias {
        text["proj_bias"] = true.into();
    }
    Ok(json!({"embed_dim": spec.embed_dim, "quick_gelu": quick_gelu, "init_logit_scale": (1.0 / spec.temperature_init).ln(),
        "vision_cfg": vision, "text_cfg": text}))
}

/// The `preprocess_cfg` of align's evaluation preprocessing, where open_clip can express it.
pub fn preprocess_to(image: &ImageConfig, image_size: usize) -> Result<Value, ConfigError> {
    if image.image_size != image_size || image.resize != image_size {
        return Err(ConfigError::Unwritable(format!(
            "open_clip resizes to the model's {image_size} px before cropping; this model is evaluated at a {} px resize and a {} px crop",
            image.resize, image.image_size
        )));
    }
    let interpolation = match image.interpolation {
        Interpolation::Bicubic => "bicubic",
        Interpolation::Bilinear => "bilinear",
        other => return Err(ConfigError::Unwritable(format!("open_clip interpolates bicubic or bilinear, not {other:?}"))),
    };
    let resize_mode = match image.resize_mode {
        ResizeMode::Shorter => "shortest",
        ResizeMode::Square => "squash",
        ResizeMode::Longer => "longest",
    };
    if image.crop_offset != CropOffset::Round && image.resize_mode == ResizeMode::Shorter {
        crate::util::log::warn(
            "open_clip's centre crop (torchvision's) rounds an odd margin where this model's (transformers') takes its floor: crops may shift by a pixel",
        );
    }
    Ok(json!({"mean": image.mean, "std": image.std, "interpolation": interpolation, "resize_mode": resize_mode}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_open_clips_and_heads_come_from_head_width() {
        let m = model_from(&json!({"embed_dim": 512, "vision_cfg": {"patch_size": 32}, "text_cfg": {}})).unwrap();
        let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&m.spec.image, &m.spec.text) else { panic!() };
        assert_eq!((v.image_size, v.encoder.width, v.encoder.heads, v.encoder.mlp_dim, v.encoder.act), (224, 768, 12, 3072, Act::Gelu));
        assert_eq!((t.vocab_size, t.max_position, t.encoder.width, t.encoder.heads), (49408, 77, 512, 8));
        assert!((m.spec.temperature_init - 0.07).abs() < 1e-9);
        // SO400M's text tower: int(1152 * 3.7362) = 4304.
        assert_eq!(mlp(1152, 3.7362, "t").unwrap(), 4304);
    }

    #[test]
    fn towers_align_does_not_build_are_named() {
        let base = || json!({"embed_dim": 16, "vision_cfg": {"width": 32, "head_width": 8}, "text_cfg": {}});
        let cases: [(&str, Value, &str); 5] = [
            ("vision_cfg", json!({"timm_model_name": "vit_base_patch16_siglip_224"}), "timm"),
            ("vision_cfg", json!({"ls_init_value": 1e-4}), "ls_init_value"),
            ("vision_cfg", json!({"layers": [3, 4, 6, 3]}), "ModifiedResNet"),
            ("text_cfg", json!({"pool_type": "none"}), "pool_type \"none\""),
            ("text_cfg", json!({"hf_model_name": "bert-base-uncased"}), "hf_model_name"),
        ];
        for (section, extra, want) in cases {
            let mut c = base();
            for (k, x) in extra.as_object().unwrap() {
                c[section][k] = x.clone();
            }
            let e = model_from(&c).unwrap_err().to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
    }

    #[test]
    fn preprocessing_reads_open_clips_modes_and_round_trips() {
        let p = preprocess_from(Some(&json!({"resize_mode": "squash", "interpolation": "bilinear", "size": 999})), 32).unwrap();
        assert_eq!((p.image_size, p.resize, p.resize_mode, p.interpolation), (32, 32, ResizeMode::Square, Interpolation::Bilinear));
        let d = preprocess_from(None, 224).unwrap();
        assert_eq!((d.resize_mode, d.interpolation, d.crop_offset), (ResizeMode::Shorter, Interpolation::Bicubic, CropOffset::Round));
        assert_eq!(preprocess_from(Some(&preprocess_to(&d, 224).unwrap()), 224).unwrap(), d);
        assert!(preprocess_from(Some(&json!({"fill_color": 255})), 32).unwrap_err().to_string().contains("fill_color"));
    }

    /// A value of the wrong type names its key; a `null` is an absent key; the refusals name
    /// theirs.
    #[test]
    fn wrong_types_name_their_key_and_nulls_are_absent() {
        let e = model_from(&json!({"vision_cfg": {"width": "wide"}, "text_cfg": {}})).unwrap_err();
        assert!(matches!(&e, ConfigError::Type { key, .. } if key == "model_cfg.vision_cfg.width"), "{e}");
        let e = preprocess_from(Some(&json!({"mean": "grey"})), 32).unwrap_err().to_string();
        assert!(e.starts_with("preprocess_cfg.mean:"), "{e}");
        let nulls = json!({"embed_dim": 16, "init_logit_bias": null, "vision_cfg": {"width": 32, "head_width": 8, "ls_init_value": null,
            "timm_model_name": null, "act_kwargs": null}, "text_cfg": {"hf_model_name": null, "norm_kwargs": null}});
        let m = model_from(&nulls).unwrap();
        assert_eq!((m.spec.logit_bias, m.spec.image.width()), (None, 32));
        let e = model_from(&json!({"vision_cfg": {"attentional_pool": true}, "text_cfg": {}})).unwrap_err();
        assert_eq!(e, ConfigError::Unsupported { key: "vision_cfg.attentional_pool".into(), what: "CoCa's attentional pooling".into() });
        let e = model_from(&json!({"vision_cfg": {"width": 1u64 << 40}, "text_cfg": {}})).unwrap_err().to_string();
        assert!(e.contains("vision_cfg.width"), "{e}");
    }
}
