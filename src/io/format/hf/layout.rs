//! Hugging Face configurations and parameter names for the architectures align shares with
//! `transformers`: `AlignModel` (EfficientNet + BERT + text projection + temperature),
//! `BertModel` and `ViTModel`. Only JSON values and names here; reading files is the caller's.
//! Parameter names are identical by construction (align's towers use Hugging Face's names).

use serde_json::{json, Value};

use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::efficientnet::{EfficientNetConfig, Stages};
use crate::model::presets::{BertConfig, ImagePooling, TemperatureKind, TextPooling, VitConfig};

pub(super) fn get<'a>(v: &'a Value, key: &str, ctx: &str) -> Result<&'a Value, String> {
    v.get(key).ok_or_else(|| format!("{ctx} has no {key:?}"))
}

pub(super) fn usize_of(v: &Value, key: &str, ctx: &str) -> Result<usize, String> {
    let x = get(v, key, ctx)?;
    let n = x.as_u64().map(|x| x as usize).ok_or_else(|| format!("{ctx}.{key} is {x}, not a whole number"))?;
    crate::io::limits::check_size(n, crate::io::limits::kind_of_key(key), &format!("{ctx}.{key}"))
}

pub(super) fn f64_of(v: &Value, key: &str, ctx: &str) -> Result<f64, String> {
    get(v, key, ctx)?.as_f64().ok_or_else(|| format!("{ctx}.{key} is not a number"))
}

/// `layer_norm_eps`: `default` when absent, else a small positive number.
fn eps_or(c: &Value, default: f64, ctx: &str) -> Result<f64, String> {
    let eps = match c.get("layer_norm_eps") {
        None | Some(Value::Null) => default,
        Some(_) => f64_of(c, "layer_norm_eps", ctx)?,
    };
    if !(eps > 0.0 && eps < 1.0) {
        return Err(format!("{ctx}.layer_norm_eps is {eps}; it must be a small positive number"));
    }
    Ok(eps)
}

fn list_of(v: &Value, key: &str, ctx: &str) -> Result<Vec<usize>, String> {
    get(v, key, ctx)?
        .as_array()
        .ok_or_else(|| format!("{ctx}.{key} is not a list"))?
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize).ok_or_else(|| format!("{ctx}.{key} holds a non-integer")))
        .collect()
}

fn check_act(v: &Value, key: &str, want: &[&str], ctx: &str) -> Result<(), String> {
    match v.get(key).and_then(Value::as_str) {
        None => Ok(()),
        Some(a) if want.contains(&a) => Ok(()),
        Some(a) => Err(format!("{ctx}.{key} is {a:?}; align implements {want:?}")),
    }
}

/// `BertConfig` (or `AlignTextConfig`) JSON.
pub fn bert_from_hf(c: &Value) -> Result<BertConfig, String> {
    let ctx = "text config";
    check_act(c, "hidden_act", &["gelu"], ctx)?;
    if let Some(t) = c.get("position_embedding_type").and_then(Value::as_str) {
        if t != "absolute" {
            return Err(format!("{ctx}.position_embedding_type {t:?} is not supported (absolute only)"));
        }
    }
    Ok(BertConfig {
        vocab_size: usize_of(c, "vocab_size", ctx)?,
        hidden: usize_of(c, "hidden_size", ctx)?,
        layers: usize_of(c, "num_hidden_layers", ctx)?,
        heads: usize_of(c, "num_attention_heads", ctx)?,
        intermediate: usize_of(c, "intermediate_size", ctx)?,
        max_position: usize_of(c, "max_position_embeddings", ctx)?,
        type_vocab: usize_of(c, "type_vocab_size", ctx)?,
        layer_norm_eps: eps_or(c, 1e-12, ctx)?,
    })
}

pub fn bert_to_hf(b: &BertConfig) -> Value {
    json!({
        "vocab_size": b.vocab_size, "hidden_size": b.hidden, "num_hidden_layers": b.layers,
        "num_attention_heads": b.heads, "intermediate_size": b.intermediate, "max_position_embeddings": b.max_position,
        "type_vocab_size": b.type_vocab, "layer_norm_eps": b.layer_norm_eps, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": 0,
        "position_embedding_type": "absolute", "model_type": "align_text_model",
    })
}

/// `ViTConfig` JSON (class-token pooling, as `ViTModel` has it).
pub fn vit_from_hf(c: &Value) -> Result<VitConfig, String> {
    let ctx = "ViT config";
    check_act(c, "hidden_act", &["gelu"], ctx)?;
    if c.get("num_channels").and_then(Value::as_u64).is_some_and(|n| n != 3) {
        return Err(format!("{ctx}.num_channels must be 3"));
    }
    Ok(VitConfig {
        image_size: usize_of(c, "image_size", ctx)?,
        patch_size: usize_of(c, "patch_size", ctx)?,
        width: usize_of(c, "hidden_size", ctx)?,
        depth: usize_of(c, "num_hidden_layers", ctx)?,
        heads: usize_of(c, "num_attention_heads", ctx)?,
        mlp_dim: usize_of(c, "intermediate_size", ctx)?,
        pool: ImagePooling::Cls,
        layer_norm_eps: eps_or(c, 1e-12, ctx)?,
        patch_dropout: 0.0,
    })
}

/// `AlignVisionConfig` JSON. HF passes TensorFlow's BatchNorm decay (0.99) to PyTorch as the
/// momentum; align uses PyTorch's convention, so a value above 0.5 is read as a decay.
pub fn efficientnet_from_hf(c: &Value) -> Result<EfficientNetConfig, String> {
    let ctx = "vision config";
    check_act(c, "hidden_act", &["swish", "silu"], ctx)?;
    if let Some(p) = c.get("pooling_type").and_then(Value::as_str) {
        if p != "mean" {
            return Err(format!("{ctx}.pooling_type {p:?} is not supported (mean only)"));
        }
    }
    let momentum = f64_of(c, "batch_norm_momentum", ctx).unwrap_or(0.99);
    let config = EfficientNetConfig {
        image_size: usize_of(c, "image_size", ctx)?,
        width_coefficient: f64_of(c, "width_coefficient", ctx)?,
        depth_coefficient: f64_of(c, "depth_coefficient", ctx)?,
        depth_divisor: usize_of(c, "depth_divisor", ctx)?,
        se_ratio: f64_of(c, "squeeze_expansion_ratio", ctx).unwrap_or(0.25),
        bn_eps: f64_of(c, "batch_norm_eps", ctx).unwrap_or(1e-3),
        bn_momentum: if momentum > 0.5 { 1.0 - momentum } else { momentum },
        bn_frozen: false,
        drop_path: f64_of(c, "drop_connect_rate", ctx).unwrap_or(0.2),
        depthwise_padding: list_of(c, "depthwise_padding", ctx).unwrap_or_default(),
        depthwise: Default::default(),
        stages: Stages {
            kernel_sizes: list_of(c, "kernel_sizes", ctx)?,
            strides: list_of(c, "strides", ctx)?,
            repeats: list_of(c, "num_block_repeats", ctx)?,
            expand_ratios: list_of(c, "expand_ratios", ctx)?,
            in_channels: list_of(c, "in_channels", ctx)?,
            out_channels: list_of(c, "out_channels", ctx)?,
        },
    };
    // The blocks and widths the coefficients derive, bounded before anything is planned.
    config.validate().map_err(|e| format!("{ctx}: {e}"))?;
    Ok(config)
}

pub fn efficientnet_to_hf(e: &EfficientNetConfig) -> Value {
    json!({
        "num_channels": 3, "image_size": e.image_size, "width_coefficient": e.width_coefficient,
        "depth_coefficient": e.depth_coefficient, "depth_divisor": e.depth_divisor,
        "kernel_sizes": e.stages.kernel_sizes, "in_channels": e.stages.in_channels, "out_channels": e.stages.out_channels,
        "depthwise_padding": e.depthwise_padding, "strides": e.stages.strides, "num_block_repeats": e.stages.repeats,
        "expand_ratios": e.stages.expand_ratios, "squeeze_expansion_ratio": e.se_ratio, "hidden_act": "swish",
        // Only the average-pool kernel: any value at least the last feature map's side pools globally.
        "hidden_dim": e.width().max(e.image_size), "pooling_type": "mean", "batch_norm_eps": e.bn_eps,
        "batch_norm_momentum": 1.0 - e.bn_momentum, "drop_connect_rate": e.drop_path, "model_type": "align_vision_model",
    })
}

/// `AlignConfig` JSON → the dual encoder it describes.
pub fn align_spec_from_hf(c: &Value) -> Result<ModelSpec, String> {
    if let Some(t) = c.get("model_type").and_then(Value::as_str) {
        if t != "align" {
            return Err(format!("config.json describes a {t:?} model, not \"align\""));
        }
    }
    let vision = efficientnet_from_hf(get(c, "vision_config", "config")?)?;
    let text = bert_from_hf(get(c, "text_config", "config")?)?;
    let embed_dim = usize_of(c, "projection_dim", "config")?;
    if vision.width() != embed_dim {
        return Err(format!(
            "projection_dim {embed_dim} differs from the vision tower's width {} (AlignModel has no image projection)",
            vision.width()
        ));
    }
    Ok(ModelSpec {
        image: ImageSpec::EfficientNet(vision),
        text: TextSpec::Bert(text),
        text_projection_bias: true,
        embed_dim,
        image_projection: false,
        text_pooling: TextPooling::Cls,
        temperature: TemperatureKind::Align,
        temperature_init: f64_of(c, "temperature_init_value", "config").unwrap_or(1.0),
        logit_bias: None,
    })
}

/// The `AlignConfig` JSON of a model, if it has ALIGN's architecture.
pub fn align_spec_to_hf(spec: &ModelSpec) -> Result<Value, String> {
    let ImageSpec::EfficientNet(vision) = &spec.image else {
        return Err("only EfficientNet image towers have a Hugging Face AlignModel layout".into());
    };
    if spec.image_projection
        || spec.text_pooling != TextPooling::Cls
        || spec.temperature != TemperatureKind::Align
        || spec.logit_bias.is_some()
    {
        return Err("AlignModel has no image projection or logit bias, pools [CLS] and divides by a temperature: this model differs".into());
    }
    Ok(json!({
        "architectures": ["AlignModel"],
        "model_type": "align",
        "projection_dim": spec.embed_dim,
        "temperature_init_value": spec.temperature_init,
        "initializer_range": 0.02,
        "text_config": bert_to_hf(spec.text.bert().ok_or("AlignModel's text tower is BERT")?),
        "vision_config": efficientnet_to_hf(vision),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_configs_round_trip_through_hugging_face_json() {
        let mut e = EfficientNetConfig::preset("efficientnet-b7", 289).unwrap();
        e.drop_path = 0.0;
        let spec = ModelSpec {
            image: ImageSpec::EfficientNet(e),
            text: TextSpec::Bert(BertConfig::preset("bert-base", 30522).unwrap()),
            text_projection_bias: true,
            embed_dim: 640,
            image_projection: false,
            text_pooling: TextPooling::Cls,
            temperature: TemperatureKind::Align,
            temperature_init: 1.0,
            logit_bias: None,
        };
        let j = align_spec_to_hf(&spec).unwrap();
        assert_eq!(j["vision_config"]["batch_norm_momentum"], 0.99);
        let mut back = align_spec_from_hf(&j).unwrap();
        if let ImageSpec::EfficientNet(e) = &mut back.image {
            assert!((e.bn_momentum - 0.01).abs() < 1e-12);
            e.bn_momentum = 0.01;
        }
        assert_eq!(back, spec);
    }

    #[test]
    fn unsupported_settings_are_named() {
        let mut j = json!({"hidden_act": "relu", "vocab_size": 1, "hidden_size": 2, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 4, "max_position_embeddings": 8, "type_vocab_size": 2});
        assert!(bert_from_hf(&j).unwrap_err().contains("hidden_act"));
        j["hidden_act"] = json!("gelu");
        assert!(bert_from_hf(&j).is_ok());
        assert!(bert_from_hf(&json!({})).unwrap_err().contains("vocab_size"));
    }

    #[test]
    fn unused_hf_tensors_are_recognised() {
        use crate::io::tensors::is_unused_tensor;
        assert!(is_unused_tensor("vision_model.encoder.blocks.0.projection.project_bn.num_batches_tracked"));
        assert!(is_unused_tensor("text_model.pooler.dense.weight"));
        assert!(!is_unused_tensor("text_model.encoder.layer.0.output.dense.weight"));
    }

    /// An AlignModel config whose coefficients derive absurd sizes is refused by name before a
    /// single parameter is planned (a depth coefficient of 1e4 planned ~2 GB of names before).
    #[test]
    fn efficientnet_sizes_derived_from_coefficients_are_bounded() {
        let l2 = crate::model::efficientnet::EfficientNetConfig::preset("efficientnet-l2", 289).unwrap();
        let mut hf = efficientnet_to_hf(&l2);
        efficientnet_from_hf(&hf).unwrap();
        for (value, want) in [(1e4, "blocks"), (1e5, "blocks"), (-1.0, "positive"), (0.0, "positive")] {
            hf["depth_coefficient"] = value.into();
            let e = efficientnet_from_hf(&hf).unwrap_err();
            assert!(e.contains("depth_coefficient") && e.contains(want), "{value}: {e}");
        }
        hf["depth_coefficient"] = 5.3.into();
        hf["width_coefficient"] = 1e4.into();
        let e = efficientnet_from_hf(&hf).unwrap_err();
        assert!(e.contains("width_coefficient") && e.contains("channels"), "{e}");
    }
}
