//! A Hugging Face image processor's `preprocessor_config.json` as align's [`ImageConfig`], so a
//! checkpoint is evaluated with the pipeline it was trained and published with.
//!
//! The processors differ in their defaults (EfficientNet's crops only when told to, CLIP's always
//! crops, SigLIP's never does), so a key missing from the file takes its processor's default.
//! Anything align's evaluation transform cannot reproduce exactly (a non-square crop, a resize
//! that is switched off) is an error naming the file, never a quietly different pipeline.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::data::transform::{ImageConfig, Interpolation, ResizeMode};

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
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Resize {
    Square(usize),
    ShortestEdge(usize),
}

/// Reads `path` (a `preprocessor_config.json`) into the settings of align's evaluation transform.
pub fn read_image_config(path: &Path) -> Result<ImageConfig> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let json: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    image_config(&json).with_context(|| format!("{}: cannot reproduce this image processor", path.display()))
}

/// The settings of a parsed processor config.
pub fn image_config(json: &Value) -> Result<ImageConfig> {
    let p = parse(json)?;
    let (resize, resize_mode, image_size) = match (p.resize, p.crop) {
        (Resize::Square(s), Some(c)) => (s.max(c), ResizeMode::Square, c),
        (Resize::Square(s), None) => (s, ResizeMode::Square, s),
        (Resize::ShortestEdge(s), Some(c)) => (s.max(c), ResizeMode::Shorter, c),
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
    // transformers computes ((x · factor − offset) − mean) / std; align computes (x/255 − m) / s.
    // Both are affine in x, so they agree for m = (offset + mean) / (255 · factor) and
    // s = std / (255 · factor).
    let (mean, std) = p.normalize.unwrap_or(([0.0; 3], [1.0; 3]));
    let offset = if p.rescale_offset { 1.0 } else { 0.0 };
    let k = 255.0 * p.rescale_factor;
    let m: [f32; 3] = std::array::from_fn(|c| ((offset + mean[c]) / k) as f32);
    let s: [f32; 3] = std::array::from_fn(|c| (std[c] / k) as f32);
    let cfg = ImageConfig { image_size, resize, resize_mode, interpolation, mean: m, std: s, ..ImageConfig::default() };
    cfg.validate().map_err(anyhow::Error::msg)?;
    Ok(cfg)
}

fn parse(json: &Value) -> Result<Processor> {
    let kind = json.get("image_processor_type").and_then(Value::as_str).unwrap_or("unknown").trim_end_matches("Fast").to_string();
    let flag = |key: &str, default: bool| json.get(key).and_then(Value::as_bool).unwrap_or(default);
    let (default_crop, default_resample) = match kind.as_str() {
        "EfficientNetImageProcessor" => (false, 0),
        "CLIPImageProcessor" | "BitImageProcessor" => (true, 3),
        // ViT's processor resizes to its square (bilinear) and crops nothing.
        "ViTImageProcessor" => (false, 2),
        "SiglipImageProcessor" => (false, 3),
        _ => (true, 3),
    };
    if !flag("do_resize", true) {
        bail!("{kind}: do_resize is false, so image sizes would vary");
    }
    if flag("include_top", false) {
        bail!("{kind}: include_top (a second division by the std for EfficientNet's classifier) is not supported");
    }
    let resize = match json.get("size") {
        Some(Value::Number(n)) => Resize::Square(as_size(n.as_u64(), "size")?),
        Some(v @ Value::Object(_)) => match (v.get("shortest_edge"), v.get("height"), v.get("width")) {
            (Some(e), _, _) => Resize::ShortestEdge(as_size(e.as_u64(), "size.shortest_edge")?),
            (None, Some(h), Some(w)) if h == w => Resize::Square(as_size(h.as_u64(), "size.height")?),
            (None, Some(h), Some(w)) => bail!("{kind}: a non-square resize ({h}×{w}) is not supported"),
            _ => bail!("{kind}: size {v} has neither shortest_edge nor height and width"),
        },
        Some(v) => bail!("{kind}: size {v} is neither a number nor an object"),
        None => bail!("{kind}: no size"),
    };
    let crop = if flag("do_center_crop", default_crop) {
        Some(match json.get("crop_size") {
            Some(Value::Number(n)) => as_size(n.as_u64(), "crop_size")?,
            Some(v) => match (v.get("height"), v.get("width")) {
                (Some(h), Some(w)) if h == w => as_size(h.as_u64(), "crop_size.height")?,
                _ => bail!("{kind}: crop_size {v} is not a square"),
            },
            None => bail!("{kind}: do_center_crop without crop_size"),
        })
    } else {
        None
    };
    let resample = json.get("resample").and_then(Value::as_u64).unwrap_or(default_resample);
    let rescale_factor =
        if flag("do_rescale", true) { json.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0) } else { 1.0 };
    let normalize = if flag("do_normalize", true) {
        let three = |key: &str| -> Result<[f64; 3]> {
            let v = json.get(key).with_context(|| format!("{kind}: do_normalize without {key}"))?;
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
        Some((three("image_mean")?, three("image_std")?))
    } else {
        None
    };
    Ok(Processor { kind, resize, crop, resample, rescale_factor, rescale_offset: flag("rescale_offset", false), normalize })
}

/// The `preprocessor_config.json` of an image processor of class `kind`
/// (`EfficientNetImageProcessor`, `CLIPImageProcessor`, `SiglipImageProcessor`,
/// `ViTImageProcessor`) that preprocesses as `c` evaluates: the resize, the centre crop, the
/// resampling filter and (x/255 − mean)/std.
pub fn processor_json(c: &ImageConfig, kind: &str) -> Value {
    let resample = match c.interpolation {
        Interpolation::Nearest => 0,
        Interpolation::Lanczos => 1,
        Interpolation::Bilinear => 2,
        Interpolation::Bicubic => 3,
    };
    let size = match c.resize_mode {
        ResizeMode::Square => serde_json::json!({"height": c.resize, "width": c.resize}),
        ResizeMode::Shorter => serde_json::json!({"shortest_edge": c.resize}),
    };
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
    j
}

fn as_size(v: Option<u64>, what: &str) -> Result<usize> {
    match v {
        Some(n) if n > 0 => Ok(n as usize),
        _ => bail!("{what} is not a positive whole number"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// x in 0..=255 through transformers' formula and through align's, for every channel.
    fn agrees(json: &Value, hf: impl Fn(f64, usize) -> f64) {
        let c = image_config(json).unwrap();
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
            "rescale_factor": 1.0 / 127.5, "rescale_offset": true, "do_normalize": false, "image_mean": [0.485, 0.456, 0.406]});
        let c = image_config(&j).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode, c.interpolation), (346, 289, ResizeMode::Square, Interpolation::Bilinear));
        agrees(&j, |x, _| x / 127.5 - 1.0);
    }

    #[test]
    fn clip_processor_resizes_the_shorter_side_bicubic_with_clip_mean_and_std() {
        let mean = [0.48145466, 0.4578275, 0.40821073];
        let std = [0.26862954, 0.26130258, 0.27577711];
        let j = json!({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
            "crop_size": {"height": 224, "width": 224}, "image_mean": mean, "image_std": std});
        let c = image_config(&j).unwrap();
        assert_eq!((c.resize, c.image_size, c.resize_mode, c.interpolation), (224, 224, ResizeMode::Shorter, Interpolation::Bicubic));
        agrees(&j, |x, ch| (x / 255.0 - mean[ch]) / std[ch]);
    }

    #[test]
    fn siglip_processor_resizes_to_a_square_without_cropping() {
        let j = json!({"image_processor_type": "SiglipImageProcessor", "size": {"height": 224, "width": 224}, "resample": 3,
            "rescale_factor": 1.0 / 255.0, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]});
        let c = image_config(&j).unwrap();
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
            let back = image_config(&processor_json(&c, kind)).unwrap();
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
            (
                json!({"image_processor_type": "SiglipImageProcessor", "size": {"shortest_edge": 224}, "do_normalize": false}),
                "varying shape",
            ),
            (json!({"size": 224, "crop_size": {"height": 200, "width": 180}}), "not a square"),
            (json!({"size": 224, "crop_size": 224, "resample": 4, "do_normalize": false}), "BOX"),
            (json!({"size": 224, "crop_size": 224, "image_mean": [0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}), "three numbers"),
        ];
        for (j, why) in cases {
            let e = format!("{:#}", image_config(&j).unwrap_err());
            assert!(e.contains(why), "{j}: {e}");
        }
    }
}
