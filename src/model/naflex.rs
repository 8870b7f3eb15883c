//! SigLIP 2's NaFlex vision tower with transformers' `Siglip2VisionModel` names: an image keeps
//! its aspect ratio as a grid of up to `max_patches` patches, each embedded by a linear layer;
//! the learned square grid of position embeddings is resized (antialiased bilinear) to each
//! image's grid; padding patches are hidden from attention and from the attention-pooling head.
//!
//! An image enters as one row of `n · 3p² + 2` numbers: its patches in order (each row by row,
//! pixel by pixel, R G B, as transformers flattens them), zeros after the last, then the grid's
//! height and width in patches. `n` is the batch's sequence length: the processor's
//! `max_patches`, or in training with token-budget batches the length drawn for the batch.
//!
//! Under patch dropout each image keeps a random `1 − rate` of its own patches (padding never
//! counts), and the batch's rows shrink to the most any image keeps.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use super::layers::{linear, scaled_normal, LayerNorm, Linear, Mask};
use super::pos_embed::bilinear_matrix;
use super::prenorm::{Encoder, EncoderConfig};
use super::siglip::PoolingHead;
use super::vit::kept_patches;
use super::{Ctx, Masking};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NaflexVisionConfig {
    pub patch_size: usize,
    /// Side of the learned position grid (`sqrt(num_patches)`).
    pub position_grid: usize,
    /// The most patches an image becomes (the processor's `max_num_patches`).
    pub max_patches: usize,
    pub encoder: EncoderConfig,
    /// Fraction of each image's patches dropped in training (open_clip's `patch_dropout`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub patch_dropout: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl NaflexVisionConfig {
    /// Numbers per image row: the patches, then the grid's height and width.
    pub fn row_len(&self) -> usize {
        self.max_patches * self.patch_dim() + 2
    }

    pub fn patch_dim(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }

    /// Patches an image of `valid` patches keeps under patch dropout (at least one).
    pub fn kept(&self, valid: usize) -> usize {
        ((valid as f64 * (1.0 - self.patch_dropout)) as usize).max(1)
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

    /// The rows' grids (height, width in patches), checked against the rows' `n` patches.
    fn grids(&self, rows: &Tensor, n: usize) -> Result<Vec<(usize, usize)>> {
        let shapes = rows.narrow(1, n * self.config.patch_dim(), 2)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        shapes
            .into_iter()
            .map(|s| {
                let (h, w) = (s[0] as usize, s[1] as usize);
                if h == 0 || w == 0 || h * w > n || s[0].fract() != 0.0 || s[1].fract() != 0.0 {
                    candle_core::bail!("a NaFlex image row gives a {}×{} patch grid; its row holds at most {n} patches", s[0], s[1]);
                }
                Ok((h, w))
            })
            .collect()
    }

    /// Each image's position embeddings `[b, n, width]`: the learned grid resized to the
    /// image's grid, the padding rows given the first position's, as transformers fills them.
    fn positions(&self, grids: &[(usize, usize)], n: usize) -> Result<Tensor> {
        let g = self.config.position_grid;
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

    /// `[b, tokens, width]` after `post_layernorm`, and the padding's score bias. `tokens` is
    /// the rows' patch count, or under patch dropout (a training `ctx` with masking and a
    /// positive rate) the most patches an image of the batch keeps.
    pub fn hidden_states(&self, rows: &Tensor, ctx: &Ctx) -> Result<(Tensor, Tensor)> {
        let (b, len) = rows.dims2()?;
        let d = self.config.patch_dim();
        if len < d + 2 || !(len - 2).is_multiple_of(d) {
            candle_core::bail!(
                "the NaFlex tower takes rows of n·{d} + 2 numbers (n patches of {d}, then the grid), got {len}; the processor's budget is {} patches",
                self.config.max_patches
            );
        }
        let n = (len - 2) / d;
        let grids = self.grids(rows, n)?;
        let patches = rows.narrow(1, 0, n * d)?.reshape((b * n, d))?;
        let positions = self.positions(&grids, n)?.reshape((b * n, self.config.encoder.width))?;
        let (x, valid) = match (ctx.train && self.config.patch_dropout > 0.0, ctx.masking) {
            // Dropped patches are left out before the embedding: they cost nothing.
            (true, Some(m)) => {
                let (rows, valid) = self.kept_rows(&grids, n, m, patches.device())?;
                (self.patch.forward(&patches.index_select(&rows, 0)?)? + positions.index_select(&rows, 0)?, valid)
            }
            _ => (self.patch.forward(&patches)? + positions, grids.iter().map(|&(h, w)| (h * w, n)).collect()),
        };
        let tokens = valid.first().map_or(n, |v| v.1);
        let x = x?.reshape((b, tokens, self.config.encoder.width))?;
        let bias: Vec<f32> = valid.iter().flat_map(|&(v, t)| (0..t).map(move |p| if p < v { 0.0 } else { MASKED as f32 })).collect();
        let bias = Tensor::from_vec(bias, (b, 1, 1, tokens), rows.device())?;
        let mask = Mask { key_bias: Some(bias.reshape((b, tokens))?), causal: false };
        let h = self.post_norm.forward(&self.encoder.forward(&x, &mask)?)?;
        Ok((h, bias))
    }

    /// The rows of the flattened `[b · n]` patches that patch dropout keeps, each image's kept
    /// patches first (drawn from its own stream by a partial Fisher-Yates shuffle, in ascending
    /// order), then its first patch again as masked filler up to the batch's widest; and per
    /// image (kept, row width).
    fn kept_rows(
        &self,
        grids: &[(usize, usize)],
        n: usize,
        m: Masking,
        device: &candle_core::Device,
    ) -> Result<(Tensor, Vec<(usize, usize)>)> {
        let width = grids.iter().map(|&(h, w)| self.config.kept(h * w)).max().unwrap_or(1);
        let mut rows = Vec::with_capacity(grids.len() * width);
        let mut valid = Vec::with_capacity(grids.len());
        let mut order: Vec<u32> = Vec::with_capacity(n);
        for (i, &(h, w)) in grids.iter().enumerate() {
            let keep = self.config.kept(h * w);
            let kept = kept_patches(m, i, h * w, keep, &mut order);
            let base = (i * n) as u32;
            rows.extend(kept.iter().map(|&p| base + p));
            rows.extend(std::iter::repeat_n(base, width - keep));
            valid.push((keep, width));
        }
        Ok((Tensor::from_vec(rows, grids.len() * width, device)?, valid))
    }

    /// The attention-pooling head's output over the image's own patches (`[b, width]`).
    pub fn pooled(&self, rows: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (h, bias) = self.hidden_states(rows, ctx)?;
        self.head.forward_masked(&h, &bias)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::init::SeededVars;
    use crate::model::prenorm::Act;
    use crate::util::rng::Rng;
    use candle_core::Device;

    /// A 2-layer tower of 2-pixel patches over a 3×3 position grid.
    fn tower(patch_dropout: f64) -> NaflexVision {
        let encoder = EncoderConfig { width: 8, layers: 2, heads: 2, mlp_dim: 16, layer_norm_eps: 1e-6, act: Act::GeluTanh };
        let c = NaflexVisionConfig { patch_size: 2, position_grid: 3, max_patches: 16, encoder, patch_dropout };
        NaflexVision::new(&c, SeededVars::builder(&candle_nn::VarMap::new(), 3, &Device::Cpu)).unwrap()
    }

    /// An image of `h × w` patches as a row of `n` patches (zeros after its own), then its grid.
    fn row(h: usize, w: usize, n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let mut r = vec![0.0f32; n * 12 + 2];
        r[..h * w * 12].iter_mut().for_each(|v| *v = rng.normal() as f32);
        r[n * 12] = h as f32;
        r[n * 12 + 1] = w as f32;
        r
    }

    fn rows(list: &[Vec<f32>]) -> Tensor {
        Tensor::from_vec(list.concat(), (list.len(), list[0].len()), &Device::Cpu).unwrap()
    }

    fn close(a: &Tensor, b: &Tensor) -> bool {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        d < 1e-5
    }

    /// An image's embedding does not depend on the row length it travels in (a token-budget
    /// batch's), nor on the other images of its batch: padding is hidden from attention and
    /// from the head.
    #[test]
    fn an_image_embeds_the_same_at_any_row_length() {
        let t = tower(0.0);
        let alone = t.pooled(&rows(&[row(2, 3, 6, 1)]), &Ctx::EVAL).unwrap();
        let longer = t.pooled(&rows(&[row(2, 3, 16, 1), row(4, 4, 16, 2)]), &Ctx::EVAL).unwrap();
        assert!(close(&alone, &longer.narrow(0, 0, 1).unwrap()));
        let err = t.pooled(&rows(&[row(4, 4, 16, 2)]).narrow(1, 0, 100).unwrap(), &Ctx::EVAL).unwrap_err().to_string();
        assert!(err.contains("n·12 + 2"), "{err}");
        let mut bad = row(2, 2, 4, 1);
        bad[4 * 12] = 3.0;
        let err = t.pooled(&rows(&[bad]), &Ctx::EVAL).unwrap_err().to_string();
        assert!(err.contains("3×2 patch grid") && err.contains("at most 4"), "{err}");
    }

    /// Patch dropout keeps ⌊v·(1 − rate)⌋ of an image's own v patches, drawn from the image's
    /// row of the global batch: the same draw whatever else shares the batch, the filler that
    /// evens the rows out hidden. Evaluation and the unmasked phase see every patch.
    #[test]
    fn patch_dropout_keeps_a_share_of_each_images_own_patches() {
        let t = tower(0.5);
        let (big, small) = (row(4, 4, 16, 2), row(1, 3, 16, 1));
        let m = Masking { seed: 9, first_row: 5 };
        let train = Ctx { masking: Some(m), ..Ctx::train(9) };
        let (kept, valid) = t.kept_rows(&[(4, 4), (1, 3)], 16, m, &Device::Cpu).unwrap();
        assert_eq!(valid, [(8, 8), (1, 8)]);
        let kept = kept.to_vec1::<u32>().unwrap();
        assert!(kept[..8].windows(2).all(|p| p[0] < p[1]) && kept[..8].iter().all(|&r| r < 16), "{kept:?}");
        assert!(kept[8] >= 16 && kept[8] < 19 && kept[9..].iter().all(|&r| r == 16), "{kept:?}");
        let both = t.pooled(&rows(&[big.clone(), small.clone()]), &train).unwrap();
        let second = Ctx { masking: Some(Masking { seed: 9, first_row: 6 }), ..Ctx::train(9) };
        assert!(close(&both.narrow(0, 0, 1).unwrap(), &t.pooled(&rows(std::slice::from_ref(&big)), &train).unwrap()));
        assert!(close(&both.narrow(0, 1, 1).unwrap(), &t.pooled(&rows(std::slice::from_ref(&small)), &second).unwrap()));
        let eval = t.pooled(&rows(std::slice::from_ref(&big)), &Ctx::EVAL).unwrap();
        assert!(!close(&both.narrow(0, 0, 1).unwrap(), &eval), "half the patches dropped changes the embedding");
        let unmasked = Ctx { masking: None, ..Ctx::train(9) };
        assert!(close(&t.pooled(&rows(&[big]), &unmasked).unwrap(), &eval));
    }

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
