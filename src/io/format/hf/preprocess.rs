//! A Hugging Face image processor's `preprocessor_config.json` as align's [`ImageConfig`], read
//! as transformers reads it, so a checkpoint is evaluated with the pipeline it was published with.
//!
//! The class comes from `image_processor_type`, else from the legacy `feature_extractor_type`
//! (`CLIPFeatureExtractor` is `CLIPImageProcessor`), else from the model's type. The classes
//! differ in what an integer `size` means (CLIP's: the shortest edge, then its centre crop;
//! ViT's and EfficientNet's: a square) and in their defaults for absent keys, which are
//! transformers 5.x's here. Anything align's evaluation transform cannot reproduce exactly (a
//! non-square crop, a resize that is switched off, images of varying shape) is an error naming
//! the file and the setting, never a quietly different pipeline.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::data::transform::{ImageConfig, Interpolation, ResizeMode};
use crate::io::limits::{check_size, SizeKind};

/// The processor settings that decide the pixels, with each processor type's defaults applied.
#[derive(Debug, Clone, PartialEq)]
struct Processor {
    kind: String,
    resize: Resize,
    crop: Option<usize>,
    resample: u64,
    rescale_factor: f64,
    rescale_offset: bool,
    normalize: Option<([f64; 3], [f64; 3])>,
    /// EfficientNet's classifier normalisation: a second division by the std.
    include_top: Option<[f64; 3]>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Resize {
    Square(usize),
    ShortestEdge(usize),
}

const OPENAI_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const OPENAI_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
const HALF: [f64; 3] = [0.5, 0.5, 0.5];

/// An image processor class's defaults (transformers 5.x).
struct ClassDefaults {
    /// An integer `size` is a square side (`default_to_square`), else the shortest edge.
    int_is_square: bool,
    size: Resize,
    center_crop: bool,
    crop: usize,
    resample: u64,
    mean: [f64; 3],
    std: [f64; 3],
    include_top: bool,
}

/// The classes align reproduces, with their defaults.
fn class_defaults(kind: &str) -> Option<ClassDefaults> {
    let clip = ClassDefaults {
        int_is_square: false,
        size: Resize::ShortestEdge(224),
        center_crop: true,
        crop: 224,
        resample: 3,
        mean: OPENAI_MEAN,
        std: OPENAI_STD,
        include_top: false,
    };
    Some(match kind {
        "CLIPImageProcessor" | "ChineseCLIPImageProcessor" | "BitImageProcessor" => clip,
        "ViTImageProcessor" => {
            ClassDefaults { int_is_square: true, size: Resize::Square(224), center_crop: false, resample: 2, mean: HALF, std: HALF, ..clip }
        }
        "SiglipImageProcessor" => {
            ClassDefaults { int_is_square: false, size: Resize::Square(224), center_crop: false, mean: HALF, std: HALF, ..clip }
        }
        "EfficientNetImageProcessor" => ClassDefaults {
            int_is_square: true,
            size: Resize::Square(346),
            center_crop: false,
            crop: 289,
            mean: HALF,
            std: HALF,
            include_top: true,
            ..clip
        },
        _ => return None,
    })
}

/// The image processor class a model type uses when its file names none.
fn class_of_model_type(model_type: &str) -> Option<&'static str> {
    Some(match model_type {
        "clip" | "chinese_clip" => "CLIPImageProcessor",
        "siglip" => "SiglipImageProcessor",
        "align" | "efficientnet" => "EfficientNetImageProcessor",
        "vit" => "ViTImageProcessor",
        _ => return None,
    })
}

/// Reads `path` (a `preprocessor_config.json`) into the settings of align's evaluation
/// transform; `model_type` is the checkpoint's (`clip`, `siglip`, ...), used when the file
/// names no class.
pub fn read_image_config(path: &Path, model_type: Option<&str>) -> Result<ImageConfig> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let json: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    image_config(&json, model_type).with_context(|| format!("{}: cannot reproduce this image processor", path.display()))
}

/// The image preprocessing a model directory states: the `image_processor` entry of a
/// `processor_config.json` (what transformers 5.x's processors write), else its
/// `preprocessor_config.json`; `None` when it has neither.
pub fn read_dir_image_config(dir: &Path, model_type: Option<&str>) -> Result<Option<ImageConfig>> {
    let combined = dir.join("processor_config.json");
    if combined.is_file() {
        let text = std::fs::read_to_string(&combined).with_context(|| format!("reading {}", combined.display()))?;
        let json: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", combined.display()))?;
        if let Some(inner) = json.get("image_processor") {
            return image_config(inner, model_type)
                .with_context(|| format!("{}: cannot reproduce this image processor", combined.display()))
                .map(Some);
        }
    }
    let path = dir.join("preprocessor_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    read_image_config(&path, model_type).map(Some)
}

/// The settings of a parsed processor config.
pub fn image_config(json: &Value, model_type: Option<&str>) -> Result<ImageConfig> {
    let p = parse(json, model_type)?;
    let (resize, resize_mode, image_size) = match (p.resize, p.crop) {
        (Resize::Square(s), Some(c)) if s >= c => (s, ResizeMode::Square, c),
        (Resize::ShortestEdge(s), Some(c)) if s >= c => (s, ResizeMode::Shorter, c),
        (Resize::Square(s) | Resize::ShortestEdge(s), Some(c)) => {
            bail!("{}: resizing to {s} then cropping {c} pads the image with black; align does not reproduce that", p.kind)
        }
        (Resize::Square(s), None) => (s, ResizeMode::Square, s),
        (Resize::ShortestEdge(_), None) => {
            bail!("{}: a shortest-edge resize without a centre crop gives images of varying shape", p.kind)
        }
    };
    let interpolation = match p.resample {
        0 => Interpolation::Nearest,
        1 => Interpolation::Lanczos,
        2 => Interpolation::Bilinear,
        3 => Interpolation::Bicubic,
        r => bail!("{}: resample {r} (PIL's BOX or HAMMING) is not supported; 0-3 are", p.kind),
    };
    // transformers computes ((x · factor − offset) − mean) / std, then for EfficientNet's
    // include_top divides by the std once more; align computes (x/255 − m) / s. All are affine
    // in x, so they agree for m = (offset + mean) / (255 · factor) and s = std · top / (255 · factor).
    let (mean, std) = p.normalize.unwrap_or(([0.0; 3], [1.0; 3]));
    let top = p.include_top.unwrap_or([1.0; 3]);
    let offset = if p.rescale_offset { 1.0 } else { 0.0 };
    let k = 255.0 * p.rescale_factor;
    let m: [f32; 3] = std::array::from_fn(|c| ((offset + mean[c]) / k) as f32);
    let s: [f32; 3] = std::array::from_fn(|c| (std[c] * top[c] / k) as f32);
    // Transparency is dropped, as transformers' pipelines read images (`load_image` converts with
    // PIL); `alpha = "white"` gives what its processors do with a transparent image handed over
    // as it is.
    let cfg = ImageConfig { image_size, resize, resize_mode, interpolation, mean: m, std: s, ..ImageConfig::default() };
    cfg.validate().map_err(anyhow::Error::msg)?;
    Ok(cfg)
}

/// The processor class a config names, as transformers' `AutoImageProcessor` picks it.
fn class_name(json: &Value, model_type: Option<&str>) -> Result<String> {
    let named = |key: &str| -> Result<Option<String>> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => bail!("{key} is {v}, not a class name"),
        }
    };
    if let Some(kind) = named("image_processor_type")? {
        return Ok(kind.trim_end_matches("Fast").to_string());
    }
    if let Some(kind) = named("feature_extractor_type")? {
        return Ok(kind.replace("FeatureExtractor", "ImageProcessor"));
    }
    match model_type.and_then(class_of_model_type) {
        Some(kind) => Ok(kind.to_string()),
        None => bail!("it names no image_processor_type (nor feature_extractor_type), and the model type {model_type:?} implies none"),
    }
}

fn parse(json: &Value, model_type: Option<&str>) -> Result<Processor> {
    if !json.is_object() {
        bail!("it is not a JSON object");
    }
    let kind = class_name(json, model_type)?;
    let d = class_defaults(&kind).with_context(|| {
        format!("{kind} is not an image processor align reproduces (CLIPImageProcessor, ViTImageProcessor, SiglipImageProcessor, EfficientNetImageProcessor, BitImageProcessor)")
    })?;
    let flag = |key: &str, default: bool| -> Result<bool> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => bail!("{kind}: {key} is {v}, not true or false"),
        }
    };
    if !flag("do_resize", true)? {
        bail!("{kind}: do_resize is false, so image sizes would vary");
    }
    let square = flag("default_to_square", d.int_is_square)?;
    let resize = match json.get("size") {
        None | Some(Value::Null) => d.size,
        Some(Value::Number(n)) if square => Resize::Square(as_size(n.as_u64(), "size")?),
        Some(Value::Number(n)) => Resize::ShortestEdge(as_size(n.as_u64(), "size")?),
        Some(v @ Value::Object(_)) => match (v.get("shortest_edge"), v.get("height"), v.get("width")) {
            (Some(_), _, _) if v.get("longest_edge").is_some() => {
                bail!("{kind}: size {v} caps the longer side, so image shapes vary")
            }
            (Some(e), _, _) => Resize::ShortestEdge(as_size(e.as_u64(), "size.shortest_edge")?),
            (None, Some(h), Some(w)) if h == w => Resize::Square(as_size(h.as_u64(), "size.height")?),
            (None, Some(h), Some(w)) => bail!("{kind}: a non-square resize ({h}×{w}) is not supported"),
            _ => bail!("{kind}: size {v} has neither shortest_edge nor height and width"),
        },
        Some(v) => bail!("{kind}: size {v} is neither a number nor an object"),
    };
    let crop = if flag("do_center_crop", d.center_crop)? {
        Some(match json.get("crop_size") {
            None | Some(Value::Null) => d.crop,
            Some(Value::Number(n)) => as_size(n.as_u64(), "crop_size")?,
            Some(v) => match (v.get("height"), v.get("width")) {
                (Some(h), Some(w)) if h == w => as_size(h.as_u64(), "crop_size.height")?,
                _ => bail!("{kind}: crop_size {v} is not a square"),
            },
        })
    } else {
        None
    };
    let resample = match json.get("resample") {
        None | Some(Value::Null) => d.resample,
        Some(v) => v.as_u64().with_context(|| format!("{kind}: resample is {v}, not a PIL filter number"))?,
    };
    let rescale_factor = if flag("do_rescale", true)? {
        match json.get("rescale_factor") {
            None | Some(Value::Null) => 1.0 / 255.0,
            Some(v) => v
                .as_f64()
                .filter(|f| *f > 0.0 && f.is_finite())
                .with_context(|| format!("{kind}: rescale_factor is {v}; it must be a positive number"))?,
        }
    } else {
        1.0
    };
    let three = |key: &str, default: [f64; 3]| -> Result<[f64; 3]> {
        let Some(v) = json.get(key).filter(|v| !v.is_null()) else { return Ok(default) };
        let xs: Vec<f64> = match v {
            Value::Number(n) => vec![n.as_f64().unwrap_or(f64::NAN); 3],
            Value::Array(a) => a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect(),
            _ => vec![],
        };
        match xs[..] {
            [a, b, c] if xs.iter().all(|x| x.is_finite()) => Ok([a, b, c]),
            _ => bail!("{kind}: {key} {v} is not three numbers"),
        }
    };
    let std = three("image_std", d.std)?;
    if std.iter().any(|&s| s <= 0.0) {
        bail!("{kind}: image_std {std:?} must be positive");
    }
    let normalize = if flag("do_normalize", true)? { Some((three("image_mean", d.mean)?, std)) } else { None };
    let include_top = flag("include_top", d.include_top)? && kind == "EfficientNetImageProcessor";
    Ok(Processor {
        kind: kind.clone(),
        resize,
        crop,
        resample,
        rescale_factor,
        rescale_offset: flag("rescale_offset", false)?,
        normalize,
        include_top: include_top.then_some(std),
    })
}

/// The `preprocessor_config.json` of an image processor of class `kind`
/// (`EfficientNetImageProcessor`, `CLIPImageProcessor`, `SiglipImageProcessor`,
/// `ViTImageProcessor`) that preprocesses as `c` evaluates: the resize, the centre crop, the
/// resampling filter and (x/255 − mean)/std.
pub fn processor_json(c: &ImageConfig, kind: &str) -> Result<Value> {
    let resample = match c.interpolation {
        Interpolation::Nearest => 0,
        Interpolation::Lanczos => 1,
        Interpolation::Bilinear => 2,
        Interpolation::Bicubic => 3,
    };
    let size = match c.resize_mode {
        ResizeMode::Square => serde_json::json!({"height": c.resize, "width": c.resize}),
        ResizeMode::Shorter => serde_json::json!({"shortest_edge": c.resize}),
        ResizeMode::Longer => {
            bail!("transformers' image processors cannot resize the longer side and pad (open_clip's resize_mode \"longest\")")
        }
    };
    if c.crop_offset != crate::data::transform::CropOffset::Floor && c.resize_mode == ResizeMode::Shorter {
        crate::util::log::warn(
            "transformers' centre crop starts an odd margin at its floor where this model's (torchvision's) rounds to even: crops may shift by a pixel",
        );
    }
    let three = |v: [f32; 3]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let mut j = serde_json::json!({
        "image_processor_type": kind,
        "do_resize": true,
        "size": size,
        "resample": resample,
        "do_center_crop": c.resize != c.image_size || c.resize_mode == ResizeMode::Shorter,
        "crop_size": {"height": c.image_size, "width": c.image_size},
        "do_rescale": true,
        "rescale_factor": 1.0 / 255.0,
        "do_normalize": true,
        "image_mean": three(c.mean),
        "image_std": three(c.std),
        "do_convert_rgb": true,
    });
    if kind == "EfficientNetImageProcessor" {
        // Its defaults offset the rescale and add a second normalisation for the classifier.
        j["rescale_offset"] = Value::Bool(false);
        j["include_top"] = Value::Bool(false);
    }
    Ok(j)
}

fn as_size(v: Option<u64>, what: &str) -> Result<usize> {
    match v {
        Some(n) => check_size(n as usize, SizeKind::Pixels, what).map_err(anyhow::Error::msg),
        None => bail!("{what} is not a positive whole number"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// x in 0..=255 through transformers' formula and through align's, for every channel.
    fn agrees(json: &Value, hf: impl Fn(f64, usize) -> f64) {
        let c = image_config(json, None).unwrap();
        for x in [0.0, 1.0, 77.0, 128.0, 255.0] {
            for ch in 0..3 {
                let ours = (x / 255.0 - c.mean[ch] as f64) / c.std[ch] as f64;
                assert!((ours - hf(x, ch)).abs() < 1e-5, "x={x} channel {ch}: {ours} vs {}", hf(x, ch));
            }
        }
    }

    #[test]
    fn align_base_processor_is_square_346_crop_289_bilinear_minus_one_to_one() {
        let j = json!({"image_processor_type": "EfficientNetImageProcessor", "size": {"height": 346, "width": 346},
            "crop_size": {"height": 289, "width": 289}, "do_center_crop": true, "resample": 2,
            "rescale_factor": 1.0 / 127.5, "rescale_offset": true, "do_normalize": false, "include_top": false,
            "image_mean": [0.485, 0.456, 0.406]});
        let c = image_config(&j, None).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode, c.interpolation), (346, 289, ResizeMode::Square, Interpolation::Bilinear));
        agrees(&j, |x, _| x / 127.5 - 1.0);
    }

    #[test]
    fn clip_processor_resizes_the_shorter_side_bicubic_with_clip_mean_and_std() {
        let mean = [0.48145466, 0.4578275, 0.40821073];
        let std = [0.26862954, 0.26130258, 0.27577711];
        let j = json!({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
            "crop_size": {"height": 224, "width": 224}, "image_mean": mean, "image_std": std});
        let c = image_config(&j, None).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode, c.interpolation), (224, 224, ResizeMode::Shorter, Interpolation::Bicubic));
        agrees(&j, |x, ch| (x / 255.0 - mean[ch]) / std[ch]);
    }

    /// The legacy forms of the hub's oldest repositories, as transformers reads them: an integer
    /// `size` is CLIP's shortest edge (then its default centre crop) but ViT's square.
    #[test]
    fn legacy_feature_extractor_configs_read_per_class() {
        let clip = json!({"crop_size": 224, "do_center_crop": true, "do_normalize": true, "do_resize": true,
            "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 224});
        let c = image_config(&clip, None).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode, c.interpolation), (224, 224, ResizeMode::Shorter, Interpolation::Bicubic));
        let vit = json!({"do_normalize": true, "do_resize": true, "feature_extractor_type": "ViTFeatureExtractor",
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224});
        let c = image_config(&vit, None).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode, c.interpolation), (224, 224, ResizeMode::Square, Interpolation::Bilinear));
        // No class at all: the model type decides; absent keys take the class's defaults.
        let c = image_config(&json!({"size": 256}), Some("clip")).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode), (256, 224, ResizeMode::Shorter));
    }

    /// EfficientNet's processor divides by the std a second time unless `include_top` is false,
    /// which transformers 5.x defaults to true.
    #[test]
    fn efficientnet_include_top_divides_by_the_std_twice() {
        let j = json!({"image_processor_type": "EfficientNetImageProcessor", "size": {"height": 32, "width": 32},
            "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]});
        let (mean, std) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
        agrees(&j, |x, ch| (x / 255.0 - mean[ch]) / std[ch] / std[ch]);
    }

    #[test]
    fn siglip_processor_resizes_to_a_square_without_cropping() {
        let j = json!({"image_processor_type": "SiglipImageProcessor", "size": {"height": 224, "width": 224}, "resample": 3,
            "rescale_factor": 1.0 / 255.0, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]});
        let c = image_config(&j, None).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode), (224, 224, ResizeMode::Square));
        agrees(&j, |x, _| (x / 255.0 - 0.5) / 0.5);
    }

    /// What align writes for a checkpoint reads back as the same preprocessing.
    #[test]
    fn written_processor_configs_read_back_unchanged() {
        let clip = ImageConfig {
            image_size: 224,
            resize: 224,
            resize_mode: ResizeMode::Shorter,
            interpolation: Interpolation::Bicubic,
            mean: [0.48145466, 0.4578275, 0.40821073],
            std: [0.268_629_5, 0.261_302_6, 0.275_777_1],
            ..Default::default()
        };
        for (c, kind) in [(ImageConfig::default(), "EfficientNetImageProcessor"), (clip, "CLIPImageProcessor")] {
            let back = image_config(&processor_json(&c, kind).unwrap(), None).unwrap();
            assert_eq!(
                (back.image_size, back.resize, back.resize_mode, back.interpolation),
                (c.image_size, c.resize, c.resize_mode, c.interpolation),
                "{kind}"
            );
            for ch in 0..3 {
                assert!((back.mean[ch] - c.mean[ch]).abs() < 1e-6 && (back.std[ch] - c.std[ch]).abs() < 1e-6, "{kind}");
            }
        }
    }

    #[test]
    fn pipelines_align_cannot_reproduce_are_errors_that_say_why() {
        let cases = [
            (json!({"size": {"height": 224, "width": 256}}), "non-square resize"),
            (json!({"size": 224, "do_resize": false}), "do_resize"),
            (json!({"feature_extractor_type": "SiglipFeatureExtractor", "size": 224}), "varying shape"),
            (
                json!({"image_processor_type": "SiglipImageProcessor", "size": {"shortest_edge": 224}, "do_normalize": false}),
                "varying shape",
            ),
            (json!({"size": 224, "crop_size": {"height": 200, "width": 180}}), "not a square"),
            (json!({"size": 224, "crop_size": 224, "resample": 4, "do_normalize": false}), "BOX"),
            (json!({"image_processor_type": "MysteryImageProcessor", "size": 224}), "MysteryImageProcessor is not an image processor"),
            (json!({"size": {"shortest_edge": 1_000_000}}), "size.shortest_edge is 1000000"),
            (json!({"size": 224, "rescale_factor": 0}), "rescale_factor is 0"),
            (json!({"size": 224, "do_center_crop": "yes"}), "do_center_crop is \"yes\""),
            (json!({"size": 200, "crop_size": 224}), "pads the image"),
            (json!({"size": 224, "crop_size": 224, "image_mean": [0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}), "three numbers"),
        ];
        for (j, why) in cases {
            let e = format!("{:#}", image_config(&j, Some("clip")).unwrap_err());
            assert!(e.contains(why), "{j}: {e}");
        }
    }
}
