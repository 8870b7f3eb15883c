//! Damage that used to be accepted without a word: each case is now an error naming the file (or
//! setting) and what is wrong.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use align::io::load::load_model;
use align::io::{run_dir, tensors};
use align::train::trainer::{train, TrainOptions};
use candle_core::{DType, Device, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The clip-tiny fixture with one tensor of its weights replaced.
fn clip_with(dir: &Path, name: &str, edit: impl Fn(&Tensor) -> Tensor) -> PathBuf {
    let d = dir.join(name);
    copy_dir(&fixture("towers/clip-tiny"), &d);
    let mut w: HashMap<String, Tensor> = tensors::read_tensors(&d.join("model.safetensors"), &Device::Cpu).unwrap();
    let t = edit(&w["logit_scale"]);
    w.insert("logit_scale".into(), t);
    tensors::write_tensors(&w, &d.join("model.safetensors")).unwrap();
    d
}

#[test]
fn integer_weights_and_an_infinite_logit_scale_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let ints = clip_with(dir.path(), "ints", |t| t.to_dtype(DType::I64).unwrap());
    let e = format!("{:#}", load_model(&ints, &Device::Cpu).err().expect("integer weights must not load"));
    assert!(e.contains("logit_scale") && e.contains("I64") && e.contains("ints"), "{e}");
    let inf = clip_with(dir.path(), "inf", |t| (t.ones_like().unwrap() * f64::INFINITY).unwrap());
    let e = format!("{:#}", load_model(&inf, &Device::Cpu).err().expect("an infinite logit scale must not load"));
    assert!(e.contains("logit_scale") && e.contains("inf") && e.contains("finite"), "{e}");
}

/// Two tensors whose data overlap in the file (each would read the other's bytes).
#[test]
fn overlapping_safetensors_data_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0u8; 12]);
    let path = dir.path().join("overlap.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let e = format!("{:#}", tensors::read_tensors(&path, &Device::Cpu).unwrap_err());
    assert!(e.contains("overlap") && e.contains("overlap.safetensors") && e.contains(" a ") && e.contains(" b "), "{e}");
}

/// `--resume PATH` from a step past `train.steps`, and a checkpoint whose loader position is
/// impossible (a shard cursor of 10^9, an epoch of 2^60): errors, not a run that "finishes"
/// without training or skips its data.
#[test]
fn impossible_resume_points_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = |name: &str, steps: u64| {
        common::tiny_config(&data, &tok, &dir.path().join("runs"), &[&format!("run.name={name}"), &format!("train.steps={steps}")])
    };
    let long = cfg("long", 6);
    train(&long, &common::cpu_options()).unwrap();
    let from = TrainOptions { resume: true, resume_from: Some(long.run_dir().join("step-6")), ..common::cpu_options() };
    let e = format!("{:#}", train(&cfg("short", 4), &from).unwrap_err());
    assert!(e.contains("step 6") && e.contains("4 steps") && e.contains("train.steps"), "{e}");

    for (field, value) in [("cursor", serde_json::json!(1_000_000_000u64)), ("epoch", serde_json::json!(1u64 << 60))] {
        let name = format!("damaged-{field}");
        let run = dir.path().join("runs").join(&name);
        std::fs::create_dir_all(&run).unwrap();
        let step = run.join("step-4");
        copy_dir(&long.run_dir().join("step-4"), &step);
        let path = step.join(run_dir::STATE_FILE);
        let mut state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        state["loaders"][0]["workers"][0][field] = value;
        std::fs::write(&path, state.to_string()).unwrap();
        let from = TrainOptions { resume: true, resume_from: Some(step), ..common::cpu_options() };
        let e = format!("{:#}", train(&cfg(&format!("{name}-branch"), 6), &from).unwrap_err());
        assert!(e.contains("worker 0") && e.contains("damaged"), "{field}: {e}");
    }
}

#[test]
fn settings_that_used_to_be_bent_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    // eval.validation_batch = 0 once ran as 2.
    let o = vec![format!("data.train={}", data.train), "eval.validation_batch=0".to_string()];
    let e = format!("{:#}", align::config::Config::from_str_with_overrides("", "t", &o).unwrap_err());
    assert!(e.contains("eval.validation_batch"), "{e}");
    // An empty source between `::` once shifted the upsampling factors onto the wrong sources.
    let e = format!("{}", align::data::spec::expand_parts(&format!("{}::::{}", data.train, data.train)).unwrap_err());
    assert!(e.contains("empty source"), "{e}");
}

/// A 0-byte shard among the validation shards is named, not read as a smaller held-out set.
#[test]
fn an_empty_validation_shard_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let empty = dir.path().join("val-empty.tar");
    std::fs::write(&empty, b"").unwrap();
    let cfg = common::tiny_config(
        &data,
        &tok,
        &dir.path().join("runs"),
        &[&format!("eval.validation={}::{}", data.test, empty.display()), "train.steps=2", "train.eval_every=2"],
    );
    // A failed evaluation does not stop training: it is a warning and a record of the log.
    let s = train(&cfg, &common::cpu_options()).unwrap();
    assert!(s.eval.validation.is_none(), "a validation loss over part of the held-out set");
    let log = align::io::metrics_log::read(&cfg.run_dir().join("metrics.jsonl")).unwrap();
    let e = log.iter().find_map(|r| r.get("eval_error").and_then(|e| e.as_str())).expect("the failed evaluation is logged").to_string();
    assert!(e.contains("val-empty.tar") && e.contains("0 bytes"), "{e}");
}

/// A start that fails before its first checkpoint (here: shards without one usable sample)
/// leaves no run directory behind to confuse the next `--resume`.
#[test]
fn a_start_that_fails_before_step_one_leaves_no_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let empty = dir.path().join("empty.tar");
    align::data::shard_writer::ShardWriter::create(&empty).unwrap().finish().unwrap();
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("runs"), &[&format!("data.train={}", empty.display())]);
    let e = format!("{:#}", train(&cfg, &common::cpu_options()).unwrap_err());
    assert!(e.contains("no usable sample"), "{e}");
    assert!(!cfg.run_dir().exists(), "{} was left behind", cfg.run_dir().display());
}

/// A resume that cannot rewrite the metrics log (a full disk; here the temporary file's place is
/// taken) names the log it could not write, and the log is left as it was.
#[test]
fn a_failed_metrics_log_rewrite_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cfg, _) = common::tiny_run(dir.path(), &["train.steps=2", "train.checkpoint_every=1"]);
    train(&cfg, &common::cpu_options()).unwrap();
    let log = cfg.run_dir().join("metrics.jsonl");
    let before = std::fs::read(&log).unwrap();
    std::fs::create_dir(cfg.run_dir().join(format!(".metrics.jsonl.tmp-{}", std::process::id()))).unwrap();
    let from = TrainOptions { resume: true, resume_from: Some(cfg.run_dir().join("step-1")), ..common::cpu_options() };
    std::fs::remove_dir_all(cfg.run_dir().join("step-2")).unwrap();
    let e = format!("{:#}", train(&cfg, &from).unwrap_err());
    assert!(e.contains("metrics.jsonl") && e.contains("resumed step"), "{e}");
    assert_eq!(std::fs::read(&log).unwrap(), before);
}
