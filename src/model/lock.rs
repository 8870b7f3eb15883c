//! Locked towers (LiT, Zhai et al. 2022; open_clip's `--lock-image` / `--lock-text`): which
//! variables train. A tower is split into groups in forward order: its embeddings, each
//! transformer layer or MBConv block, the last one together with the final norms and pooling
//! head, and the projection into the shared space. Locking a tower freezes all its groups but the
//! last `unlocked` ones. Locked variables get no gradient, no optimizer state and no all-reduce.

use super::dual_encoder::{ImageGraph, ImageSpec, ModelSpec, TextSpec};
use candle_core::Var;

/// `[model]`'s locking fields (documented there).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LockConfig {
    pub lock_image: bool,
    pub lock_image_unlocked_groups: usize,
    pub lock_image_freeze_bn_stats: bool,
    pub lock_text: bool,
    pub lock_text_unlocked_layers: usize,
    pub lock_text_freeze_layer_norm: bool,
}

/// The number of layers (or MBConv blocks) of each tower.
fn image_layers(spec: &ModelSpec) -> usize {
    match &spec.image {
        ImageSpec::Vit(c) => c.depth,
        ImageSpec::EfficientNet(c) => c.num_blocks(),
        ImageSpec::Clip(c) => c.encoder.layers,
        ImageSpec::Siglip(c) => c.encoder.layers,
        ImageSpec::Naflex(c) => c.encoder.layers,
    }
}

fn text_layers(spec: &ModelSpec) -> usize {
    match &spec.text {
        TextSpec::Bert(c) => c.layers,
        TextSpec::Clip(c) => c.encoder.layers,
        TextSpec::Siglip(c) => c.encoder.layers,
    }
}

/// The layer index in `rest` (`layer.3.…`, `layers.3.…`, `blocks.3.…` after `encoder.`).
fn layer_index(rest: &str) -> Option<usize> {
    let rest = rest.strip_prefix("encoder.")?;
    let rest = ["layers.", "layer.", "blocks."].iter().find_map(|p| rest.strip_prefix(p))?;
    rest.split('.').next()?.parse().ok()
}

/// The group of a tower variable named `rest` (after the tower's prefix) in a tower of `layers`
/// layers: 0 for the embeddings, 1 + i for layer i, `layers` for what follows the last layer.
fn group_in_tower(rest: &str, layers: usize) -> usize {
    if rest.starts_with("embeddings.") || rest.starts_with("pre_layrnorm.") {
        return 0;
    }
    match layer_index(rest) {
        Some(i) => (1 + i).min(layers),
        None => layers,
    }
}

/// Which tower a variable belongs to and its group, with the tower's group count; `None` for the
/// variables of neither tower (the temperature, the logit bias).
fn group_of(name: &str, spec: &ModelSpec) -> Option<(Tower, usize, usize)> {
    let (il, tl) = (image_layers(spec), text_layers(spec));
    let (image_groups, text_groups) = group_counts(spec);
    if let Some(rest) = name.strip_prefix("vision_model.") {
        return Some((Tower::Image, group_in_tower(rest, il), image_groups));
    }
    if name.starts_with("visual_projection.") {
        return Some((Tower::Image, il + 1, image_groups));
    }
    if let Some(rest) = name.strip_prefix("text_model.") {
        return Some((Tower::Text, group_in_tower(rest, tl), text_groups));
    }
    if name.starts_with("text_projection.") {
        return Some((Tower::Text, tl + 1, text_groups));
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tower {
    Image,
    Text,
}

fn is_layer_norm(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("layernorm") || n.contains("layer_norm") || n.contains("pre_layrnorm")
}

/// The groups of each tower (embeddings, each layer or block, the projection).
pub fn group_counts(spec: &ModelSpec) -> (usize, usize) {
    let (il, tl) = (image_layers(spec), text_layers(spec));
    (il + 1 + usize::from(spec.image_projection), tl + 1 + usize::from(!matches!(spec.text, TextSpec::Siglip(_))))
}

/// Unlocked group counts within their tower's: more than a tower has would unlock it whole,
/// which `lock_* = false` says plainly; a count past the end is a mistake, not a setting.
pub fn validate(spec: &ModelSpec, lock: &LockConfig) -> Result<(), String> {
    let (image, text) = group_counts(spec);
    if lock.lock_image && lock.lock_image_unlocked_groups > image {
        return Err(format!(
            "model.lock_image_unlocked_groups is {}, but the image tower has {image} groups (embeddings, its layers or blocks, the projection)",
            lock.lock_image_unlocked_groups
        ));
    }
    if lock.lock_text && lock.lock_text_unlocked_layers > text {
        return Err(format!(
            "model.lock_text_unlocked_layers is {}, but the text tower has {text} groups (embeddings, its layers, the projection)",
            lock.lock_text_unlocked_layers
        ));
    }
    Ok(())
}

/// Whether `name` trains under `lock`.
pub fn trains(name: &str, spec: &ModelSpec, lock: &LockConfig) -> bool {
    match group_of(name, spec) {
        None => true,
        Some((Tower::Image, g, total)) => !lock.lock_image || g + lock.lock_image_unlocked_groups >= total,
        Some((Tower::Text, g, total)) => {
            !lock.lock_text || (g + lock.lock_text_unlocked_layers >= total && !(lock.lock_text_freeze_layer_norm && is_layer_norm(name)))
        }
    }
}

/// The learning-rate factor of `name` under layer-wise decay: `decay^k` for a variable k groups
/// before its tower's last; 1 outside the towers.
pub fn layer_lr_scale(name: &str, spec: &ModelSpec, image_decay: f64, text_decay: f64) -> f64 {
    match group_of(name, spec) {
        None => 1.0,
        Some((tower, g, total)) => {
            let decay = if tower == Tower::Image { image_decay } else { text_decay };
            decay.powi((total - 1 - g) as i32)
        }
    }
}

/// Where the image side's graph can start under `lock`.
pub fn image_graph(spec: &ModelSpec, lock: &LockConfig) -> ImageGraph {
    match (lock.lock_image, lock.lock_image_unlocked_groups, spec.image_projection) {
        (false, _, _) => ImageGraph::Whole,
        (true, 0, _) => ImageGraph::None,
        (true, 1, true) => ImageGraph::FromProjection,
        _ => ImageGraph::Whole,
    }
}

/// The variables that train, and the number of elements of those that do not.
pub fn split(vars: Vec<(String, Var)>, spec: &ModelSpec, lock: &LockConfig) -> (Vec<(String, Var)>, usize) {
    let (train, frozen): (Vec<_>, Vec<_>) = vars.into_iter().partition(|(n, _)| trains(n, spec, lock));
    (train, frozen.iter().map(|(_, v)| v.elem_count()).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dual_encoder::tests::tiny_spec;

    #[test]
    fn groups_follow_the_forward_order() {
        let mut spec = tiny_spec();
        if let ImageSpec::Vit(v) = &mut spec.image {
            v.depth = 3;
        }
        spec.image_projection = true;
        // Image: embeddings 0, layers 1..=3 (the final norm with layer 2), projection 4.
        let g = |n: &str| group_of(n, &spec).map(|(_, g, total)| (g, total));
        assert_eq!(g("vision_model.embeddings.cls_token"), Some((0, 5)));
        assert_eq!(g("vision_model.encoder.layer.0.output.dense.weight"), Some((1, 5)));
        assert_eq!(g("vision_model.encoder.layer.2.output.dense.weight"), Some((3, 5)));
        assert_eq!(g("vision_model.layernorm.weight"), Some((3, 5)));
        assert_eq!(g("visual_projection.weight"), Some((4, 5)));
        assert_eq!(g("text_model.encoder.layer.0.attention.self.query.weight"), Some((1, 3)));
        assert_eq!(g("text_projection.bias"), Some((2, 3)));
        assert_eq!(g("temperature"), None);

        let lock = |groups: usize| LockConfig { lock_image: true, lock_image_unlocked_groups: groups, ..Default::default() };
        assert!(!trains("vision_model.encoder.layer.2.output.dense.weight", &spec, &lock(0)));
        assert!(!trains("visual_projection.weight", &spec, &lock(0)));
        assert!(trains("visual_projection.weight", &spec, &lock(1)));
        assert!(!trains("vision_model.layernorm.weight", &spec, &lock(1)));
        assert!(trains("vision_model.layernorm.weight", &spec, &lock(2)));
        assert!(trains("text_model.embeddings.word_embeddings.weight", &spec, &lock(0)));
        assert!(trains("temperature", &spec, &lock(0)));

        // Layer-wise decay 0.5: the projection at 1, the last layer 0.5, the embeddings 0.5⁴.
        let scale = |n: &str| layer_lr_scale(n, &spec, 0.5, 0.75);
        assert_eq!(
            [scale("visual_projection.weight"), scale("vision_model.layernorm.bias"), scale("vision_model.embeddings.cls_token")],
            [1.0, 0.5, 0.0625]
        );
        assert_eq!([scale("text_model.embeddings.word_embeddings.weight"), scale("temperature")], [0.5625, 1.0]);

        let text = LockConfig { lock_text: true, lock_text_unlocked_layers: 2, lock_text_freeze_layer_norm: true, ..Default::default() };
        assert!(!trains("text_model.embeddings.word_embeddings.weight", &spec, &text));
        assert!(trains("text_model.encoder.layer.0.attention.self.query.weight", &spec, &text));
        assert!(!trains("text_model.encoder.layer.0.output.LayerNorm.weight", &spec, &text));
        assert!(trains("vision_model.embeddings.cls_token", &spec, &text));
    }
}
