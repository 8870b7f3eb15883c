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
