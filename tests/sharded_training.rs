//! Sharded optimizer state and gradients (`train.shard`) on thread ranks: the same training as
//! unsharded, step for step and bit for bit; sharded checkpoints that resume on other numbers of
//! ranks, that a kill -9 mid-save leaves whole, and whose manifest is checked.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use align::io::state_shards;
use align::io::{metrics_log, run_dir, tensors};
use align::train::trainer::{train, TrainOptions};
use candle_core::{Device, Tensor};

fn opts(nproc: usize) -> TrainOptions {
    TrainOptions { nproc, ..common::cpu_options() }
}

fn bits(map: HashMap<String, Tensor>) -> HashMap<String, Vec<u32>> {
    map.into_iter().map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect())).collect()
}

/// Every optimizer state tensor of a checkpoint, sharded or not.
fn optimizer_state(checkpoint: &Path) -> HashMap<String, Vec<u32>> {
    let names: Vec<String> = if checkpoint.join(state_shards::MANIFEST_FILE).is_file() {
        state_shards::read_manifest(checkpoint).unwrap().shards.into_iter().flat_map(|s| s.tensors).collect()
    } else {
        tensors::header_shapes(&checkpoint.join(run_dir::OPTIMIZER_FILE)).unwrap().into_keys().collect()
    };
    bits(run_dir::read_optimizer(checkpoint, &Device::Cpu, &names).unwrap())
}

fn file_bits(checkpoint: &Path, file: &str) -> HashMap<String, Vec<u32>> {
    bits(tensors::read_tensors(&checkpoint.join(file), &Device::Cpu).unwrap())
}

/// (step, loss, grad_norm) of every logged step, as bits.
fn log_bits(run: &Path) -> Vec<(u64, u64, u64)> {
    metrics_log::read(&run.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .filter_map(|r| Some((r.get("step")?.as_u64()?, r.get("loss")?.as_f64()?.to_bits(), r.get("grad_norm")?.as_f64()?.to_bits())))
        .collect()
}

/// Weights, moving average, optimizer state and log of two runs' ends are the same bits.
fn assert_same_run(a: &Path, b: &Path, run_a: &Path, run_b: &Path, what: &str) {
    assert!(file_bits(a, run_dir::MODEL_FILE) == file_bits(b, run_dir::MODEL_FILE), "{what}: the weights differ");
    if a.join(run_dir::EMA_FILE).is_file() {
        assert!(file_bits(a, run_dir::EMA_FILE) == file_bits(b, run_dir::EMA_FILE), "{what}: the weight averages differ");
    }
    let (oa, ob) = (optimizer_state(a), optimizer_state(b));
    assert_eq!(oa.len(), ob.len(), "{what}");
    assert!(oa == ob, "{what}: the optimizer states differ");
    let (la, lb) = (log_bits(run_a), log_bits(run_b));
    assert!(!la.is_empty() && la == lb, "{what}: the logged losses or gradient norms differ");
}

/// The largest difference between two sets of tensors, relative to the largest magnitude.
fn relative_difference(a: &HashMap<String, Vec<u32>>, b: &HashMap<String, Vec<u32>>) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut diff, mut size) = (0f64, 0f64);
    for (k, va) in a {
        for (x, y) in va.iter().zip(&b[k]) {
            let (x, y) = (f32::from_bits(*x) as f64, f32::from_bits(*y) as f64);
            diff = diff.max((x - y).abs());
            size = size.max(x.abs());
        }
    }
    diff / size
}

/// As [`assert_same_run`], within a tolerance: for sharded gradients accumulated over
/// micro-batches, which add the same f32 terms in another order (micro-batches of rank sums,
/// not ranks of micro-batch sums). Each such sum differs by a few units in the last place
/// (2^-24 ≈ 6e-8 relative); Adam's normalised step carries a relative error through at its
/// size, so four steps stay near 1e-7. Measured over the twelve runs below, largest differences
/// in weights, moments, a loss and a gradient norm (a norm of partly cancelling sums): 1.2e-7,
/// 1.1e-7, 3.1e-7 and 7.8e-7 where the matrix products run on AVX-512; 2.8e-7, 5.6e-7, 4.7e-7
/// and 1.3e-6 on AVX2 alone, whose 8-wide kernels block the sums otherwise. The bound, 1e-5 of each file's largest value, of each logged loss and
/// of each gradient norm, leaves a wide margin and still catches any wrong gradient, which errs
/// at the size of the gradient itself.
fn assert_close_run(a: &Path, b: &Path, run_a: &Path, run_b: &Path, what: &str) {
    let weights = relative_difference(&file_bits(a, run_dir::MODEL_FILE), &file_bits(b, run_dir::MODEL_FILE));
    let moments = relative_difference(&optimizer_state(a), &optimizer_state(b));
    assert!(weights < 1e-5 && moments < 1e-5, "{what}: weights differ by {weights:.1e}, moments by {moments:.1e}");
    let ema = relative_difference(&file_bits(a, run_dir::EMA_FILE), &file_bits(b, run_dir::EMA_FILE));
    assert!(ema < 1e-5, "{what}: the weight averages differ by {ema:.1e}");
    let (la, lb) = (log_bits(run_a), log_bits(run_b));
    assert_eq!(la.len(), lb.len(), "{what}");
    for ((step, x, gx), (_, y, gy)) in la.iter().zip(&lb) {
        let (x, y) = (f64::from_bits(*x), f64::from_bits(*y));
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{what}: step {step} loss {x} against {y}");
        let (gx, gy) = (f64::from_bits(*gx), f64::from_bits(*gy));
        assert!((gx - gy).abs() <= 1e-5 * gx.abs(), "{what}: step {step} gradient norm {gx} against {gy}");
    }
}

struct Tiny {
    _dir: tempfile::TempDir,
    data: align::data::synth::SynthOutput,
    tok: PathBuf,
    root: PathBuf,
}

impl Tiny {
    fn new() -> Tiny {
        let dir = tempfile::tempdir().unwrap();
        let data = common::tiny_data(&dir.path().join("data"));
        let tok = common::tiny_tokenizer(&data, dir.path());
        let root = dir.path().join("runs");
        Tiny { _dir: dir, data, tok, root }
    }

    fn config(&self, name: &str, extra: &[String]) -> align::config::Config {
        let mut all = vec![format!("run.name={name}")];
        all.extend(extra.iter().cloned());
        common::tiny_config(&self.data, &self.tok, &self.root, &all.iter().map(String::as_str).collect::<Vec<_>>())
    }
}

/// On 2, 3 and 4 thread ranks, AdamW and LAMB, with two accumulated micro-batches per step and a
/// gradient clip that binds at every step: with sharded optimizer state, a run's weights, moving
/// average, optimizer moments, losses and gradient norms are bit for bit the unsharded run's;
/// with sharded gradients too (reduced micro-batch by micro-batch), the same within rounding.
#[test]
fn sharded_runs_follow_the_unsharded_run() {
    let t = Tiny::new();
    for (world, batch) in [(2, 16), (3, 12), (4, 16)] {
        for kind in ["adamw", "lamb"] {
            let settings = |shard: &str| -> Vec<String> {
                vec![
                    format!("train.batch_size={batch}"),
                    "train.accum_steps=2".into(),
                    "train.steps=4".into(),
                    "train.checkpoint_every=0".into(),
                    "train.ema_decay=0.9".into(),
                    "data.resampled=true".into(),
                    "data.workers=1".into(),
                    format!("optimizer.kind=\"{kind}\""),
                    "optimizer.grad_clip=0.05".into(),
                    format!("train.shard=\"{shard}\""),
                ]
            };
            let whole = t.config(&format!("none-{world}-{kind}"), &settings("none"));
            let w = train(&whole, &opts(world)).unwrap();
            let norms: Vec<f64> =
                metrics_log::read(&whole.run_dir().join("metrics.jsonl")).unwrap().iter().filter_map(|r| r["grad_norm"].as_f64()).collect();
            assert!(norms.iter().all(|&n| n > 0.05), "the clip must bind: {norms:?}");
            for mode in ["optimizer", "gradients"] {
                let cfg = t.config(&format!("{mode}-{world}-{kind}"), &settings(mode));
                let s = train(&cfg, &opts(world)).unwrap();
                let what = format!("{world} ranks, {kind}, train.shard = {mode}");
                if mode == "optimizer" {
                    assert_same_run(&w.checkpoint, &s.checkpoint, &whole.run_dir(), &cfg.run_dir(), &what);
                } else {
                    assert_close_run(&w.checkpoint, &s.checkpoint, &whole.run_dir(), &cfg.run_dir(), &what);
                }
                let m = state_shards::read_manifest(&s.checkpoint).unwrap();
                assert_eq!((m.world_size, m.mode.as_str()), (world, mode), "{what}");
                assert!(!s.checkpoint.join(run_dir::OPTIMIZER_FILE).exists(), "{what}");
            }
        }
    }
}

/// The sigmoid loss (blocks passed around the ring) with a locked image tower (whose tensors
/// have no moments and belong to no rank): sharded gradients equal the unsharded run.
#[test]
fn sharding_composes_with_the_sigmoid_ring_and_a_locked_tower() {
    let t = Tiny::new();
    let settings = |shard: &str| -> Vec<String> {
        vec![
            "loss.kind=\"sigmoid\"".into(),
            "model.temperature_init=1.0".into(),
            "model.lock_image=true".into(),
            "train.steps=4".into(),
            "train.checkpoint_every=0".into(),
            "data.workers=1".into(),
            format!("train.shard=\"{shard}\""),
        ]
    };
    let (a, b) = (t.config("none", &settings("none")), t.config("gradients", &settings("gradients")));
    let (ra, rb) = (train(&a, &opts(2)).unwrap(), train(&b, &opts(2)).unwrap());
    assert_same_run(&ra.checkpoint, &rb.checkpoint, &a.run_dir(), &b.run_dir(), "sigmoid, locked image tower");
    let names: Vec<String> = state_shards::read_manifest(&rb.checkpoint).unwrap().shards.into_iter().flat_map(|s| s.tensors).collect();
    assert!(!names.is_empty() && names.iter().all(|n| !n.contains("vision_model")), "a locked tensor has moments: {names:?}");
}

/// Both towers locked (their projections with them) leave one trained tensor, the temperature,
/// for four ranks: the three that own none still take part in every exchange and write empty
/// files, and a sharded run stopped and resumed ends bit for bit where the unsharded one does.
#[test]
fn a_rank_that_owns_no_tensor_still_takes_part() {
    let t = Tiny::new();
    let settings = |shard: &str| -> Vec<String> {
        vec![
            "model.lock_image=true".into(),
            "model.lock_text=true".into(),
            "train.steps=4".into(),
            "train.checkpoint_every=2".into(),
            "data.workers=1".into(),
            "data.resampled=true".into(),
            format!("train.shard=\"{shard}\""),
        ]
    };
    let (a, b) = (t.config("none", &settings("none")), t.config("gradients", &settings("gradients")));
    let ra = train(&a, &opts(4)).unwrap();
    train(&b, &TrainOptions { stop_after: Some(2), ..opts(4) }).unwrap();
    let m = state_shards::read_manifest(&b.run_dir().join("step-2")).unwrap();
    assert_eq!(m.shards.iter().map(|s| s.tensors.len()).sum::<usize>(), 2, "the temperature's two moments: {m:?}");
    assert_eq!(m.shards.iter().filter(|s| s.tensors.is_empty()).count(), 3, "{m:?}");
    let rb = train(&b, &TrainOptions { resume: true, ..opts(4) }).unwrap();
    assert_same_run(&ra.checkpoint, &rb.checkpoint, &a.run_dir(), &b.run_dir(), "one tensor on four ranks");
}

/// A run on 2 ranks × 2 loader workers, resumed on 4 ranks × 1, then on 1 rank × 4 (the same four
/// data streams): sharded, it ends bit for bit where the unsharded run resumed the same way ends,
/// each checkpoint written by the ranks that were there; resumes on a shape whose streams differ
/// are refused, and so is a manifest that no longer matches its files.
#[test]
fn a_sharded_checkpoint_resumes_on_four_ranks_then_on_one() {
    let t = Tiny::new();
    let settings = |shard: &str, workers: usize| -> Vec<String> {
        vec![
            "train.steps=9".into(),
            "train.checkpoint_every=1".into(),
            "train.keep_last=20".into(),
            format!("data.workers={workers}"),
            "data.resampled=true".into(),
            format!("train.shard=\"{shard}\""),
        ]
    };
    let mut ends = Vec::new();
    for shard in ["none", "gradients"] {
        let name = format!("reshard-{shard}");
        let stage = |workers: usize| t.config(&name, &settings(shard, workers));
        let first = TrainOptions { stop_after: Some(3), ..opts(2) };
        train(&stage(2), &first).unwrap();
        if shard == "gradients" {
            let wrong = TrainOptions { resume: true, ..opts(4) };
            let err = format!("{:#}", train(&stage(2), &wrong).unwrap_err());
            assert!(err.contains("data.workers = 1"), "{err}");
        }
        let wide = TrainOptions { resume: true, stop_after: Some(3), ..opts(4) };
        train(&stage(1), &wide).unwrap();
        let one = TrainOptions { resume: true, ..opts(1) };
        let end = train(&stage(4), &one).unwrap();
        assert_eq!(end.steps, 9);
        ends.push((end.checkpoint, stage(4).run_dir()));
    }
    let ((a, run_a), (b, run_b)) = (&ends[0], &ends[1]);
    assert_same_run(a, b, run_a, run_b, "resumed on 2, 4 and 1 ranks");
    let written_by = |step: u64| state_shards::read_manifest(&run_b.join(format!("step-{step}"))).map(|m| m.world_size).ok();
    assert_eq!((written_by(3), written_by(6), written_by(9)), (Some(2), Some(4), None), "the ranks that wrote each checkpoint");
    assert!(run_b.join("step-9").join(run_dir::OPTIMIZER_FILE).is_file(), "one rank writes the whole state");

    // The unsharded run's checkpoint resumed by sharded ranks: the same state, the same steps.
    let branch = t.config("branch", &settings("gradients", 1));
    let from = TrainOptions { resume: true, resume_from: Some(run_a.join("step-3")), stop_after: Some(3), ..opts(4) };
    train(&branch, &from).unwrap();
    let (mine, theirs) = (branch.run_dir().join("step-6"), run_b.join("step-6"));
    assert!(file_bits(&mine, run_dir::MODEL_FILE) == file_bits(&theirs, run_dir::MODEL_FILE), "weights after an unsharded start");
    assert!(optimizer_state(&mine) == optimizer_state(&theirs), "moments after an unsharded start");

    // A sharded checkpoint is a whole model to the forward-only commands.
    let model = align::io::load::load_model_with(&run_b.join("step-6"), &Device::Cpu, false).unwrap();
    drop(model);
    let out = Command::new(env!("CARGO_BIN_EXE_align")).args(["inspect", "--json"]).arg(run_b.join("step-6")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let said = report["optimizer_state"].as_str().unwrap_or_default();
    assert!(said.starts_with("sharded over 4 ranks (train.shard = \"gradients\")"), "{said}");

    // A shard changed after its checkpoint was written: the resume names it.
    let step6 = run_b.join("step-6");
    let m = state_shards::read_manifest(&step6).unwrap();
    let shard = step6.join(&m.shards[2].file);
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&shard, &bytes).unwrap();
    let cfg = t.config("from-damaged", &settings("gradients", 1));
    let from = TrainOptions { resume: true, resume_from: Some(step6), ..opts(4) };
    let err = format!("{:#}", train(&cfg, &from).unwrap_err());
    assert!(err.contains("does not match its files") && err.contains(&m.shards[2].file), "{err}");
}

/// The last step in a run's metrics log (0 before the first).
fn logged_step(run: &Path) -> u64 {
    let log = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    log.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).filter_map(|v| v["step"].as_u64()).max().unwrap_or(0)
}

/// `align train --nproc 2` with sharded gradients killed with SIGKILL at moments inside its
/// checkpoint saves (one every step): the latest checkpoint is always whole, and resuming from
/// it ends where the uninterrupted run ends.
#[test]
fn a_kill_during_a_sharded_save_leaves_the_previous_checkpoint_whole() {
    let t = Tiny::new();
    let steps = 40;
    let settings = |name: &str| -> (align::config::Config, PathBuf) {
        let cfg = t.config(
            name,
            &[
                format!("train.steps={steps}"),
                "train.checkpoint_every=1".into(),
                "data.workers=1".into(),
                "train.shard=\"gradients\"".into(),
            ],
        );
        let path = t.root.join(format!("{name}.toml"));
        std::fs::create_dir_all(&t.root).unwrap();
        std::fs::write(&path, cfg.to_toml().unwrap()).unwrap();
        (cfg, path)
    };
    let run_align = |path: &Path, resume: bool| {
        let mut args = vec!["train", "--config", path.to_str().unwrap(), "--quiet", "--nproc", "2"];
        if resume {
            args.push("--resume");
        }
        Command::new(env!("CARGO_BIN_EXE_align")).args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let (straight, straight_path) = settings("straight");
    let out = run_align(&straight_path, false).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (cfg, path) = settings("killed");
    let run = cfg.run_dir();
    let mut rng = align::util::rng::Rng::new(5);
    let mut kills = 0;
    for round in 0..4 {
        let from = logged_step(&run);
        if from + 8 >= steps {
            break;
        }
        let child = run_align(&path, round > 0);
        let deadline = Instant::now() + Duration::from_secs(120);
        while logged_step(&run) < from + 2 {
            assert!(Instant::now() < deadline, "training did not get going");
            std::thread::sleep(Duration::from_millis(5));
        }
        // A step here takes milliseconds and most of it is the save, so a kill lands in one.
        std::thread::sleep(Duration::from_millis(rng.below(25) as u64));
        Command::new("kill").args(["-KILL", &child.id().to_string()]).status().unwrap();
        child.wait_with_output().unwrap();
        kills += 1;
        let latest = run_dir::latest(&run).unwrap().expect("a checkpoint survives");
        let m = state_shards::read_manifest(&latest).unwrap();
        let names: Vec<String> = m.shards.iter().flat_map(|s| s.tensors.clone()).collect();
        run_dir::read_optimizer(&latest, &Device::Cpu, &names).unwrap_or_else(|e| panic!("{}: {e:#}", latest.display()));
    }
    assert!(kills >= 3);
    let out = run_align(&path, true).wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let end = |run: &Path| run_dir::latest(run).unwrap().unwrap();
    assert_eq!(end(&run).file_name(), end(&straight.run_dir()).file_name());
    assert!(
        file_bits(&end(&run), run_dir::MODEL_FILE) == file_bits(&end(&straight.run_dir()), run_dir::MODEL_FILE),
        "the killed run ended elsewhere"
    );
    assert!(optimizer_state(&end(&run)) == optimizer_state(&end(&straight.run_dir())), "the killed run's moments differ");
}
