//! open_clip's standard architectures trained from scratch by name (`model.architecture`): the
//! run takes the architecture's text length, preprocessing, loss and optimizer recipe, tokenizes
//! with CLIP's BPE as open_clip does, and its checkpoint is written in open_clip's format with
//! the same embeddings.

mod common;

use align::config::{Config, LossKind, OptimizerKind};
use align::io::load::load_model;
use align::io::registry::{export::export, named};
use align::model::dual_encoder::{ImageSpec, TextSpec};
use align::model::Ctx;
use align::train::trainer::train;
use candle_core::{DType, Device, Tensor};

#[test]
fn a_vit_b_32_trained_from_scratch_is_written_for_open_clip() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let o: Vec<String> = vec![
        format!("data.train={}", data.train),
        format!("run.out_dir={}", dir.path().join("runs").display()),
        "model.architecture=\"ViT-B-32\"".into(),
        // A smaller image keeps the test quick; the patch grid follows it.
        "data.image.image_size=64".into(),
        "data.workers=1".into(),
        "train.batch_size=4".into(),
        "train.steps=1".into(),
        "train.warmup_steps=0".into(),
    ];
    let cfg = Config::from_str_with_overrides("", "vit-b-32", &o).unwrap();
    let run = train(&cfg, &common::cpu_options()).unwrap_or_else(|e| panic!("{e:#}"));
    let saved = Config::load(&run.checkpoint.join("config.toml"), &[]).unwrap();
    assert_eq!((saved.text.max_len, saved.loss.kind, saved.data.image.image_size), (77, LossKind::Softmax, 64));
    assert_eq!((saved.optimizer.kind, saved.optimizer.beta2, saved.optimizer.weight_decay), (OptimizerKind::Adamw, 0.98, 0.2));
    assert!((saved.data.image.mean[0] - 0.481_454_66).abs() < 1e-6, "OpenAI's mean: {:?}", saved.data.image.mean);

    let m = load_model(&run.checkpoint, &Device::Cpu).unwrap();
    let (ImageSpec::Clip(v), TextSpec::Clip(t)) = (&m.spec().image, &m.spec().text) else { panic!("{:?}", m.spec()) };
    assert_eq!((v.patch_size, v.encoder.width, v.encoder.layers, t.encoder.width, t.max_position), (32, 768, 12, 512, 77));
    let batch = m.tokenizer.encode_batch(&["A ﬁne DOG &amp; a cat"]).unwrap();
    // open_clip's SimpleTokenizer: cleaned, lower-cased, padded with 0.
    assert_eq!(&batch.ids[..8], &[49406, 320, 3797, 1929, 261, 320, 2368, 49407]);
    assert_eq!(batch.ids[8], 0);

    let out = dir.path().join("open_clip");
    export(&m.files().unwrap(), named("open_clip").unwrap(), &out, false).unwrap();
    let back = load_model(&out, &Device::Cpu).unwrap();
    assert_eq!(back.format.name(), "open_clip");
    assert_eq!(back.tokenizer.encode_batch(&["A ﬁne DOG &amp; a cat"]).unwrap().ids, batch.ids);
    let pixels = align::util::rng::randn(3, 0.0, 1.0, (2, 3, 64, 64), DType::F32, &Device::Cpu).unwrap();
    let (a, b) = (m.model.image_embeddings(&pixels, &Ctx::EVAL).unwrap(), back.model.image_embeddings(&pixels, &Ctx::EVAL).unwrap());
    assert_eq!(common::max_diff(&a, &b), 0.0);
    let ids = Tensor::from_vec(batch.ids.clone(), (1, batch.max_len), &Device::Cpu).unwrap();
    let mask = ids.ones_like().unwrap();
    let (a, b) = (m.model.text_embeddings(&ids, &mask).unwrap(), back.model.text_embeddings(&ids, &mask).unwrap());
    assert_eq!(common::max_diff(&a, &b), 0.0);
}

#[test]
fn an_architecture_and_a_start_from_weights_are_refused_together() {
    let o = ["model.architecture=\"ViT-B-16-SigLIP\"".to_string(), "model.init=\"somewhere\"".to_string()];
    let cfg = Config::from_str_with_overrides("", "both", &o).unwrap();
    let e = align::train::start::Start::resolve(&cfg, None).err().unwrap().to_string();
    assert!(e.contains("model.architecture") && e.contains("model.init"), "{e}");
    let cfg = Config::from_str_with_overrides("", "unknown", &["model.architecture=\"ViT-Q-99\"".to_string()]).unwrap();
    let e = align::train::start::Start::resolve(&cfg, None).err().unwrap().to_string();
    assert!(e.contains("ViT-B-32") && e.contains("ViT-B-16-SigLIP2"), "{e}");
}
