//! open_clip's Hugging Face text towers (`text_cfg.hf_model_name`, LAION's multilingual models):
//! a RoBERTa or XLM-RoBERTa encoder (`text.transformer.*`), its states averaged over the tokens
//! that are not padding (`hf_pooler_type = "mean_pooler"`), then projected (`hf_proj_type`
//! `mlp`: two bias-free linear layers through the mean of the two widths with an exact GELU
//! between; `linear`: one). open_clip builds the encoder from the hub's config of the name; align
//! reads a `config.json` in the folder, else the sizes of the names it knows.

use serde_json::Value;

use crate::io::format::config_error::ConfigError;
use crate::io::format::hf::layout::roberta_from_hf;
use crate::model::presets::BertConfig;

/// The encoders of the names LAION's models use, as their hub configs give them: vocabulary,
/// width, layers, heads, MLP width (positions 514, one token type, LayerNorm ε 1e-5, padding 1).
const KNOWN: [(&str, [usize; 5]); 4] = [
    ("xlm-roberta-base", [250_002, 768, 12, 12, 3072]),
    ("xlm-roberta-large", [250_002, 1024, 24, 16, 4096]),
    ("roberta-base", [50_265, 768, 12, 12, 3072]),
    ("roberta-large", [50_265, 1024, 24, 16, 4096]),
];

/// The text encoder: the folder's `config.json` when it is a RoBERTa's, else the name's sizes.
pub fn encoder(name: &str, folder_config: Option<&Value>) -> Result<BertConfig, ConfigError> {
    let key = "text_cfg.hf_model_name";
    if let Some(c) = folder_config {
        match c.get("model_type").and_then(Value::as_str) {
            Some("xlm-roberta" | "roberta") => {
                return roberta_from_hf(c).map_err(|e| ConfigError::Invalid(format!("{key} {name:?}: config.json: {e}")))
            }
            Some(other) => {
                return Err(ConfigError::Unsupported {
                    key: key.into(),
                    what: format!("a {other:?} text tower (align reads RoBERTa and XLM-RoBERTa ones)"),
                })
            }
            None => {}
        }
    }
    let base = name.rsplit('/').next().unwrap_or(name);
    let Some((_, [vocab_size, hidden, layers, heads, intermediate])) = KNOWN.iter().find(|(n, _)| *n == base) else {
        return Err(ConfigError::Unsupported {
            key: key.into(),
            what: format!(
                "{name:?} without its config.json in the folder (align knows xlm-roberta-base/large and roberta-base/large by name)"
            ),
        });
    };
    Ok(BertConfig {
        vocab_size: *vocab_size,
        hidden: *hidden,
        layers: *layers,
        heads: *heads,
        intermediate: *intermediate,
        max_position: 514,
        type_vocab: 1,
        layer_norm_eps: 1e-5,
        pad_token_id: Some(1),
    })
}

/// The projection's hidden width (`mlp`), or none (`linear`).
pub fn projection(proj_type: &str, width: usize, embed_dim: usize) -> Result<Option<usize>, ConfigError> {
    match proj_type {
        "mlp" => Ok(Some((width + embed_dim) / 2)),
        "linear" => Ok(None),
        other => {
            Err(ConfigError::Unsupported { key: "text_cfg.hf_proj_type".into(), what: format!("{other:?} (align reads mlp and linear)") })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn known_names_and_folder_configs() {
        let b = encoder("xlm-roberta-base", None).unwrap();
        assert_eq!((b.vocab_size, b.hidden, b.max_position, b.pad_token_id), (250_002, 768, 514, Some(1)));
        let c = json!({"model_type": "xlm-roberta", "vocab_size": 402, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 18, "type_vocab_size": 1, "layer_norm_eps": 1e-5, "pad_token_id": 1});
        let t = encoder("xlm-roberta-base", Some(&c)).unwrap();
        assert_eq!((t.vocab_size, t.hidden, t.max_position, t.pad_token_id), (402, 32, 18, Some(1)));
        assert!(encoder("bert-base-multilingual-cased", None).unwrap_err().to_string().contains("hf_model_name"));
        assert_eq!(projection("mlp", 768, 512).unwrap(), Some(640));
        assert!(projection("identity", 768, 512).is_err());
    }
}
