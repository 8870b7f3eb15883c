//! Standard architectures by name (`model.architecture`), for training from scratch: open_clip's,
//! their `model_cfg` as its own `model_configs/*.json` give them, read as any open_clip folder's
//! config is, with the preprocessing open_clip uses for their family; and SigLIP 2's NaFlex B/16
//! as transformers' `google/siglip2-base-patch16-naflex` configures it. A model trained from one
//! is written back in open_clip's format (CLIP's), as a `SiglipModel` or as a `Siglip2Model`.

use serde_json::{json, Value};

use super::convert::{model_from, preprocess_from};
use crate::io::format::{loss_of, Usage};
use crate::model::dual_encoder::ModelSpec;

/// Which cleaning open_clip's tokenizer applies to the family's captions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// CLIP's BPE, lower-cased (`SimpleTokenizer`).
    Clip,
    /// SigLIP's canonicalised text (`clean = "canonicalize"`).
    Siglip,
}

/// A named architecture: its sizes and how it is used.
#[derive(Debug)]
pub struct Architecture {
    pub name: &'static str,
    pub family: Family,
    pub spec: ModelSpec,
    pub usage: Usage,
}

fn clip(embed_dim: usize, image: usize, patch: usize, vision: [usize; 2], text: [usize; 3]) -> Value {
    let [width, layers] = vision;
    let [text_width, heads, text_layers] = text;
    json!({"embed_dim": embed_dim,
        "vision_cfg": {"image_size": image, "layers": layers, "width": width, "patch_size": patch},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": text_width, "heads": heads, "layers": text_layers}})
}

fn siglip(trunk: &str, image: usize, embed_dim: usize, text: [usize; 4], tanh: bool) -> Value {
    let [context, vocab, width, layers] = text;
    let mut text_cfg = json!({"context_length": context, "vocab_size": vocab, "width": width, "heads": width / 64, "layers": layers,
        "no_causal_mask": true, "proj_bias": true, "pool_type": "last", "norm_kwargs": {"eps": 1e-6}});
    if tanh {
        text_cfg["act_kwargs"] = json!({"approximate": "tanh"});
    }
    json!({"embed_dim": embed_dim, "init_logit_bias": -10, "custom_text": true,
        "vision_cfg": {"image_size": image, "timm_model_name": trunk, "timm_model_pretrained": false, "timm_pool": "map", "timm_proj": "none"},
        "text_cfg": text_cfg})
}

/// The names, as open_clip spells them.
pub const NAMES: [&str; 9] = [
    "ViT-B-32",
    "ViT-B-32-256",
    "ViT-B-16",
    "ViT-L-14",
    "ViT-B-32-quickgelu",
    "ViT-B-16-quickgelu",
    "ViT-B-16-SigLIP",
    "ViT-B-16-SigLIP2",
    "siglip2-base-patch16-naflex",
];

/// SigLIP 2's NaFlex B/16: transformers' `Siglip2Config` of `google/siglip2-base-patch16-naflex`
/// (a 16×16 position grid, up to 256 patches of 16 px), its processor's preprocessing.
fn naflex_b16() -> anyhow::Result<Architecture> {
    use crate::data::transform::{ImageConfig, Interpolation, Naflex};
    use crate::model::dual_encoder::{ImageSpec, TextSpec};
    use crate::model::naflex::NaflexVisionConfig;
    use crate::model::prenorm::{Act, EncoderConfig};
    use crate::model::siglip::SiglipTextConfig;
    let encoder = EncoderConfig { width: 768, layers: 12, heads: 12, mlp_dim: 3072, layer_norm_eps: 1e-6, act: Act::GeluTanh };
    let spec = ModelSpec {
        image: ImageSpec::Naflex(NaflexVisionConfig {
            patch_size: 16,
            position_grid: 16,
            max_patches: 256,
            encoder: encoder.clone(),
            patch_dropout: 0.0,
        }),
        text: TextSpec::Siglip(SiglipTextConfig { vocab_size: 256_000, max_position: 64, encoder, projection: 768, masked: false }),
        embed_dim: 768,
        image_projection: false,
        text_projection_bias: false,
        text_projection_hidden: None,
        text_pooling: crate::model::presets::TextPooling::Cls,
        temperature: crate::model::presets::TemperatureKind::Clip,
        temperature_init: 0.1,
        logit_bias: Some(-10.0),
    };
    let naflex = Naflex { patch_size: 16, max_num_patches: 256 };
    let image = ImageConfig {
        image_size: 256,
        resize: 256,
        mean: [0.5; 3],
        std: [0.5; 3],
        interpolation: Interpolation::Bilinear,
        naflex: Some(naflex),
        ..ImageConfig::default()
    };
    let usage = Usage { image, text_len: 64, loss: loss_of(&spec) };
    Ok(Architecture { name: "siglip2-base-patch16-naflex", family: Family::Siglip, spec, usage })
}

/// `model_cfg` of a named architecture.
fn model_cfg(name: &str) -> Option<(Value, Family)> {
    let b = [768, 12];
    let clip_text = [512, 8, 12];
    let mut cfg = match name {
        "ViT-B-32" | "ViT-B-32-quickgelu" => clip(512, 224, 32, b, clip_text),
        "ViT-B-32-256" => clip(512, 256, 32, b, clip_text),
        "ViT-B-16" | "ViT-B-16-quickgelu" => clip(512, 224, 16, b, clip_text),
        "ViT-L-14" => clip(768, 224, 14, [1024, 24], [768, 12, 12]),
        "ViT-B-16-SigLIP" => return Some((siglip("vit_base_patch16_siglip_224", 224, 768, [64, 32000, 768, 12], false), Family::Siglip)),
        "ViT-B-16-SigLIP2" => return Some((siglip("vit_base_patch16_siglip_224", 224, 768, [64, 256000, 768, 12], true), Family::Siglip)),
        _ => return None,
    };
    if name.ends_with("-quickgelu") {
        cfg["quick_gelu"] = true.into();
    }
    Some((cfg, Family::Clip))
}

/// The architecture `name` is, or an error listing those there are.
pub fn architecture(name: &str) -> anyhow::Result<Architecture> {
    if name == "siglip2-base-patch16-naflex" {
        return naflex_b16();
    }
    let known = NAMES.iter().find(|n| **n == name);
    let (Some(name), Some((cfg, family))) = (known, model_cfg(name)) else {
        anyhow::bail!("model.architecture {name:?} is not one of {NAMES:?}");
    };
    let model = model_from(&cfg).map_err(|e| anyhow::anyhow!("the {name} architecture: {e}"))?;
    let spec = model.spec;
    let preprocess = match family {
        // open_clip's defaults: OpenAI's mean and std, bicubic, the shorter side resized.
        Family::Clip => None,
        Family::Siglip => {
            Some(json!({"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bicubic", "resize_mode": "squash"}))
        }
    };
    let image =
        preprocess_from(preprocess.as_ref(), spec.image.image_size()).map_err(|e| anyhow::anyhow!("the {name} architecture: {e}"))?;
    let usage = Usage { image, text_len: spec.text.max_position(), loss: loss_of(&spec) };
    Ok(Architecture { name, family, spec, usage })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dual_encoder::{ImageSpec, TextSpec};

    #[test]
    fn every_name_builds_and_clip_b32_has_open_clips_sizes() {
        for n in NAMES {
            architecture(n).unwrap_or_else(|e| panic!("{n}: {e}"));
        }
        let a = architecture("ViT-B-32").unwrap();
        let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&a.spec.image, &a.spec.text) else { panic!() };
        assert_eq!((v.image_size, v.patch_size, v.encoder.width, v.encoder.layers, v.encoder.heads), (224, 32, 768, 12, 12));
        assert_eq!((t.max_position, t.encoder.width, t.encoder.heads, a.spec.embed_dim), (77, 512, 8, 512));
        assert_eq!(a.usage.loss, crate::config::LossKind::Softmax);
        let s = architecture("ViT-B-16-SigLIP").unwrap();
        assert!(matches!((&s.spec.image, &s.spec.text), (ImageSpec::Siglip(_), TextSpec::Siglip(_))));
        assert_eq!((s.spec.logit_bias, s.usage.text_len, s.usage.loss), (Some(-10.0), 64, crate::config::LossKind::Sigmoid));
        assert!(architecture("ViT-H-14").unwrap_err().to_string().contains("ViT-B-32"));
        let n = architecture("siglip2-base-patch16-naflex").unwrap();
        assert!(matches!(&n.spec.image, ImageSpec::Naflex(v) if v.max_patches == 256 && v.position_grid == 16));
        assert_eq!(n.usage.image.naflex.map(|x| x.max_num_patches), Some(256));
    }
}
