//! End-to-end training behaviour on tiny synthetic data.

mod common;

use std::collections::HashMap;

use align::io::metrics_log;
use align::io::{load, run_dir, tensors};
use align::train::trainer::{train, TrainOptions};
use candle_core::{Device, Tensor};

fn opts(resume: bool, stop_after: Option<u64>) -> TrainOptions {
    TrainOptions { resume, resume_from: None, quiet: true, device: Device::Cpu, stop_after, nproc: 1, allow_change: Vec::new() }
}

fn weights(dir: &std::path::Path) -> HashMap<String, Tensor> {
    tensors::read_tensors(&dir.join(run_dir::MODEL_FILE), &Device::Cpu).unwrap()
}

fn assert_identical(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) {
    assert_eq!(a.len(), b.len());
    for (name, ta) in a {
        let va = ta.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let vb = b[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(va.iter().zip(&vb).all(|(x, y)| x.to_bits() == y.to_bits()), "{name} differs after resuming");
    }
}

/// Trains 8 steps straight and 3 + 5 resumed with `extra` settings; the two end bit for bit
/// identical (weights, optimizer moments, metrics log). Returns the two final checkpoints.
fn assert_resume_is_exact(dir: &std::path::Path, extra: &[&str]) -> (std::path::PathBuf, std::path::PathBuf) {
    let data = common::tiny_data(&dir.join("data"));
    let tok = common::tiny_tokenizer(&data, dir);

    let straight = common::tiny_config(&data, &tok, &dir.join("a"), extra);
    let s = train(&straight, &opts(false, None)).unwrap();
    assert_eq!(s.steps, 8);

    let split = common::tiny_config(&data, &tok, &dir.join("b"), extra);
    let first = train(&split, &opts(false, Some(3))).unwrap();
    assert_eq!(first.steps, 3);
    let second = train(&split, &opts(true, None)).unwrap();
    assert_eq!(second.steps, 8);
    assert_eq!(second.samples_seen, s.samples_seen);

    assert_identical(&weights(&s.checkpoint), &weights(&second.checkpoint));
    let a = tensors::read_tensors(&s.checkpoint.join(run_dir::OPTIMIZER_FILE), &Device::Cpu).unwrap();
    let b = tensors::read_tensors(&second.checkpoint.join(run_dir::OPTIMIZER_FILE), &Device::Cpu).unwrap();
    assert_identical(&a, &b);
    // The metrics log reads as one run: steps 1..=8 once each, with the same losses.
    let la = metrics_log::read(&straight.run_dir().join("metrics.jsonl")).unwrap();
    let lb = metrics_log::read(&split.run_dir().join("metrics.jsonl")).unwrap();
    let losses = |l: &[serde_json::Value]| l.iter().filter_map(|r| r.get("loss").and_then(|v| v.as_f64())).collect::<Vec<_>>();
    assert_eq!(losses(&la), losses(&lb));
    assert_eq!(losses(&la).len(), 8);
    (s.checkpoint, second.checkpoint)
}

#[test]
fn resumed_run_matches_uninterrupted_run_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = assert_resume_is_exact(dir.path(), &[]);
    assert!(!a.join(run_dir::EMA_FILE).exists(), "a run without train.ema_decay saved a weight average");
    let e = load::load_model_with(&a, &Device::Cpu, true).err().unwrap().to_string();
    assert!(e.contains("--ema") && e.contains("ema_decay"), "{e}");
}

/// `train.epochs` counts the shards' samples and trains the steps they imply; the run's saved
/// config states those steps, and a resume with a longer length is refused like any change.
#[test]
fn epochs_become_the_steps_the_run_trains_and_saves() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    // tiny_config sets train.steps; a recipe in epochs states no steps.
    let mut cfg = common::tiny_config(&data, &tok, &dir.path().join("runs"), &[]);
    cfg.train.epochs = 2.0;
    cfg.train.steps = align::config::Config::default().train.steps;
    let s = train(&cfg, &opts(false, None)).unwrap();
    // 3 shards × 40 samples, twice, at 16 a step: 15 steps.
    assert_eq!(s.steps, 15);
    let saved = align::config::Config::load(&s.checkpoint.join(run_dir::CONFIG_FILE), &[]).unwrap();
    assert_eq!((saved.train.steps, saved.train.epochs), (15, 0.0));
    // Three epochs: 360 samples, 22.5 steps, so 23.
    cfg.train.epochs = 3.0;
    let e = format!("{:#}", train(&cfg, &opts(true, None)).unwrap_err());
    assert!(e.contains("train.steps changed from 15 to 23"), "{e}");
}

/// The validation loss (`eval.validation`) is the training loss of held-out pairs in batches of
/// `eval.validation_batch`: checked against the same loss computed by hand in f64 from the saved
/// checkpoint's embeddings, and logged with each evaluation.
#[test]
fn the_validation_loss_is_the_training_loss_on_held_out_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let val = format!("eval.validation={}", data.test);
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("runs"), &[&val, "eval.validation_batch=16", "train.eval_every=4"]);
    let s = train(&cfg, &opts(false, None)).unwrap();
    let v = s.eval.validation.clone().expect("the last step evaluates");
    assert_eq!((v.pairs, v.batch), (36, 16));
    let log = metrics_log::read(&cfg.run_dir().join("metrics.jsonl")).unwrap();
    let logged: Vec<(u64, f64)> =
        log.iter().filter_map(|r| Some((r["step"].as_u64()?, r.get("eval")?.get("validation")?.get("loss")?.as_f64()?))).collect();
    assert_eq!(logged.iter().map(|x| x.0).collect::<Vec<_>>(), [4, 8]);
    assert_eq!(logged[1].1, v.loss);

    // By hand: the first caption of each test image, batches of 16, 16 and 4.
    let m = load::load_model(&s.checkpoint, &Device::Cpu).unwrap();
    let (img, txt, scale) = common::first_caption_pairs(&m, &data.test, 36);
    let eps = cfg.loss.label_smoothing;
    let direction = |a: &[Vec<f64>], b: &[Vec<f64>]| common::cross_entropy_by_hand(a, b, scale, eps);
    let mut want = 0.0;
    for (start, n) in [(0, 16), (16, 16), (32, 4)] {
        let (a, b) = (&img[start..start + n], &txt[start..start + n]);
        want += n as f64 / 36.0 * (direction(a, b) + direction(b, a));
    }
    assert!((v.loss - want).abs() < 1e-4 * want.abs().max(1.0), "logged {} by hand {want}", v.loss);
}

/// `--resume PATH`: an earlier checkpoint of one run continues into another run's directory bit
/// for bit; within its own run, the later checkpoints it would replace block it; a run that has
/// checkpoints of its own refuses another run's.
#[test]
fn resume_from_a_chosen_checkpoint_branches_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let a = common::tiny_config(&data, &tok, &dir.path().join("a"), &["train.keep_last=10"]);
    let straight = train(&a, &opts(false, None)).unwrap();
    let step4 = a.run_dir().join("step-4");
    let from_step4 = TrainOptions { resume_from: Some(step4.clone()), ..opts(true, None) };
    let e = format!("{:#}", train(&a, &from_step4).unwrap_err());
    assert!(e.contains("step-6") && e.contains("step-8") && e.contains("replace"), "{e}");

    let b = common::tiny_config(&data, &tok, &dir.path().join("b"), &["train.keep_last=10"]);
    let branch = train(&b, &from_step4).unwrap();
    assert_eq!((branch.steps, branch.samples_seen), (8, straight.samples_seen));
    assert_identical(&weights(&straight.checkpoint), &weights(&branch.checkpoint));
    assert!(!b.run_dir().join("step-2").exists(), "the branch starts at step 4");
    let e = format!("{:#}", train(&b, &from_step4).unwrap_err());
    assert!(e.contains("already has checkpoints"), "{e}");
}

/// Patch dropout's draws and the weights' moving average come back exactly on resume, through
/// the switch to unmasked tuning (the last 2 steps); `--ema` loads the average.
#[test]
fn resume_with_patch_dropout_and_a_weight_average_is_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let extra = [
        "model.vit={patch_size = 8, width = 32, depth = 1, heads = 2, patch_dropout = 0.5}",
        "train.unmasked_tuning_steps=2",
        "train.ema_decay=0.9",
    ];
    let (a, b) = assert_resume_is_exact(dir.path(), &extra);
    let ema = |d: &std::path::Path| tensors::read_tensors(&d.join(run_dir::EMA_FILE), &Device::Cpu).unwrap();
    assert_identical(&ema(&a), &ema(&b));
    let loaded = load::load_model_with(&a, &Device::Cpu, true).unwrap();
    assert_identical(&loaded.weights, &ema(&a));
    let differs = weights(&a).iter().any(|(k, w)| {
        let (w, e) = (w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), ema(&a)[k].flatten_all().unwrap().to_vec1::<f32>().unwrap());
        w != e
    });
    assert!(differs, "the average equals the weights");
}

#[test]
fn tensorboard_events_carry_the_metrics_log_records() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("run"), &["train.log_every=2"]);
    let s = train(&cfg, &opts(false, None)).unwrap();
    let log = metrics_log::read(&cfg.run_dir().join("metrics.jsonl")).unwrap();
    let files: Vec<_> = std::fs::read_dir(cfg.run_dir().join("tb")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let events = align::io::tensorboard::read_scalars(&files[0]).unwrap();
    let mut compared = 0;
    for r in &log {
        let step = r["step"].as_i64().unwrap();
        for (tag, value) in metrics_log::scalars(r) {
            let found: Vec<f32> = events.iter().filter(|e| e.step == step && e.tag == tag).map(|e| e.value).collect();
            assert_eq!(found, vec![value as f32], "{tag} at step {step}");
            compared += 1;
        }
    }
    for tag in [
        "train/loss",
        "train/loss_i2t",
        "train/loss_t2i",
        "train/temperature",
        "train/lr",
        "train/grad_norm",
        "train/samples_per_s",
        "train/data_wait_share",
        "train/skipped",
    ] {
        assert!(events.iter().any(|e| e.tag == tag), "{tag} missing");
    }
    assert_eq!(events.iter().filter(|e| e.tag == "train/loss").count(), s.steps as usize / 2);
    assert!(compared >= 9 * 4);
}

#[test]
fn checkpoints_keep_the_last_k_and_latest_points_at_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("run"), &["train.steps=6"]);
    train(&cfg, &opts(false, None)).unwrap();
    let steps: Vec<u64> = run_dir::list_steps(&cfg.run_dir()).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, vec![4, 6]);
    assert_eq!(run_dir::latest(&cfg.run_dir()).unwrap().unwrap(), cfg.run_dir().join("step-6"));
    let leftovers: Vec<_> = std::fs::read_dir(cfg.run_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("partial") || n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // The saved model loads back and embeds.
    let m = load::load_model(&cfg.run_dir(), &Device::Cpu).unwrap();
    assert_eq!(m.dir, cfg.run_dir().join("step-6"));
}

#[test]
fn the_loss_falls_on_learnable_data() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg =
        common::tiny_config(&data, &tok, &dir.path().join("run"), &["train.steps=200", "train.checkpoint_every=0", "train.log_every=1"]);
    train(&cfg, &opts(false, None)).unwrap();
    let losses: Vec<f64> = metrics_log::read(&cfg.run_dir().join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|r| r.get("loss").and_then(|v| v.as_f64()))
        .collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&losses[..20]), mean(&losses[180..]));
    // ln(16) per direction is chance level; learning must take it clearly below.
    assert!(last < first - 0.5, "loss went from {first:.3} to {last:.3}");
}

#[test]
fn a_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("run"), &["train.steps=4"]);
    train(&cfg, &opts(false, Some(2))).unwrap();
    // An absurd learning rate blows the weights up within a few steps.
    let bad = common::tiny_config(
        &data,
        &tok,
        &dir.path().join("run"),
        &["train.steps=40", "train.lr=1e30", "train.warmup_steps=0", "optimizer.kind=\"adamw\""],
    );
    let mut resume = opts(true, None);
    resume.allow_change = vec!["train.steps".into(), "optimizer".into()];
    let err = train(&bad, &resume).unwrap_err().to_string();
    assert!(err.contains("non-finite"), "{err}");
    assert!(err.contains("step-2"), "{err}");
    assert_eq!(run_dir::latest(&cfg.run_dir()).unwrap().unwrap(), cfg.run_dir().join("step-2"));
}

#[test]
fn a_tiny_efficientnet_and_bert_learn_on_the_demo_data() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = common::tiny_config(
        &data,
        &tok,
        &dir.path().join("run"),
        &[
            "model.image_tower=\"efficientnet-b0\"",
            "model.efficientnet={width_coefficient = 0.25, depth_coefficient = 0.3}",
            "data.image.image_size=32",
            "data.image.resize=36",
            "train.steps=80",
            "train.checkpoint_every=0",
        ],
    );
    let summary = train(&cfg, &opts(false, None)).unwrap();
    let losses: Vec<f64> = metrics_log::read(&cfg.run_dir().join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|r| r.get("loss").and_then(|v| v.as_f64()))
        .collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&losses[..10]), mean(&losses[70..]));
    assert!(last < first - 0.3, "loss went from {first:.3} to {last:.3}");
    // BatchNorm running statistics are saved with the weights.
    let w = weights(&summary.checkpoint);
    let rv = w["vision_model.embeddings.batchnorm.running_var"].to_vec1::<f32>().unwrap();
    assert!(rv.iter().any(|&v| (v - 1.0).abs() > 1e-3), "running variance never updated");
}

/// Two data-parallel ranks (threads) with one loader worker each read exactly what one rank with
/// two workers reads, and one rank accumulating its two workers' micro-batches (keeping all
/// negatives) computes the same global batch: the runs must agree step for step. (Within an
/// epoch: the 3 shards deal 2 + 1, and once the lighter worker runs dry the single rank keeps
/// taking batches from the other while the second rank starts its next epoch.)
#[test]
fn two_ranks_follow_one_rank_with_the_same_global_batch_step_for_step() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let ranks = common::tiny_config(&data, &tok, &dir.path().join("ranks"), &["data.workers=1", "train.steps=5"]);
    let mut o = opts(false, None);
    o.nproc = 2;
    let a = train(&ranks, &o).unwrap();
    let single = common::tiny_config(&data, &tok, &dir.path().join("single"), &["data.workers=2", "train.accum_steps=2", "train.steps=5"]);
    let b = train(&single, &opts(false, None)).unwrap();
    assert_eq!(a.samples_seen, b.samples_seen);
    let losses = |cfg: &align::config::Config| -> Vec<f64> {
        metrics_log::read(&cfg.run_dir().join("metrics.jsonl"))
            .unwrap()
            .iter()
            .filter_map(|r| r.get("loss").and_then(|v| v.as_f64()))
            .collect()
    };
    let (la, lb) = (losses(&ranks), losses(&single));
    assert_eq!(la.len(), 5);
    for (x, y) in la.iter().zip(&lb) {
        assert!((x - y).abs() < 1e-4 * y.abs(), "step losses differ: {la:?} vs {lb:?}");
    }
    let (wa, wb) = (weights(&a.checkpoint), weights(&b.checkpoint));
    for (name, t) in &wa {
        let d = (t - &wb[name]).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-4, "{name} differs by {d}");
    }
}

#[test]
fn a_two_rank_run_resumes_on_both_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("run"), &["data.workers=1", "train.steps=6"]);
    let mut o = opts(false, None);
    o.nproc = 2;
    let straight = train(&cfg, &o).unwrap();
    let cfg2 = common::tiny_config(&data, &tok, &dir.path().join("run2"), &["data.workers=1", "train.steps=6"]);
    let mut first = opts(false, Some(2));
    first.nproc = 2;
    train(&cfg2, &first).unwrap();
    let state = run_dir::read_state(&run_dir::latest(&cfg2.run_dir()).unwrap().unwrap()).unwrap();
    assert_eq!(state.loaders.len(), 2, "a position per rank");
    let mut again = opts(true, None);
    again.nproc = 2;
    let resumed = train(&cfg2, &again).unwrap();
    assert_identical(&weights(&straight.checkpoint), &weights(&resumed.checkpoint));
    // Resuming on a number of ranks that cannot regroup its data streams (2 ranks × 1 worker
    // onto 3 ranks) is refused, naming both.
    let mut wrong = opts(true, None);
    wrong.nproc = 3;
    let err = format!("{:#}", train(&cfg2, &wrong).unwrap_err());
    assert!(err.contains("2 ranks") && err.contains("3"), "{err}");
}

/// On the CPU, bf16 training runs the f32 towers with every matrix product (here every one,
/// however small) on bf16 operands; the losses follow the f32 run's.
#[test]
fn bf16_towers_follow_the_f32_run_over_the_first_steps() {
    if !align::ops::kernels::bf16_gemm::available() {
        eprintln!("skipped: this CPU has no AVX-512 BF16, and bf16 training is refused on it");
        return;
    }
    align::ops::kernels::bf16_gemm::set_min_macs(1);
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let losses = |precision: &str| -> Vec<f64> {
        let cfg = common::tiny_config(&data, &tok, &dir.path().join(precision), &[&format!("train.precision=\"{precision}\"")]);
        train(&cfg, &opts(false, None)).unwrap();
        metrics_log::read(&cfg.run_dir().join("metrics.jsonl")).unwrap().iter().filter_map(|r| r["loss"].as_f64()).collect()
    };
    let (full, half) = (losses("f32"), losses("bf16"));
    assert_eq!(full.len(), 8);
    assert_eq!(half.len(), 8);
    // bf16 keeps 8 bits of mantissa; the losses differed by at most 0.11% here. Stated tolerance:
    // 1% of the loss at every one of the 8 steps, and the runs must differ (the products really
    // ran in bf16).
    for (step, (a, b)) in full.iter().zip(&half).enumerate() {
        assert!((a - b).abs() <= 0.01 * a.abs(), "step {}: f32 loss {a}, bf16 loss {b}", step + 1);
    }
    assert!(full.iter().zip(&half).any(|(a, b)| a != b));
}

/// LiT: a text tower trained against a locked pretrained image tower. The image tower and its
/// projection come out byte for byte as they went in, get no optimizer state, and the text tower
/// learns; with the last group unlocked only the projection moves.
#[test]
fn a_locked_image_tower_stays_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let pretrained = train(&common::tiny_config(&data, &tok, &dir.path().join("pre"), &["train.steps=2"]), &opts(false, None)).unwrap();
    let init = format!("model.init={}", pretrained.checkpoint.display());
    let before = weights(&pretrained.checkpoint);
    let is_image = |k: &str| k.starts_with("vision_model.") || k.starts_with("visual_projection.");
    for (unlocked, out) in [(0usize, "lit"), (1, "lit1")] {
        let groups = format!("model.lock_image_unlocked_groups={unlocked}");
        let cfg = common::tiny_config(
            &data,
            &tok,
            &dir.path().join(out),
            &[init.as_str(), "model.lock_image=true", groups.as_str(), "train.steps=4"],
        );
        let s = train(&cfg, &opts(false, None)).unwrap();
        let after = weights(&s.checkpoint);
        let same = |k: &str| {
            let (a, b) =
                (before[k].flatten_all().unwrap().to_vec1::<f32>().unwrap(), after[k].flatten_all().unwrap().to_vec1::<f32>().unwrap());
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        for k in before.keys() {
            let frozen = is_image(k) && !(unlocked == 1 && k.starts_with("visual_projection."));
            if frozen {
                assert!(same(k), "unlocked {unlocked}: {k} changed");
            }
        }
        assert!(!same("text_model.encoder.layer.0.attention.self.query.weight"), "the text tower did not train");
        assert_eq!(!same("visual_projection.weight"), unlocked == 1, "unlocked {unlocked}: the projection");
        let moments = tensors::read_tensors(&s.checkpoint.join(run_dir::OPTIMIZER_FILE), &Device::Cpu).unwrap();
        let locked_moments: Vec<&String> = moments
            .keys()
            .filter(|k| {
                k.starts_with("exp_avg") && is_image(k.split_once('.').unwrap().1) && !(unlocked == 1 && k.contains("visual_projection"))
            })
            .collect();
        assert!(locked_moments.is_empty(), "optimizer state for locked weights: {locked_moments:?}");
        assert!(moments.keys().any(|k| k.contains("text_model.")));
    }
}

/// A mix of `::` sources reports how many samples each gave, over every rank: the numbers a
/// `data.upsampling_factors` ratio is checked against.
#[test]
fn a_mix_counts_its_samples_by_source() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let shards = align::data::spec::expand(&data.train).unwrap();
    let mix = format!("data.train={}::{}", shards[0], shards[1]);
    let cfg = common::tiny_config(
        &data,
        &tok,
        &dir.path().join("runs"),
        &[&mix, "data.resampled=true", "data.upsampling_factors=[1.0, 3.0]", "train.steps=12", "data.workers=1"],
    );
    let mut o = opts(false, None);
    o.nproc = 2;
    let s = train(&cfg, &o).unwrap();
    assert_eq!(s.samples_per_source.len(), 2);
    assert_eq!(s.samples_per_source.iter().sum::<u64>(), s.samples_seen);
    assert!(s.samples_per_source[1] > s.samples_per_source[0], "{:?}", s.samples_per_source);
}
