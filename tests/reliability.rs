//! Bad input never destroys, hangs or panics: a stop signal ends a run that waits for data (a
//! stalled `pipe:` shard is abandoned: `tests/stall.rs`), a resume that would silently restart the weight
//! average is refused, and damaged or hostile files are errors naming the file and field.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use align::io::load::load_model;
use candle_core::Device;

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// SIGTERM while every shard source is silent: the run stops at once with 143, keeps its last
/// checkpoint, and leaves no pipe command behind.
#[test]
fn a_stop_signal_ends_a_run_waiting_for_a_silent_pipe() {
    let dir = tempfile::tempdir().unwrap();
    // A duration no other process uses marks the command in the process table.
    let marker = format!("sleep 600.{}", std::process::id());
    let (_, cfg, cfg_path) = common::tiny_run(dir.path(), &["data.stall_timeout_s=600"]);
    let _ = cfg;
    let child = Command::new(env!("CARGO_BIN_EXE_align"))
        .args(["train", "--config", cfg_path.to_str().unwrap(), "--quiet", "--set"])
        .arg(format!("data.train=pipe:{marker}"))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(15), "the signal took {:?} to end the run", started.elapsed());
    assert_eq!(out.status.code(), Some(143), "{}", String::from_utf8_lossy(&out.stderr));
    let ps = Command::new("ps").args(["-eo", "args"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&ps.stdout).lines().any(|l| l.trim() == marker), "the pipe command outlived the run");
}

/// kill -9 of align while a pipe command runs: the command and everything it started die with
/// it (nothing left downloading into a closed pipe).
#[test]
fn pipe_commands_die_with_a_killed_align() {
    let dir = tempfile::tempdir().unwrap();
    let marker = format!("sleep 601.{}", std::process::id());
    let (_, _, cfg_path) = common::tiny_run(dir.path(), &["data.stall_timeout_s=600"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_align"))
        .args(["train", "--config", cfg_path.to_str().unwrap(), "--quiet", "--set"])
        // A pipeline, so the command has children of its own.
        .arg(format!("data.train=pipe:{marker} | cat"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let running = || {
        let ps = Command::new("ps").args(["-eo", "args"]).output().unwrap();
        String::from_utf8_lossy(&ps.stdout).lines().any(|l| l.trim() == marker)
    };
    let started = Instant::now();
    while !running() {
        assert!(started.elapsed() < Duration::from_secs(30), "the pipe command never started");
        std::thread::sleep(Duration::from_millis(100));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    while running() {
        assert!(killed.elapsed() < Duration::from_secs(10), "the pipe command outlived a kill -9 of align");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_resume_without_the_weight_average_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cfg, _) = common::tiny_run(dir.path(), &["train.ema_decay=0.9", "train.steps=4"]);
    let mut opts = common::cpu_options();
    opts.stop_after = Some(2);
    align::train::trainer::train(&cfg, &opts).unwrap();
    let ema = cfg.run_dir().join("step-2").join("ema.safetensors");
    std::fs::remove_file(&ema).unwrap();
    opts.resume = true;
    let err = format!("{:#}", align::train::trainer::train(&cfg, &opts).unwrap_err());
    assert!(err.contains("ema.safetensors") && err.contains("--allow-change train.ema_decay"), "{err}");
    opts.allow_change = vec!["train.ema_decay".into()];
    let s = align::train::trainer::train(&cfg, &opts).unwrap();
    assert_eq!(s.steps, 4);
}

/// A resume with another schedule length would re-stretch the learning rate under the steps
/// already taken: refused unless allowed.
#[test]
fn a_resume_with_another_length_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let (data, cfg, _) = common::tiny_run(dir.path(), &["train.steps=4"]);
    let mut opts = common::cpu_options();
    opts.stop_after = Some(2);
    align::train::trainer::train(&cfg, &opts).unwrap();
    let tok = dir.path().join("tokenizer.json");
    let longer = common::tiny_config(&data, &tok, &dir.path().join("runs"), &["train.steps=8"]);
    opts.resume = true;
    let err = format!("{:#}", align::train::trainer::train(&longer, &opts).unwrap_err());
    assert!(err.contains("train.steps changed from 4 to 8"), "{err}");
    opts.allow_change = vec!["train.steps".into()];
    align::train::trainer::train(&longer, &opts).unwrap();
}

/// A resume under another objective or optimizer (their moments are in the checkpoint; a start's
/// family recipe sets them) is refused field by field unless allowed.
#[test]
fn a_resume_with_another_optimizer_or_loss_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let (data, cfg, _) = common::tiny_run(dir.path(), &["train.steps=4"]);
    let mut opts = common::cpu_options();
    opts.stop_after = Some(2);
    align::train::trainer::train(&cfg, &opts).unwrap();
    let tok = dir.path().join("tokenizer.json");
    let other = common::tiny_config(
        &data,
        &tok,
        &dir.path().join("runs"),
        &["train.steps=4", "optimizer.kind=\"adamw\"", "loss.label_smoothing=0.0"],
    );
    opts.resume = true;
    let err = format!("{:#}", align::train::trainer::train(&other, &opts).unwrap_err());
    assert!(
        err.contains("\n  loss.label_smoothing changed from 0.1 to 0.0")
            && err.contains("\n  optimizer.kind changed from \"lamb\" to \"adamw\""),
        "{err}"
    );
    opts.allow_change = vec!["optimizer".into(), "loss".into()];
    align::train::trainer::train(&other, &opts).unwrap();
}

/// Damaged and hostile files: errors naming the file and what is wrong, never a panic or an
/// allocation of whatever size a file claims.
#[test]
fn damaged_checkpoint_files_are_errors_that_name_them() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |from: &str, name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(fixtures().join(from)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    };
    let edit_json = |path: &Path, f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
    };
    let err_of = |d: &Path| format!("{:#}", load_model(d, &Device::Cpu).err().expect("a damaged checkpoint must not load"));

    // A truncated BERT tokenizer.json.
    let d = copy("towers/vtde-tiny", "truncated-tokenizer");
    let t = std::fs::read(d.join("tokenizer.json")).unwrap();
    std::fs::write(d.join("tokenizer.json"), &t[..t.len() / 2]).unwrap();
    let e = err_of(&d);
    assert!(e.contains("tokenizer.json"), "{e}");

    // A projection a billion wide, and a vocabulary of 10^12: refused before allocating.
    let d = copy("towers/clip-tiny", "huge");
    edit_json(&d.join("config.json"), &|v| v["projection_dim"] = 1_000_000_000u64.into());
    let started = Instant::now();
    let e = err_of(&d);
    assert!(e.contains("projection_dim") && started.elapsed() < Duration::from_secs(5), "{e}");
    edit_json(&d.join("config.json"), &|v| {
        v["projection_dim"] = 16.into();
        v["text_config"]["vocab_size"] = 1_000_000_000_000u64.into();
    });
    assert!(err_of(&d).contains("vocab_size"));
    // A config that disagrees with its weights names the tensors.
    edit_json(&d.join("config.json"), &|v| {
        v["text_config"]["vocab_size"] = 900.into();
    });
    let e = err_of(&d);
    assert!(e.contains("token_embedding") && e.contains("config.json"), "{e}");

    // No vision_config: an error naming it, not a default tower.
    let d = copy("towers/clip-tiny", "no-vision");
    edit_json(&d.join("config.json"), &|v| {
        v.as_object_mut().unwrap().remove("vision_config");
    });
    assert!(err_of(&d).contains("vision_config"));

    // A broken config.json is reported as itself.
    let d = copy("towers/clip-tiny", "broken-config");
    std::fs::write(d.join("config.json"), "{\"model_type\": \"clip\", ").unwrap();
    let e = err_of(&d);
    assert!(e.contains("config.json") && !e.contains("config.toml"), "{e}");

    // An image processor class align does not know, and a zero rescale factor.
    let d = copy("towers/clip-tiny", "processor");
    edit_json(&d.join("preprocessor_config.json"), &|v| v["image_processor_type"] = "MysteryImageProcessor".into());
    assert!(err_of(&d).contains("MysteryImageProcessor"));
    edit_json(&d.join("preprocessor_config.json"), &|v| {
        v["image_processor_type"] = "CLIPImageProcessor".into();
        v["rescale_factor"] = 0.into();
    });
    assert!(err_of(&d).contains("rescale_factor"));

    // A tokenizer with more ids than the embedding table.
    let d = copy("towers/clip-tiny", "small-table");
    edit_json(&d.join("config.json"), &|v| v["text_config"]["vocab_size"] = 100.into());
    let w = align::io::format::hf::files::read_weights(&d, &Device::Cpu).unwrap();
    let mut w: std::collections::HashMap<String, candle_core::Tensor> = w;
    let table = w["text_model.embeddings.token_embedding.weight"].narrow(0, 0, 100).unwrap();
    w.insert("text_model.embeddings.token_embedding.weight".into(), table);
    candle_core::safetensors::save(&w, d.join("model.safetensors")).unwrap();
    let e = err_of(&d);
    assert!(e.contains("tokenizer has") && e.contains("embedding table"), "{e}");
}

#[test]
fn lock_group_counts_past_the_tower_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cfg, _) = common::tiny_run(dir.path(), &["model.lock_image=true", "model.lock_image_unlocked_groups=9"]);
    let err = format!("{:#}", align::train::trainer::train(&cfg, &common::cpu_options()).unwrap_err());
    assert!(err.contains("lock_image_unlocked_groups is 9") && err.contains("3 groups"), "{err}");
}
