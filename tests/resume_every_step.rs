//! Every checkpoint resumes: a small run is continued from each of its steps, across two epoch
//! ends, and every continuation ends bit for bit where the uninterrupted run ends.

mod common;

use std::collections::HashMap;
use std::path::Path;

use align::io::{metrics_log, run_dir, tensors};
use align::train::trainer::{train, TrainOptions};
use candle_core::{Device, Tensor};

/// 3 shards of 40 pairs at 16 a step: an epoch ends every 7.5 steps, so 18 steps cross two ends.
const STEPS: u64 = 18;

fn opts(nproc: usize) -> TrainOptions {
    TrainOptions { nproc, ..common::cpu_options() }
}

fn tensors_of(checkpoint: &Path, file: &str) -> HashMap<String, Vec<u32>> {
    tensors::read_tensors(&checkpoint.join(file), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t): (String, Tensor)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()))
        .collect()
}

fn losses(run: &Path) -> Vec<(u64, u64)> {
    metrics_log::read(&run.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|r| Some((r.get("step")?.as_u64()?, r.get("loss")?.as_f64()?.to_bits())))
        .collect()
}

fn assert_same_checkpoint(a: &Path, b: &Path, what: &str) {
    for file in [run_dir::MODEL_FILE, run_dir::OPTIMIZER_FILE] {
        assert!(tensors_of(a, file) == tensors_of(b, file), "{what}: {file} differs from the uninterrupted run's");
    }
    let (sa, sb) = (run_dir::read_state(a).unwrap(), run_dir::read_state(b).unwrap());
    assert_eq!(sa.samples_seen, sb.samples_seen, "{what}");
    assert_eq!(serde_json::to_string(&sa.loaders).unwrap(), serde_json::to_string(&sb.loaders).unwrap(), "{what}: loader positions differ");
}

/// Trains `STEPS` steps straight with a checkpoint at every step, then branches a run from each
/// checkpoint and checks that it ends on the same weights, moments, loader positions and losses.
fn every_step_resumes(nproc: usize, workers: usize, resampled: bool) {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let settings = |name: &str| -> Vec<String> {
        vec![
            format!("run.name={name}"),
            format!("data.workers={workers}"),
            format!("data.resampled={resampled}"),
            format!("train.steps={STEPS}"),
            "train.checkpoint_every=1".into(),
            "train.keep_last=100".into(),
        ]
    };
    let cfg = |name: &str| {
        let s = settings(name);
        common::tiny_config(&data, &tok, &dir.path().join("runs"), &s.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let what = format!("{nproc} rank(s), {workers} worker(s), resampled={resampled}");
    let straight = cfg("straight");
    let s = train(&straight, &opts(nproc)).unwrap();
    assert_eq!(s.steps, STEPS);
    let epochs = run_dir::read_state(&s.checkpoint).unwrap().loaders.iter().map(|l| l.epoch).max().unwrap();
    assert!(resampled || epochs >= 2, "{what}: the run must cross two epoch ends (reached epoch {epochs})");
    let reference = losses(&straight.run_dir());
    for k in 1..STEPS {
        let branch = cfg(&format!("from-{k}"));
        let from = TrainOptions { resume: true, resume_from: Some(straight.run_dir().join(format!("step-{k}"))), ..opts(nproc) };
        let b = train(&branch, &from).unwrap_or_else(|e| panic!("{what}: resuming from step {k}: {e:#}"));
        assert_eq!(b.steps, STEPS);
        assert_same_checkpoint(&s.checkpoint, &b.checkpoint, &format!("{what}, from step {k}"));
        let tail: Vec<_> = reference.iter().filter(|(step, _)| *step > k).copied().collect();
        let got: Vec<_> = losses(&branch.run_dir()).into_iter().filter(|(step, _)| *step > k).collect();
        assert_eq!(got, tail, "{what}, from step {k}: losses differ");
        std::fs::remove_dir_all(branch.run_dir()).unwrap();
    }
}

#[test]
fn one_rank_one_worker_resumes_from_every_step() {
    every_step_resumes(1, 1, false);
}

#[test]
fn one_rank_two_workers_resume_from_every_step() {
    every_step_resumes(1, 2, false);
}

#[test]
fn two_ranks_one_worker_resume_from_every_step() {
    every_step_resumes(2, 1, false);
}

#[test]
fn two_ranks_two_workers_resume_from_every_step() {
    every_step_resumes(2, 2, false);
}

#[test]
fn resampled_shards_resume_from_every_step() {
    every_step_resumes(1, 2, true);
    every_step_resumes(2, 1, true);
}

/// The paths a user takes to an epoch-end checkpoint: a stop there and `--resume`, and a finished
/// run whose length is raised afterwards.
#[test]
fn a_run_stopped_or_finished_on_an_epoch_end_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let at = |name: &str, steps: u64| {
        common::tiny_config(
            &data,
            &tok,
            &dir.path().join("runs"),
            // A constant rate after the warm-up: a run's length changes nothing before its end, so
            // an extended run can be held to the longer straight one.
            &[
                &format!("run.name={name}"),
                "data.workers=1",
                &format!("train.steps={steps}"),
                "train.checkpoint_every=5",
                "train.schedule=\"constant\"",
            ],
        )
    };
    let plain = at("straight", 20);
    let straight = train(&plain, &opts(1)).unwrap();
    // One worker holds all 120 pairs: epochs end after steps 7.5 and 15, the second exactly on a
    // step and a checkpoint.
    let state = run_dir::read_state(&plain.run_dir().join("step-15")).unwrap();
    assert_eq!(state.loaders[0].workers[0].epoch, 1, "step 15 is the last batch of epoch 1");

    let stopped = at("stopped", 20);
    let first = TrainOptions { stop_after: Some(15), ..opts(1) };
    assert_eq!(train(&stopped, &first).unwrap().steps, 15);
    let resumed = train(&stopped, &TrainOptions { resume: true, ..opts(1) }).unwrap();
    assert_same_checkpoint(&straight.checkpoint, &resumed.checkpoint, "stopped at step 15 and resumed");

    let short = at("extended", 15);
    assert_eq!(train(&short, &opts(1)).unwrap().steps, 15);
    let longer = at("extended", 20);
    let extend = TrainOptions { resume: true, allow_change: vec!["train.steps".into()], ..opts(1) };
    let extended = train(&longer, &extend).unwrap();
    assert_same_checkpoint(&straight.checkpoint, &extended.checkpoint, "finished at step 15 and extended");
}
