//! Position embeddings of a vision transformer resampled to another image size, as open_clip's
//! `resize_pos_embed` does when a checkpoint is loaded at a new resolution: the class token's row
//! stays, the grid of patch rows is interpolated as an image (`F.interpolate(mode="bicubic",
//! antialias=True, align_corners=False)`, which is PIL's separable bicubic with a = −0.5, its
//! support widened when shrinking).

use std::collections::HashMap;

use candle_core::{Result, Tensor};

use super::dual_encoder::{ImageSpec, ModelSpec};

/// PIL's and torch's antialiased bicubic kernel (Keys, a = −0.5).
fn cubic(x: f64) -> f64 {
    let a = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * a
    } else {
        0.0
    }
}

/// The triangle kernel of bilinear interpolation.
fn triangle(x: f64) -> f64 {
    (1.0 - x.abs()).max(0.0)
}

/// For each output index, the first input index and the normalised weights of the inputs from it.
fn weights(input: usize, output: usize) -> Vec<(usize, Vec<f64>)> {
    kernel_weights(input, output, 2.0, cubic)
}

/// torch's antialiased bilinear interpolation (`F.interpolate(mode="bilinear",
/// align_corners=False, antialias=True)`) from `input` to `output` positions, as a dense
/// `[output, input]` matrix.
pub fn bilinear_matrix(input: usize, output: usize) -> Vec<f32> {
    let mut m = vec![0f32; output * input];
    for (i, (lo, ws)) in kernel_weights(input, output, 1.0, triangle).into_iter().enumerate() {
        for (k, w) in ws.into_iter().enumerate() {
            m[i * input + lo + k] = w as f32;
        }
    }
    m
}

/// PIL's and torch's antialiased resampling: a kernel of half-width `radius`, stretched by the
/// downscaling factor, its weights normalised per output.
fn kernel_weights(input: usize, output: usize, radius: f64, kernel: fn(f64) -> f64) -> Vec<(usize, Vec<f64>)> {
    let scale = input as f64 / output as f64;
    let stretch = scale.max(1.0);
    let support = radius * stretch;
    (0..output)
        .map(|i| {
            let center = scale * (i as f64 + 0.5);
            let lo = ((center - support + 0.5).floor().max(0.0)) as usize;
            let hi = ((center + support + 0.5).floor() as usize).min(input);
            let w: Vec<f64> = (lo..hi).map(|j| kernel((j as f64 - center + 0.5) / stretch)).collect();
            let total: f64 = w.iter().sum();
            (lo, w.into_iter().map(|x| if total != 0.0 { x / total } else { x }).collect())
        })
        .collect()
}

/// `grid` (`[old, old, channels]`, row-major) resampled to `[new, new, channels]`.
pub fn resize_grid(grid: &[f32], old: usize, new: usize, channels: usize) -> Vec<f32> {
    let w = weights(old, new);
    // Along x first (rows stay old), then along y.
    let mut tmp = vec![0f64; old * new * channels];
    for y in 0..old {
        for (x, (lo, ws)) in w.iter().enumerate() {
            let out = &mut tmp[(y * new + x) * channels..][..channels];
            for (k, wk) in ws.iter().enumerate() {
                let src = &grid[(y * old + lo + k) * channels..][..channels];
                for c in 0..channels {
                    out[c] += wk * src[c] as f64;
                }
            }
        }
    }
    let mut out = vec![0f32; new * new * channels];
    for (y, (lo, ws)) in w.iter().enumerate() {
        for x in 0..new {
            let dst = &mut out[(y * new + x) * channels..][..channels];
            for c in 0..channels {
                let v: f64 = ws.iter().enumerate().map(|(k, wk)| wk * tmp[((lo + k) * new + x) * channels + c]).sum();
                dst[c] = v as f32;
            }
        }
    }
    out
}

/// A position table `[prefix + old², channels]` with its grid rows resampled to `new²`.
pub fn resize_table(table: &Tensor, prefix: usize, old: usize, new: usize) -> Result<Tensor> {
    let (rows, channels) = table.dims2()?;
    if rows != prefix + old * old {
        candle_core::bail!("a position table of {rows} rows is not {prefix} + {old}²");
    }
    let dtype = table.dtype();
    let data = table.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let grid = resize_grid(&data[prefix * channels..], old, new, channels);
    let mut out = data[..prefix * channels].to_vec();
    out.extend(grid);
    Tensor::from_vec(out, (prefix + new * new, channels), table.device())?.to_dtype(dtype)
}

/// Resamples the position embeddings in `weights` (a model of sizes `from`) for a model of sizes
/// `to` whose image size differs; returns a line for the log when it did.
pub fn resample_for(from: &ModelSpec, to: &ModelSpec, weights: &mut HashMap<String, Tensor>) -> Result<Option<String>> {
    let (name, prefix, patch, shape3) = match (&from.image, &to.image) {
        (ImageSpec::Vit(a), ImageSpec::Vit(_)) => ("vision_model.embeddings.position_embeddings", 1, a.patch_size, true),
        (ImageSpec::Clip(a), ImageSpec::Clip(_)) => ("vision_model.embeddings.position_embedding.weight", 1, a.patch_size, false),
        (ImageSpec::Siglip(a), ImageSpec::Siglip(_)) => ("vision_model.embeddings.position_embedding.weight", 0, a.patch_size, false),
        _ => return Ok(None),
    };
    let (old, new) = (from.image.image_size() / patch, to.image.image_size() / patch);
    if old == new {
        return Ok(None);
    }
    let Some(table) = weights.get(name) else { return Ok(None) };
    let flat = if shape3 { table.squeeze(0)? } else { table.clone() };
    let resized = resize_table(&flat, prefix, old, new)?;
    let resized = if shape3 { resized.unsqueeze(0)? } else { resized };
    weights.insert(name.to_string(), resized);
    Ok(Some(format!(
        "position embeddings resampled from a {old}×{old} grid ({} px) to {new}×{new} ({} px), bicubic",
        from.image.image_size(),
        to.image.image_size()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_size_is_the_identity_and_a_constant_stays_constant() {
        let grid: Vec<f32> = (0..4 * 4 * 2).map(|i| i as f32 * 0.1).collect();
        let same = resize_grid(&grid, 4, 4, 2);
        for (a, b) in grid.iter().zip(&same) {
            assert!((a - b).abs() < 1e-6);
        }
        for (old, new) in [(4, 7), (7, 3), (2, 9)] {
            let flat = vec![1.5f32; old * old * 3];
            assert!(resize_grid(&flat, old, new, 3).iter().all(|v| (v - 1.5).abs() < 1e-6), "{old}->{new}");
        }
    }

    /// torch's `F.interpolate(mode="bicubic", antialias=True, align_corners=False)`, as open_clip
    /// calls it, up and down (`scripts/make_pos_embed_fixture.py`).
    #[test]
    fn resampling_matches_torchs_antialiased_bicubic() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pos_embed.json");
        let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        for case in j["cases"].as_array().unwrap() {
            let n = |k: &str| case[k].as_u64().unwrap() as usize;
            let floats = |k: &str| case[k].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect::<Vec<f32>>();
            let got = resize_grid(&floats("grid"), n("old"), n("new"), n("channels"));
            let want = floats("resized");
            let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(d < 1e-5, "{} -> {}: {d}", n("old"), n("new"));
        }
    }

    /// Upsampling 2 → 4 by hand: output i samples at (i + 0.5)/2 − 0.5 in input coordinates, so
    /// at −0.25, 0.25, 0.75, 1.25; the kernel's taps outside the image are dropped and the rest
    /// renormalised, as PIL and torch's antialiased path do. Output 0 is 0.25 from pixel 0 and
    /// 1.25 from pixel 1.
    #[test]
    fn upsampling_a_ramp_matches_the_kernel_by_hand() {
        let w = weights(2, 4);
        let (a, b) = (cubic(0.25), cubic(1.25));
        assert_eq!(w[0].0, 0);
        assert!((w[0].1[0] - a / (a + b)).abs() < 1e-12 && (w[0].1[1] - b / (a + b)).abs() < 1e-12, "{:?}", w[0]);
        let out = resize_grid(&[0.0, 1.0, 0.0, 1.0], 2, 4, 1);
        let row0 = b / (a + b);
        assert!((out[0] - row0 as f32).abs() < 1e-6 && (out[3] - (1.0 - row0) as f32).abs() < 1e-6, "{out:?}");
    }
}
