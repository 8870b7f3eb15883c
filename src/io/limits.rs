//! Sizes read from files are checked before anything of that size is allocated: against bounds
//! no real model comes near (a config that asks for a 10^12-token vocabulary is a broken or
//! hostile file, not a model), and against the shapes of the weights file itself
//! ([`check_against_weights`]), whose header holds every tensor's shape.

use std::collections::{BTreeMap, HashMap};

use anyhow::{bail, Result};

use crate::model::dual_encoder::{DualEncoder, ModelSpec};

/// The largest value a size field of a config may hold, by the kind of size it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeKind {
    /// Image side in pixels (model input, resize and crop targets).
    Pixels,
    /// Patch side in pixels.
    Patch,
    /// A layer's width, an embedding's or an MLP's.
    Width,
    /// Layers, heads, blocks.
    Count,
    /// Vocabulary entries.
    Vocabulary,
    /// Text positions.
    Positions,
}

impl SizeKind {
    pub fn max(self) -> usize {
        match self {
            SizeKind::Pixels => 8192,
            SizeKind::Patch => 1024,
            SizeKind::Width => 1 << 18,
            SizeKind::Count => 4096,
            SizeKind::Vocabulary => 1 << 24,
            SizeKind::Positions => 1 << 20,
        }
    }
}

/// The kind of size a config key holds, from its name (`vocab_size`, `image_size`,
/// `num_hidden_layers`, ...).
pub fn kind_of_key(key: &str) -> SizeKind {
    if key.contains("vocab") {
        SizeKind::Vocabulary
    } else if key.contains("image_size") || key.contains("crop") || key.contains("edge") {
        SizeKind::Pixels
    } else if key.contains("patch") {
        SizeKind::Patch
    } else if key.contains("position") || key.contains("context") || key.contains("max_len") {
        SizeKind::Positions
    } else if ["layers", "depth", "heads", "blocks"].iter().any(|k| key.ends_with(k)) {
        SizeKind::Count
    } else {
        SizeKind::Width
    }
}

/// `value` of the field `field` (a file and key, for the message) within its kind's bounds.
pub fn check_size(value: usize, kind: SizeKind, field: &str) -> Result<usize, String> {
    if value == 0 {
        return Err(format!("{field} is 0; it must be positive"));
    }
    if value > kind.max() {
        return Err(format!(
            "{field} is {value}, beyond any real model (at most {}); the file is damaged or not a model config",
            kind.max()
        ));
    }
    Ok(value)
}

/// The size field `key` of the section `ctx` (`text_config`, `vision_cfg`) within the bounds of
/// the kind of size its name says.
pub fn check_key(value: usize, ctx: &str, key: &str) -> Result<usize, String> {
    check_size(value, kind_of_key(key), &format!("{ctx}.{key}"))
}

/// A normalisation's ε (the field `field`): a small positive number.
pub fn check_eps(eps: f64, field: &str) -> Result<f64, String> {
    if !(eps > 0.0 && eps < 1.0) {
        return Err(format!("{field} is {eps}; it must be a small positive number"));
    }
    Ok(eps)
}

/// Every size of a model spec within bounds (for specs align wrote itself, read back).
pub fn check_spec(spec: &ModelSpec) -> Result<()> {
    let json = serde_json::to_value(spec)?;
    let mut bad = Vec::new();
    walk(&json, String::new(), &mut bad);
    if !bad.is_empty() {
        bail!("sizes out of bounds: {}", bad.join("; "));
    }
    // Sizes derived from the stated ones (EfficientNet's scaled depths and widths).
    if let crate::model::dual_encoder::ImageSpec::EfficientNet(e) = &spec.image {
        e.validate().map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

fn walk(v: &serde_json::Value, path: String, bad: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                walk(x, if path.is_empty() { k.clone() } else { format!("{path}.{k}") }, bad);
            }
        }
        serde_json::Value::Number(n) => {
            let Some(x) = n.as_u64() else { return };
            let kind = kind_of_key(path.rsplit('.').next().unwrap_or(""));
            if x as usize > kind.max() {
                bad.push(format!("{path} = {x} (at most {})", kind.max()));
            }
        }
        _ => {}
    }
}

/// The parameters a model of `spec` has, by name and shape, computed without allocating them.
pub fn planned_parameters(spec: &ModelSpec) -> Result<BTreeMap<String, Vec<usize>>> {
    let shapes = crate::model::init::ShapeVars::default();
    DualEncoder::new(spec, shapes.builder())?;
    Ok(shapes.shapes().into_iter().collect())
}

/// Checks that the weights hold every parameter a model of `spec` needs, at its shape, before the
/// model is built: sizes read from a config that disagree with the weights file are an error
/// naming both, not an allocation of whatever size the config says.
pub fn check_against_weights(spec: &ModelSpec, weights: &HashMap<String, Vec<usize>>, origin: &str) -> Result<()> {
    let planned = planned_parameters(spec)?;
    let mut missing = Vec::new();
    let mut wrong = Vec::new();
    for (name, shape) in &planned {
        match weights.get(name) {
            None => missing.push(name.clone()),
            Some(s) if s != shape => wrong.push(format!("{name}: weights {s:?}, config {shape:?}")),
            Some(_) => {}
        }
    }
    if missing.is_empty() && wrong.is_empty() {
        return Ok(());
    }
    let mut unexpected: Vec<String> =
        weights.keys().filter(|k| !planned.contains_key(*k) && !crate::io::tensors::is_unused_tensor(k)).cloned().collect();
    unexpected.sort();
    let shown = |v: &[String]| -> String {
        let head: Vec<&str> = v.iter().take(8).map(String::as_str).collect();
        if v.len() > 8 {
            format!("{} and {} more", head.join(", "), v.len() - 8)
        } else {
            head.join(", ")
        }
    };
    let mut parts = Vec::new();
    if !wrong.is_empty() {
        parts.push(format!("{} tensors have other shapes than the config says ({})", wrong.len(), shown(&wrong)));
    }
    if !missing.is_empty() {
        parts.push(format!("{} tensors the config implies are missing ({})", missing.len(), shown(&missing)));
    }
    if !unexpected.is_empty() {
        parts.push(format!("{} tensors the model has no place for ({})", unexpected.len(), shown(&unexpected)));
    }
    bail!("{origin}: the config and the weights disagree: {}", parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dual_encoder::tests::tiny_spec;

    #[test]
    fn planned_parameters_allocate_nothing_even_for_absurd_sizes() {
        let mut spec = tiny_spec();
        if let crate::model::dual_encoder::TextSpec::Bert(b) = &mut spec.text {
            // 10^12 tokens × 16 would be 64 TB of f32.
            b.vocab_size = 1_000_000_000_000;
        }
        let planned = planned_parameters(&spec).unwrap();
        assert_eq!(planned["text_model.embeddings.word_embeddings.weight"], vec![1_000_000_000_000, 16]);
        let err = check_spec(&spec).unwrap_err().to_string();
        assert!(err.contains("vocab_size = 1000000000000"), "{err}");
    }

    #[test]
    fn weights_that_disagree_with_the_config_name_the_tensors() {
        let spec = tiny_spec();
        let mut weights: HashMap<String, Vec<usize>> = planned_parameters(&spec).unwrap().into_iter().collect();
        check_against_weights(&spec, &weights, "x").unwrap();
        weights.insert("visual_projection.weight".into(), vec![9, 16]);
        weights.remove("temperature");
        let err = check_against_weights(&spec, &weights, "m/config.json").unwrap_err().to_string();
        assert!(err.contains("m/config.json") && err.contains("visual_projection.weight: weights [9, 16], config [8, 16]"), "{err}");
        assert!(err.contains("missing (temperature)"), "{err}");
    }

    #[test]
    fn sizes_out_of_bounds_name_the_field() {
        let e = check_size(1_000_000, SizeKind::Pixels, "preprocessor_config.json: size.shortest_edge").unwrap_err();
        assert!(e.contains("size.shortest_edge is 1000000") && e.contains("8192"), "{e}");
        assert!(check_size(0, SizeKind::Count, "x").unwrap_err().contains("0"));
        assert_eq!(check_size(224, SizeKind::Pixels, "x"), Ok(224));
    }
}
