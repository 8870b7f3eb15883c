//! A NaFlex fine-tune: a `Siglip2Model` start (`scripts/make_siglip2_fixtures.py`) trained on
//! shards of images of every aspect ratio with nothing set by hand. The run takes the start's
//! patch budget, preprocessing, tokenizer and sigmoid loss, the images reach the tower as patch
//! grids of their own shape, its weights move, and the checkpoint reads back as the model it is.

mod common;

use std::io::Cursor;
use std::path::{Path, PathBuf};

use align::config::{Config, LossKind};
use align::data::shard_writer::ShardWriter;
use align::io::load::load_model;
use align::io::tensors::read_tensors;
use align::model::dual_encoder::ImageSpec;
use align::train::trainer::train;
use candle_core::Device;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Two shards of 24 pairs whose images run from 4:1 to 1:4, PNG and JPEG.
fn mixed_aspect_shards(dir: &Path) -> String {
    let shapes = [(64u32, 16u32), (16, 64), (48, 32), (32, 48), (40, 40), (90, 20), (20, 90), (33, 17)];
    let words = ["red", "green", "blue", "striped", "dotted", "plain"];
    std::fs::create_dir_all(dir).unwrap();
    for shard in 0..2 {
        let mut w = ShardWriter::create(&dir.join(format!("mixed-{shard:02}.tar"))).unwrap();
        for i in 0..24 {
            let (iw, ih) = shapes[i % shapes.len()];
            let k = shard * 24 + i;
            let img = image::RgbImage::from_fn(iw, ih, |x, y| image::Rgb([(x * 4 + k as u32 * 9) as u8, (y * 3) as u8, (k * 40) as u8]));
            let mut bytes = Vec::new();
            let (format, ext) = if i % 2 == 0 { (image::ImageFormat::Png, "png") } else { (image::ImageFormat::Jpeg, "jpg") };
            image::DynamicImage::ImageRgb8(img).write_to(&mut Cursor::new(&mut bytes), format).unwrap();
            let caption = format!("a {} shape number {i}", words[k % words.len()]);
            w.write_sample(&format!("{k:06}"), &[(ext, bytes.as_slice()), ("txt", caption.as_bytes())]).unwrap();
        }
        w.finish().unwrap();
    }
    format!("{}/mixed-{{00..01}}.tar", dir.display())
}

#[test]
fn a_siglip2_naflex_start_fine_tunes_on_mixed_aspect_shards() {
    let dir = tempfile::tempdir().unwrap();
    let start = fixtures().join("siglip2/naflex");
    let o = vec![
        format!("data.train={}", mixed_aspect_shards(&dir.path().join("data"))),
        format!("run.out_dir={}", dir.path().join("runs").display()),
        format!("model.init={}", start.display()),
        "data.workers=1".into(),
        "train.batch_size=8".into(),
        "train.steps=3".into(),
        "train.warmup_steps=0".into(),
        "train.lr=1e-3".into(),
    ];
    let cfg = Config::from_str_with_overrides("", "naflex", &o).unwrap();
    let run = train(&cfg, &common::cpu_options()).unwrap_or_else(|e| panic!("{e:#}"));
    let saved = Config::load(&run.checkpoint.join("config.toml"), &[]).unwrap();
    let naflex = saved.data.image.naflex.expect("the run records the start's patch budget");
    assert_eq!((naflex.patch_size, naflex.max_num_patches, saved.loss.kind), (4, 64, LossKind::Sigmoid));

    let log = std::fs::read_to_string(run.checkpoint.parent().unwrap().join("metrics.jsonl")).unwrap();
    for line in log.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if let Some(loss) = v.get("loss").and_then(|l| l.as_f64()) {
            assert!(loss.is_finite(), "{line}");
        }
    }
    let before = align::io::format::hf::files::read_weights(&start, &Device::Cpu).unwrap();
    let after = read_tensors(&run.checkpoint.join("model.safetensors"), &Device::Cpu).unwrap();
    let name = "vision_model.embeddings.position_embedding.weight";
    assert!(common::max_diff(&before[name], &after[name]) > 0.0, "the position grid trains through its resizing");

    let m = load_model(&run.checkpoint, &Device::Cpu).unwrap();
    assert!(matches!(m.spec().image, ImageSpec::Naflex(_)));
    assert_eq!(m.usage.image.naflex, Some(naflex));
    // And leaves align as a Siglip2Model, which reads back as the same model.
    let out = dir.path().join("export");
    align::io::registry::export::export(&m.files().unwrap(), align::io::registry::named("Siglip2Model").unwrap(), &out, false).unwrap();
    let back = load_model(&out, &Device::Cpu).unwrap();
    assert_eq!((back.spec(), &back.usage.image.naflex), (m.spec(), &m.usage.image.naflex));
}

fn weights_bits(checkpoint: &Path, file: &str) -> Vec<(String, Vec<u32>)> {
    let mut all: Vec<(String, Vec<u32>)> = read_tensors(&checkpoint.join(file), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            (
                k,
                t.flatten_all()
                    .unwrap()
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            )
        })
        .collect();
    all.sort();
    all
}

/// Token-budget batches (timm's NaFlex loader) on two thread ranks with patch dropout: each
/// batch draws 16, 36 or 64 patches per image and holds 8, 3 or 2 images per rank to match, the
/// global batch changes from step to step, and a run resumed from any of its steps ends bit for
/// bit where the uninterrupted run ends.
#[test]
fn token_budget_batches_train_on_two_ranks_and_resume_from_every_step() {
    const STEPS: u64 = 6;
    let dir = tempfile::tempdir().unwrap();
    let data = mixed_aspect_shards(&dir.path().join("data"));
    let start = fixtures().join("siglip2/naflex");
    let cfg = |name: &str| {
        let o = vec![
            format!("data.train={data}"),
            format!("run.out_dir={}", dir.path().join("runs").display()),
            format!("run.name={name}"),
            format!("model.init={}", start.display()),
            "data.workers=1".into(),
            "data.naflex_seq_lens=[16, 36, 64]".into(),
            "data.naflex_batch_divisor=1".into(),
            "model.vit.patch_dropout=0.25".into(),
            "train.batch_size=4".into(),
            format!("train.steps={STEPS}"),
            "train.warmup_steps=0".into(),
            "train.lr=1e-3".into(),
            "train.checkpoint_every=1".into(),
            "train.keep_last=100".into(),
        ];
        Config::from_str_with_overrides("", "naflex", &o).unwrap()
    };
    let opts = |resume_from: Option<PathBuf>| align::train::trainer::TrainOptions {
        nproc: 2,
        resume: resume_from.is_some(),
        resume_from,
        ..common::cpu_options()
    };
    let straight = cfg("straight");
    let s = train(&straight, &opts(None)).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(s.steps, STEPS);
    let seen: Vec<u64> =
        (0..=STEPS)
            .map(|k| {
                if k == 0 {
                    0
                } else {
                    align::io::run_dir::read_state(&straight.run_dir().join(format!("step-{k}"))).unwrap().samples_seen
                }
            })
            .collect();
    let batches: Vec<u64> = seen.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(batches.iter().all(|b| [4, 6, 16].contains(b)), "global batches of 2 ranks × 2, 3 or 8 images: {batches:?}");
    assert!(batches.iter().collect::<std::collections::HashSet<_>>().len() > 1, "the length changes between steps: {batches:?}");
    for k in 1..STEPS {
        let branch = cfg(&format!("from-{k}"));
        let b =
            train(&branch, &opts(Some(straight.run_dir().join(format!("step-{k}"))))).unwrap_or_else(|e| panic!("from step {k}: {e:#}"));
        for file in ["model.safetensors", "optimizer.safetensors"] {
            assert!(weights_bits(&s.checkpoint, file) == weights_bits(&b.checkpoint, file), "from step {k}: {file} differs");
        }
    }
    // Other lengths would give other batches: a resume under them is refused, naming the field.
    let mut other = cfg("other-lengths");
    other.data.naflex_seq_lens = vec![16, 64];
    let e = format!("{:#}", train(&other, &opts(Some(straight.run_dir().join("step-3")))).unwrap_err());
    assert!(e.contains("data.naflex_seq_lens"), "{e}");
}
