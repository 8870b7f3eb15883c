//! DataComp's image-based filter (Gadre et al. 2023, §4 baselines): the input's image embeddings
//! are clustered with k-means; each image of a target set (ImageNet's training images in the
//! paper) votes for the input cluster whose centre is nearest to it; the input samples whose
//! nearest centre got a vote are kept. Intersected with the CLIP-score filter it is the paper's
//! best small-scale baseline. The target's embeddings must come from the checkpoint that scored
//! the input: they are an `align embed` output (`image_embeddings`, one row per image).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::kmeans::kmeans;

/// What the filter decided.
pub struct Selection {
    /// For each input sample, whether its nearest centre is one the target voted for.
    pub keep: Vec<bool>,
    pub clusters: usize,
    /// Clusters with at least one target image nearest to them.
    pub target_clusters: usize,
    pub target_images: usize,
}

/// Selects among `pool` (unit rows of `dim`) with `clusters` k-means clusters and the unit rows
/// of `target`.
pub fn select(pool: &[f32], target: &[f32], dim: usize, clusters: usize, seed: u64) -> Selection {
    let c = kmeans(pool, dim, clusters, seed, 30);
    let mut voted = vec![false; c.k];
    for v in target.chunks_exact(dim) {
        voted[c.nearest(v)] = true;
    }
    Selection {
        keep: c.assignment.iter().map(|&a| voted[a]).collect(),
        clusters: c.k,
        target_clusters: voted.iter().filter(|&&v| v).count(),
        target_images: target.len() / dim.max(1),
    }
}

/// Reads the target's image embeddings from an `align embed` output, each row scaled to unit
/// length; returns them and their dimension.
/// The model that embedded a target, as `align embed` records it beside the matrix (the
/// directory it loaded), or None where nothing says.
pub fn target_model(path: &Path) -> Option<String> {
    let side: serde_json::Value = serde_json::from_slice(&std::fs::read(path.with_extension("json")).ok()?).ok()?;
    side.get("checkpoint")?.as_str().map(str::to_string)
}

pub fn read_target(path: &Path) -> Result<(Vec<f32>, usize)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading the target embeddings {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file (write it with `align embed --data TARGET --out FILE`)", path.display()))?;
    let t = st.tensor("image_embeddings").map_err(|_| {
        anyhow::anyhow!("{} holds no image_embeddings (write it with `align embed --data TARGET_IMAGES --out FILE`)", path.display())
    })?;
    let shape = t.shape();
    if t.dtype() != safetensors::Dtype::F32 || shape.len() != 2 {
        bail!("{}: image_embeddings must be a float32 matrix, found {:?} {:?}", path.display(), t.dtype(), shape);
    }
    let dim = shape[1];
    ensure!(shape[0] > 0 && dim > 0, "{}: image_embeddings is empty ({:?})", path.display(), shape);
    let mut data: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    for row in data.chunks_exact_mut(dim) {
        let n = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        row.iter_mut().for_each(|x| *x /= n);
    }
    Ok((data, dim))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;

    fn unit(v: Vec<f32>) -> Vec<f32> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.into_iter().map(|x| x / n).collect()
    }

    #[test]
    fn samples_near_the_target_are_kept_and_the_rest_go() {
        // Four tight groups around the axes of R^4; the target lies in groups 0 and 2.
        let mut rng = Rng::new(4);
        let mut pool = Vec::new();
        for g in 0..4 {
            for _ in 0..25 {
                pool.extend(unit((0..4).map(|d| if d == g { 1.0 } else { 0.05 * rng.normal() as f32 }).collect()));
            }
        }
        let target: Vec<f32> = [0, 0, 2].iter().flat_map(|&g| unit((0..4).map(|d| if d == g { 1.0 } else { 0.1 }).collect())).collect();
        let s = select(&pool, &target, 4, 4, 7);
        assert_eq!((s.clusters, s.target_clusters, s.target_images), (4, 2, 3));
        for (i, &k) in s.keep.iter().enumerate() {
            assert_eq!(k, i / 25 == 0 || i / 25 == 2, "sample {i} of group {}", i / 25);
        }
    }

    #[test]
    fn a_target_file_without_image_embeddings_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("target.safetensors");
        let t = candle_core::Tensor::zeros((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        candle_core::safetensors::save(&std::collections::HashMap::from([("text_embeddings".to_string(), t)]), &path).unwrap();
        let e = format!("{:#}", read_target(&path).unwrap_err());
        assert!(e.contains("no image_embeddings") && e.contains("target.safetensors"), "{e}");
    }
}
