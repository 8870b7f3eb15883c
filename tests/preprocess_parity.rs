//! End-to-end parity of evaluation preprocessing with transformers: image files of awkward sizes
//! and formats, read and preprocessed by align as `align eval` / `align embed` do, must give the
//! embeddings that transformers' `AlignProcessor` + `AlignModel` gave (fixtures written by
//! `scripts/make_preprocess_fixtures.py`).

use std::path::PathBuf;

use align::data::eval_reader::{EvalSource, FileSample, Needs};
use align::data::transform::{ImageConfig, Interpolation, ResizeMode};
use align::eval::embed::Embedder;
use align::io::load::{load_model, LoadedModel};
use align::io::tensors::read_tensors;
use candle_core::Device;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A tiny AlignModel with its processor config, as a published checkpoint has it.
fn model_dir() -> PathBuf {
    fixtures().join("preprocess/model")
}

fn names() -> Vec<String> {
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("preprocess/expected.json")).unwrap()).unwrap();
    j["names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

#[test]
fn checkpoint_processor_config_gives_transformers_pipeline() {
    let m = load_model(&model_dir(), &Device::Cpu).unwrap();
    let c = &m.usage.image;
    assert_eq!((c.resize, c.image_size), (346, 289), "the processor's size and crop, not the model config's 32 px");
}

/// Per image, the cosine between align's embedding of the file (through the evaluation reader, as
/// `align eval` and `align embed` read files) with `cfg` and transformers' embedding.
fn cosines(m: &LoadedModel, cfg: &ImageConfig) -> Vec<(String, f64)> {
    let names = names();
    let files: Vec<FileSample> =
        names.iter().map(|n| FileSample { path: fixtures().join("preprocess").join(n), label: None, captions: vec![] }).collect();
    let needs = Needs { image: true, captions: false, label: false };
    let embedder = Embedder { image: cfg, ..Embedder::of(m, 4, &Device::Cpu, true) };
    let got = embedder.images(EvalSource::Files(files), needs).unwrap();
    assert!(got.skipped.is_empty(), "{}", got.skipped.summary());
    let expected = read_tensors(&fixtures().join("preprocess/expected.safetensors"), &Device::Cpu).unwrap();
    let reference = expected["image_embeds"].to_vec2::<f32>().unwrap();
    let dim = got.embeddings.dim;
    names.into_iter().enumerate().map(|(i, n)| (n, cosine(&got.embeddings.data[i * dim..(i + 1) * dim], &reference[i]))).collect()
}

#[test]
fn image_files_embed_as_transformers_embeds_them() {
    let m = load_model(&model_dir(), &Device::Cpu).unwrap();
    let got = cosines(&m, &m.usage.image);
    let report: Vec<String> = got.iter().map(|(n, c)| format!("{n}: cosine {c:.6}")).collect();
    println!("{}", report.join("\n"));
    for (name, cos) in &got {
        assert!(*cos >= 0.999, "{name}: cosine {cos} with transformers' embedding is below 0.999\n{}", report.join("\n"));
    }
}

/// The check above can fail: the fixture model tells a near miss of the pipeline from the real one.
#[test]
fn a_near_miss_of_the_pipeline_falls_below_the_threshold() {
    let m = load_model(&model_dir(), &Device::Cpu).unwrap();
    let base = m.usage.image.clone();
    let misses = [
        ("bicubic instead of bilinear", ImageConfig { interpolation: Interpolation::Bicubic, ..base.clone() }),
        ("resize to 320 instead of 346", ImageConfig { resize: 320, ..base.clone() }),
        ("aspect-preserving resize", ImageConfig { resize_mode: ResizeMode::Shorter, ..base.clone() }),
    ];
    for (what, cfg) in misses {
        let worst = cosines(&m, &cfg).into_iter().map(|(_, c)| c).fold(1.0, f64::min);
        println!("{what}: worst cosine {worst:.4}");
        assert!(worst < 0.999, "{what}: every cosine stays >= 0.999 (worst {worst}), so the parity test could not see it");
    }
}

/// One 8-bit level after x/127.5 − 1.
const LEVEL: f32 = 1.0 / 127.5;

#[test]
fn preprocessed_pixels_match_transformers_on_a_grid() {
    use align::data::transform::{decode, eval_transform, FULL_RESOLUTION};
    let m = load_model(&model_dir(), &Device::Cpu).unwrap();
    let cfg = &m.usage.image;
    let expected = read_tensors(&fixtures().join("preprocess/expected.safetensors"), &Device::Cpu).unwrap();
    let grid = expected["pixel_grid"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let idx: Vec<usize> = expected["grid_index"].to_vec1::<i64>().unwrap().iter().map(|&i| i as usize).collect();
    let g = idx.len();
    let s = cfg.image_size;
    for (n, name) in names().iter().enumerate() {
        let bytes = std::fs::read(fixtures().join("preprocess").join(name)).unwrap();
        let img = decode(&bytes, FULL_RESOLUTION, cfg.max_pixels, cfg.alpha).unwrap();
        let mut px = vec![0f32; cfg.numel()];
        eval_transform(&img, cfg, &mut px);
        let mut worst = 0f32;
        let mut sum = 0f64;
        for c in 0..3 {
            for (gy, &y) in idx.iter().enumerate() {
                for (gx, &x) in idx.iter().enumerate() {
                    let ours = px[c * s * s + y * s + x];
                    let theirs = grid[((n * 3 + c) * g + gy) * g + gx];
                    worst = worst.max((ours - theirs).abs());
                    sum += (ours - theirs).abs() as f64;
                }
            }
        }
        let mean = sum / (3 * g * g) as f64;
        println!("{name}: max |Δ| {worst:.4}, mean |Δ| {mean:.5} (one 8-bit level is {LEVEL:.4})");
        // JPEG decoders (libjpeg-turbo in PIL, zune-jpeg here) round their IDCT and chroma
        // upsampling differently, and the resizers their fixed-point filter sums: a few levels
        // at worst, a fraction of one on average. A wrong filter, crop or scale is far more.
        assert!(worst <= 3.0 * LEVEL + 1e-6, "{name}: a pixel differs from transformers' by {worst}");
        assert!(mean <= 0.5 * LEVEL as f64, "{name}: pixels differ from transformers' by {mean} on average");
    }
}

/// The preprocessor configs of four hub repositories, key for key (scaled to 32 px by
/// `scripts/make_processor_fixtures.py`), read as transformers reads them: the legacy
/// `feature_extractor_type` forms of openai/clip-vit-base-patch32 (an integer `size` is CLIP's
/// shortest edge, then its centre crop) and google/vit-base-patch16-224-in21k (an integer `size`
/// is ViT's square, no crop), google/siglip-base-patch16-224 and kakaobrain/align-base. On every
/// awkward file, align's pixels embed as transformers' pixels do (AutoImageProcessor's default
/// class) through a tiny model of that family, to cosine 0.999, with the pixels themselves at most
/// a level apart on average (decoders and resizers round differently, most on the 40 px JPEG);
/// a square resize where CLIP's processor keeps the aspect fails both.
#[test]
fn hub_processor_configs_in_every_form_give_transformers_pixels() {
    use align::data::transform::{decode, eval_transform, FULL_RESOLUTION};
    use candle_core::Tensor;
    let dir = fixtures().join("processors");
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let expected = read_tensors(&dir.join("expected.safetensors"), &Device::Cpu).unwrap();
    let images: Vec<String> = j["images"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    // (mean level difference, embedding cosine) of align's pixels against transformers'.
    let compare = |cfg: &ImageConfig, form: &str, image: &str, m: &LoadedModel| -> (f32, f64) {
        let bytes = std::fs::read(fixtures().join("preprocess").join(image)).unwrap();
        let img = decode(&bytes, FULL_RESOLUTION, cfg.max_pixels, cfg.alpha).unwrap();
        let mut ours = vec![0.0; cfg.numel()];
        eval_transform(&img, cfg, &mut ours);
        let want = expected[&format!("{form}/{image}")].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(want.len(), ours.len(), "{form}/{image}: shape");
        let plane = cfg.image_size * cfg.image_size;
        let levels = ours.iter().zip(&want).enumerate().map(|(i, (a, b))| (a - b).abs() * cfg.std[i / plane] * 255.0).sum::<f32>()
            / ours.len() as f32;
        let s = cfg.image_size;
        let embed = |p: Vec<f32>| {
            let t = Tensor::from_vec(p, (1, 3, s, s), &Device::Cpu).unwrap();
            m.model.image_embeddings(&t, &align::model::Ctx::EVAL).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        (levels, cosine(&embed(ours), &embed(want)))
    };
    let models = [
        ("clip-legacy", "towers/clip-tiny"),
        ("vit-legacy", "towers/vtde-tiny"),
        ("siglip", "towers/siglip-tiny"),
        ("align-base", "hf/align-tiny"),
    ];
    for (form, model) in models {
        let m = load_model(&fixtures().join(model), &Device::Cpu).unwrap();
        let cfg = align::io::format::hf::preprocess::read_image_config(&dir.join(form).join("preprocessor_config.json"), None).unwrap();
        assert_eq!(cfg.image_size, 32, "{form}");
        for image in &images {
            let (levels, c) = compare(&cfg, form, image, &m);
            assert!(levels <= 1.0 && c >= 0.999, "{form}/{image}: {levels} levels apart on average, cosine {c}");
        }
    }
    let clip = align::io::format::hf::preprocess::read_image_config(&dir.join("clip-legacy/preprocessor_config.json"), None).unwrap();
    assert_eq!(clip.resize_mode, ResizeMode::Shorter);
    let squashed = ImageConfig { resize_mode: ResizeMode::Square, ..clip };
    let m = load_model(&fixtures().join("towers/clip-tiny"), &Device::Cpu).unwrap();
    let (levels, c) = compare(&squashed, "clip-legacy", "tall-1to4.jpg", &m);
    assert!(levels > 5.0 && c < 0.999, "a square resize of a 1:4 image must not pass ({levels} levels, cosine {c})");
}
