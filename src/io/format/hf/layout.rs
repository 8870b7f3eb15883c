//! Hugging Face configurations and parameter names for the architectures align shares with
//! `transformers`: `AlignModel` (EfficientNet + BERT + text projection + temperature),
//! `BertModel` and `ViTModel`. Only JSON values and names here; reading files is the caller's.
//! Parameter names are identical by construction (align's towers use Hugging Face's names).

use serde_json::{json, Value};

use super::tower_config::{read, sub, AlignJointFields, AlignVisionFields, BertFields, VitFields};
use crate::io::limits::{check_eps, check_key};
use crate::model::dual_encoder::{ImageSpec, ModelSpec, TextSpec};
use crate::model::efficientnet::{EfficientNetConfig, Stages};
use crate::model::presets::{BertConfig, ImagePooling, TemperatureKind, TextPooling, VitConfig};

fn check_act(act: &str, want: &[&str], ctx: &str) -> Result<(), String> {
    if !want.contains(&act) {
        return Err(format!("{ctx}.hidden_act is {act:?}; align implements {want:?}"));
    }
    Ok(())
}

fn typed<T: serde::Serialize + serde::de::DeserializeOwned + Default>(c: &Value, ctx: &str) -> Result<T, String> {
    read(c, ctx).map_err(|e| e.to_string())
}

/// `BertConfig` (or `AlignTextConfig`) JSON.
pub fn bert_from_hf(c: &Value) -> Result<BertConfig, String> {
    let ctx = "text config";
    let b: BertFields = typed(c, ctx)?;
    check_act(&b.hidden_act, &["gelu"], ctx)?;
    if b.position_embedding_type != "absolute" {
        return Err(format!("{ctx}.position_embedding_type {:?} is not supported (absolute only)", b.position_embedding_type));
    }
    Ok(BertConfig {
        vocab_size: check_key(b.vocab_size, ctx, "vocab_size")?,
        hidden: check_key(b.hidden_size, ctx, "hidden_size")?,
        layers: check_key(b.num_hidden_layers, ctx, "num_hidden_layers")?,
        heads: check_key(b.num_attention_heads, ctx, "num_attention_heads")?,
        intermediate: check_key(b.intermediate_size, ctx, "intermediate_size")?,
        max_position: check_key(b.max_position_embeddings, ctx, "max_position_embeddings")?,
        type_vocab: check_key(b.type_vocab_size, ctx, "type_vocab_size")?,
        layer_norm_eps: check_eps(b.layer_norm_eps, &format!("{ctx}.layer_norm_eps"))?,
        pad_token_id: None,
    })
}

/// An `XLMRobertaConfig` (or `RobertaConfig`): BERT's sizes with RoBERTa's positions, counted
/// from its `pad_token_id` (transformers' default 1).
pub fn roberta_from_hf(c: &Value) -> Result<BertConfig, String> {
    let mut b = bert_from_hf(c)?;
    let pad = match c.get("pad_token_id") {
        None | Some(Value::Null) => 1,
        Some(v) => v
            .as_u64()
            .filter(|&p| (p as usize) < b.vocab_size)
            .ok_or_else(|| format!("config.pad_token_id {v} is not an id of the vocabulary"))?,
    };
    b.pad_token_id = Some(pad as u32);
    if b.max_position <= pad as usize + 1 {
        return Err(format!("config.max_position_embeddings {} leaves no position after the padding id {pad}", b.max_position));
    }
    Ok(b)
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
    let v: VitFields = typed(c, ctx)?;
    check_act(&v.hidden_act, &["gelu"], ctx)?;
    if v.num_channels != 3 {
        return Err(format!("{ctx}.num_channels must be 3"));
    }
    Ok(VitConfig {
        image_size: check_key(v.image_size, ctx, "image_size")?,
        patch_size: check_key(v.patch_size, ctx, "patch_size")?,
        width: check_key(v.hidden_size, ctx, "hidden_size")?,
        depth: check_key(v.num_hidden_layers, ctx, "num_hidden_layers")?,
        heads: check_key(v.num_attention_heads, ctx, "num_attention_heads")?,
        mlp_dim: check_key(v.intermediate_size, ctx, "intermediate_size")?,
        pool: ImagePooling::Cls,
        layer_norm_eps: check_eps(v.layer_norm_eps, &format!("{ctx}.layer_norm_eps"))?,
        patch_dropout: 0.0,
    })
}

/// `AlignVisionConfig` JSON. HF passes TensorFlow's BatchNorm decay (0.99) to PyTorch as the
/// momentum; align uses PyTorch's convention, so a value above 0.5 is read as a decay.
pub fn efficientnet_from_hf(c: &Value) -> Result<EfficientNetConfig, String> {
    let ctx = "vision config";
    let v: AlignVisionFields = typed(c, ctx)?;
    check_act(&v.hidden_act, &["swish", "silu"], ctx)?;
    if v.pooling_type != "mean" {
        return Err(format!("{ctx}.pooling_type {:?} is not supported (mean only)", v.pooling_type));
    }
    let momentum = v.batch_norm_momentum;
    let config = EfficientNetConfig {
        image_size: check_key(v.image_size, ctx, "image_size")?,
        width_coefficient: v.width_coefficient,
        depth_coefficient: v.depth_coefficient,
        depth_divisor: check_key(v.depth_divisor, ctx, "depth_divisor")?,
        se_ratio: v.squeeze_expansion_ratio,
        bn_eps: v.batch_norm_eps,
        bn_momentum: if momentum > 0.5 { 1.0 - momentum } else { momentum },
        bn_frozen: false,
        drop_path: v.drop_connect_rate,
        depthwise_padding: v.depthwise_padding,
        depthwise: Default::default(),
        stages: Stages {
            kernel_sizes: v.kernel_sizes,
            strides: v.strides,
            repeats: v.num_block_repeats,
            expand_ratios: v.expand_ratios,
            in_channels: v.in_channels,
            out_channels: v.out_channels,
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
    let sub = |key: &str| sub(c, key).map_err(|e| e.to_string());
    let vision = efficientnet_from_hf(sub("vision_config")?)?;
    let text = bert_from_hf(sub("text_config")?)?;
    let joint: AlignJointFields = typed(c, "config")?;
    let embed_dim = check_key(joint.projection_dim, "config", "projection_dim")?;
    if !(joint.temperature_init_value > 0.0 && joint.temperature_init_value.is_finite()) {
        return Err(format!("config.temperature_init_value is {}; it must be positive", joint.temperature_init_value));
    }
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
        text_projection_hidden: None,
        embed_dim,
        image_projection: false,
        text_pooling: TextPooling::Cls,
        temperature: TemperatureKind::Align,
        temperature_init: joint.temperature_init_value,
        logit_bias: None,
    })
}

/// The `AlignConfig` JSON of a model, if it has ALIGN's architecture.
/// A BERT text tower with BERT's positions and one linear projection, what transformers' BERT
/// classes hold (not open_clip's XLM-RoBERTa towers and their MLP projection).
pub fn plain_bert_text(spec: &ModelSpec, class: &str) -> Result<(), String> {
    if spec.text.bert().is_some_and(|b| b.pad_token_id.is_some()) || spec.text_projection_hidden.is_some() {
        return Err(format!(
            "{class} holds BERT with BERT's positions and a linear projection; this text tower is RoBERTa's or projects through an MLP"
        ));
    }
    Ok(())
}

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
    plain_bert_text(spec, "AlignModel")?;
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
            text_projection_hidden: None,
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
        // An absent key is transformers' class default (BERT-base), as transformers reads it.
        let base = bert_from_hf(&json!({})).unwrap();
        assert_eq!((base.vocab_size, base.hidden, base.layers, base.max_position, base.layer_norm_eps), (30522, 768, 12, 512, 1e-12));
        let e = bert_from_hf(&json!({"vocab_size": "30k"})).unwrap_err();
        assert!(e.starts_with("text config.vocab_size: invalid type"), "{e}");
        let v = efficientnet_from_hf(&json!({"image_size": 289})).unwrap();
        assert_eq!((v.width_coefficient, v.depth_coefficient, v.stages.repeats.len()), (2.0, 3.1, 7), "AlignVisionConfig's B7");
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
