//! Shared helpers for integration tests: tiny synthetic data and a tiny model config.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use align::config::Config;
use align::data::synth::{write_synth, SynthOutput, SynthSpec};
use align::data::tokenizer::{captions_from_shards, train_wordpiece, TextTokenizer};

pub fn tiny_data(dir: &Path) -> SynthOutput {
    write_synth(dir, &SynthSpec { train_shards: 3, samples_per_shard: 40, test_samples: 36, image_size: 24, seed: 1 }).unwrap()
}

pub fn tiny_tokenizer(data: &SynthOutput, dir: &Path) -> PathBuf {
    let shards = align::data::spec::expand(&data.train).unwrap();
    let caps = captions_from_shards(&shards, 0);
    let tok = TextTokenizer::new(train_wordpiece(caps.iter(), 300, true, 1).unwrap(), 20).unwrap();
    let path = dir.join("tokenizer.json");
    tok.save(&path).unwrap();
    path
}

/// A model small enough that a step takes milliseconds.
pub fn tiny_config(data: &SynthOutput, tokenizer: &Path, out: &Path, extra: &[&str]) -> Config {
    let mut o: Vec<String> = vec![
        format!("data.train={}", data.train),
        format!("text.tokenizer={}", tokenizer.display()),
        format!("run.out_dir={}", out.display()),
        "run.name=tiny".into(),
        "data.workers=2".into(),
        "data.shuffle_buffer=16".into(),
        "data.image.image_size=16".into(),
        "data.image.resize=20".into(),
        "text.max_len=20".into(),
        "model.image_tower=\"vit\"".into(),
        "model.text_tower=\"bert\"".into(),
        "model.embed_dim=16".into(),
        "model.image_projection=true".into(),
        "model.temperature_init=0.1".into(),
        "model.vit={patch_size = 8, width = 32, depth = 1, heads = 2}".into(),
        "model.bert={hidden = 32, layers = 1, heads = 2, intermediate = 64, max_position = 32}".into(),
        "train.batch_size=16".into(),
        "train.steps=8".into(),
        "train.warmup_steps=2".into(),
        "train.lr=3e-3".into(),
        "train.log_every=1".into(),
        "train.checkpoint_every=2".into(),
        "train.keep_last=2".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    Config::from_str_with_overrides("", "tiny", &o).unwrap()
}

/// Tiny data, tokenizer and config made in `dir`, the config also written to `dir/tiny.toml`
/// for commands that take `--config`.
pub fn tiny_run(dir: &Path, extra: &[&str]) -> (SynthOutput, Config, PathBuf) {
    let data = tiny_data(&dir.join("data"));
    let tok = tiny_tokenizer(&data, dir);
    let cfg = tiny_config(&data, &tok, &dir.join("runs"), extra);
    let path = dir.join("tiny.toml");
    std::fs::write(&path, cfg.to_toml().unwrap()).unwrap();
    (data, cfg, path)
}

/// One quiet rank on the CPU, from scratch.
pub fn cpu_options() -> align::train::trainer::TrainOptions {
    align::train::trainer::TrainOptions {
        resume: false,
        resume_from: None,
        quiet: true,
        device: candle_core::Device::Cpu,
        stop_after: None,
        nproc: 1,
        allow_change: Vec::new(),
    }
}

pub fn max_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

/// The cosine of each image file's embedding, through the checkpoint's own preprocessing as
/// `align eval` reads files, with the reference library's embedding of the same file.
pub fn file_cosines(m: &align::io::load::LoadedModel, files: &[PathBuf], reference: &[Vec<f32>]) -> Vec<f64> {
    use align::data::eval_reader::{EvalSource, FileSample, Needs};
    let samples = files.iter().map(|p| FileSample { path: p.clone(), label: None, captions: vec![] }).collect();
    let needs = Needs { image: true, captions: false, label: false };
    let got = align::eval::embed::Embedder::of(m, 4, &candle_core::Device::Cpu, true).images(EvalSource::Files(samples), needs).unwrap();
    let dim = got.embeddings.dim;
    reference.iter().enumerate().map(|(i, r)| cosine(&got.embeddings.data[i * dim..(i + 1) * dim], r)).collect()
}

/// Each test image's embedding and its first caption's, in f64, with the model's logit scale:
/// what a loss computed by hand starts from. The test shard has `n` images of five captions.
pub fn first_caption_pairs(m: &align::io::load::LoadedModel, test: &str, n: usize) -> (Vec<Vec<f64>>, Vec<Vec<f64>>, f64) {
    let cpu = candle_core::Device::Cpu;
    let needs = align::data::eval_reader::Needs { image: true, captions: true, label: false };
    let source = align::data::eval_reader::EvalSource::Shards(align::data::spec::expand(test).unwrap());
    let e = align::eval::embed::Embedder::of(m, 8, &cpu, true).pairs(source, needs).unwrap();
    let d = e.embeddings.dim;
    let texts = e.caption_embeddings.as_ref().unwrap();
    let img = (0..n).map(|i| e.embeddings.data[i * d..(i + 1) * d].iter().map(|&x| x as f64).collect()).collect();
    let txt = (0..n).map(|i| texts.data[i * 5 * d..(i * 5 + 1) * d].iter().map(|&x| x as f64).collect()).collect();
    let scale = m.model.logit_scale().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_scalar::<f64>().unwrap();
    (img, txt, scale)
}

/// One direction of the softmax loss by hand: each row of `a` against every row of `b`, the
/// target the same row, label smoothing `eps`, averaged over rows.
pub fn cross_entropy_by_hand(a: &[Vec<f64>], b: &[Vec<f64>], scale: f64, eps: f64) -> f64 {
    let n = a.len();
    let mut total = 0.0;
    for (r, x) in a.iter().enumerate() {
        let logits: Vec<f64> = b.iter().map(|y| scale * x.iter().zip(y).map(|(p, q)| p * q).sum::<f64>()).collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
        for (j, l) in logits.iter().enumerate() {
            total -= (eps / n as f64 + if j == r { 1.0 - eps } else { 0.0 }) * (l - lse);
        }
    }
    total / n as f64
}
