//! open_clip's parameter names and layouts against align's (which are transformers' CLIP names):
//! the fused attention input projection `in_proj_weight` (rows q, k, v) against three
//! projections, `visual.proj` and `text_projection` applied as `x @ P` against `[out, in]`
//! linear weights, and the renamed LayerNorms and MLP layers. The mapping is exact and invertible.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::Tensor;

use super::convert::TextKind;

/// One residual block's names, open_clip's against align's.
const BLOCK: [(&str, &str); 10] = [
    ("ln_1.weight", "layer_norm1.weight"),
    ("ln_1.bias", "layer_norm1.bias"),
    ("attn.out_proj.weight", "self_attn.out_proj.weight"),
    ("attn.out_proj.bias", "self_attn.out_proj.bias"),
    ("ln_2.weight", "layer_norm2.weight"),
    ("ln_2.bias", "layer_norm2.bias"),
    ("mlp.c_fc.weight", "mlp.fc1.weight"),
    ("mlp.c_fc.bias", "mlp.fc1.bias"),
    ("mlp.c_proj.weight", "mlp.fc2.weight"),
    ("mlp.c_proj.bias", "mlp.fc2.bias"),
];

/// Names outside the blocks (vision, then text with `{t}` for its prefix), open_clip's against
/// align's. The projections are handled apart: they are transposed.
const PLAIN: [(&str, &str); 9] = [
    ("visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight"),
    ("visual.class_embedding", "vision_model.embeddings.class_embedding"),
    ("visual.positional_embedding", "vision_model.embeddings.position_embedding.weight"),
    ("visual.ln_pre.weight", "vision_model.pre_layrnorm.weight"),
    ("visual.ln_pre.bias", "vision_model.pre_layrnorm.bias"),
    ("visual.ln_post.weight", "vision_model.post_layernorm.weight"),
    ("visual.ln_post.bias", "vision_model.post_layernorm.bias"),
    ("logit_scale", "logit_scale"),
    ("logit_bias", "logit_bias"),
];

const TEXT_PLAIN: [(&str, &str); 4] = [
    ("token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
    ("positional_embedding", "text_model.embeddings.position_embedding.weight"),
    ("ln_final.weight", "text_model.final_layer_norm.weight"),
    ("ln_final.bias", "text_model.final_layer_norm.bias"),
];

/// An open_clip state dict under align's names. `text_prefix` is `"text."` for a
/// `CustomTextCLIP`, `""` for a native `CLIP`.
/// `timm_trunk`: the image tower is a timm trunk (`visual.trunk.*`, then `visual.head.proj`).
pub fn to_align(mut sd: HashMap<String, Tensor>, text_prefix: &str, text: TextKind, timm_trunk: bool) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    let take = |sd: &mut HashMap<String, Tensor>, from: &str| sd.remove(from).ok_or_else(|| anyhow!("open_clip weights have no {from}"));
    if timm_trunk {
        super::timm::to_align(&mut sd, &mut out)?;
        if let Some(p) = sd.remove("visual.head.proj.weight") {
            out.insert("visual_projection.weight".into(), p);
        }
    }
    for (from, to) in PLAIN {
        if timm_trunk && from.starts_with("visual.") {
            continue;
        }
        match sd.remove(from) {
            Some(t) => {
                // A 0-d parameter may be stored as [1] (nonscalar_logit_scale).
                let t = if from.starts_with("logit_") && t.dims() == [1] { t.squeeze(0)? } else { t };
                out.insert(to.to_string(), t);
            }
            // CLIPA's towers have no ln_pre; whether the model needs one is the spec's to say.
            None if from == "logit_bias" || from.starts_with("visual.ln_pre.") => {}
            None => bail!("open_clip weights have no {from}"),
        }
    }
    if text == TextKind::Hf {
        hf_text_to_align(&mut sd, &mut out)?;
    } else {
        for (from, to) in TEXT_PLAIN {
            out.insert(to.to_string(), take(&mut sd, &format!("{text_prefix}{from}"))?);
        }
    }
    if !timm_trunk {
        out.insert("visual_projection.weight".into(), take(&mut sd, "visual.proj")?.t()?.contiguous()?);
    }
    match text {
        TextKind::Clip => {
            out.insert("text_projection.weight".into(), take(&mut sd, &format!("{text_prefix}text_projection"))?.t()?.contiguous()?);
        }
        TextKind::ClipBiased => {
            out.insert("text_projection.weight".into(), take(&mut sd, &format!("{text_prefix}text_projection.weight"))?);
            out.insert("text_projection.bias".into(), take(&mut sd, &format!("{text_prefix}text_projection.bias"))?);
        }
        TextKind::Hf => {}
        TextKind::LastToken => {
            out.insert("text_model.head.weight".into(), take(&mut sd, &format!("{text_prefix}text_projection.weight"))?);
            out.insert("text_model.head.bias".into(), take(&mut sd, &format!("{text_prefix}text_projection.bias"))?);
        }
    }
    for (from_prefix, to_prefix) in [
        ("visual.transformer.resblocks.", "vision_model.encoder.layers."),
        (&format!("{text_prefix}transformer.resblocks."), "text_model.encoder.layers."),
    ] {
        for layer in 0.. {
            let at = format!("{from_prefix}{layer}.");
            if !sd.contains_key(&format!("{at}attn.in_proj_weight")) {
                break;
            }
            let to = format!("{to_prefix}{layer}.");
            for (a, b) in BLOCK {
                out.insert(format!("{to}{b}"), take(&mut sd, &format!("{at}{a}"))?);
            }
            let w = take(&mut sd, &format!("{at}attn.in_proj_weight"))?;
            let b = take(&mut sd, &format!("{at}attn.in_proj_bias"))?;
            let width = w.dim(1)?;
            for (i, name) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                out.insert(format!("{to}self_attn.{name}.weight"), w.narrow(0, i * width, width)?.contiguous()?);
                out.insert(format!("{to}self_attn.{name}.bias"), b.narrow(0, i * width, width)?.contiguous()?);
            }
        }
    }
    // The causal mask is a buffer some old checkpoints stored; everything else must have been used.
    sd.retain(|k, _| !k.ends_with("attn_mask"));
    if !sd.is_empty() {
        let mut left: Vec<&String> = sd.keys().collect();
        left.sort();
        bail!("open_clip weights hold {} tensors align's model does not have: {:?}", left.len(), left.iter().take(10).collect::<Vec<_>>());
    }
    Ok(out)
}

/// A Hugging Face text tower (`text.transformer.*`, transformers' own names, which align's BERT
/// shares) and its projection (`text.proj.*`, open_clip's `Sequential` indices) under align's
/// names. The encoder's pooler, which the mean pooling never uses, and the position-id buffer
/// older transformers saved are left out.
fn hf_text_to_align(sd: &mut HashMap<String, Tensor>, out: &mut HashMap<String, Tensor>) -> Result<()> {
    let keys: Vec<String> = sd.keys().filter(|k| k.starts_with("text.")).cloned().collect();
    for k in keys {
        let t = sd.remove(&k).expect("listed above");
        if let Some(rest) = k.strip_prefix("text.transformer.") {
            if !(rest.starts_with("pooler.") || rest.ends_with("position_ids")) {
                out.insert(format!("text_model.{rest}"), t);
            }
        } else if let Some(rest) = k.strip_prefix("text.proj.") {
            out.insert(format!("text_projection.{rest}"), t);
        } else {
            bail!("open_clip weights hold {k}, which a Hugging Face text tower does not have");
        }
    }
    if !out.keys().any(|k| k.starts_with("text_projection.")) {
        bail!("open_clip weights have no text.proj: the Hugging Face text tower's projection");
    }
    Ok(())
}

/// align's weights of a native CLIP model under open_clip's names and layouts.
pub fn from_align(w: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let get = |name: &str| w.get(name).cloned().ok_or_else(|| anyhow!("the model has no {name}"));
    let mut out = HashMap::new();
    for (to, from) in PLAIN {
        if from == "logit_bias" || (from.starts_with("vision_model.pre_layrnorm.") && !w.contains_key(from)) {
            continue;
        }
        out.insert(to.to_string(), get(from)?);
    }
    for (to, from) in TEXT_PLAIN {
        out.insert(to.to_string(), get(from)?);
    }
    out.insert("visual.proj".into(), get("visual_projection.weight")?.t()?.contiguous()?);
    if w.contains_key("text_projection.bias") {
        out.insert("text_projection.weight".into(), get("text_projection.weight")?);
        out.insert("text_projection.bias".into(), get("text_projection.bias")?);
    } else {
        out.insert("text_projection".into(), get("text_projection.weight")?.t()?.contiguous()?);
    }
    for (from_prefix, to_prefix) in
        [("vision_model.encoder.layers.", "visual.transformer.resblocks."), ("text_model.encoder.layers.", "transformer.resblocks.")]
    {
        for layer in 0.. {
            let at = format!("{from_prefix}{layer}.");
            if !w.contains_key(&format!("{at}self_attn.q_proj.weight")) {
                break;
            }
            let to = format!("{to_prefix}{layer}.");
            for (a, b) in BLOCK {
                out.insert(format!("{to}{a}"), get(&format!("{at}{b}"))?);
            }
            let part = |p: &str, kind: &str| get(&format!("{at}self_attn.{p}.{kind}"));
            let weights = [part("q_proj", "weight")?, part("k_proj", "weight")?, part("v_proj", "weight")?];
            let biases = [part("q_proj", "bias")?, part("k_proj", "bias")?, part("v_proj", "bias")?];
            out.insert(format!("{to}attn.in_proj_weight"), Tensor::cat(&weights, 0)?);
            out.insert(format!("{to}attn.in_proj_bias"), Tensor::cat(&biases, 0)?);
        }
    }
    Ok(out)
}
