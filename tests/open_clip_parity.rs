//! open_clip's own format against open_clip 3.3 itself, on tiny models its own code made and saved
//! (`scripts/make_open_clip_fixtures.py`): a native CLIP with quick-GELU in the hub's config form
//! (safetensors, no tokenizer files: open_clip's SimpleTokenizer, whose cleaning align
//! reproduces), one with exact GELU saved only as the PyTorch pickle with squash resizing, and a
//! CustomTextCLIP with SigLIP-style text (`text.*`, no causal mask, last-token pooling, a
//! projection bias, a logit bias) and the Hugging Face tokenizer its folder holds. Embeddings to
//! 1e-5 from open_clip's pixels and ids, the ids exactly, and the image files through the
//! checkpoint's own preprocessing to cosine 0.999. Then round trips: every format align writes
//! loads back with identical embeddings.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use align::io::load::{load_model, LoadedModel};
use align::io::registry::{export::export, named};
use align::io::tensors::read_tensors;
use align::model::Ctx;
use candle_core::{DType, Device, Tensor};
use common::max_diff;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn expected() -> serde_json::Value {
    json_fixture("open_clip/expected.json")
}

fn json_fixture(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(name)).unwrap()).unwrap()
}

fn io(name: &str) -> HashMap<String, Tensor> {
    read_tensors(&fixtures().join(format!("open_clip/{name}-io.safetensors")), &Device::Cpu).unwrap()
}

fn normalised(t: &Tensor) -> Tensor {
    t.broadcast_div(&t.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap()).unwrap()
}

/// The text embeddings of the fixture's token ids (open_clip attends to no mask).
fn text_of(m: &LoadedModel, ids: &Tensor) -> Tensor {
    let ids = ids.to_dtype(DType::U32).unwrap();
    m.model.text_embeddings(&ids, &ids.ones_like().unwrap()).unwrap()
}

fn check(name: &str) {
    check_against(name, &expected());
}

fn check_against(name: &str, expected: &serde_json::Value) {
    let m = load_model(&fixtures().join("open_clip").join(name), &Device::Cpu).unwrap();
    assert_eq!(m.format.name(), "open_clip");
    let io = io(name);
    let img = m.model.image_embeddings(&io["pixel_values"], &Ctx::EVAL).unwrap();
    let d = max_diff(&img, &normalised(&io["image_features"]));
    assert!(d <= 1e-5, "{name}: image embeddings differ by {d}");
    let txt = text_of(&m, &io["input_ids"]);
    let d = max_diff(&txt, &normalised(&io["text_features"]));
    assert!(d <= 1e-5, "{name}: text embeddings differ by {d}");
    let scale = m.model.logit_scale().unwrap().to_scalar::<f32>().unwrap();
    let want = io["logit_scale"].flatten_all().unwrap().to_vec1::<f32>().unwrap()[0].exp();
    assert!((scale - want).abs() < 1e-4 * want, "{name}: logit scale {scale} vs {want}");

    let e = &expected["models"][name];
    let captions: Vec<String> = e["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let batch = m.tokenizer.encode_batch(&captions).unwrap();
    let want_ids = io["input_ids"].to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
    let width = want_ids[0].len();
    assert_eq!(batch.max_len, width, "{name}: context length");
    for (i, c) in captions.iter().enumerate() {
        assert_eq!(&batch.ids[i * width..(i + 1) * width], &want_ids[i][..], "{name}: ids of {c:?}");
    }

    let images: Vec<String> = expected["images"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    let files: Vec<PathBuf> = images.iter().map(|n| fixtures().join(n)).collect();
    let cosines = common::file_cosines(&m, &files, &io["jpeg_image_features"].to_vec2::<f32>().unwrap());
    for (n, c) in images.iter().zip(cosines) {
        assert!(c >= 0.999, "{name}: {n}: cosine {c} with open_clip's embedding of the file");
    }
}

#[test]
fn a_native_clip_in_the_hubs_form_matches_open_clip() {
    check("clip-native");
}

#[test]
fn a_native_clip_saved_as_a_pytorch_pickle_matches_open_clip() {
    check("clip-native-bin");
}

#[test]
fn a_custom_text_clip_with_a_logit_bias_matches_open_clip() {
    check("custom-text");
    let m = load_model(&fixtures().join("open_clip/custom-text"), &Device::Cpu).unwrap();
    let bias = m.model.logit_bias().unwrap().unwrap().to_scalar::<f32>().unwrap();
    let want = io("custom-text")["logit_bias"].flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
    assert!((bias - want).abs() < 1e-6, "{bias} vs {want}");
    assert_eq!(m.usage.loss, align::config::LossKind::Sigmoid);
}

/// transformers' CLIP has a LayerNorm before its encoder and pools the class token: a CLIPA
/// tower is refused, naming what differs, rather than exported to behave differently.
#[test]
fn a_clipa_tower_is_not_exported_as_a_clip_model() {
    let m = load_model(&fixtures().join("open_clip/clipa"), &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let e = export(&m.files().unwrap(), named("CLIPModel").unwrap(), &dir.path().join("out"), false).unwrap_err();
    assert!(format!("{e:#}").contains("no_ln_pre or average pooling"), "{e:#}");
}

/// A CLIPA-style tower (scripts/make_zoo_fixtures.py): no `ln_pre`, the patch tokens averaged
/// and then normalised (`final_ln_after_pool`), a bidirectional text tower pooled at its last
/// position, which attends to its padding, and BERT ids whose `[SEP]` open_clip turns into 0.
#[test]
fn a_clipa_tower_matches_open_clip() {
    check_against("clipa", &json_fixture("open_clip/zoo-expected.json"));
    let m = load_model(&fixtures().join("open_clip/clipa"), &Device::Cpu).unwrap();
    assert!(!m.model.spec.text.masks_padding(), "a bidirectional tower pooled at its last position sees its padding");
}

/// open_clip's SigLIP 2 form (`ViT-B-16-SigLIP2`'s config at toy size): a timm ViT trunk
/// (`visual.trunk.*`, no class token, a MAP head, no projection), SigLIP-style text cleaned by
/// canonicalisation and tokenised by the folder's SentencePiece-like tokenizer, a logit bias.
/// The trunk's name is not one of timm's SigLIP sizes, so its sizes come from its weights.
#[test]
fn a_timm_trunk_siglip_matches_open_clip() {
    check_against("timm-siglip", &json_fixture("open_clip/zoo-expected.json"));
    let m = load_model(&fixtures().join("open_clip/timm-siglip"), &Device::Cpu).unwrap();
    assert_eq!(m.usage.loss, align::config::LossKind::Sigmoid);
    let bias = m.model.logit_bias().unwrap().unwrap().to_scalar::<f32>().unwrap();
    let want = io("timm-siglip")["logit_bias"].flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
    assert!((bias - want).abs() < 1e-6, "{bias} vs {want}");
}

/// LAION's multilingual form (`xlm-roberta-base-ViT-B-32` at toy size): an XLM-RoBERTa text
/// tower (`text.transformer.*`, RoBERTa's positions from the padding id, padding found by its id
/// and left out of attention and the mean), open_clip's MLP projection, and the folder's
/// SentencePiece tokenizer, on captions in seven scripts.
#[test]
fn an_xlm_roberta_text_tower_matches_open_clip() {
    check_against("xlmr", &json_fixture("open_clip/zoo-expected.json"));
    let m = load_model(&fixtures().join("open_clip/xlmr"), &Device::Cpu).unwrap();
    assert_eq!(m.spec().text_projection_hidden, Some(24));
    assert_eq!(m.spec().text.bert().and_then(|b| b.pad_token_id), Some(1));
}

/// Awkward captions (ligatures, full-width and half-width forms, HTML entities, curly quotes,
/// emoji, non-Latin scripts, control characters) tokenised as open_clip 3.3's SimpleTokenizer
/// does in each of its cleaning modes, and embedded as open_clip embeds them.
#[test]
fn awkward_captions_are_cleaned_and_embedded_as_open_clip_does() {
    use align::data::clip_bpe::{open_clip_simple, Clean};
    use align::data::tokenizer::TextTokenizer;
    let c = json_fixture("open_clip/captions.json");
    let captions: Vec<String> = c["captions"].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect();
    let len = c["context_length"].as_u64().unwrap() as usize;
    for clean in Clean::ALL {
        let inner = open_clip_simple(clean).unwrap();
        let pad = inner.id_to_token(0).unwrap();
        let t = TextTokenizer::with_pad_token(inner, len, &pad).unwrap();
        assert_eq!(t.clean(), Some(clean));
        let want = c["ids"][clean.name()].as_array().unwrap();
        for (caption, want) in captions.iter().zip(want) {
            let want: Vec<u32> = want.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(t.encode_batch(&[caption]).unwrap().ids, want, "{clean:?}: {caption:?}");
        }
    }

    let m = load_model(&fixtures().join("open_clip/clip-native"), &Device::Cpu).unwrap();
    let io = read_tensors(&fixtures().join("open_clip/captions-io.safetensors"), &Device::Cpu).unwrap();
    let want_ids = io["input_ids"].to_dtype(DType::U32).unwrap();
    let batch = m.tokenizer.encode_batch(&captions).unwrap();
    assert_eq!(batch.ids, want_ids.flatten_all().unwrap().to_vec1::<u32>().unwrap());
    let d = max_diff(&text_of(&m, &want_ids), &normalised(&io["text_features"]));
    assert!(d <= 1e-5, "text embeddings differ by {d}");
}

/// Embeddings of the same pixels and ids by two loaded models.
fn same_embeddings(a: &LoadedModel, b: &LoadedModel, pixels: &Tensor, ids: &Tensor) {
    let (ia, ib) = (a.model.image_embeddings(pixels, &Ctx::EVAL).unwrap(), b.model.image_embeddings(pixels, &Ctx::EVAL).unwrap());
    assert_eq!(max_diff(&ia, &ib), 0.0, "image embeddings");
    assert_eq!(max_diff(&text_of(a, ids), &text_of(b, ids)), 0.0, "text embeddings");
    let scale = |m: &LoadedModel| m.model.logit_scale().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(scale(a), scale(b));
}

/// load → export → load gives identical embeddings, ids and preprocessing, for each format that
/// can hold the model.
#[test]
fn every_format_round_trips_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("open_clip/clip-native", "open_clip"),
        ("open_clip/clip-native", "CLIPModel"),
        ("open_clip/clip-native-bin", "open_clip"),
        ("open_clip/clipa", "open_clip"),
        ("towers/clip-tiny", "open_clip"),
        ("towers/clip-tiny", "CLIPModel"),
        ("towers/siglip-tiny", "SiglipModel"),
        ("towers/vtde-tiny", "VisionTextDualEncoderModel"),
        ("hf/align-tiny", "AlignModel"),
    ];
    for (i, (from, format)) in cases.into_iter().enumerate() {
        let m = load_model(&fixtures().join(from), &Device::Cpu).unwrap();
        let out = dir.path().join(format!("{i}-{format}"));
        export(&m.files().unwrap(), named(format).unwrap(), &out, false).unwrap_or_else(|e| panic!("{from} as {format}: {e:#}"));
        let back = load_model(&out, &Device::Cpu).unwrap();
        assert_eq!(back.format.name(), format, "{from}");
        let size = m.spec().image.image_size();
        let pixels = align::util::rng::randn(7, 0.0, 1.0, (2, 3, size, size), DType::F32, &Device::Cpu).unwrap();
        let captions = ["a photo of a red car", "Two DOGS and a Café, in the park!"];
        let batch = m.tokenizer.encode_batch(&captions).unwrap();
        // The tokens themselves; the padding id is each format's convention (open_clip pads CLIP's
        // ids with 0, transformers with <|endoftext|>), which CLIP's causal text tower never sees.
        let tokens = |b: &align::data::tokenizer::TokenBatch| -> Vec<u32> {
            b.ids.iter().zip(&b.mask).filter(|(_, m)| **m == 1).map(|(i, _)| *i).collect()
        };
        assert_eq!(tokens(&back.tokenizer.encode_batch(&captions).unwrap()), tokens(&batch), "{from} as {format}: ids");
        let ids = Tensor::from_vec(batch.ids.clone(), (2, batch.max_len), &Device::Cpu).unwrap();
        same_embeddings(&m, &back, &pixels, &ids);
        let (a, b) = (&m.usage.image, &back.usage.image);
        assert_eq!(
            (a.image_size, a.resize, a.resize_mode, a.interpolation),
            (b.image_size, b.resize, b.resize_mode, b.interpolation),
            "{from} as {format}"
        );
        for c in 0..3 {
            assert!((a.mean[c] - b.mean[c]).abs() < 1e-6 && (a.std[c] - b.std[c]).abs() < 1e-6, "{from} as {format}: mean/std");
        }
    }
}

/// What open_clip refuses in a config (unknown keys are a TypeError there) never reaches its
/// `model_cfg`: only its own keys are written.
#[test]
fn the_open_clip_export_writes_only_open_clips_keys() {
    let dir = tempfile::tempdir().unwrap();
    let m = load_model(&fixtures().join("towers/clip-tiny"), &Device::Cpu).unwrap();
    let out = dir.path().join("oc");
    export(&m.files().unwrap(), named("open_clip").unwrap(), &out, false).unwrap();
    let c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("open_clip_config.json")).unwrap()).unwrap();
    let allowed = |v: &serde_json::Value, keys: &[&str]| v.as_object().unwrap().keys().all(|k| keys.contains(&k.as_str()));
    let mc = &c["model_cfg"];
    assert!(allowed(mc, &["embed_dim", "quick_gelu", "init_logit_scale", "vision_cfg", "text_cfg"]), "{mc}");
    assert!(allowed(&mc["vision_cfg"], &["image_size", "patch_size", "width", "layers", "head_width", "mlp_ratio", "norm_kwargs"]));
    let text =
        ["context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio", "norm_kwargs", "hf_tokenizer_name", "tokenizer_kwargs"];
    assert!(allowed(&mc["text_cfg"], &text), "{}", mc["text_cfg"]);
    // Not CLIP's full vocabulary: the folder carries the tokenizer open_clip then reads.
    assert!(out.join("tokenizer.json").is_file() && mc["text_cfg"]["hf_tokenizer_name"].is_string());
    // CLIP's own vocabulary needs no files: SimpleTokenizer has it.
    let native = load_model(&fixtures().join("open_clip/clip-native"), &Device::Cpu).unwrap();
    let out = dir.path().join("native");
    export(&native.files().unwrap(), named("open_clip").unwrap(), &out, false).unwrap();
    assert!(!out.join("tokenizer.json").exists());
}

/// A checkpoint saved from DistributedDataParallel (`module.` before every key) in safetensors
/// reads as open_clip reads it: the same model as the plain file.
#[test]
fn ddp_module_keys_in_safetensors_are_read_as_open_clip_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("open_clip/clip-native");
    let ddp = dir.path().join("ddp");
    std::fs::create_dir(&ddp).unwrap();
    std::fs::copy(src.join("open_clip_config.json"), ddp.join("open_clip_config.json")).unwrap();
    let plain = read_tensors(&src.join("open_clip_model.safetensors"), &Device::Cpu).unwrap();
    let prefixed: HashMap<String, Tensor> = plain.into_iter().map(|(k, t)| (format!("module.{k}"), t)).collect();
    align::io::tensors::write_tensors(&prefixed, &ddp.join("open_clip_model.safetensors")).unwrap();
    let (a, b) = (load_model(&src, &Device::Cpu).unwrap(), load_model(&ddp, &Device::Cpu).unwrap());
    let pixels = Tensor::randn(0f32, 1.0, (2, 3, a.spec().image.image_size(), a.spec().image.image_size()), &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[49406u32, 320, 1929, 49407]], &Device::Cpu).unwrap();
    same_embeddings(&a, &b, &pixels, &ids);
}

/// open_clip's own training checkpoint (`epoch_N.pt`: a dict with `state_dict` under
/// DistributedDataParallel's `module.` keys, beside the model's open_clip_config.json), named as
/// a file, is the same model as the exported weights it was saved from
/// (`scripts/make_open_clip_epoch_fixture.py`).
#[test]
fn an_open_clip_training_checkpoint_file_reads_as_its_model() {
    let bin = load_model(&fixtures().join("open_clip/clip-native-bin"), &Device::Cpu).unwrap();
    let epoch = load_model(&fixtures().join("open_clip/clip-native-epoch/epoch_3.pt"), &Device::Cpu).unwrap();
    assert_eq!(epoch.format.name(), "open_clip");
    let pixels = Tensor::randn(0f32, 1.0, (2, 3, bin.spec().image.image_size(), bin.spec().image.image_size()), &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[49406u32, 320, 1929, 49407]], &Device::Cpu).unwrap();
    same_embeddings(&bin, &epoch, &pixels, &ids);
    // Without the config beside it, the error says what to put there.
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("epoch_3.pt");
    std::fs::copy(fixtures().join("open_clip/clip-native-epoch/epoch_3.pt"), &alone).unwrap();
    let e = format!("{:#}", load_model(&alone, &Device::Cpu).err().unwrap());
    assert!(e.contains("open_clip_config.json") && e.contains("epoch_N.pt"), "{e}");
}
