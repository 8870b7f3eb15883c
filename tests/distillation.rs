//! Distillation end to end: a student learns from an align-trained teacher run beside it, or from
//! the teacher's embeddings stored by `align data score --embeddings`; both give the same
//! student, a resume under another teacher is refused, and stored embeddings whose caption is
//! not the sample's are counted and never used.

mod common;

use std::path::{Path, PathBuf};

use align::data::shard_writer::ShardWriter;
use align::data::spec::{self, ShardSource};
use align::data::synth::SynthOutput;
use align::data::tar_read::{read_shard_events, ShardEvent};
use align::eval::score::{score_shards, ScoreOptions};
use align::io::load::load_model;
use align::io::{metrics_log, run_dir, tensors::read_tensors};
use align::train::trainer::{train, TrainOptions};
use candle_core::Device;

/// A teacher wider than the tiny student, trained 24 steps on the tiny data.
fn teacher(data: &SynthOutput, tok: &Path, dir: &Path) -> PathBuf {
    let cfg = common::tiny_config(
        data,
        tok,
        &dir.join("runs"),
        &[
            "run.name=teacher",
            "train.steps=24",
            "model.vit={patch_size = 8, width = 48, depth = 2, heads = 2}",
            "model.bert={hidden = 48, layers = 2, heads = 2, intermediate = 96, max_position = 32}",
        ],
    );
    train(&cfg, &common::cpu_options()).unwrap().checkpoint
}

/// The teacher's embeddings of `shards` into `out`, as `align data score --embeddings` writes them.
fn score(teacher: &Path, shards: &[ShardSource], out: &Path) {
    let m = load_model(teacher, &Device::Cpu).unwrap();
    let o = ScoreOptions {
        out: out.to_path_buf(),
        embeddings: true,
        batch: 16,
        quiet: true,
        checkpoint: teacher.display().to_string(),
        model: m.dir.display().to_string(),
    };
    score_shards(&m, shards, &o, &Device::Cpu).unwrap();
}

fn student(data: &SynthOutput, tok: &Path, dir: &Path, name: &str, extra: &[&str]) -> align::config::Config {
    let mut o = vec![format!("run.name={name}"), "train.steps=6".to_string(), "train.checkpoint_every=3".to_string()];
    o.extend(extra.iter().map(|s| s.to_string()));
    common::tiny_config(data, tok, &dir.join("runs"), &o.iter().map(String::as_str).collect::<Vec<_>>())
}

fn metrics(run: &Path) -> Vec<serde_json::Value> {
    metrics_log::read(&run.join("metrics.jsonl")).unwrap()
}

#[test]
fn stored_embeddings_teach_the_student_the_online_teacher_does() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let t = teacher(&data, &tok, dir.path());
    let scores = dir.path().join("scores");
    score(&t, &spec::expand(&data.train).unwrap(), &scores);

    let online = student(&data, &tok, dir.path(), "online", &[&format!("distill.teacher={}", t.display())]);
    let a = train(&online, &common::cpu_options()).unwrap_or_else(|e| panic!("{e:#}"));
    let stored = student(&data, &tok, dir.path(), "stored", &[&format!("distill.embeddings={}", scores.display())]);
    let b = train(&stored, &common::cpu_options()).unwrap_or_else(|e| panic!("{e:#}"));
    let plain = student(&data, &tok, dir.path(), "plain", &[]);
    let c = train(&plain, &common::cpu_options()).unwrap();

    // The same view of the same samples: the same teacher embeddings, the same student.
    let [wa, wb, wc] = [&a, &b, &c].map(|s| read_tensors(&s.checkpoint.join(run_dir::MODEL_FILE), &Device::Cpu).unwrap());
    let mut moved = 0.0f32;
    for (name, x) in &wa {
        let d = common::max_diff(x, &wb[name]);
        // An attention key's bias shifts every score of a row alike, which the softmax ignores:
        // its gradient is zero but for rounding, and the optimizer's normalised steps make any
        // rounding a full step. Every other weight follows the teacher's embeddings.
        if !name.ends_with("attention.key.bias") {
            assert!(d < 1e-4, "{name}: online and stored teachers differ by {d}");
        }
        moved = moved.max(common::max_diff(x, &wc[name]));
    }
    assert!(moved > 1e-3, "the teacher changes what the student learns (max {moved})");
    let (ma, mb) = (metrics(&online.run_dir()), metrics(&stored.run_dir()));
    let distill = |m: &[serde_json::Value]| -> Vec<f64> { m.iter().filter_map(|r| r.get("distill_loss")?.as_f64()).collect() };
    let (da, db) = (distill(&ma), distill(&mb));
    assert_eq!(da.len(), 6, "every step logs its distillation loss");
    for (x, y) in da.iter().zip(&db) {
        assert!((x - y).abs() < 1e-4 * x.abs().max(1.0), "distillation losses {da:?} vs {db:?}");
    }
    let scale = ma.iter().find_map(|r| r.get("teacher_logit_scale")?.as_f64()).unwrap();
    let m = load_model(&t, &Device::Cpu).unwrap();
    let want = m.model.logit_scale().unwrap().to_dtype(candle_core::DType::F64).unwrap().to_scalar::<f64>().unwrap();
    assert!((scale - want).abs() < 1e-9 * want, "{scale} vs the teacher's {want}");

    // The teacher's products in bf16: the same losses within bf16's rounding, not the same bits
    // (the tiny teacher's products are all below the bf16 threshold unless it is lowered).
    let file = dir.path().join("online.toml");
    std::fs::write(&file, online.to_toml().unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_align"))
        .args(["train", "--quiet", "--config"])
        .arg(&file)
        .args(["--set", "run.name=\"bf16\"", "--set", "distill.precision=\"bf16\""])
        .env("ALIGN_BF16_MIN_MACS", "1")
        .output()
        .unwrap();
    if align::ops::kernels::bf16_gemm::available() {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let half = distill(&metrics(&online.run_dir().parent().unwrap().join("bf16")));
        assert!(half.iter().zip(&da).all(|(h, f)| (h - f).abs() < 2e-2 * f.abs()), "bf16 {half:?} vs f32 {da:?}");
        assert_ne!(half, da, "the teacher's products ran in bf16");
    } else {
        assert!(String::from_utf8_lossy(&out.stderr).contains("AVX-512 BF16"), "{}", String::from_utf8_lossy(&out.stderr));
    }

    // A distillation run stopped at step 3 and resumed ends bit for bit where the straight one
    // does: the teacher's rows come back with the loader's position.
    let again = student(&data, &tok, dir.path(), "stored-resumed", &[&format!("distill.embeddings={}", scores.display())]);
    train(&again, &TrainOptions { stop_after: Some(3), ..common::cpu_options() }).unwrap();
    let r = train(&again, &TrainOptions { resume: true, ..common::cpu_options() }).unwrap();
    let bits = |p: &Path| -> Vec<(String, Vec<u32>)> {
        let mut v: Vec<(String, Vec<u32>)> = read_tensors(&p.join(run_dir::MODEL_FILE), &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()))
            .collect();
        v.sort();
        v
    };
    assert!(bits(&r.checkpoint) == bits(&b.checkpoint), "the resumed distillation run differs from the straight one");

    // The teacher alone (no contrastive loss) trains too, and logs the weighted loss.
    let alone = student(
        &data,
        &tok,
        dir.path(),
        "alone",
        &[&format!("distill.embeddings={}", scores.display()), "distill.contrastive=false", "distill.weight=2.0", "distill.loss=\"kl\""],
    );
    train(&alone, &common::cpu_options()).unwrap();
    for r in metrics(&alone.run_dir()).iter().filter(|r| r.get("distill_loss").is_some()) {
        let (loss, d) = (r["loss"].as_f64().unwrap(), r["distill_loss"].as_f64().unwrap());
        assert!((loss - 2.0 * d).abs() < 1e-9 * loss.abs().max(1.0) && d >= -1e-9, "{r}");
    }
}

/// Rewrites `shards` into `out` with the caption of every third sample changed.
fn recaptioned(shards: &[ShardSource], out: &Path) -> String {
    std::fs::create_dir_all(out).unwrap();
    for s in shards {
        let ShardSource::File(path) = s else { unreachable!() };
        let mut w = ShardWriter::create(&out.join(path.file_name().unwrap())).unwrap();
        for (i, ev) in read_shard_events(s).into_iter().enumerate() {
            let ShardEvent::Sample(mut sample) = ev else { continue };
            if i % 3 == 0 {
                sample.fields.insert("txt".into(), b"a caption the teacher never saw".to_vec());
            }
            let fields: Vec<(&str, &Vec<u8>)> = sample.fields.iter().map(|(k, v)| (k.as_str(), v)).collect();
            w.write_sample(&sample.key, &fields).unwrap();
        }
        w.finish().unwrap();
    }
    format!("{}/train-{{00000..00002}}.tar", out.display())
}

#[test]
fn another_teacher_is_refused_on_resume_and_other_captions_are_counted_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let tok = common::tiny_tokenizer(&data, dir.path());
    let t = teacher(&data, &tok, dir.path());
    // The teacher is copied to a place of its own, to be replaced there later.
    let place = dir.path().join("the-teacher");
    std::fs::create_dir_all(&place).unwrap();
    for f in std::fs::read_dir(&t).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, place.join(f.file_name().unwrap())).unwrap();
        }
    }
    let cfg = student(&data, &tok, dir.path(), "s", &[&format!("distill.teacher={}", place.display())]);
    let first = TrainOptions { stop_after: Some(3), ..common::cpu_options() };
    train(&cfg, &first).unwrap();
    // Another teacher's weights at the same path: the run's teacher is not that one any more.
    let earlier = t.parent().unwrap().join("step-22");
    std::fs::copy(earlier.join(run_dir::MODEL_FILE), place.join(run_dir::MODEL_FILE)).unwrap();
    let resume = TrainOptions { resume: true, ..common::cpu_options() };
    let e = format!("{:#}", train(&cfg, &resume).unwrap_err());
    assert!(e.contains("distilling from the teacher") && e.contains("--allow-change distill"), "{e}");
    let allowed = TrainOptions { allow_change: vec!["distill".into()], ..resume };
    train(&cfg, &allowed).unwrap();

    // Stored embeddings of the original captions, training shards with a third recaptioned.
    let scores = dir.path().join("scores");
    let shards = spec::expand(&data.train).unwrap();
    score(&t, &shards, &scores);
    let changed = recaptioned(&shards, &dir.path().join("recaptioned"));
    let cfg = student(
        &data,
        &tok,
        dir.path(),
        "mismatch",
        &[&format!("distill.embeddings={}", scores.display()), &format!("data.train={changed}")],
    );
    let s = train(&cfg, &common::cpu_options()).unwrap();
    let state = run_dir::read_state(&s.checkpoint).unwrap();
    let skipped = state.loaders[0].skips();
    let other = skipped.get("teacher_other_caption");
    let seen = state.samples_seen;
    // A third of each shard's samples: about one in three read, none of them trained on.
    assert!(other > 0 && other * 4 >= seen / 2 && skipped.get("no_teacher_embedding") == 0, "{} of {seen}: {skipped:?}", other);
}

fn mean_recall(checkpoint: &Path, test: &str) -> f64 {
    let m = load_model(checkpoint, &Device::Cpu).unwrap();
    let source = align::data::eval_reader::EvalSource::Shards(spec::expand(test).unwrap());
    let e = align::eval::tasks::evaluate_retrieval(&m, source, "test", &[1, 5, 10], 16, &Device::Cpu, true).unwrap();
    e.run.report.mean_recall()
}

/// A small student distilled from a larger align-trained teacher retrieves the held-out pairs
/// better than the same student trained on captions alone for as many steps, seed after seed.
/// The teacher's loss is weighted 10 to the captions' 1: the tiny student learns slowly, and
/// at weight 1 the gain is within a seed's spread.
#[test]
fn a_distilled_student_retrieves_better_than_captions_alone() {
    let dir = tempfile::tempdir().unwrap();
    let spec = align::data::synth::SynthSpec { train_shards: 4, samples_per_shard: 150, test_samples: 50, image_size: 24, seed: 3 };
    let data = align::data::synth::write_synth(&dir.path().join("data"), &spec).unwrap();
    let tok = common::tiny_tokenizer(&data, dir.path());
    let cfg = common::tiny_config(
        &data,
        &tok,
        &dir.path().join("runs"),
        &[
            "run.name=teacher",
            "train.steps=300",
            "train.batch_size=32",
            "train.warmup_steps=10",
            "train.checkpoint_every=0",
            "model.vit={patch_size = 8, width = 64, depth = 2, heads = 4}",
            "model.bert={hidden = 64, layers = 2, heads = 4, intermediate = 128, max_position = 32}",
        ],
    );
    let t = train(&cfg, &common::cpu_options()).unwrap().checkpoint;
    let teacher_recall = mean_recall(&t, &data.test);
    let mut rows = Vec::new();
    for seed in [1u64, 2, 3] {
        let run = |name: &str, extra: &[&str]| {
            let mut o = vec![
                format!("run.seed={seed}"),
                "train.steps=150".to_string(),
                "train.batch_size=32".into(),
                "train.checkpoint_every=0".into(),
            ];
            o.extend(extra.iter().map(|s| s.to_string()));
            let c = student(&data, &tok, dir.path(), &format!("{name}-{seed}"), &o.iter().map(String::as_str).collect::<Vec<_>>());
            mean_recall(&train(&c, &common::cpu_options()).unwrap().checkpoint, &data.test)
        };
        rows.push((run("plain", &[]), run("distilled", &[&format!("distill.teacher={}", t.display()), "distill.weight=10.0"])));
    }
    // Measured: teacher 0.643; (plain, distilled) 0.189 / 0.203, 0.170 / 0.199, 0.152 / 0.168.
    let mean = |f: fn(&(f64, f64)) -> f64| rows.iter().map(f).sum::<f64>() / rows.len() as f64;
    let (plain, distilled) = (mean(|r| r.0), mean(|r| r.1));
    let wins = rows.iter().filter(|r| r.1 > r.0).count();
    assert!(teacher_recall > 0.5, "the teacher must know the data: mean recall {teacher_recall}");
    assert!(distilled > plain + 0.01 && wins >= 2, "teacher {teacher_recall:.3}; (plain, distilled) by seed: {rows:?}");
}
