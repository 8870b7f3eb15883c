//! CLIP and SigLIP towers against Hugging Face transformers, on tiny random `CLIPModel` (with
//! quick-GELU, and with exact GELU as LAION's checkpoints have) and `SiglipModel` fixtures made
//! by `scripts/make_tower_fixtures.py`: embeddings from pixel values and token ids to 1e-5 (tight
//! enough that the wrong GELU fails), the tokenizer's ids exactly, and embeddings from the JPEG
//! files through each checkpoint's own preprocessing to cosine 0.999.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use align::io::load::load_model;
use align::io::tensors::read_tensors;
use candle_core::{DType, Device, Tensor};

fn towers() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/towers")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(towers().join("expected.json")).unwrap()).unwrap()
}

fn io(name: &str) -> HashMap<String, Tensor> {
    read_tensors(&towers().join(format!("{name}-io.safetensors")), &Device::Cpu).unwrap()
}

fn u32s(t: &Tensor) -> Tensor {
    t.to_dtype(DType::U32).unwrap()
}

use common::max_diff;

/// Embeddings of the fixture's pixel values and token ids, its captions' ids as align's
/// tokenizer makes them, and the JPEGs through the checkpoint's processor.
fn check_clip(name: &str) {
    let m = load_model(&towers().join(name), &Device::Cpu).unwrap();
    let io = io(name);
    let img = m.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    let d = max_diff(&img, &io["image_embeds_normalised"]);
    assert!(d <= 1e-5, "{name}: image embeddings differ by {d}");
    let txt = m.model.text_embeddings(&u32s(&io["input_ids"]), &u32s(&io["attention_mask"])).unwrap();
    let d = max_diff(&txt, &io["text_embeds_normalised"]);
    assert!(d <= 1e-5, "{name}: text embeddings differ by {d}");
    let scale = m.model.logit_scale().unwrap().to_scalar::<f32>().unwrap();
    let want = io["logit_scale"].flatten_all().unwrap().to_vec1::<f32>().unwrap()[0].exp();
    assert!((scale - want).abs() < 1e-4 * want, "{name}: logit scale {scale} vs {want}");

    let e = &expected()["models"][name];
    let captions: Vec<String> = e["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let batch = m.tokenizer.encode_batch(&captions).unwrap();
    let want_ids = io["input_ids"].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    let want_mask = io["attention_mask"].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    let width = want_ids[0].len();
    assert_eq!(batch.max_len, width, "{name}: model_max_length");
    for (i, c) in captions.iter().enumerate() {
        assert_eq!(&batch.ids[i * width..(i + 1) * width], &want_ids[i][..], "{name}: ids of {c:?}");
        assert_eq!(&batch.mask[i * width..(i + 1) * width], &want_mask[i][..], "{name}: mask of {c:?}");
    }

    // Through the evaluation path, which cuts each batch to its longest caption: the same.
    let got = align::eval::embed::embed_texts(&m.model, &m.tokenizer, &captions, 3, &Device::Cpu, |_| {}).unwrap();
    let got = Tensor::from_vec(got.data, (captions.len(), got.dim), &Device::Cpu).unwrap();
    let d = max_diff(&got, &io["text_embeds_normalised"]);
    assert!(d <= 1e-5, "{name}: batched text embeddings differ by {d}");

    assert_files_embed_as_in_transformers(&m, &io, name);
}

/// The JPEG files through the checkpoint's own preprocessing give transformers' embeddings of
/// them (its processor on the same files) to cosine 0.999.
fn assert_files_embed_as_in_transformers(m: &align::io::load::LoadedModel, io: &HashMap<String, Tensor>, name: &str) {
    let images: Vec<String> = expected()["images"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    let files: Vec<PathBuf> = images.iter().map(|n| towers().join("images").join(n)).collect();
    let cosines = common::file_cosines(m, &files, &io["jpeg_image_embeds"].to_vec2::<f32>().unwrap());
    for (n, c) in images.iter().zip(cosines) {
        assert!(c >= 0.999, "{name}: {n}: cosine {c} with transformers' embedding of the file");
    }
}

#[test]
fn clip_with_quick_gelu_matches_transformers() {
    check_clip("clip-tiny");
}

#[test]
fn clip_with_exact_gelu_matches_transformers() {
    check_clip("clip-tiny-gelu");
}

/// The two CLIP fixtures differ only in the activation (and the end-of-text rule), so each
/// checkpoint's weights under the other's activation must miss by far more than the tolerance.
#[test]
fn the_wrong_activation_is_caught() {
    let m = load_model(&towers().join("clip-tiny"), &Device::Cpu).unwrap();
    let mut spec = m.model.spec.clone();
    if let align::model::dual_encoder::ImageSpec::Clip(v) = &mut spec.image {
        v.encoder.act = align::model::prenorm::Act::Gelu;
    }
    let vb = candle_nn::VarBuilder::from_tensors(m.weights.clone(), DType::F32, &Device::Cpu);
    let wrong = align::model::dual_encoder::DualEncoder::new(&spec, vb).unwrap();
    let io = io("clip-tiny");
    let img = wrong.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    let d = max_diff(&img, &io["image_embeds_normalised"]);
    assert!(d > 1e-3, "exact GELU in place of quick-GELU moved the embeddings by only {d}");
}

#[test]
fn siglip_towers_match_transformers() {
    let dir = towers().join("siglip-tiny");
    let m = load_model(&dir, &Device::Cpu).unwrap();
    let model = &m.model;
    let io = io("siglip-tiny");
    let img = model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    let d = max_diff(&img, &io["image_embeds_normalised"]);
    assert!(d <= 1e-5, "image embeddings differ by {d}");
    let ids = u32s(&io["input_ids"]);
    // SigLIP is used without a mask: the padding takes part in attention.
    let txt = model.text_embeddings(&ids, &Tensor::ones_like(&ids).unwrap()).unwrap();
    let d = max_diff(&txt, &io["text_embeds_normalised"]);
    assert!(d <= 1e-5, "text embeddings differ by {d}");
    let scale = model.logit_scale().unwrap().to_scalar::<f32>().unwrap();
    let bias = model.logit_bias().unwrap().unwrap().to_scalar::<f32>().unwrap();
    let want = |k: &str| io[k].flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
    assert!((scale - want("logit_scale").exp()).abs() < 1e-4 && (bias - want("logit_bias")).abs() < 1e-6, "{scale} {bias}");
    // The logits as SiglipModel computes them: t̂·îᵀ·exp(s) + b.
    let logits = (txt.matmul(&img.t().unwrap()).unwrap() * scale as f64).unwrap().affine(1.0, bias as f64).unwrap();
    let d = max_diff(&logits.t().unwrap(), &io["logits_per_image"]);
    assert!(d <= 1e-4, "logits differ by {d}");
    // The SentencePiece model with SigLIP's canonicalisation gives SiglipTokenizer's ids.
    let e = &expected()["models"]["siglip-tiny"];
    let captions: Vec<String> = e["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let batch = m.tokenizer.encode_batch(&captions).unwrap();
    let want = io["input_ids"].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    assert_eq!(batch.max_len, 64);
    for (i, c) in captions.iter().enumerate() {
        assert_eq!(&batch.ids[i * 64..(i + 1) * 64], &want[i][..], "ids of {c:?}");
    }
    // Saved as a tokenizer.json (an align checkpoint's), the pipeline keeps all of it.
    let dir = tempfile::tempdir().unwrap();
    m.tokenizer.save(&dir.path().join("tokenizer.json")).unwrap();
    let reread = align::data::tokenizer::TextTokenizer::from_file(&dir.path().join("tokenizer.json"), 64).unwrap();
    assert_eq!(reread.encode_batch(&captions).unwrap(), batch);
    for (text, want) in [("Hello,   WORLD!!", "hello world"), ("(a) [b] {c}", "a b c")] {
        let a = m.tokenizer.encode_batch(&[text]).unwrap().ids;
        assert_eq!(a, m.tokenizer.encode_batch(&[want]).unwrap().ids, "{text:?} canonicalises to {want:?}");
    }
    // From the JPEG files through SigLIP's processor (a square resize, x/127.5 − 1).
    assert_files_embed_as_in_transformers(&m, &io, "siglip-tiny");
}

/// Two steps of fine-tuning from the fixture `name` on tiny data, at a learning rate that keeps
/// the weights, with `extra` settings; the run's summary or its error.
fn fine_tune(name: &str, extra: &[&str]) -> (tempfile::TempDir, anyhow::Result<align::train::trainer::TrainSummary>) {
    let dir = tempfile::tempdir().unwrap();
    let data = common::tiny_data(&dir.path().join("data"));
    let mut overrides = vec![
        format!("data.train={}", data.train),
        format!("run.out_dir={}", dir.path().join("runs").display()),
        format!("model.init={}", towers().join(name).display()),
        "data.image.image_size=32".into(),
        "data.image.resize=36".into(),
        "data.workers=1".into(),
        "train.batch_size=8".into(),
        "train.steps=2".into(),
        "train.lr=1e-30".into(),
        "train.warmup_steps=0".into(),
    ];
    overrides.extend(extra.iter().map(|s| s.to_string()));
    let cfg = align::config::Config::from_str_with_overrides("", name, &overrides).unwrap();
    let summary = align::train::trainer::train(&cfg, &common::cpu_options());
    (dir, summary)
}

/// Fine-tuning starts from the CLIPModel: its weights and tokenizer (a zero learning rate keeps
/// the weights), and the align checkpoint it writes embeds as transformers does.
#[test]
fn training_starts_from_a_clip_model() {
    let e = fine_tune("clip-tiny", &["text.max_len=64"]).1.err().unwrap().to_string();
    assert!(e.contains("text.max_len 64") && e.contains("16 positions"), "{e}");
    let (_dir, s) = fine_tune("clip-tiny", &["text.max_len=16"]);
    let s = s.unwrap();
    let m = load_model(&s.checkpoint, &Device::Cpu).unwrap();
    let io = io("clip-tiny");
    let txt = m.model.text_embeddings(&u32s(&io["input_ids"]), &u32s(&io["attention_mask"])).unwrap();
    let d = max_diff(&txt, &io["text_embeds_normalised"]);
    assert!(d <= 1e-5, "text embeddings of the fine-tuned checkpoint differ by {d}");
    let img = m.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    let d = max_diff(&img, &io["image_embeds_normalised"]);
    assert!(d <= 1e-5, "image embeddings of the fine-tuned checkpoint differ by {d}");
    let ids = m.tokenizer.encode_batch(&["a photo of a cat"]).unwrap().ids;
    assert_eq!(&ids[..10], &[812, 320, 79, 606, 531, 539, 320, 66, 536, 813], "the checkpoint keeps CLIP's tokenizer");
}

/// SigLIP fine-tuned with its own loss starts from its weights, scale and bias, and its
/// SentencePiece tokenizer travels with the checkpoint.
#[test]
fn training_starts_from_a_siglip_model_with_the_sigmoid_loss() {
    let (_dir, s) = fine_tune("siglip-tiny", &["loss.kind=\"sigmoid\""]);
    let s = s.unwrap();
    let m = load_model(&s.checkpoint, &Device::Cpu).unwrap();
    let io = io("siglip-tiny");
    let img = m.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    let d = max_diff(&img, &io["image_embeds_normalised"]);
    assert!(d <= 1e-5, "image embeddings of the fine-tuned checkpoint differ by {d}");
    let bias = m.model.logit_bias().unwrap().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(bias, io["logit_bias"].flatten_all().unwrap().to_vec1::<f32>().unwrap()[0]);
    let e = &expected()["models"]["siglip-tiny"];
    let first = e["captions"][0].as_str().unwrap();
    let ids = m.tokenizer.encode_batch(&[first]).unwrap().ids;
    let want = io["input_ids"].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    assert_eq!(ids, want[0], "the checkpoint keeps SigLIP's tokenizer");
}

/// `align export` of a CLIP model writes a CLIPModel directory that loads back with the same
/// embeddings, tokenizer and preprocessing (`scripts/make_tower_fixtures.py --check DIR --like
/// clip-tiny` loads it in transformers, pipeline included).
#[test]
fn an_exported_clip_model_loads_back_the_same() {
    let m = load_model(&towers().join("clip-tiny"), &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("clip");
    align::io::registry::export::export(&m.files().unwrap(), align::io::registry::named("CLIPModel").unwrap(), &out, false).unwrap();
    let back = load_model(&out, &Device::Cpu).unwrap();
    assert_eq!(back.model.spec, m.model.spec);
    assert_eq!(back.usage.image, m.usage.image);
    let io = io("clip-tiny");
    let img = back.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    assert!(max_diff(&img, &io["image_embeds_normalised"]) <= 1e-5);
    let captions = ["a photo of a cat", "Two DOGS & a café!"];
    assert_eq!(back.tokenizer.encode_batch(&captions).unwrap(), m.tokenizer.encode_batch(&captions).unwrap());
}

/// `align export` of a SigLIP model: a SiglipModel directory (scale and bias as `[1]`, a
/// tokenizer that returns no mask) that loads back the same (`scripts/make_tower_fixtures.py
/// --check DIR --like siglip-tiny` loads it in transformers, pipeline included).
#[test]
fn an_exported_siglip_model_loads_back_the_same() {
    let m = load_model(&towers().join("siglip-tiny"), &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("siglip");
    align::io::registry::export::export(&m.files().unwrap(), align::io::registry::named("SiglipModel").unwrap(), &out, false).unwrap();
    let w = read_tensors(&out.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!((w["logit_scale"].dims(), w["logit_bias"].dims()), (&[1usize][..], &[1usize][..]));
    let tc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(tc["model_input_names"], serde_json::json!(["input_ids"]));
    let back = load_model(&out, &Device::Cpu).unwrap();
    assert_eq!(back.model.spec, m.model.spec);
    let io = io("siglip-tiny");
    let img = back.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    assert!(max_diff(&img, &io["image_embeds_normalised"]) <= 1e-5);
    let captions = ["a photo of a cat", "Two DOGS & a café!"];
    assert_eq!(back.tokenizer.encode_batch(&captions).unwrap(), m.tokenizer.encode_batch(&captions).unwrap());
}

/// A `VisionTextDualEncoderModel` (ViT + BERT, each pooled by its tanh pooler) loads with
/// transformers' embeddings, tokenizer and preprocessing, and exports back to one.
#[test]
fn vision_text_dual_encoder_matches_transformers_and_exports_back() {
    let m = load_model(&towers().join("vtde-tiny"), &Device::Cpu).unwrap();
    let io = io("vtde-tiny");
    let img = m.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    let d = max_diff(&img, &io["image_embeds_normalised"]);
    assert!(d <= 1e-5, "image embeddings differ by {d}");
    let txt = m.model.text_embeddings(&u32s(&io["input_ids"]), &u32s(&io["attention_mask"])).unwrap();
    let d = max_diff(&txt, &io["text_embeds_normalised"]);
    assert!(d <= 1e-5, "text embeddings differ by {d}");
    assert_files_embed_as_in_transformers(&m, &io, "vtde-tiny");
    let e = &expected()["models"]["vtde-tiny"];
    let captions: Vec<String> = e["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let batch = m.tokenizer.encode_batch(&captions).unwrap();
    let want = io["input_ids"].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    let width = want[0].len();
    for (i, c) in captions.iter().enumerate() {
        assert_eq!(&batch.ids[i * batch.max_len..i * batch.max_len + width], &want[i][..], "ids of {c:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("vtde");
    align::io::registry::export::export(
        &m.files().unwrap(),
        align::io::registry::named("VisionTextDualEncoderModel").unwrap(),
        &out,
        false,
    )
    .unwrap();
    let back = load_model(&out, &Device::Cpu).unwrap();
    assert_eq!(back.model.spec, m.model.spec);
    assert_eq!(back.usage.image, m.usage.image);
    let again = back.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    assert_eq!(max_diff(&again, &img), 0.0);
    // An ALIGN-style ViT + BERT (raw [CLS] states, a biased text projection) has no such layout.
    let mut spec = m.model.spec.clone();
    spec.text_pooling = align::model::presets::TextPooling::Cls;
    let e = align::io::format::hf::vtde::vtde_spec_to_hf(&spec).unwrap_err();
    assert!(e.contains("model.text_pooling = \"pooler\""), "{e}");
}

/// A model loaded to be used (evaluate, embed, search, score) holds plain tensors, not
/// variables, so its forward pass records no graph: nothing keeps a batch's activations alive
/// past their use. A model built on variables, as training builds it, does record one.
#[test]
fn a_loaded_model_records_no_graph() {
    let m = load_model(&towers().join("clip-tiny"), &Device::Cpu).unwrap();
    assert!(m.weights.values().all(|t| !t.is_variable()));
    let io = io("clip-tiny");
    let img = m.model.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap();
    let txt = m.model.text_embeddings(&u32s(&io["input_ids"]), &u32s(&io["attention_mask"])).unwrap();
    assert!(!img.track_op() && !txt.track_op(), "the forward-only path recorded a graph");
    let vm = candle_nn::VarMap::new();
    let trained =
        align::model::dual_encoder::DualEncoder::new(&m.model.spec, align::model::init::SeededVars::builder(&vm, 0, &Device::Cpu)).unwrap();
    assert!(trained.image_embeddings(&io["pixel_values"], &align::model::Ctx::EVAL).unwrap().track_op());
}
