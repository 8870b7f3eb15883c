//! What a shared cluster does to a run: SIGTERM / SIGUSR1 at any moment (then a requeued
//! `--resume` must equal the uninterrupted run), two trainers on one run directory, a batch job's
//! log, resumes that would change the run, and the small things a user meets.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use align::config::Config;
use align::io::{run_dir, tensors};
use candle_core::{Device, Tensor};

fn align(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_align")).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A tiny run's config written to `dir/NAME.toml`.
fn config(dir: &Path, name: &str, extra: &[&str]) -> (Config, PathBuf) {
    let data = common::tiny_data(&dir.join("data"));
    let tok = if dir.join("tokenizer.json").is_file() { dir.join("tokenizer.json") } else { common::tiny_tokenizer(&data, dir) };
    let cfg = common::tiny_config(&data, &tok, &dir.join("runs"), extra);
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, cfg.to_toml().unwrap()).unwrap();
    (cfg, path)
}

/// The last step in a run's metrics log (0 before the first).
fn logged_step(run: &Path) -> u64 {
    let log = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    log.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).filter_map(|v| v["step"].as_u64()).max().unwrap_or(0)
}

fn weights(run: &Path) -> HashMap<String, Tensor> {
    let dir = run_dir::latest(run).unwrap().unwrap();
    tensors::read_tensors(&dir.join(run_dir::MODEL_FILE), &Device::Cpu).unwrap()
}

fn same(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> bool {
    a.len() == b.len()
        && a.iter().all(|(k, t)| {
            let u = &b[k];
            t.dims() == u.dims() && t.flatten_all().unwrap().to_vec1::<f32>().unwrap() == u.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        })
}

/// Starts `align train` and waits until its log reaches `step`.
fn start_training(cfg_path: &Path, run: &Path, extra: &[&str], step: u64) -> std::process::Child {
    let mut args = vec!["train", "--config", cfg_path.to_str().unwrap(), "--quiet", "--json"];
    args.extend_from_slice(extra);
    let child = Command::new(env!("CARGO_BIN_EXE_align")).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while logged_step(run) < step {
        assert!(Instant::now() < deadline, "training did not reach step {step}");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn kill(pid: u32, signal: &str) {
    assert!(Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap().success());
}

#[test]
fn sigterm_and_sigusr1_at_random_moments_then_resume_equal_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    // This tiny model's steps take milliseconds at most: far more of them than a segment's few,
    // so that a signal sent up to 40 ms late (and later on a loaded machine) still finds the run
    // going.
    let steps = 300;
    let base = ["train.checkpoint_every=0".to_string(), format!("train.steps={steps}")];
    let base: Vec<&str> = base.iter().map(String::as_str).collect();
    let (straight, straight_path) = config(dir.path(), "straight", &[&base[..], &["run.name=straight"]].concat());
    let out = align(&["train", "--config", straight_path.to_str().unwrap(), "--quiet", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (cfg, path) = config(dir.path(), "stopped", &[&base[..], &["run.name=stopped"]].concat());
    let run = cfg.run_dir();
    // Moments chosen by a fixed seed: after the first logged step of a segment, the signal
    // lands 0..3 steps in, at some point inside a step.
    let mut rng = align::util::rng::Rng::new(23);
    let mut stops = 0;
    for (i, signal) in ["TERM", "USR1", "TERM", "USR1"].iter().enumerate() {
        let from = logged_step(&run);
        if from + 200 >= steps {
            break;
        }
        let resume: &[&str] = if i == 0 { &[] } else { &["--resume"] };
        let child = start_training(&path, &run, resume, from + 1 + rng.below(3) as u64);
        std::thread::sleep(Duration::from_millis(rng.below(40) as u64));
        kill(child.id(), signal);
        let out = child.wait_with_output().unwrap();
        let want = if *signal == "TERM" { 143 } else { 138 };
        assert_eq!(out.status.code(), Some(want), "{}", text(&out.stderr));
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(summary["interrupted"], true);
        assert_eq!(summary["stopped_by"], if *signal == "TERM" { "SIGTERM" } else { "SIGUSR1" });
        let at = summary["steps"].as_u64().unwrap();
        assert!(run.join(format!("step-{at}")).join(run_dir::STATE_FILE).is_file(), "no checkpoint at the stop ({at})");
        stops += 1;
    }
    assert!(stops >= 2);
    // The requeued job: `--resume auto` continues to the end.
    let out = align(&["train", "--config", path.to_str().unwrap(), "--quiet", "--json", "--resume", "auto"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(same(&weights(&straight.run_dir()), &weights(&run)), "the interrupted run differs from the uninterrupted one");
}

#[test]
fn a_second_trainer_on_a_run_directory_is_refused_and_a_killed_holder_does_not_block() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, path) = config(dir.path(), "busy", &["train.steps=100000", "train.checkpoint_every=2"]);
    let run = cfg.run_dir();
    let mut first = start_training(&path, &run, &[], 2);
    let started = Instant::now();
    let out = align(&["train", "--config", path.to_str().unwrap(), "--quiet", "--resume"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("in use by") && err.contains(&format!("pid {}", first.id())), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "the second trainer waited instead of refusing");
    assert!(logged_step(&run) >= 2, "the refused trainer disturbed the first one's log");
    // A checkpoint to resume from first: killed while writing its first one, the trainer would
    // leave none.
    let deadline = Instant::now() + Duration::from_secs(120);
    while run_dir::latest(&run).unwrap().is_none() {
        assert!(Instant::now() < deadline, "the first trainer saved no checkpoint in 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // kill -9 leaves the lock file behind, but no lock.
    first.kill().unwrap();
    first.wait().unwrap();
    let out = align(&["train", "--config", path.to_str().unwrap(), "--quiet", "--json", "--resume", "--stop-after", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn resuming_refuses_a_changed_seed_unless_allowed_and_says_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = config(dir.path(), "seeded", &["train.steps=6"]);
    let p = path.to_str().unwrap();
    let out = align(&["train", "--config", p, "--quiet", "--stop-after", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = align(&["train", "--config", p, "--quiet", "--resume", "--set", "run.seed=5", "--set", "train.batch_size=8"]);
    let err = text(&out.stderr);
    assert!(!out.status.success() && err.contains("run.seed changed from 0 to 5") && err.contains("train.batch_size"), "{err}");
    let out = align(&["train", "--config", p, "--resume", "--set", "run.seed=5", "--allow-change", "run.seed", "--stop-after", "1"]);
    let err = text(&out.stderr);
    assert!(out.status.success() && err.contains("resuming with run.seed changed from 0 to 5"), "{err}");
}

#[test]
fn a_batch_jobs_log_has_a_timestamped_line_per_log_interval() {
    let dir = tempfile::tempdir().unwrap();
    let (_, path) = config(dir.path(), "batch", &["train.steps=4", "train.log_every=2", "train.compute_threads=1"]);
    // stderr is a pipe here, as in a batch job.
    let out = align(&["train", "--config", path.to_str().unwrap()]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    let steps: Vec<&str> = err.lines().filter(|l| l.contains(" step ")).collect();
    assert_eq!(steps.len(), 2, "{err}");
    for (line, step) in steps.iter().zip(["step 2/4", "step 4/4"]) {
        let (stamp, rest) = line.split_once(' ').unwrap();
        assert!(stamp.len() == 20 && stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T', "{line}");
        assert!(
            rest.trim_start().starts_with("INFO") && rest.contains(step) && rest.contains("samples/s") && rest.contains("ETA"),
            "{line}"
        );
    }
    // train.compute_threads is applied, not refused because a pool already exists.
    assert!(err.contains("1 compute threads") && !err.contains("not applied"), "{err}");
}

#[test]
fn user_errors_are_one_line_whatever_rust_backtrace_says() {
    let out = Command::new(env!("CARGO_BIN_EXE_align"))
        .args(["train", "--config", "/nonexistent/run.toml"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("error: reading config /nonexistent/run.toml") && !err.to_lowercase().contains("backtrace"), "{err}");
    assert_eq!(err.lines().filter(|l| !l.contains("device:")).count(), 1, "{err}");
}

#[test]
fn embeddings_go_into_a_new_directory_readable_like_any_file() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (cfg, path) = config(dir.path(), "embed", &["train.steps=2"]);
    let out = align(&["train", "--config", path.to_str().unwrap(), "--quiet"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let data = common::tiny_data(&dir.path().join("data"));
    let index = dir.path().join("new/dir/index.safetensors");
    let out = align(&["embed", "--checkpoint", cfg.run_dir().to_str().unwrap(), "--data", &data.test, "--out", index.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plain = dir.path().join("plain");
    std::fs::write(&plain, b"x").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&index), mode(&plain));
    let ckpt = run_dir::latest(&cfg.run_dir()).unwrap().unwrap();
    assert_eq!(mode(&ckpt.join(run_dir::MODEL_FILE)), mode(&plain));
}

#[test]
fn a_checkpoint_with_nan_in_a_projection_fails_every_evaluation_naming_the_checkpoint_and_sample() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, path) = config(dir.path(), "nan", &["train.steps=2"]);
    let out = align(&["train", "--config", path.to_str().unwrap(), "--quiet"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ckpt = run_dir::latest(&cfg.run_dir()).unwrap().unwrap();
    let file = ckpt.join(run_dir::MODEL_FILE);
    let mut t = tensors::read_tensors(&file, &Device::Cpu).unwrap();
    let names: Vec<String> = t.keys().filter(|k| k.contains("projection")).cloned().collect();
    assert!(!names.is_empty());
    for name in names {
        let nan = (t[&name].ones_like().unwrap() * f64::NAN).unwrap();
        t.insert(name, nan);
    }
    candle_core::safetensors::save(&t, &file).unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let run = cfg.run_dir();
    let c = run.to_str().unwrap();
    let index = dir.path().join("index.safetensors");
    let commands: Vec<Vec<&str>> = vec![
        vec!["eval", "retrieval", "--checkpoint", c, "--data", &data.test, "--json"],
        vec!["eval", "zeroshot", "--checkpoint", c, "--data", &data.test, "--classes", data.classes.to_str().unwrap(), "--json"],
        vec!["eval", "knn", "--checkpoint", c, "--train", &data.test, "--val", &data.test, "--json"],
        vec!["embed", "--checkpoint", c, "--data", &data.test, "--out", index.to_str().unwrap()],
    ];
    for args in commands {
        let out = align(&args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} scored a NaN model: {}", text(&out.stdout));
        assert!(err.contains("not finite") && err.contains(&ckpt.display().to_string()), "{args:?}: {err}");
        assert!(err.contains("image ") || err.contains("text "), "{args:?} names no sample: {err}");
    }
}
