//! Parity with Hugging Face transformers: tiny random models saved by `scripts/make_fixtures.py`
//! (torch 2.15, transformers 5.23) with their inputs and outputs; align must reproduce the outputs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use align::io::format::hf::files::{load_prefixed, read_json, read_weights};
use align::io::format::hf::layout::{bert_from_hf, vit_from_hf};
use align::io::load::load_model;
use align::io::tensors::read_tensors;
use align::model::bert::Bert;
use align::model::init::SeededVars;
use align::model::vit::Vit;
use align::model::Ctx;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name)
}

fn io(name: &str) -> HashMap<String, Tensor> {
    read_tensors(&fixture(&format!("{name}-io.safetensors")), &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn u32s(t: &Tensor) -> Tensor {
    t.to_dtype(DType::U32).unwrap()
}

#[test]
fn align_model_embeddings_logits_and_loss_match_transformers() {
    let m = load_model(&fixture("align-tiny"), &Device::Cpu).unwrap();
    let io = io("align-tiny");
    let img = m.model.image_embeddings(&io["pixel_values"], &Ctx::EVAL).unwrap();
    let txt = m.model.text_embeddings(&u32s(&io["input_ids"]), &u32s(&io["attention_mask"])).unwrap();
    assert!(max_diff(&img, &io["image_embeds"]) < 1e-4, "image embeddings differ by {}", max_diff(&img, &io["image_embeds"]));
    assert!(max_diff(&txt, &io["text_embeds"]) < 1e-4, "text embeddings differ by {}", max_diff(&txt, &io["text_embeds"]));
    let logits = txt.matmul(&img.t().unwrap()).unwrap().broadcast_mul(&m.model.logit_scale().unwrap()).unwrap();
    assert!(max_diff(&logits, &io["logits_per_text"]) < 1e-4);
    // transformers averages the two directions; ALIGN (and align) sums them.
    let loss = align::train::loss::contrastive_loss(&img, &txt, &img, &txt, 0, &m.model.logit_scale().unwrap(), 0.1).unwrap().total;
    let hf = io["loss"].to_vec1::<f32>().unwrap()[0];
    assert!((loss.to_scalar::<f32>().unwrap() / 2.0 - hf).abs() < 1e-4, "{} vs {hf}", loss.to_scalar::<f32>().unwrap() / 2.0);
}

#[test]
fn bert_model_hidden_states_match_transformers() {
    let cfg = bert_from_hf(&read_json(&fixture("bert-tiny/config.json")).unwrap()).unwrap();
    let vm = VarMap::new();
    let bert = Bert::new(&cfg, SeededVars::builder(&vm, 0, &Device::Cpu).pp("text_model")).unwrap();
    let weights = read_weights(&fixture("bert-tiny"), &Device::Cpu).unwrap();
    load_prefixed(&vm, &weights, "", "text_model.", "bert-tiny").unwrap();
    let io = io("bert-tiny");
    let h = bert.hidden_states(&u32s(&io["input_ids"]), &u32s(&io["attention_mask"])).unwrap();
    // Padding positions hold values too; transformers computes them the same way.
    assert!(max_diff(&h, &io["last_hidden_state"]) < 1e-4, "{}", max_diff(&h, &io["last_hidden_state"]));
}

#[test]
fn vit_model_hidden_states_match_transformers() {
    let cfg = vit_from_hf(&read_json(&fixture("vit-tiny/config.json")).unwrap()).unwrap();
    let vm = VarMap::new();
    let vit = Vit::new(&cfg, SeededVars::builder(&vm, 0, &Device::Cpu).pp("vision_model")).unwrap();
    let weights = read_weights(&fixture("vit-tiny"), &Device::Cpu).unwrap();
    load_prefixed(&vm, &weights, "", "vision_model.", "vit-tiny").unwrap();
    let io = io("vit-tiny");
    let h = vit.hidden_states(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    assert!(max_diff(&h, &io["last_hidden_state"]) < 1e-4, "{}", max_diff(&h, &io["last_hidden_state"]));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_renamed_or_reshaped_tensor_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tok");
    for (edit, expect) in [("rename", "text_model.encoder.layer.1.output.dense.weight"), ("reshape", "text_projection.bias")] {
        let d = dir.path().join(edit);
        copy_dir(&fixture("align-tiny"), &d);
        let mut w = read_weights(&d, &Device::Cpu).unwrap();
        if edit == "rename" {
            let t = w.remove("text_model.encoder.layer.1.output.dense.weight").unwrap();
            w.insert("text_model.encoder.layer.1.output.dense.kernel".into(), t);
        } else {
            w.insert("text_projection.bias".into(), Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap());
        }
        candle_core::safetensors::save(&w, d.join("model.safetensors")).unwrap();
        std::fs::create_dir_all(&tok).unwrap();
        let err = format!("{:#}", load_model(&d, &Device::Cpu).err().expect("a broken checkpoint must not load"));
        assert!(err.contains(expect), "{edit}: {err}");
        if edit == "rename" {
            assert!(err.contains("output.dense.kernel"), "{err}");
        }
    }
}

#[test]
fn an_exported_model_loads_back_with_the_same_embeddings() {
    let m = load_model(&fixture("align-tiny"), &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("export");
    let format = align::io::registry::named("AlignModel").unwrap();
    align::io::registry::export::export(&m.files().unwrap(), format, &out, false).unwrap();
    let back = load_model(&out, &Device::Cpu).unwrap();
    // The processor and tokenizer configs transformers' AutoProcessor needs.
    assert_eq!(back.usage.image, m.usage.image);
    let tc = read_json(&out.join("tokenizer_config.json")).unwrap();
    assert_eq!(
        (tc["tokenizer_class"].as_str(), tc["model_max_length"].as_u64()),
        (Some("BertTokenizer"), Some(m.tokenizer.max_len() as u64))
    );
    assert_eq!(read_json(&out.join("preprocessor_config.json")).unwrap()["processor_class"], "AlignProcessor");
    let io = io("align-tiny");
    let a = m.model.image_embeddings(&io["pixel_values"], &Ctx::EVAL).unwrap();
    let b = back.model.image_embeddings(&io["pixel_values"], &Ctx::EVAL).unwrap();
    assert_eq!(max_diff(&a, &b), 0.0);
    let w = read_weights(&out, &Device::Cpu).unwrap();
    assert!(w.contains_key("vision_model.embeddings.batchnorm.num_batches_tracked"));
    assert_eq!(read_json(&out.join("config.json")).unwrap()["model_type"], "align");
}

mod common;

#[test]
fn training_starts_from_a_hugging_face_align_model_or_pretrained_towers() {
    use align::train::trainer::train;
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let opts = common::cpu_options();
    let tensor_equal = |a: &Tensor, b: &Tensor| max_diff(a, b) == 0.0;
    // A whole AlignModel, its tokenizer (vocab.txt) included; a zero learning rate keeps the weights.
    let whole = align::config::Config::from_str_with_overrides(
        "",
        "init",
        &[
            format!("data.train={}", data.train),
            format!("run.out_dir={}", dir.path().join("runs").display()),
            format!("model.init={}", fixture("align-tiny").display()),
            "data.image.image_size=32".into(),
            "data.image.resize=36".into(),
            "data.workers=1".into(),
            "train.batch_size=8".into(),
            "train.steps=2".into(),
            "train.lr=1e-30".into(),
            "train.warmup_steps=0".into(),
            "model.embed_dim=80".into(),
            "model.image_projection=false".into(),
        ],
    )
    .unwrap();
    let s = train(&whole, &opts).unwrap();
    let saved = read_tensors(&s.checkpoint.join("model.safetensors"), &Device::Cpu).unwrap();
    let original = read_weights(&fixture("align-tiny"), &Device::Cpu).unwrap();
    for name in [
        "text_model.encoder.layer.1.output.dense.weight",
        "vision_model.encoder.blocks.3.depthwise_conv.depthwise_conv.weight",
        "temperature",
    ] {
        assert!(tensor_equal(&saved[name], &original[name]), "{name} was not initialised from the checkpoint");
    }
    // Pretrained towers with new projections.
    let towers = align::config::Config::from_str_with_overrides(
        "",
        "towers",
        &[
            format!("data.train={}", data.train),
            format!("run.out_dir={}", dir.path().join("runs2").display()),
            format!("model.init_text={}", fixture("bert-tiny").display()),
            format!("model.init_image={}", fixture("vit-tiny").display()),
            "data.image.image_size=32".into(),
            "data.image.resize=36".into(),
            "data.workers=1".into(),
            "model.embed_dim=16".into(),
            "model.image_projection=true".into(),
            "train.batch_size=8".into(),
            "train.steps=2".into(),
            "train.lr=1e-30".into(),
            "train.warmup_steps=0".into(),
        ],
    )
    .unwrap();
    let s = train(&towers, &opts).unwrap();
    let saved = read_tensors(&s.checkpoint.join("model.safetensors"), &Device::Cpu).unwrap();
    let bert = read_weights(&fixture("bert-tiny"), &Device::Cpu).unwrap();
    let vit = read_weights(&fixture("vit-tiny"), &Device::Cpu).unwrap();
    assert!(tensor_equal(
        &saved["text_model.encoder.layer.0.attention.self.query.weight"],
        &bert["encoder.layer.0.attention.self.query.weight"]
    ));
    assert!(tensor_equal(&saved["vision_model.embeddings.cls_token"], &vit["embeddings.cls_token"]));
    assert_eq!(saved["visual_projection.weight"].dims(), &[16, 32]);
}
