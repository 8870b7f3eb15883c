//! SigLIP 2's NaFlex vision tower with transformers' `Siglip2VisionModel` names: an image keeps
//! its aspect ratio as a grid of up to `max_patches` patches, each embedded by a linear layer;
//! the learned square grid of position embeddings is resized (antialiased bilinear) to each
//! image's grid; padding patches are hidden from attention and from the attention-pooling head.
//!
//! An image enters as one row of `max_patches · 3p² + 2` numbers: its patches in order (each
//! row by row, pixel by pixel, R G B, as transformers flattens them), zeros after the last, then
//! the grid's height and width in patches.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::layers::{linear, scaled_normal, LayerNorm, Linear};
use super::pos_embed::bilinear_matrix;
use super::prenorm::{Encoder, EncoderConfig};
use super::siglip::PoolingHead;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NaflexVisionConfig {
    pub patch_size: usize,
    /// Side of the learned position grid (`sqrt(num_patches)`).
    pub position_grid: usize,
    /// The most patches an image becomes (the processor's `max_num_patches`).
    pub max_patches: usize,
    pub encoder: EncoderConfig,
}

impl NaflexVisionConfig {
    /// Numbers per image row: the patches, then the grid's height and width.
    pub fn row_len(&self) -> usize {
        self.max_patches * self.patch_dim() + 2
    }

    pub fn patch_dim(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }
}

pub struct NaflexVision {
    patch: Linear,
    position: Tensor,
    pub encoder: Encoder,
    post_norm: LayerNorm,
    head: PoolingHead,
    pub config: NaflexVisionConfig,
}

/// A large negative score for padding: finite, so that a row of padding stays finite.
const MASKED: f64 = -1e9;

impl NaflexVision {
    pub fn new(c: &NaflexVisionConfig, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let w = c.encoder.width;
        let positions = c.position_grid * c.position_grid;
        Ok(NaflexVision {
            patch: linear(c.patch_dim(), w, true, scaled_normal(c.patch_dim()), e.pp("patch_embedding"))?,
            position: e.pp("position_embedding").get_with_hints((positions, w), "weight", scaled_normal(w))?,
            encoder: Encoder::new(&c.encoder, vb.pp("encoder"))?,
            post_norm: LayerNorm::new(w, c.encoder.layer_norm_eps, vb.pp("post_layernorm"))?,
            head: PoolingHead::new(&c.encoder, vb.pp("head"))?,
            config: c.clone(),
        })
    }

    /// The rows' grids (height, width in patches), checked against `max_patches`.
    fn grids(&self, rows: &Tensor) -> Result<Vec<(usize, usize)>> {
        let n = self.config.max_patches * self.config.patch_dim();
        let shapes = rows.narrow(1, n, 2)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        shapes
            .into_iter()
            .map(|s| {
                let (h, w) = (s[0] as usize, s[1] as usize);
                if h == 0 || w == 0 || h * w > self.config.max_patches || s[0].fract() != 0.0 || s[1].fract() != 0.0 {
                    candle_core::bail!(
                        "a NaFlex image row gives a {}×{} patch grid; at most {} patches",
                        s[0],
                        s[1],
                        self.config.max_patches
                    );
                }
                Ok((h, w))
            })
            .collect()
    }

    /// Each image's position embeddings `[b, max_patches, width]`: the learned grid resized to
    /// the image's grid, the padding rows given the first position's, as transformers fills them.
    fn positions(&self, grids: &[(usize, usize)]) -> Result<Tensor> {
        let (g, n) = (self.config.position_grid, self.config.max_patches);
        let mut all = Vec::with_capacity(grids.len() * n * g * g);
        for &(h, w) in grids {
            let (rh, rw) = (bilinear_matrix(g, h), bilinear_matrix(g, w));
            // Row (y, x) of the resized grid weighs grid cell (i, j) by rh[y, i] · rw[x, j].
            for p in 0..n {
                let (y, x) = if p < h * w { (p / w, p % w) } else { (0, 0) };
                for i in 0..g {
                    all.extend((0..g).map(|j| rh[y * g + i] * rw[x * g + j]));
                }
            }
        }
        let mix = Tensor::from_vec(all, (grids.len(), n, g * g), self.position.device())?.to_dtype(self.position.dtype())?;
        mix.broadcast_matmul(&self.position)
    }

    /// `[b, max_patches, width]` after `post_layernorm`, and the padding's score bias.
    pub fn hidden_states(&self, rows: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, len) = rows.dims2()?;
        if len != self.config.row_len() {
            candle_core::bail!(
                "the NaFlex tower takes rows of {} numbers ({} patches of {}, then the grid), got {len}",
                self.config.row_len(),
                self.config.max_patches,
                self.config.patch_dim()
            );
        }
        let grids = self.grids(rows)?;
        let (n, d) = (self.config.max_patches, self.config.patch_dim());
        let patches = rows.narrow(1, 0, n * d)?.reshape((b, n, d))?;
        let x = self.patch.forward(&patches)?.broadcast_add(&self.positions(&grids)?)?;
        let bias: Vec<f32> = grids.iter().flat_map(|&(h, w)| (0..n).map(move |p| if p < h * w { 0.0 } else { MASKED as f32 })).collect();
        let bias = Tensor::from_vec(bias, (b, 1, 1, n), rows.device())?;
        let h = self.post_norm.forward(&self.encoder.forward(&x, Some(&bias))?)?;
        Ok((h, bias))
    }

    /// The attention-pooling head's output over the image's own patches (`[b, width]`).
    pub fn pooled(&self, rows: &Tensor) -> Result<Tensor> {
        let (h, bias) = self.hidden_states(rows)?;
        self.head.forward_masked(&h, &bias)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch 2.15's `F.interpolate(ramp, size, mode="bilinear", align_corners=False,
    /// antialias=True)` of the ramp 0, 1, 2, 3: up to 6 (plain bilinear, clamped at the ends),
    /// down to 3 and to 2 (the triangle kernel widened by the scale).
    #[test]
    fn position_grids_resize_as_torch_does() {
        let ramp = [0.0f32, 1.0, 2.0, 3.0];
        for (out, want) in [(6, vec![0.0, 0.5, 1.1666667, 1.8333335, 2.5, 3.0]), (3, vec![0.3, 1.5, 2.7]), (2, vec![0.71428573, 2.2857144])]
        {
            let m = bilinear_matrix(4, out);
            let got: Vec<f32> = (0..out).map(|i| (0..4).map(|j| m[i * 4 + j] * ramp[j]).sum()).collect();
            assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6), "{out}: {got:?} vs {want:?}");
        }
    }
}
