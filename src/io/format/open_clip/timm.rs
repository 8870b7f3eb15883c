//! timm's SigLIP vision transformers, the image towers of open_clip's SigLIP and SigLIP 2 models
//! (`vision_cfg.timm_model_name`, weights under `visual.trunk.*`): their sizes by name as timm
//! defines them, and their weights under align's names (transformers' `SiglipVisionModel`,
//! whose architecture they share: no class token, a final LayerNorm on every token, then a
//! learned latent attending over the tokens and a residual MLP).

use std::collections::HashMap;

use anyhow::{anyhow, Result};
use candle_core::Tensor;

use crate::io::format::config_error::ConfigError;
use crate::model::prenorm::{Act, EncoderConfig};
use crate::model::siglip::SiglipVisionConfig;

/// Tensor shapes by name, as a weights file holds them.
pub type Shapes = HashMap<String, Vec<usize>>;

/// timm's SigLIP sizes: width, depth, heads, MLP width.
const SIZES: [(&str, [usize; 4]); 4] = [
    ("base", [768, 12, 12, 3072]),
    ("large", [1024, 24, 16, 4096]),
    // mlp_ratio 3.7362, truncated as timm truncates it.
    ("so400m", [1152, 27, 16, 4304]),
    ("giantopt", [1536, 40, 16, 6144]),
];

/// The SigLIP models timm builds with GELU's tanh approximation (`act_layer='gelu_tanh'`, the
/// SigLIP 2 era's); the others use the exact GELU, timm's default.
const TANH: [&str; 7] = [
    "vit_base_patch32_siglip_256",
    "vit_large_patch16_siglip_512",
    "vit_so400m_patch16_siglip_256",
    "vit_so400m_patch16_siglip_384",
    "vit_so400m_patch16_siglip_512",
    "vit_giantopt_patch16_siglip_256",
    "vit_giantopt_patch16_siglip_384",
];

/// timm's ViTs use heads 64 wide unless their definition says otherwise.
const HEAD_WIDTH: usize = 64;

fn invalid(msg: String) -> ConfigError {
    ConfigError::Invalid(msg)
}

/// The trunk `vit_{size}_patch{p}_siglip_{image}` (a `.tag` after it ignored). A size timm's
/// SigLIP family does not have is read off the weights (`shapes`), with 64-wide heads and the
/// exact GELU, timm's defaults.
pub fn trunk(name: &str, image_size: usize, shapes: Option<&Shapes>) -> Result<SiglipVisionConfig, ConfigError> {
    let key = "vision_cfg.timm_model_name";
    let base = name.split('.').next().unwrap_or(name);
    let parts: Vec<&str> = base.split('_').collect();
    let (size, patch, image) = match parts[..] {
        ["vit", size, patch, "siglip", image] => (size, patch, image),
        ["vit", _, _, "siglip", "gap", _] => {
            return Err(ConfigError::Unsupported { key: key.into(), what: format!("{name:?}, a trunk pooled by a global average") })
        }
        _ => {
            return Err(invalid(format!(
                "{key} {name:?}: align reads timm's SigLIP vision transformers (vit_<size>_patch<p>_siglip_<image>)"
            )))
        }
    };
    let number = |s: &str, what: &str| s.parse::<usize>().map_err(|_| invalid(format!("{key} {name:?}: {what} {s:?} is not a number")));
    let patch_size = number(patch.strip_prefix("patch").unwrap_or(patch), "patch")?;
    let named_size = number(image, "image size")?;
    if named_size != image_size {
        return Err(invalid(format!("vision_cfg.image_size {image_size} differs from the {named_size} px that {name:?} is built for")));
    }
    let [width, layers, heads, mlp_dim] = match SIZES.iter().find(|(s, _)| *s == size) {
        Some((_, dims)) => *dims,
        None => {
            let shapes = shapes.ok_or_else(|| invalid(format!("{key} {name:?}: the size {size:?} is not one of timm's SigLIP sizes")))?;
            sizes_from_weights(shapes).map_err(|e| invalid(format!("{key} {name:?}: {e}")))?
        }
    };
    let act = if TANH.contains(&base) { Act::GeluTanh } else { Act::Gelu };
    Ok(SiglipVisionConfig { image_size, patch_size, encoder: EncoderConfig { width, layers, heads, mlp_dim, layer_norm_eps: 1e-6, act } })
}

fn sizes_from_weights(shapes: &Shapes) -> std::result::Result<[usize; 4], String> {
    let dim = |k: &str, i: usize| -> std::result::Result<usize, String> {
        shapes.get(k).and_then(|s| s.get(i).copied()).ok_or_else(|| format!("the weights have no {k}"))
    };
    let width = dim("visual.trunk.patch_embed.proj.weight", 0)?;
    let layers = (0..).take_while(|i| shapes.contains_key(&format!("visual.trunk.blocks.{i}.norm1.weight"))).count();
    let mlp_dim = dim("visual.trunk.blocks.0.mlp.fc1.weight", 0)?;
    if !width.is_multiple_of(HEAD_WIDTH) {
        return Err(format!("its width {width} is not a multiple of timm's {HEAD_WIDTH}-wide heads"));
    }
    Ok([width, layers, width / HEAD_WIDTH, mlp_dim])
}

/// One block's names, timm's against align's; the fused `attn.qkv` is split apart.
const BLOCK: [(&str, &str); 10] = [
    ("norm1.weight", "layer_norm1.weight"),
    ("norm1.bias", "layer_norm1.bias"),
    ("attn.proj.weight", "self_attn.out_proj.weight"),
    ("attn.proj.bias", "self_attn.out_proj.bias"),
    ("norm2.weight", "layer_norm2.weight"),
    ("norm2.bias", "layer_norm2.bias"),
    ("mlp.fc1.weight", "mlp.fc1.weight"),
    ("mlp.fc1.bias", "mlp.fc1.bias"),
    ("mlp.fc2.weight", "mlp.fc2.weight"),
    ("mlp.fc2.bias", "mlp.fc2.bias"),
];

/// Names outside the blocks, timm's (under `visual.trunk.`) against align's (under
/// `vision_model.`). The latent's query and key-value projections are fused apart.
const PLAIN: [(&str, &str); 12] = [
    ("patch_embed.proj.weight", "embeddings.patch_embedding.weight"),
    ("patch_embed.proj.bias", "embeddings.patch_embedding.bias"),
    ("norm.weight", "post_layernorm.weight"),
    ("norm.bias", "post_layernorm.bias"),
    ("attn_pool.proj.weight", "head.attention.out_proj.weight"),
    ("attn_pool.proj.bias", "head.attention.out_proj.bias"),
    ("attn_pool.norm.weight", "head.layernorm.weight"),
    ("attn_pool.norm.bias", "head.layernorm.bias"),
    ("attn_pool.mlp.fc1.weight", "head.mlp.fc1.weight"),
    ("attn_pool.mlp.fc1.bias", "head.mlp.fc1.bias"),
    ("attn_pool.mlp.fc2.weight", "head.mlp.fc2.weight"),
    ("attn_pool.mlp.fc2.bias", "head.mlp.fc2.bias"),
];

const TRUNK: &str = "visual.trunk.";
const OURS: &str = "vision_model.";

/// Moves the trunk's tensors out of `sd` into `out` under align's names.
pub fn to_align(sd: &mut HashMap<String, Tensor>, out: &mut HashMap<String, Tensor>) -> Result<()> {
    let mut take = |k: &str| sd.remove(&format!("{TRUNK}{k}")).ok_or_else(|| anyhow!("open_clip weights have no {TRUNK}{k}"));
    for (from, to) in PLAIN {
        out.insert(format!("{OURS}{to}"), take(from)?);
    }
    out.insert(format!("{OURS}embeddings.position_embedding.weight"), take("pos_embed")?.squeeze(0)?);
    out.insert(format!("{OURS}head.probe"), take("attn_pool.latent")?);
    let (q, kv) = (take("attn_pool.q.weight")?, take("attn_pool.kv.weight")?);
    out.insert(format!("{OURS}head.attention.in_proj_weight"), Tensor::cat(&[&q, &kv], 0)?);
    let (q, kv) = (take("attn_pool.q.bias")?, take("attn_pool.kv.bias")?);
    out.insert(format!("{OURS}head.attention.in_proj_bias"), Tensor::cat(&[&q, &kv], 0)?);
    for layer in 0.. {
        let at = format!("blocks.{layer}.");
        let Ok(w) = take(&format!("{at}attn.qkv.weight")) else { break };
        let b = take(&format!("{at}attn.qkv.bias"))?;
        let to = format!("{OURS}encoder.layers.{layer}.");
        let width = w.dim(1)?;
        for (i, name) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
            out.insert(format!("{to}self_attn.{name}.weight"), w.narrow(0, i * width, width)?.contiguous()?);
            out.insert(format!("{to}self_attn.{name}.bias"), b.narrow(0, i * width, width)?.contiguous()?);
        }
        for (a, b) in BLOCK {
            out.insert(format!("{to}{b}"), take(&format!("{at}{a}"))?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timms_siglip_names_give_timms_sizes() {
        let b = trunk("vit_base_patch16_siglip_224", 224, None).unwrap();
        assert_eq!((b.patch_size, b.encoder.width, b.encoder.layers, b.encoder.heads, b.encoder.mlp_dim), (16, 768, 12, 12, 3072));
        assert_eq!((b.encoder.act, b.encoder.layer_norm_eps), (Act::Gelu, 1e-6));
        let s = trunk("vit_so400m_patch16_siglip_384.v2_webli", 384, None).unwrap();
        assert_eq!((s.patch_size, s.encoder.width, s.encoder.heads, s.encoder.mlp_dim, s.encoder.act), (16, 1152, 16, 4304, Act::GeluTanh));
        let e = trunk("vit_base_patch16_siglip_224", 256, None).unwrap_err().to_string();
        assert!(e.contains("224 px"), "{e}");
        let e = trunk("vit_base_patch16_siglip_gap_224", 224, None).unwrap_err().to_string();
        assert!(e.contains("global average"), "{e}");
        let e = trunk("vit_pico_patch8_siglip_32", 32, None).unwrap_err().to_string();
        assert!(e.contains("\"pico\""), "{e}");
        let shapes: Shapes = [
            ("visual.trunk.patch_embed.proj.weight", vec![128, 3, 8, 8]),
            ("visual.trunk.blocks.0.norm1.weight", vec![128]),
            ("visual.trunk.blocks.1.norm1.weight", vec![128]),
            ("visual.trunk.blocks.0.mlp.fc1.weight", vec![512, 128]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let p = trunk("vit_pico_patch8_siglip_32", 32, Some(&shapes)).unwrap();
        assert_eq!((p.encoder.width, p.encoder.layers, p.encoder.heads, p.encoder.mlp_dim), (128, 2, 2, 512));
    }
}
