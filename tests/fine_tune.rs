//! Fine-tuning from a published checkpoint with nothing copied by hand: `model.init` alone makes
//! the run take the start's image size, resize, crop, filter, mean and std, text length, tokenizer
//! and loss family, train with open_clip's augmentation at that size, and record all of it in the
//! run's `config.toml`; an explicit setting wins; another image size resamples the position
//! embeddings.

mod common;

use std::path::{Path, PathBuf};

use align::config::{Config, LossKind};
use align::data::transform::{CropOffset, Interpolation, ResizeMode, TrainCrop};
use align::io::tensors::read_tensors;
use align::train::trainer::train;
use candle_core::Device;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A run from `init` on the tiny synthetic shards with only the data, the run's place, the batch
/// and the length set, plus `extra`.
fn fine_tune(dir: &Path, init: &str, extra: &[&str]) -> (Config, PathBuf) {
    let data = common::tiny_data(&dir.join("data"));
    let mut o = vec![
        format!("data.train={}", data.train),
        format!("run.out_dir={}", dir.join("runs").display()),
        format!("model.init={}", fixtures().join(init).display()),
        "data.workers=1".into(),
        "train.batch_size=8".into(),
        "train.steps=2".into(),
        "train.warmup_steps=0".into(),
        "train.lr=1e-3".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    let cfg = Config::from_str_with_overrides("", "fine-tune", &o).unwrap();
    let s = train(&cfg, &common::cpu_options()).unwrap_or_else(|e| panic!("{init}: {e:#}"));
    let saved = Config::load(&s.checkpoint.join("config.toml"), &[]).unwrap();
    (saved, s.checkpoint)
}

#[test]
fn a_clip_start_trains_with_its_own_preprocessing_and_records_it() {
    let dir = tempfile::tempdir().unwrap();
    let (c, checkpoint) = fine_tune(dir.path(), "towers/clip-tiny", &[]);
    let im = &c.data.image;
    assert_eq!((im.image_size, im.resize, im.resize_mode, im.interpolation), (32, 32, ResizeMode::Shorter, Interpolation::Bicubic));
    assert!((im.mean[0] - 0.481_454_66).abs() < 1e-6 && (im.std[2] - 0.275_777_1).abs() < 1e-6, "{im:?}");
    assert_eq!((im.train_crop, im.rrc_scale, im.hflip), (TrainCrop::RandomResizedCrop, [0.9, 1.0], false));
    assert_eq!((c.text.max_len, c.loss.kind), (16, LossKind::Softmax));
    assert!(c.model.image_tower.starts_with("clip-vit") && c.model.text_tower.starts_with("clip-text"), "{:?}", c.model);
    assert_eq!(c.model.embed_dim, 16);
    // The checkpoint is used as it was trained: CLIP's preprocessing, not ALIGN's defaults.
    let m = align::io::load::load_model(&checkpoint, &Device::Cpu).unwrap();
    assert_eq!(m.usage.image.resize_mode, ResizeMode::Shorter);
}

#[test]
fn a_siglip_start_trains_with_the_sigmoid_loss_and_its_bias() {
    let dir = tempfile::tempdir().unwrap();
    let (c, checkpoint) = fine_tune(dir.path(), "towers/siglip-tiny", &[]);
    assert_eq!(c.loss.kind, LossKind::Sigmoid);
    assert_eq!(c.data.image.resize_mode, ResizeMode::Square);
    let start = align::io::format::hf::files::read_weights(&fixtures().join("towers/siglip-tiny"), &Device::Cpu).unwrap();
    let after = read_tensors(&checkpoint.join("model.safetensors"), &Device::Cpu).unwrap();
    let bias = |w: &std::collections::HashMap<String, candle_core::Tensor>| w["logit_bias"].to_scalar::<f32>().unwrap();
    assert_ne!(bias(&start), bias(&after), "the logit bias must train");
    let log = std::fs::read_to_string(checkpoint.parent().unwrap().join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    assert!(first.get("logit_bias").is_some() && first.get("logit_scale").is_some(), "{first}");
}

#[test]
fn an_open_clip_start_uses_open_clips_tokenizer_and_crop() {
    let dir = tempfile::tempdir().unwrap();
    let (c, checkpoint) = fine_tune(dir.path(), "open_clip/clip-native", &[]);
    assert_eq!((c.data.image.crop_offset, c.text.max_len), (CropOffset::Round, 16));
    let tokenizer = align::data::tokenizer::TextTokenizer::from_file(&checkpoint.join("tokenizer.json"), 16).unwrap();
    assert_eq!((tokenizer.vocab_size(), tokenizer.pad_id()), (49_408, 0), "open_clip's SimpleTokenizer pads with 0");
}

#[test]
fn a_vision_text_dual_encoder_folder_is_a_start_too() {
    let dir = tempfile::tempdir().unwrap();
    let (c, _) = fine_tune(dir.path(), "towers/vtde-tiny", &[]);
    assert_eq!((c.data.image.image_size, c.data.image.resize_mode), (32, ResizeMode::Square));
}

/// An explicit image size wins and resamples the position embeddings (bicubic, open_clip's
/// `resize_pos_embed`); an explicit mean wins over the checkpoint's.
#[test]
fn explicit_settings_win_and_another_image_size_resamples_positions() {
    let dir = tempfile::tempdir().unwrap();
    let (c, checkpoint) = fine_tune(
        dir.path(),
        "towers/clip-tiny",
        &["data.image.image_size=48", "data.image.mean=[0.5, 0.5, 0.5]", "data.image.std=[0.5, 0.5, 0.5]"],
    );
    assert_eq!((c.data.image.image_size, c.data.image.resize, c.data.image.mean), (48, 48, [0.5; 3]));
    let w = read_tensors(&checkpoint.join("model.safetensors"), &Device::Cpu).unwrap();
    // 48 px in patches of 8: a 6×6 grid and the class token.
    assert_eq!(w["vision_model.embeddings.position_embedding.weight"].dims(), &[37, 32]);
}

/// A CLIP start trains and logs open_clip's `ClipLoss`: no label smoothing, the mean of the two
/// directions. The validation loss of the fine-tuned model equals that loss computed by hand in
/// f64 from its embeddings (open_clip's `ClipLoss` is the same formula).
#[test]
fn a_clip_start_logs_open_clips_loss() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let val = format!("eval.validation={}", data.test);
    let (c, checkpoint) = fine_tune(dir.path(), "towers/clip-tiny", &[&val, "eval.validation_batch=36"]);
    assert_eq!((c.loss.label_smoothing, c.loss.directions), (0.0, align::config::Directions::Mean));
    assert_eq!((c.optimizer.kind, c.optimizer.beta2, c.optimizer.weight_decay), (align::config::OptimizerKind::Adamw, 0.98, 0.2));
    let log = std::fs::read_to_string(checkpoint.parent().unwrap().join("metrics.jsonl")).unwrap();
    let logged = log
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("eval")?.get("validation")?.get("loss")?.as_f64())
        .expect("the last step evaluates");

    let m = align::io::load::load_model(&checkpoint, &Device::Cpu).unwrap();
    let (img, txt, scale) = common::first_caption_pairs(&m, &data.test, 36);
    let cross_entropy = |a: &[Vec<f64>], b: &[Vec<f64>]| common::cross_entropy_by_hand(a, b, scale, 0.0);
    let want = (cross_entropy(&img, &txt) + cross_entropy(&txt, &img)) / 2.0;
    assert!((logged - want).abs() < 1e-4 * want, "logged {logged}, open_clip's ClipLoss by hand {want}");
}

/// The sigmoid loss chosen for a softmax-trained start: its bias starts at
/// `loss.init_logit_bias` and trains, with a warning that the start was trained otherwise.
#[test]
fn the_sigmoid_loss_on_a_clip_start_adds_its_bias() {
    let dir = tempfile::tempdir().unwrap();
    let (c, checkpoint) = fine_tune(dir.path(), "towers/clip-tiny", &["loss.kind=\"sigmoid\""]);
    assert_eq!(c.loss.kind, LossKind::Sigmoid);
    let after = read_tensors(&checkpoint.join("model.safetensors"), &Device::Cpu).unwrap();
    let bias = after["logit_bias"].to_scalar::<f32>().unwrap();
    assert!(bias != -10.0 && (bias + 10.0).abs() < 0.1, "the bias starts at -10 and trains: {bias}");
}

/// A resumed run reads its sizes, tokenizer, weights and start settings from its own checkpoint:
/// the start it began from may be gone, and the run ends where an uninterrupted one does.
#[test]
fn a_resume_needs_no_start_folder() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let start = dir.path().join("start");
    std::fs::create_dir(&start).unwrap();
    for f in std::fs::read_dir(fixtures().join("towers/clip-tiny")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, start.join(f.file_name().unwrap())).unwrap();
    }
    let config = |name: &str| {
        let o = [
            format!("data.train={}", data.train),
            format!("run.out_dir={}", dir.path().join("runs").display()),
            format!("run.name={name}"),
            format!("model.init={}", start.display()),
            "data.workers=1".into(),
            "train.batch_size=8".into(),
            "train.steps=4".into(),
            "train.checkpoint_every=1".into(),
            "train.warmup_steps=0".into(),
            "train.lr=1e-3".into(),
        ];
        Config::from_str_with_overrides("", "fine-tune", &o).unwrap()
    };
    let straight = train(&config("straight"), &common::cpu_options()).unwrap();
    let mut stopped = common::cpu_options();
    stopped.stop_after = Some(2);
    train(&config("stopped"), &stopped).unwrap();
    std::fs::remove_dir_all(&start).unwrap();
    let mut resume = common::cpu_options();
    resume.resume = true;
    let resumed = train(&config("stopped"), &resume).unwrap_or_else(|e| panic!("a resume without its start: {e:#}"));
    let (a, b) = (
        read_tensors(&straight.checkpoint.join("model.safetensors"), &Device::Cpu).unwrap(),
        read_tensors(&resumed.checkpoint.join("model.safetensors"), &Device::Cpu).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        assert_eq!(common::max_diff(t, &b[name]), 0.0, "{name}");
    }
    let saved = |s: &align::train::trainer::TrainSummary| std::fs::read_to_string(s.checkpoint.join("config.toml")).unwrap();
    assert_eq!(saved(&straight).replace("straight", "stopped"), saved(&resumed), "the resumed run records the start's settings");
}
