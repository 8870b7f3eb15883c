//! The `align` binary as a user runs it: JSON output, skip counts, errors, determinism.

mod common;

use std::path::Path;
use std::process::Command;

use align::data::shard_writer::ShardWriter;

/// The tiny run trained for two steps under `dir`: its data and its run directory.
fn trained_tiny_run(dir: &Path) -> (align::data::synth::SynthOutput, std::path::PathBuf) {
    let (data, cfg, cfg_path) = common::tiny_run(dir, &["train.steps=2"]);
    let (ok, _, err) = align(&["train", "--config", cfg_path.to_str().unwrap(), "--quiet"]);
    assert!(ok, "training the tiny run: {err}");
    (data, cfg.run_dir())
}

fn align(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_align")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xffff_ffffu32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0xedb8_8320 } else { c >> 1 };
        }
    }
    !c
}

fn png(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    image::RgbImage::from_pixel(w, h, image::Rgb([9, 9, 9]))
        .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
        .unwrap();
    out
}

/// A valid small PNG whose header claims 60000 x 60000 pixels (a decompression bomb's header).
fn bomb() -> Vec<u8> {
    let mut b = png(4, 4);
    // IHDR data starts at byte 16: width, height (big-endian); the CRC covers type + data.
    b[16..20].copy_from_slice(&60000u32.to_be_bytes());
    b[20..24].copy_from_slice(&60000u32.to_be_bytes());
    let crc = crc32(&b[12..29]);
    b[29..33].copy_from_slice(&crc.to_be_bytes());
    b
}

fn planted_shards(dir: &Path) -> String {
    let mut w = ShardWriter::create(&dir.join("bad-0.tar")).unwrap();
    w.write_sample("ok1", &[("png", png(8, 6)), ("txt", b"a caption".to_vec())]).unwrap();
    w.write_sample("corrupt", &[("jpg", b"\xff\xd8 not really".to_vec()), ("txt", b"x".to_vec())]).unwrap();
    w.write_sample("empty", &[("png", png(8, 6)), ("txt", b"   ".to_vec())]).unwrap();
    w.write_sample("latin1", &[("png", png(8, 6)), ("txt", b"caf\xe9".to_vec())]).unwrap();
    w.write_sample("bomb", &[("png", bomb()), ("txt", b"big".to_vec())]).unwrap();
    w.write_sample("noimage", &[("txt", b"text only".to_vec())]).unwrap();
    w.finish().unwrap();
    let mut w = ShardWriter::create(&dir.join("bad-1.tar")).unwrap();
    w.write_sample("ok2", &[("png", png(10, 6)), ("txt", b"another caption here".to_vec())]).unwrap();
    w.write_sample("cut", &[("png", png(8, 6)), ("txt", vec![b'y'; 3000])]).unwrap();
    w.finish().unwrap();
    let p = dir.join("bad-1.tar");
    let bytes = std::fs::read(&p).unwrap();
    let at = bytes.windows(8).position(|x| x == b"yyyyyyyy").unwrap() + 500;
    std::fs::write(&p, &bytes[..at]).unwrap();
    format!("{}/bad-{{0..1}}.tar", dir.display())
}

#[test]
fn data_stats_counts_every_kind_of_bad_sample_and_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let spec = planted_shards(dir.path());
    let (ok, out, err) = align(&["data", "stats", "--data", &spec, "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["samples"], 2, "{out}");
    let skipped = &v["skipped"];
    for (reason, n) in [
        ("corrupt_image", 1),
        ("empty_caption", 1),
        ("caption_not_utf8", 1),
        ("image_too_large", 1),
        ("missing_image", 1),
        ("incomplete_sample", 1),
        ("truncated_shard", 1),
    ] {
        assert_eq!(skipped[reason], n, "{reason} in {skipped}");
    }
    // One warning line names the shard and the key.
    assert!(err.lines().any(|l| l.contains("bad-0.tar") && l.contains("corrupt")), "{err}");
}

#[test]
fn a_spec_matching_no_shard_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let spec = format!("{}/nothing-{{000..009}}.tar", dir.path().display());
    let (ok, _, err) = align(&["data", "stats", "--data", &spec]);
    assert!(!ok);
    assert!(err.contains("nothing-{000..009}.tar"), "{err}");
}

#[test]
fn evaluating_the_same_checkpoint_twice_gives_the_same_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let (data, cfg, cfg_path) = common::tiny_run(dir.path(), &["train.steps=4"]);
    let (ok, out, err) = align(&["train", "--config", cfg_path.to_str().unwrap(), "--quiet", "--json"]);
    assert!(ok, "{err}");
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["steps"], 4);
    let run = cfg.run_dir();
    let run = run.to_str().unwrap();
    let retrieval = || align(&["eval", "retrieval", "--checkpoint", run, "--data", &data.test, "--json"]);
    let (ok, a, err) = retrieval();
    assert!(ok, "{err}");
    let (_, b, _) = retrieval();
    assert_eq!(a, b);
    let r: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!((r["images"].as_u64(), r["texts"].as_u64()), (Some(36), Some(180)));
    assert_eq!((r["step"].as_u64(), r["complete"].as_bool(), r["unit"].as_str()), (Some(4), Some(true), Some("fraction")));
    assert_eq!(r["precision"], "f32");
    assert!(r["checkpoint"].as_str().unwrap().ends_with("step-4"), "{r}");
    // The recalls again, from `align embed`'s matrices, by brute force: a caption's rank is the
    // number of images scoring higher plus the tied ones before its own (a stable sort).
    let index = dir.path().join("index.safetensors");
    let (ok, _, err) = align(&["embed", "--checkpoint", run, "--data", &data.test, "--out", index.to_str().unwrap()]);
    assert!(ok, "{err}");
    let t = candle_core::safetensors::load(&index, &candle_core::Device::Cpu).unwrap();
    let side: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("index.json")).unwrap()).unwrap();
    let images = t["image_embeddings"].to_vec2::<f32>().unwrap();
    let texts = t["text_embeddings"].to_vec2::<f32>().unwrap();
    let link: Vec<usize> = side["text_image"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let rank = |scores: &[f32], target: usize| {
        scores.iter().enumerate().filter(|&(j, &v)| v > scores[target] || (v == scores[target] && j < target)).count()
    };
    for k in [1usize, 5, 10] {
        let t2i = texts.iter().zip(&link).filter(|(t, &i)| rank(&images.iter().map(|im| dot(im, t)).collect::<Vec<_>>(), i) < k).count();
        let i2t = images
            .iter()
            .enumerate()
            .filter(|(i, im)| {
                let scores: Vec<f32> = texts.iter().map(|t| dot(im, t)).collect();
                link.iter().enumerate().filter(|(_, &l)| l == *i).any(|(c, _)| rank(&scores, c) < k)
            })
            .count();
        let m = &r["metrics"];
        assert_eq!(m[format!("image_retrieval_recall@{k}")].as_f64(), Some(t2i as f64 / texts.len() as f64), "k={k}: {m}");
        assert_eq!(m[format!("text_retrieval_recall@{k}")].as_f64(), Some(i2t as f64 / images.len() as f64), "k={k}: {m}");
    }
    // CLIP_benchmark's result layout, for its aggregation.
    let out = dir.path().join("cb/result.json");
    let (ok, _, err) =
        align(&["eval", "retrieval", "--checkpoint", run, "--data", &data.test, "--recall-k", "2", "--output", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    let cb: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(cb["task"], "zeroshot_retrieval");
    assert_eq!(cb["language"], "en");
    assert_eq!(cb["dataset"].as_str(), Some(data.test.as_str()));
    assert!(cb["metrics"]["image_retrieval_recall@2"].is_number() && cb["model"].is_string() && cb["pretrained"] == "step-4", "{cb}");
    let zs = || {
        align(&[
            "eval",
            "zeroshot",
            "--checkpoint",
            run,
            "--data",
            &data.test,
            "--classes",
            data.classes.to_str().unwrap(),
            "--templates",
            data.templates.to_str().unwrap(),
            "--json",
        ])
    };
    let (ok, a, err) = zs();
    assert!(ok, "{err}");
    assert_eq!(a, zs().1);
    let z: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!((z["images"].as_u64(), z["classes"].as_u64()), (Some(36), Some(36)));
    let m = &z["metrics"];
    for key in ["acc1", "acc5", "mean_per_class_recall"] {
        assert!((0.0..=1.0).contains(&m[key].as_f64().unwrap()), "{key}: {m}");
    }
    let probe =
        || align(&["eval", "linear-probe", "--checkpoint", run, "--train", &data.test, "--test", &data.test, "--epochs", "3", "--json"]);
    let (ok, a, err) = probe();
    assert!(ok, "{err}");
    assert_eq!(a, probe().1, "the probe is not reproducible");
    let p: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!((p["task"].as_str(), p["images"].as_u64(), p["classes"].as_u64()), (Some("linear_probe"), Some(36), Some(36)));
    assert!((0.0..=1.0).contains(&p["metrics"]["lp_acc1"].as_f64().unwrap()), "{p}");
    assert!(p["metrics"]["weight_decay"].as_f64().unwrap() > 0.0, "{p}");
    // KNN prints the same record as every evaluation, and writes it with --output.
    let knn_file = dir.path().join("knn.json");
    let (ok, k, err) = align(&[
        "eval",
        "knn",
        "--checkpoint",
        run,
        "--train",
        &data.test,
        "--val",
        &data.test,
        "--k",
        "5",
        "--json",
        "--strict",
        "--output",
        knn_file.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let k: serde_json::Value = serde_json::from_str(&k).unwrap();
    assert_eq!(
        (k["task"].as_str(), k["images"].as_u64(), k["neighbours"].as_u64(), k["complete"].as_bool()),
        (Some("knn"), Some(36), Some(5), Some(true))
    );
    assert_eq!((k["step"].as_u64(), k["unit"].as_str()), (p["step"].as_u64(), Some("fraction")));
    // Each query is in the index, so it is its own nearest neighbour.
    assert_eq!(k["metrics"]["knn_recall@1"].as_f64(), Some(1.0), "{k}");
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&knn_file).unwrap()).unwrap();
    assert_eq!((written["task"].as_str(), &written["metrics"]), (Some("knn"), &k["metrics"]));
    // The suite: the same three evaluations for two checkpoints in one command give the single
    // commands' numbers, one CLIP_benchmark file each.
    let step2 = std::path::Path::new(run).join("step-2");
    assert!(step2.is_dir());
    let suite = dir.path().join("evals.toml");
    let toml = format!(
        "checkpoints = [{run:?}, {step2:?}]\nrecall_k = [1, 5, 10]\n\
         [[dataset]]\nname = \"synth-classes\"\ntask = \"zeroshot_classification\"\ndata = {test:?}\nclasses = {classes:?}\ntemplates = {templates:?}\n\
         [[dataset]]\nname = \"synth-captions\"\ntask = \"zeroshot_retrieval\"\ndata = {test:?}\n\
         [[dataset]]\nname = \"synth-probe\"\ntask = \"linear_probe\"\ntrain = {test:?}\ntest = {test:?}\nepochs = 3\n",
        test = data.test,
        classes = data.classes,
        templates = data.templates,
    );
    std::fs::write(&suite, toml).unwrap();
    let results = dir.path().join("suite-results");
    let (ok, out, err) =
        align(&["eval", "suite", "--config", suite.to_str().unwrap(), "--json", "--output-dir", results.to_str().unwrap()]);
    assert!(ok, "{err}");
    let all: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(all.len(), 6);
    let single: serde_json::Value = serde_json::from_str(&retrieval().1).unwrap();
    for (got, want) in [(&all[0], &z), (&all[1], &single), (&all[2], &p)] {
        assert_eq!(got["metrics"], want["metrics"], "{got}\nvs\n{want}");
        assert_eq!((&got["step"], &got["images"], &got["task"]), (&want["step"], &want["images"], &want["task"]));
    }
    assert_eq!(all[3]["step"].as_u64(), Some(2));
    let files = std::fs::read_dir(&results).unwrap().count();
    assert_eq!(files, 6);
    let cb: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(results.join(format!(
            "synth-captions_step-4_{}_en_zeroshot_retrieval.json",
            all[1]["checkpoint"].as_str().unwrap().replace(['/', '_'], "-").trim_matches('-')
        )))
        .unwrap(),
    )
    .unwrap();
    assert_eq!((cb["dataset"].as_str(), &cb["metrics"]), (Some("synth-captions"), &single["metrics"]));
    let (ok, table, err) = align(&["eval", "suite", "--config", suite.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(table.contains("synth-probe") && table.contains("acc@1"), "{table}");
}

/// The weights' moving average evaluated during training (`train.ema_eval`) is the one `--ema`
/// loads from the saved checkpoint: the same recalls at the last step.
#[test]
fn the_average_evaluated_in_training_is_the_one_ema_loads() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let retrieval_data = format!("eval.retrieval={}", data.test);
    let extra = ["train.steps=4", "train.ema_decay=0.5", "train.ema_eval=true", "train.eval_every=2", retrieval_data.as_str()];
    let cfg = common::tiny_config(&data, &tok, &dir.path().join("runs"), &extra);
    let cfg_path = dir.path().join("ema.toml");
    std::fs::write(&cfg_path, cfg.to_toml().unwrap()).unwrap();
    let (ok, _, err) = align(&["train", "--config", cfg_path.to_str().unwrap(), "--quiet"]);
    assert!(ok, "{err}");
    let log = align::io::metrics_log::read(&cfg.run_dir().join("metrics.jsonl")).unwrap();
    let evals = |key: &str| {
        log.iter().filter(|r| r.get(key).is_some()).map(|r| (r["step"].as_u64().unwrap(), r[key]["retrieval"].clone())).collect::<Vec<_>>()
    };
    let (plain, ema) = (evals("eval"), evals("eval_ema"));
    assert_eq!(ema.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4]);
    assert_eq!(plain.len(), 2);
    assert_ne!(
        ema[1].1["mean_recall"], plain[1].1["mean_recall"],
        "the average and the weights evaluate alike, so the test could not tell them apart"
    );
    let run = cfg.run_dir();
    let run = run.to_str().unwrap();
    for (flag, logged) in [(true, &ema[1].1), (false, &plain[1].1)] {
        let mut args = vec!["eval", "retrieval", "--checkpoint", run, "--data", &data.test, "--json"];
        if flag {
            args.push("--ema");
        }
        let (ok, out, err) = align(&args);
        assert!(ok, "{err}");
        let m = &serde_json::from_str::<serde_json::Value>(&out).unwrap()["metrics"];
        for k in [1, 5, 10] {
            // The training log and the standalone evaluation name and scale each recall alike.
            for name in [format!("image_retrieval_recall@{k}"), format!("text_retrieval_recall@{k}")] {
                assert!(logged[&name].is_f64(), "{name} missing from the training log's {logged}");
                assert_eq!(m[&name].as_f64(), logged[&name].as_f64(), "--ema {flag}, {name}");
            }
        }
    }
}

#[test]
fn a_partial_test_set_is_flagged_and_strict_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let (data, run) = trained_tiny_run(dir.path());
    // The test shard cut in half: its second half is lost, and the cut sample counted.
    let test = std::path::PathBuf::from(&data.test);
    let bytes = std::fs::read(&test).unwrap();
    let cut = dir.path().join("cut.tar");
    std::fs::write(&cut, &bytes[..bytes.len() / 2 + 100]).unwrap();
    let args = ["eval", "retrieval", "--checkpoint", run.to_str().unwrap(), "--data", cut.to_str().unwrap()];
    let (ok, out, err) = align(&[&args[..], &["--json"]].concat());
    assert!(ok, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["complete"], false, "{r}");
    assert!(r["skipped_total"].as_u64().unwrap() >= 1 && r["images"].as_u64().unwrap() < 36, "{r}");
    let (ok, out, _) = align(&args);
    assert!(ok && out.contains("PARTIAL"), "{out}");
    let (ok, _, err) = align(&[&args[..], &["--strict"]].concat());
    assert!(!ok && err.contains("--strict"), "{err}");
}

#[test]
fn embed_then_search_finds_the_captioned_image() {
    let dir = tempfile::tempdir().unwrap();
    let (data, run) = trained_tiny_run(dir.path());
    let index = dir.path().join("index.safetensors");
    let (ok, _, err) = align(&["embed", "--checkpoint", run.to_str().unwrap(), "--data", &data.test, "--out", index.to_str().unwrap()]);
    assert!(ok, "{err}");
    let side: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("index.json")).unwrap()).unwrap();
    assert_eq!(side["image_keys"].as_array().unwrap().len(), 36);
    assert_eq!(side["texts"].as_array().unwrap().len(), 180);
    assert_eq!(side["text_image"][7], 1, "captions come five per image, in order");
    let t = candle_core::safetensors::load(&index, &candle_core::Device::Cpu).unwrap();
    assert_eq!(t["image_embeddings"].dims(), &[36, 16]);
    assert_eq!(t["text_embeddings"].dims(), &[180, 16]);
    let (ok, out, err) = align(&[
        "search",
        "--index",
        index.to_str().unwrap(),
        "--checkpoint",
        run.to_str().unwrap(),
        "--text",
        "a red circle",
        "-k",
        "3",
        "--json",
    ]);
    assert!(ok, "{err}");
    let hits: serde_json::Value = serde_json::from_str(&out).unwrap();
    let hits = hits.as_array().unwrap();
    assert_eq!(hits.len(), 3);
    assert!(hits[0]["score"].as_f64().unwrap() >= hits[2]["score"].as_f64().unwrap());
    // An image query finds itself first among the images.
    let img_path = dir.path().join("query.png");
    let events = align::data::tar_read::read_shard_events(&align::data::spec::expand(&data.test).unwrap()[0]);
    let align::data::tar_read::ShardEvent::Sample(first) = &events[0] else { panic!() };
    let img = align::data::transform::decode(&first.fields["jpg"], u32::MAX, 1 << 30, align::data::transform::Alpha::Drop).unwrap();
    img.save(&img_path).unwrap();
    let (ok, out, err) = align(&[
        "search",
        "--index",
        index.to_str().unwrap(),
        "--checkpoint",
        run.to_str().unwrap(),
        "--image",
        img_path.to_str().unwrap(),
        "--plus",
        "blue",
        "--text-weight",
        "0",
        "-k",
        "1",
        "--json",
    ]);
    assert!(ok, "{err}");
    let hits: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(hits[0]["row"], 0, "{out}");

    // Another checkpoint, of the same or another dimension, is refused in one line naming both.
    let search_with = |run: &Path| {
        align(&["search", "--index", index.to_str().unwrap(), "--checkpoint", run.to_str().unwrap(), "--text", "a red circle"])
    };
    let (_, other, other_path) = common::tiny_run(&dir.path().join("other"), &["train.steps=2", "run.seed=7"]);
    assert!(align(&["train", "--config", other_path.to_str().unwrap(), "--quiet"]).0);
    let (ok, _, err) = search_with(&other.run_dir());
    assert!(!ok && err.contains("was embedded with") && err.contains("index.safetensors"), "{err}");
    let (_, narrow, narrow_path) = common::tiny_run(&dir.path().join("narrow"), &["train.steps=2", "model.embed_dim=8"]);
    assert!(align(&["train", "--config", narrow_path.to_str().unwrap(), "--quiet"]).0);
    let (ok, _, err) = search_with(&narrow.run_dir());
    assert!(!ok && err.contains("16-dimensional") && err.contains("embeds in 8") && !err.contains("matmul"), "{err}");
    // An index written before the sidecar recorded its model: the matrix's width still tells.
    let sidecar = dir.path().join("index.json");
    let mut side: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sidecar).unwrap()).unwrap();
    for field in ["checkpoint", "dim", "ema"] {
        side.as_object_mut().unwrap().remove(field);
    }
    std::fs::write(&sidecar, side.to_string()).unwrap();
    let (ok, _, err) = search_with(&narrow.run_dir());
    assert!(!ok && err.contains("16-dimensional") && err.contains("embeds in 8"), "{err}");
    assert!(search_with(&run).0);
}

#[test]
fn launch_starts_ranks_with_torchrun_variables_and_reports_a_failing_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (data, _, cfg_path) = common::tiny_run(dir.path(), &[]);
    let (ok, out, err) = align(&["launch", "--nproc-per-node", "2", "--", "data", "stats", "--data", &data.test, "--json"]);
    assert!(ok, "{err}");
    // Each rank's lines come out whole, prefixed with its rank.
    assert!(out.lines().all(|l| l.starts_with("[rank 0] ") || l.starts_with("[rank 1] ")), "{out}");
    assert!(out.contains("[rank 0] {") && out.contains("[rank 1] {"), "{out}");
    // Training in a multi-process job needs NCCL; without it each rank says so and launch fails.
    let (ok, _, err) = align(&["launch", "--nproc-per-node", "2", "--", "train", "--config", cfg_path.to_str().unwrap(), "--quiet"]);
    assert!(!ok);
    assert!(err.contains("NCCL") && err.contains("failed"), "{err}");
}

#[test]
fn ctrl_c_saves_a_checkpoint_that_resumes() {
    let dir = tempfile::tempdir().unwrap();
    // Far more steps than the test waits for, and no periodic checkpoints: any checkpoint
    // found afterwards was written because of the interrupt.
    let (_, cfg, cfg_path) = common::tiny_run(dir.path(), &["train.steps=100000", "train.checkpoint_every=0"]);
    let child = Command::new(env!("CARGO_BIN_EXE_align"))
        .args(["train", "--config", cfg_path.to_str().unwrap(), "--quiet", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = cfg.run_dir().join("metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < 3 {
        assert!(std::time::Instant::now() < deadline, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["interrupted"], true);
    let stopped = summary["steps"].as_u64().unwrap();
    assert!((3..100000).contains(&stopped));
    assert!(cfg.run_dir().join(format!("step-{stopped}")).is_dir());

    let (ok, out, err) = align(&["train", "--config", cfg_path.to_str().unwrap(), "--quiet", "--json", "--resume", "--stop-after", "2"]);
    assert!(ok, "{err}");
    let resumed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(resumed["steps"].as_u64(), Some(stopped + 2));
    assert_eq!(resumed["interrupted"], false);

    // The interrupted and resumed run plots as one, from its log or from its event files alone.
    let run = cfg.run_dir();
    let png = dir.path().join("curves.png");
    let plot = || {
        let (ok, out, err) = align(&["plot", run.to_str().unwrap(), "--out", png.to_str().unwrap(), "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let img = image::open(&png).unwrap().to_rgb8();
        assert_eq!((img.width() as u64, img.height() as u64), (v["width"].as_u64().unwrap(), v["height"].as_u64().unwrap()));
        assert!(img.pixels().filter(|p| p.0 != [255, 255, 255]).count() > 10_000, "the figure is nearly blank");
        v["runs"][0].clone()
    };
    let from_log = plot();
    std::fs::remove_file(run.join("metrics.jsonl")).unwrap();
    let from_events = plot();
    assert_eq!(from_log["last_step"].as_f64(), Some((stopped + 2) as f64));
    assert_eq!(from_log, from_events);
    assert!(from_log["curves"].as_array().unwrap().iter().any(|c| c == "train/loss"));
}

/// `align bench model --json` reports the figures issue 10 compares by (samples/s, peak memory),
/// with and without activation checkpointing, and the profile when asked.
#[test]
fn bench_model_json_reports_throughput_memory_and_profile() {
    for ckpt in ["false", "true"] {
        let set = format!("train.grad_checkpointing={ckpt}");
        let (ok, out, err) = align(&[
            "bench",
            "model",
            "--image-tower",
            "vit-ti16",
            "--text-tower",
            "bert-mini",
            "--batch",
            "2",
            "--image-size",
            "32",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--profile",
            "--json",
            "--device",
            "cpu",
            "--set",
            &set,
        ]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert!(v["samples_per_s"].as_f64().unwrap() > 0.0, "{out}");
        assert!(v["peak_rss_mb"].as_f64().unwrap() > 0.0, "{out}");
        assert!(v["profile"]["backward"]["ms_per_step"].as_f64().unwrap() > 0.0, "{out}");
        if ckpt == "true" {
            assert!(v["profile"]["recompute"]["calls"].as_f64().unwrap() > 0.0, "checkpointed blocks must be recomputed: {out}");
        }
    }
}

/// Under `--precision bf16` the JSON names the instruction the products ran on: the one
/// `ALIGN_BF16_KERNEL` forces, and none under f32.
#[test]
fn bench_model_json_names_the_bf16_products_instruction() {
    let run = |precision: &str, kernel: &str| {
        let args = ["bench", "model", "--image-tower", "vit-ti16", "--text-tower", "bert-mini", "--batch", "2"];
        let more = ["--image-size", "32", "--steps", "1", "--warmup", "0", "--json", "--device", "cpu", "--precision", precision];
        let out = Command::new(env!("CARGO_BIN_EXE_align")).args(args).args(more).env("ALIGN_BF16_KERNEL", kernel).output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        (out.status.success(), stdout, stderr)
    };
    let (ok, out, err) = run("f32", "fma");
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v.get("bf16_instruction").is_none(), "{out}");
    if !align::ops::kernels::bf16_gemm::available() {
        let (ok, _, err) = run("bf16", "fma");
        assert!(!ok && err.contains("AVX-512 BF16"), "{err}");
        return;
    }
    for (kernel, instruction) in [("dot", "vdpbf16ps"), ("fma", "vfmadd231ps")] {
        let (ok, out, err) = run("bf16", kernel);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["bf16_instruction"].as_str(), Some(instruction), "{out}");
    }
}

#[test]
fn bench_loss_reports_both_exchanges_and_their_logits_blocks() {
    for (dist, block) in [("shift", 4.0 * 4.0), ("gather", 4.0 * 12.0)] {
        let (ok, out, err) =
            align(&["bench", "loss", "--dist-impl", dist, "--world", "3", "--batch", "12", "--dim", "8", "--steps", "1", "--json"]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["logits_block_mib"].as_f64(), Some(block * 4.0 / (1u64 << 20) as f64), "{out}");
        assert!(v["peak_rss_mib"].as_f64().unwrap() >= v["rss_before_mib"].as_f64().unwrap(), "{out}");
    }
    let (ok, _, err) = align(&["bench", "loss", "--dist-impl", "ring", "--json"]);
    assert!(!ok && err.contains("shift or gather"), "{err}");
}

/// `align inspect` says what align understood of a checkpoint in any format, as a table and as
/// JSON; `align export` refuses a non-empty directory until `--force`.
#[test]
fn inspect_describes_every_format_and_export_refuses_to_overwrite() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (dir, format, tower) in [
        ("open_clip/clip-native", "open_clip", "CLIP ViT 32px/8"),
        ("towers/siglip-tiny", "SiglipModel", "SigLIP ViT 32px/8"),
        ("hf/align-tiny", "AlignModel", "EfficientNet"),
    ] {
        let path = fixtures.join(dir);
        let (ok, out, err) = align(&["inspect", path.to_str().unwrap(), "--json"]);
        assert!(ok, "{dir}: {err}");
        let j: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(j["format"], format, "{dir}");
        assert!(j["image_tower"].as_str().unwrap().starts_with(tower), "{dir}: {}", j["image_tower"]);
        assert!(j["parameters"]["total"].as_u64().unwrap() > 0 && j["tokenizer"]["vocabulary"].as_u64().unwrap() > 0);
        let (ok, table, _) = align(&["inspect", path.to_str().unwrap()]);
        assert!(ok && table.contains("logit scale") && table.contains(format), "{table}");
    }
    let (ok, out, _) = align(&["inspect", fixtures.join("open_clip/custom-text").to_str().unwrap(), "--json"]);
    assert!(ok);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((j["loss"].as_str(), j["logit_bias"].is_number()), (Some("sigmoid"), true));

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("oc");
    let from = fixtures.join("towers/clip-tiny");
    let args = ["export", "--checkpoint", from.to_str().unwrap(), "--format", "open_clip", "--out", out.to_str().unwrap()];
    assert!(align(&args).0);
    let (ok, _, err) = align(&args);
    assert!(!ok && err.contains("not empty"), "{err}");
    let mut forced = args.to_vec();
    forced.push("--force");
    assert!(align(&forced).0);
    let (ok, _, err) = align(&["inspect", "/nonexistent/model"]);
    assert!(!ok && err.lines().count() == 1 && err.contains("does not exist"), "{err}");
}

#[test]
fn completions_and_man_pages_cover_every_subcommand() {
    let (ok, bash, err) = align(&["completions", "bash"]);
    assert!(ok, "{err}");
    for sub in ["train", "export", "inspect", "knn", "score"] {
        assert!(bash.contains(sub), "bash completion lacks {sub}");
    }
    let (ok, zsh, _) = align(&["completions", "zsh"]);
    assert!(ok && zsh.contains("#compdef align"), "{zsh}");
    let dir = tempfile::tempdir().unwrap();
    let (ok, _, err) = align(&["man", "--out", dir.path().to_str().unwrap()]);
    assert!(ok, "{err}");
    for page in ["align.1", "align-train.1", "align-data-score.1", "align-eval-knn.1"] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap_or_else(|_| panic!("no {page}"));
        assert!(text.contains(".TH"), "{page} is not a man page");
    }
    let train = std::fs::read_to_string(dir.path().join("align-train.1")).unwrap();
    assert!(train.contains("resume"), "the train page lists its options");
}

#[test]
fn config_lists_every_field_with_default_meaning_and_a_configs_values() {
    let (ok, all, err) = align(&["config"]);
    assert!(ok, "{err}");
    for want in [
        "[train]",
        "train.lr = 0.001",
        "Peak learning rate",
        "[data.image]",
        "data.image.image_size = 289",
        "one of linear | cosine | constant",
    ] {
        assert!(all.contains(want), "`align config` lacks {want:?}");
    }
    let (ok, only, _) = align(&["config", "loss"]);
    assert!(ok && only.contains("loss.label_smoothing = 0.1") && !only.contains("train.lr"), "{only}");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "[train]\nlr = 5e-4\n").unwrap();
    let (ok, out, err) = align(&["config", "train", "--config", cfg.to_str().unwrap(), "--set", "train.steps=7", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let field = |p: &str| v["fields"].as_array().unwrap().iter().find(|f| f["path"] == p).cloned().unwrap();
    assert_eq!((field("train.lr")["value"].as_f64(), field("train.lr")["default"].as_f64()), (Some(5e-4), Some(1e-3)));
    assert_eq!(field("train.steps")["value"].as_u64(), Some(7));
    assert_eq!(field("train.schedule")["choices"].as_array().map(Vec::len), Some(3));
    let (ok, _, err) = align(&["config", "trian"]);
    assert!(!ok && err.lines().count() == 1 && err.contains("trian"), "{err}");
}

/// `align bench embed --warmup N` embeds the data's first N batches untimed, then times the whole
/// data: the images and texts it reports are the data's whatever the warm-up, and a warm-up
/// longer than the data is no error.
#[test]
fn bench_embed_times_the_whole_data_after_its_warm_up() {
    let dir = tempfile::tempdir().unwrap();
    let (data, run) = trained_tiny_run(dir.path());
    let bench = |warmup: usize| {
        let w = warmup.to_string();
        let args =
            ["bench", "embed", "--checkpoint", run.to_str().unwrap(), "--data", &data.test, "--batch", "2", "--warmup", &w, "--json"];
        let (ok, out, err) = align(&args);
        assert!(ok, "--warmup {warmup}: {err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let cold = bench(0);
    let images = cold["images"].as_u64().unwrap();
    assert!(images > 2, "the test data should hold more than one batch: {cold}");
    for warmup in [1, 1000] {
        let warm = bench(warmup);
        assert_eq!(warm["warmup"].as_u64(), Some(warmup as u64));
        assert_eq!((&warm["images"], &warm["texts"]), (&cold["images"], &cold["texts"]), "--warmup {warmup}");
        assert!(warm["seconds"].as_f64().unwrap() > 0.0);
    }
}

/// `--precision bf16` runs the towers' products in bfloat16 and `--precision int8` the linear
/// layers' in 8-bit integers: the embeddings move (so the path ran) but stay within the
/// rounding's reach of the f32 ones (1 − cosine below 1e-3 and 2e-3), and the index records the
/// precision. A CPU without the instructions (AVX-512 BF16, VNNI) refuses in one line instead,
/// which `ALIGN_NO_AVX512` shows on any CPU.
#[test]
fn bf16_and_int8_embeddings_track_the_f32_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (data, run) = trained_tiny_run(dir.path());
    let embed = |precision: &str, avx512: bool| {
        let out = dir.path().join(format!("{precision}.safetensors"));
        let args = [
            "embed",
            "--checkpoint",
            run.to_str().unwrap(),
            "--data",
            &data.test,
            "--out",
            out.to_str().unwrap(),
            "--precision",
            precision,
        ];
        // The tiny model's products are all below the size bf16 and int8 pay off at; 1 routes
        // them all.
        let mut command = Command::new(env!("CARGO_BIN_EXE_align"));
        command.args(args).env("ALIGN_BF16_MIN_MACS", "1");
        if !avx512 {
            command.env("ALIGN_NO_AVX512", "1");
        }
        let o = command.output().unwrap();
        (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned(), out)
    };
    let (ok, err, f32_out) = embed("f32", true);
    assert!(ok, "{err}");
    let load = |p: &std::path::Path| candle_core::safetensors::load(p, &candle_core::Device::Cpu).unwrap();
    let a = load(&f32_out);
    let cpu_has = [
        ("bf16", align::ops::kernels::bf16_gemm::available(), "AVX-512 BF16", 1e-3),
        ("int8", align::ops::kernels::int8_gemm::available(), "AVX-512 VNNI", 2e-3),
    ];
    for (precision, available, instructions, tolerance) in cpu_has {
        let (ok, err, _) = embed(precision, false);
        // The log's lines (the device) come first; the refusal is then the one line left.
        let said: Vec<&str> = err.lines().filter(|l| !l.contains(" INFO ")).collect();
        assert!(!ok && said.len() == 1 && said[0].contains(instructions), "{precision} without AVX-512: {err}");
        if !available {
            eprintln!("{precision}: only the refusal checked, this CPU lacks {instructions}");
            continue;
        }
        let (ok, err, out) = embed(precision, true);
        assert!(ok, "{err}");
        let side: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(format!("{precision}.json"))).unwrap()).unwrap();
        assert_eq!(side["precision"], precision);
        let b = load(&out);
        let rows = |t: &std::collections::HashMap<String, candle_core::Tensor>, name: &str| t[name].to_vec2::<f32>().unwrap();
        let dot = |p: &[f32], q: &[f32]| p.iter().zip(q).map(|(p, q)| p * q).sum::<f32>();
        for name in ["image_embeddings", "text_embeddings"] {
            let (x, y) = (rows(&a, name), rows(&b, name));
            // Unit vectors: 1 − cosine.
            let largest = x.iter().zip(&y).map(|(x, y)| 1.0 - dot(x, y)).fold(0f32, f32::max);
            assert!(x != y, "{precision} {name}: the f32 numbers exactly, so its path did not run");
            assert!(largest < tolerance, "{precision} {name}: 1 − cosine up to {largest}");
        }
    }
}

/// `align ... | head`: a reader that has gone away ends the command quietly, as it ends any Unix
/// tool (status 0, or death by SIGPIPE, which a shell reports as 141), never a panic.
#[test]
fn a_closed_pipe_ends_every_printing_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let clip = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/towers/clip-tiny");
    let clip = clip.to_str().unwrap();
    let commands: Vec<Vec<&str>> =
        vec![vec!["inspect", clip], vec!["inspect", clip, "--json"], vec!["data", "stats", "--data", &data.train], vec!["config"]];
    for args in commands {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out =
            Command::new(env!("CARGO_BIN_EXE_align")).args(&args).stdout(writer).stderr(std::process::Stdio::piped()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() || out.status.signal() == Some(libc::SIGPIPE), "{args:?}: {:?}: {stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// `align config --config F` says where each value comes from: the file, `--set`, the start's
/// recipe (`model.init`) or the default.
#[test]
fn config_shows_where_each_value_comes_from() {
    let dir = tempfile::tempdir().unwrap();
    let clip = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/towers/clip-tiny");
    let file = dir.path().join("f.toml");
    std::fs::write(&file, format!("[model]\ninit = {:?}\n[train]\nsteps = 77\n", clip.display().to_string())).unwrap();
    let (ok, out, err) = align(&["config", "--config", file.to_str().unwrap(), "--set", "train.lr=0.25"]);
    assert!(ok, "{err}");
    let line = |path: &str| out.lines().find(|l| l.trim_start().starts_with(&format!("{path} = "))).unwrap_or_default().to_string();
    assert!(line("train.steps").ends_with("from file"), "{}", line("train.steps"));
    assert!(line("train.lr").ends_with("from --set"), "{}", line("train.lr"));
    assert!(line("optimizer.kind").contains("\"adamw\"") && line("optimizer.kind").ends_with("from start"), "{}", line("optimizer.kind"));
    assert!(!line("train.warmup_steps").contains("from"), "{}", line("train.warmup_steps"));
    let (ok, out, _) = align(&["config", "loss", "--config", file.to_str().unwrap(), "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let smoothing = v["fields"].as_array().unwrap().iter().find(|f| f["path"] == "loss.label_smoothing").unwrap();
    assert_eq!((smoothing["value"].as_f64(), smoothing["source"].as_str()), (Some(0.0), Some("start")));
}
