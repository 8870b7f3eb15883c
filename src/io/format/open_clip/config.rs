//! `open_clip_config.json`: its `model_cfg` as align's model sizes and back, and its
//! `preprocess_cfg` as align's image preprocessing, with open_clip 3.x's defaults for absent
//! keys. Options that change the architecture in ways align's towers do not follow (a timm or
//! Hugging Face tower, a ResNet, layer scale, CoCa's pooling, ...) are errors naming the key.

use serde_json::{json, Value};

use crate::data::transform::{CropOffset, ImageConfig, Interpolation, ResizeMode};
use crate::io::format::hf::towers::{f64_or, usize_or};
use crate::model::clip::{ClipTextConfig, ClipVisionConfig};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::prenorm::{Act, EncoderConfig};
use crate::model::presets::{TemperatureKind, TextPooling};
use crate::model::siglip::SiglipTextConfig;

pub const OPENAI_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const OPENAI_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// The text tower's kind: CLIP's causal transformer pooled at the end token (native `CLIP`), or a
/// bidirectional one pooled at its last position through a linear head with a bias (SigLIP-style
/// text of a `CustomTextCLIP`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextKind {
    Clip,
    LastToken,
}

/// What `model_cfg` says beyond the sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenClipModel {
    pub spec: ModelSpec,
    /// Keys of the text tower under `text.` (`CustomTextCLIP`) instead of the top level.
    pub custom_text: bool,
    pub text_kind: TextKind,
}

fn get<'a>(c: &'a Value, key: &str) -> Option<&'a Value> {
    c.get(key).filter(|v| !v.is_null())
}

fn flag(c: &Value, key: &str, ctx: &str) -> Result<bool, String> {
    match get(c, key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(format!("{ctx}.{key} is {v}, not true or false")),
    }
}

fn string<'a>(c: &'a Value, key: &str, default: &'a str, ctx: &str) -> Result<&'a str, String> {
    match get(c, key) {
        None => Ok(default),
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(format!("{ctx}.{key} is {v}, not a name")),
    }
}

/// The options align's towers do not have, each an error naming the key when set.
fn refuse(c: &Value, ctx: &str, keys: &[(&str, &str)]) -> Result<(), String> {
    for (key, why) in keys {
        let set = match get(c, key) {
            None | Some(Value::Bool(false)) => false,
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(_) => true,
        };
        if set {
            return Err(format!("{ctx}.{key} is set: {why}, which align does not build"));
        }
    }
    Ok(())
}

const CUSTOM_BLOCK: [(&str, &str); 6] = [
    ("qk_norm", "a custom attention block"),
    ("scaled_cosine_attn", "a custom attention block"),
    ("scale_heads", "a custom attention block"),
    ("scale_attn_inner", "a custom attention block"),
    ("scale_attn", "a custom attention block"),
    ("scale_fc", "a custom attention block"),
];

fn eps(c: &Value, ctx: &str) -> Result<f64, String> {
    let norm = get(c, "norm_kwargs").cloned().unwrap_or(json!({}));
    let e = f64_or(&norm, "eps", 1e-5, &format!("{ctx}.norm_kwargs"))?;
    if !(e > 0.0 && e < 1.0) {
        return Err(format!("{ctx}.norm_kwargs.eps is {e}; it must be a small positive number"));
    }
    Ok(e)
}

fn act(c: &Value, quick_gelu: bool, ctx: &str) -> Result<Act, String> {
    if quick_gelu {
        return Ok(Act::QuickGelu);
    }
    let kwargs = get(c, "act_kwargs").cloned().unwrap_or(json!({}));
    match string(&kwargs, "approximate", "none", &format!("{ctx}.act_kwargs"))? {
        "none" => Ok(Act::Gelu),
        "tanh" => Ok(Act::GeluTanh),
        other => Err(format!("{ctx}.act_kwargs.approximate {other:?} is not \"none\" or \"tanh\"")),
    }
}

fn mlp(width: usize, c: &Value, ctx: &str) -> Result<usize, String> {
    let ratio = f64_or(c, "mlp_ratio", 4.0, ctx)?;
    if !(ratio > 0.0 && ratio <= 64.0) {
        return Err(format!("{ctx}.mlp_ratio is {ratio}"));
    }
    // open_clip truncates: int(width * mlp_ratio).
    Ok((width as f64 * ratio) as usize)
}

fn image_size(v: &Value) -> Result<usize, String> {
    match get(v, "image_size") {
        Some(Value::Array(a)) => match a.as_slice() {
            [h, w] if h == w => usize_or(&json!({"image_size": h}), "image_size", 224, "vision_cfg"),
            _ => Err(format!("vision_cfg.image_size {a:?} is not square; align's towers take square images")),
        },
        _ => usize_or(v, "image_size", 224, "vision_cfg"),
    }
}

/// `model_cfg` as align's model sizes.
pub fn model_from(cfg: &Value) -> Result<OpenClipModel, String> {
    if !cfg.is_object() {
        return Err("open_clip_config.json has no model_cfg object".into());
    }
    let v = get(cfg, "vision_cfg").filter(|v| v.is_object()).ok_or("model_cfg has no vision_cfg")?;
    let t = get(cfg, "text_cfg").filter(|v| v.is_object()).ok_or("model_cfg has no text_cfg")?;
    refuse(cfg, "model_cfg", &[("multimodal_cfg", "CoCa's captioning decoder")])?;
    if get(v, "timm_model_name").is_some() {
        return Err("vision_cfg.timm_model_name: the image tower is a timm model (visual.trunk.*), which align does not read; its SigLIP checkpoints are read in the Hugging Face SiglipModel format".into());
    }
    if get(t, "hf_model_name").is_some() {
        return Err(
            "text_cfg.hf_model_name: the text tower is a Hugging Face model, which align does not read in open_clip's format".into()
        );
    }
    if get(v, "layers").is_some_and(Value::is_array) {
        return Err("vision_cfg.layers is a list: a ModifiedResNet image tower, which align does not build".into());
    }
    refuse(
        v,
        "vision_cfg",
        &[
            ("ls_init_value", "layer scale"),
            ("attentional_pool", "CoCa's attentional pooling"),
            ("no_ln_pre", "a tower without ln_pre"),
            ("final_ln_after_pool", "LayerNorm after pooling"),
            ("output_tokens", "token outputs"),
            ("block_type", "a custom block"),
        ],
    )?;
    refuse(v, "vision_cfg", &CUSTOM_BLOCK)?;
    refuse(t, "text_cfg", &[("ls_init_value", "layer scale"), ("embed_cls", "a class token"), ("output_tokens", "token outputs")])?;
    refuse(t, "text_cfg", &CUSTOM_BLOCK)?;
    if string(v, "pool_type", "tok", "vision_cfg")? != "tok" {
        return Err(format!("vision_cfg.pool_type {:?}: align pools the class token (\"tok\")", v["pool_type"]));
    }
    if string(v, "pos_embed_type", "learnable", "vision_cfg")? != "learnable" {
        return Err("vision_cfg.pos_embed_type: align learns its position embeddings (\"learnable\")".into());
    }
    if string(t, "proj_type", "linear", "text_cfg")? != "linear" {
        return Err("text_cfg.proj_type: align projects text linearly (\"linear\")".into());
    }
    let quick_gelu = flag(cfg, "quick_gelu", "model_cfg")?;
    let embed_dim = usize_or(cfg, "embed_dim", 512, "model_cfg")?;

    let vw = usize_or(v, "width", 768, "vision_cfg")?;
    let head_width = usize_or(v, "head_width", 64, "vision_cfg")?;
    if !vw.is_multiple_of(head_width) {
        return Err(format!("vision_cfg.width {vw} is not a multiple of head_width {head_width}"));
    }
    let vision = ClipVisionConfig {
        image_size: image_size(v)?,
        patch_size: usize_or(v, "patch_size", 16, "vision_cfg")?,
        encoder: EncoderConfig {
            width: vw,
            layers: usize_or(v, "layers", 12, "vision_cfg")?,
            heads: vw / head_width,
            mlp_dim: mlp(vw, v, "vision_cfg")?,
            layer_norm_eps: eps(v, "vision_cfg")?,
            act: act(v, quick_gelu, "vision_cfg")?,
        },
    };
    if !vision.image_size.is_multiple_of(vision.patch_size) {
        return Err(format!("vision_cfg.image_size {} is not a multiple of patch_size {}", vision.image_size, vision.patch_size));
    }
    let tw = usize_or(t, "width", 512, "text_cfg")?;
    let heads = usize_or(t, "heads", 8, "text_cfg")?;
    if !tw.is_multiple_of(heads) {
        return Err(format!("text_cfg.width {tw} is not divisible by heads {heads}"));
    }
    let encoder = EncoderConfig {
        width: tw,
        layers: usize_or(t, "layers", 12, "text_cfg")?,
        heads,
        mlp_dim: mlp(tw, t, "text_cfg")?,
        layer_norm_eps: eps(t, "text_cfg")?,
        act: act(t, quick_gelu, "text_cfg")?,
    };
    let vocab_size = usize_or(t, "vocab_size", 49408, "text_cfg")?;
    let positions = usize_or(t, "context_length", 77, "text_cfg")?;
    let causal = !flag(t, "no_causal_mask", "text_cfg")?;
    let pool = string(t, "pool_type", "argmax", "text_cfg")?;
    let proj_bias = flag(t, "proj_bias", "text_cfg")?;
    let (text, text_kind) = match (causal, pool, proj_bias) {
        (true, "argmax", false) => {
            // argmax pools at the highest id: what a CLIP config with eos_token_id 2 makes
            // transformers (and align) do.
            (TextSpec::Clip(ClipTextConfig { vocab_size, max_position: positions, encoder, eos_token_id: 2 }), TextKind::Clip)
        }
        (false, "last", true) => {
            (TextSpec::Siglip(SiglipTextConfig { vocab_size, max_position: positions, projection: embed_dim, encoder }), TextKind::LastToken)
        }
        _ => {
            return Err(format!(
                "text_cfg: no_causal_mask {}, pool_type {pool:?}, proj_bias {proj_bias}: align reads CLIP's text tower (causal, \"argmax\", no projection bias) and SigLIP's (no causal mask, \"last\", a projection bias)",
                !causal
            ))
        }
    };
    let init_scale = f64_or(cfg, "init_logit_scale", (1.0f64 / 0.07).ln(), "model_cfg")?;
    let logit_bias = match get(cfg, "init_logit_bias") {
        None => None,
        Some(b) => Some(b.as_f64().ok_or_else(|| format!("model_cfg.init_logit_bias is {b}, not a number"))?),
    };
    let custom_text = flag(cfg, "custom_text", "model_cfg")?;
    if text_kind == TextKind::LastToken && !custom_text {
        return Err("text_cfg: a bidirectional text tower pooled at its last token outside custom_text (CLIPA) is not read by align".into());
    }
    Ok(OpenClipModel {
        spec: ModelSpec {
            image: ImageSpec::Clip(vision),
            text,
            embed_dim,
            image_projection: true,
            text_projection_bias: false,
            text_pooling: TextPooling::Cls,
            temperature: TemperatureKind::Clip,
            temperature_init: (-init_scale).exp(),
            logit_bias,
        },
        custom_text,
        text_kind,
    })
}

/// The `model_cfg` of a native CLIP model: open_clip refuses keys it does not know, so only its
/// own are written.
pub fn model_to(spec: &ModelSpec) -> Result<Value, String> {
    let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&spec.image, &spec.text) else {
        return Err("open_clip's native CLIP has CLIP's vision and text towers; this model does not (SigLIP's vision tower is a timm model in open_clip)".into());
    };
    if !spec.image_projection || spec.text_projection_bias || spec.temperature != TemperatureKind::Clip || spec.logit_bias.is_some() {
        return Err("open_clip's CLIP projects both towers without a bias and scales by exp(logit_scale)".into());
    }
    if v.encoder.act != t.encoder.act || v.encoder.layer_norm_eps != t.encoder.layer_norm_eps {
        return Err("open_clip's CLIP has one activation and one LayerNorm epsilon for both towers".into());
    }
    let quick_gelu = match v.encoder.act {
        Act::QuickGelu => true,
        Act::Gelu => false,
        Act::GeluTanh => return Err("open_clip's CLIP uses GELU or quick-GELU, not GELU's tanh approximation".into()),
    };
    if !t.pools_at_highest_id() && t.eos_token_id != t.vocab_size as u32 - 1 {
        return Err(format!("the text tower pools at token {}, not at the highest id as open_clip's argmax pooling does", t.eos_token_id));
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
    Ok(json!({"embed_dim": spec.embed_dim, "quick_gelu": quick_gelu, "init_logit_scale": (1.0 / spec.temperature_init).ln(),
        "vision_cfg": vision, "text_cfg": text}))
}

/// `preprocess_cfg` as align's evaluation preprocessing at the tower's `image_size` (open_clip
/// ignores a `size` there: the model's image size wins).
pub fn preprocess_from(p: Option<&Value>, image_size: usize) -> Result<ImageConfig, String> {
    let empty = json!({});
    let p = p.unwrap_or(&empty);
    let three = |key: &str, default: [f64; 3]| -> Result<[f32; 3], String> {
        let xs: Vec<f64> = match get(p, key) {
            None => default.to_vec(),
            Some(Value::Number(n)) => vec![n.as_f64().unwrap_or(f64::NAN); 3],
            Some(Value::Array(a)) => a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect(),
            Some(v) => return Err(format!("preprocess_cfg.{key} is {v}, not three numbers")),
        };
        match xs[..] {
            [a, b, c] if xs.iter().all(|x| x.is_finite()) => Ok([a as f32, b as f32, c as f32]),
            _ => Err(format!("preprocess_cfg.{key} {xs:?} is not three numbers")),
        }
    };
    let (mean, std) = (three("mean", OPENAI_MEAN)?, three("std", OPENAI_STD)?);
    if std.iter().any(|&s| s <= 0.0) {
        return Err(format!("preprocess_cfg.std {std:?} must be positive"));
    }
    let interpolation = match string(p, "interpolation", "bicubic", "preprocess_cfg")? {
        "bicubic" | "random" => Interpolation::Bicubic,
        "bilinear" => Interpolation::Bilinear,
        other => return Err(format!("preprocess_cfg.interpolation {other:?} is not bicubic, bilinear or random")),
    };
    let resize_mode = match string(p, "resize_mode", "shortest", "preprocess_cfg")? {
        "shortest" => ResizeMode::Shorter,
        "squash" => ResizeMode::Square,
        "longest" => ResizeMode::Longer,
        other => return Err(format!("preprocess_cfg.resize_mode {other:?} is not shortest, squash or longest")),
    };
    if let Some(fill) = get(p, "fill_color").filter(|f| f.as_f64() != Some(0.0)) {
        return Err(format!("preprocess_cfg.fill_color {fill}: align pads with black (0)"));
    }
    if let Some(mode) = get(p, "mode").filter(|m| m.as_str() != Some("RGB")) {
        return Err(format!("preprocess_cfg.mode {mode}: align reads RGB images"));
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

/// The `preprocess_cfg` of align's evaluation preprocessing, where open_clip can express it.
pub fn preprocess_to(image: &ImageConfig, image_size: usize) -> Result<Value, String> {
    if image.image_size != image_size || image.resize != image_size {
        return Err(format!(
            "open_clip resizes to the model's {image_size} px before cropping; this model is evaluated at a {} px resize and a {} px crop",
            image.resize, image.image_size
        ));
    }
    let interpolation = match image.interpolation {
        Interpolation::Bicubic => "bicubic",
        Interpolation::Bilinear => "bilinear",
        other => return Err(format!("open_clip interpolates bicubic or bilinear, not {other:?}")),
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
        assert_eq!(mlp(1152, &json!({"mlp_ratio": 3.7362}), "t").unwrap(), 4304);
    }

    #[test]
    fn towers_align_does_not_build_are_named() {
        let base = || json!({"embed_dim": 16, "vision_cfg": {"width": 32, "head_width": 8}, "text_cfg": {}});
        let cases: [(&str, Value, &str); 5] = [
            ("vision_cfg", json!({"timm_model_name": "vit_base_patch16_siglip_224"}), "timm"),
            ("vision_cfg", json!({"ls_init_value": 1e-4}), "ls_init_value"),
            ("vision_cfg", json!({"layers": [3, 4, 6, 3]}), "ModifiedResNet"),
            ("text_cfg", json!({"pool_type": "eos"}), "pool_type \"eos\""),
            ("text_cfg", json!({"hf_model_name": "xlm-roberta-base"}), "hf_model_name"),
        ];
        for (section, extra, want) in cases {
            let mut c = base();
            for (k, x) in extra.as_object().unwrap() {
                c[section][k] = x.clone();
            }
            let e = model_from(&c).unwrap_err();
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
        assert!(preprocess_from(Some(&json!({"fill_color": 255})), 32).unwrap_err().contains("fill_color"));
    }
}
