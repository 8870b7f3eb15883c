//! SigLIP checkpoints against transformers 5.24 as a user runs them (`processor(text, images,
//! padding="max_length")` then `model(**inputs)`), on tiny models its own code saved
//! (`scripts/make_siglip2_fixtures.py`): a fixed-resolution SigLIP 2 with a Gemma byte-fallback
//! BPE `tokenizer.json` whose config returns no attention mask, and a SigLIP whose tokenizer
//! config (as transformers 5 saves it) names none, so the class's default, a mask, applies and
//! the model hides the padding. Ids and masks exactly, embeddings to 1e-5 from the processor's
//! pixels, and the awkward image files (tiny, 4:1, 1:4, greyscale, CMYK, alpha) through the
//! checkpoint's own preprocessing to cosine 0.999. Export keeps the behaviour.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use align::data::transform::Alpha;
use align::io::load::{load_model, LoadedModel};
use align::io::registry::{export::export, named};
use align::io::tensors::read_tensors;
use align::model::dual_encoder::TextSpec;
use align::model::Ctx;
use candle_core::{DType, Device, Tensor};
use common::max_diff;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn normalised(t: &Tensor) -> Tensor {
    t.broadcast_div(&t.sqr().unwrap().sum_keepdim(1).unwrap().sqrt().unwrap()).unwrap()
}

fn masked(m: &LoadedModel) -> bool {
    matches!(&m.spec().text, TextSpec::Siglip(t) if t.masked)
}

/// Embeddings of the image files: every file read as transformers' pipelines read it, except a
/// transparent one, which the fixtures hand to the processor as it is (composited over white,
/// align's `data.image.alpha = "white"`).
fn file_cosines(m: &mut LoadedModel, images: &[String], want: &[Vec<f32>]) -> Vec<f64> {
    images
        .iter()
        .zip(want)
        .map(|(n, w)| {
            let white = n.contains("rgba") && m.usage.image.naflex.is_none();
            m.usage.image.alpha = if white { Alpha::White } else { Alpha::Drop };
            let c = common::file_cosines(m, &[fixtures().join(n)], std::slice::from_ref(w))[0];
            m.usage.image.alpha = Alpha::Drop;
            c
        })
        .collect()
}

fn check(name: &str, want_mask: bool) -> LoadedModel {
    let e: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join(format!("siglip2/{name}.json"))).unwrap()).unwrap();
    let io: HashMap<String, Tensor> = read_tensors(&fixtures().join(format!("siglip2/{name}-io.safetensors")), &Device::Cpu).unwrap();
    let mut m = load_model(&fixtures().join("siglip2").join(name), &Device::Cpu).unwrap();
    assert_eq!((m.format.name(), masked(&m)), ("SiglipModel", want_mask), "{name}");

    let captions: Vec<String> = e["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let batch = m.tokenizer.encode_batch(&captions).unwrap();
    let want_ids = io["input_ids"].to_dtype(DType::U32).unwrap();
    assert_eq!(batch.max_len, want_ids.dim(1).unwrap(), "{name}: length");
    let rows = want_ids.to_vec2::<u32>().unwrap();
    for (i, c) in captions.iter().enumerate() {
        assert_eq!(&batch.ids[i * batch.max_len..(i + 1) * batch.max_len], &rows[i][..], "{name}: ids of {c:?}");
    }
    let mask = match io.get("attention_mask") {
        Some(t) => {
            let t = t.to_dtype(DType::U32).unwrap();
            assert_eq!(batch.mask, t.flatten_all().unwrap().to_vec1::<u32>().unwrap(), "{name}: the attention mask");
            t
        }
        None => want_ids.ones_like().unwrap(),
    };
    let txt = m.model.text_embeddings(&want_ids, &mask).unwrap();
    let d = max_diff(&txt, &normalised(&io["text_features"]));
    assert!(d <= 1e-5, "{name}: text embeddings differ by {d}");
    let img = m.model.image_embeddings(&io["pixel_values"], &Ctx::EVAL).unwrap();
    let d = max_diff(&img, &normalised(&io["image_features"]));
    assert!(d <= 1e-5, "{name}: image embeddings differ by {d}");

    let images: Vec<String> = e["images"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    let want: Vec<Vec<f32>> =
        images.iter().map(|n| io[&format!("file/{n}/image_features")].flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
    for (n, c) in images.iter().zip(file_cosines(&mut m, &images, &want)) {
        assert!(c >= 0.999, "{name}: {n}: cosine {c} with transformers' embedding of the file");
    }
    m
}

#[test]
fn a_fixed_resolution_siglip2_with_gemmas_tokenizer_matches_transformers() {
    check("fixed", false);
}

#[test]
fn a_siglip_whose_tokenizer_returns_a_mask_is_masked_as_transformers_masks_it() {
    let m = check("legacy-mask", true);
    // The mask matters: transformers' embeddings without it differ.
    let io = read_tensors(&fixtures().join("siglip2/legacy-mask-io.safetensors"), &Device::Cpu).unwrap();
    assert!(max_diff(&io["text_features"], &io["text_features_no_mask"]) > 1e-3);

    // The exported folder tells transformers to return the mask, and reads back masked.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    export(&m.files().unwrap(), named("SiglipModel").unwrap(), &out, false).unwrap();
    let back = load_model(&out, &Device::Cpu).unwrap();
    assert!(masked(&back));
    let names = serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap()).unwrap()
        ["model_input_names"]
        .clone();
    assert_eq!(names, serde_json::json!(["input_ids", "attention_mask"]));
    let captions = ["a dog", "Two CATS on a sofa, sleeping"];
    let (a, b) = (m.tokenizer.encode_batch(&captions).unwrap(), back.tokenizer.encode_batch(&captions).unwrap());
    assert_eq!((&a.ids, &a.mask), (&b.ids, &b.mask));
    let ids = Tensor::from_vec(a.ids.clone(), (2, a.max_len), &Device::Cpu).unwrap();
    let mask = Tensor::from_vec(a.mask.clone(), (2, a.max_len), &Device::Cpu).unwrap();
    assert_eq!(max_diff(&m.model.text_embeddings(&ids, &mask).unwrap(), &back.model.text_embeddings(&ids, &mask).unwrap()), 0.0);
}

/// A `Siglip2Model` (NaFlex) as transformers 5.24 runs it: each image resized to keep its aspect
/// ratio within the processor's patch budget (the grid sizes of every file at 16, 64 and 256
/// patches exactly), the position grid resized to it, padding masked in the encoder and the
/// pooling head; the text lower-cased as `Siglip2Processor`'s tokenizer does.
#[test]
fn a_naflex_siglip2_matches_transformers() {
    let e: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("siglip2/naflex.json")).unwrap()).unwrap();
    let io: HashMap<String, Tensor> = read_tensors(&fixtures().join("siglip2/naflex-io.safetensors"), &Device::Cpu).unwrap();
    let mut m = load_model(&fixtures().join("siglip2/naflex"), &Device::Cpu).unwrap();
    assert_eq!(m.format.name(), "Siglip2Model");

    for (file, budgets) in e["spatial_shapes"].as_object().unwrap() {
        let img = image::open(fixtures().join(file)).unwrap();
        for (budget, want) in budgets.as_object().unwrap() {
            let n = align::data::transform::Naflex { patch_size: 4, max_num_patches: budget.parse().unwrap() };
            let (h, w) = n.size_for(img.height(), img.width());
            let want: Vec<u32> = serde_json::from_value(want.clone()).unwrap();
            assert_eq!(vec![h / 4, w / 4], want, "{file} at {budget} patches");
        }
    }

    let captions: Vec<String> = e["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let batch = m.tokenizer.encode_batch(&captions).unwrap();
    let want_ids = io["input_ids"].to_dtype(DType::U32).unwrap();
    assert_eq!(batch.ids, want_ids.flatten_all().unwrap().to_vec1::<u32>().unwrap(), "ids");
    let txt = m.model.text_embeddings(&want_ids, &want_ids.ones_like().unwrap()).unwrap();
    let d = max_diff(&txt, &normalised(&io["text_features"]));
    assert!(d <= 1e-5, "text embeddings differ by {d}");

    // The processor's own patches and grids, as align's image rows.
    let (pixels, shapes) = (&io["pixel_values"], io["spatial_shapes"].to_dtype(DType::F32).unwrap());
    let b = pixels.dim(0).unwrap();
    let rows = Tensor::cat(&[&pixels.reshape((b, ())).unwrap(), &shapes], 1).unwrap();
    let img = m.model.image_embeddings(&rows, &Ctx::EVAL).unwrap();
    let d = max_diff(&img, &normalised(&io["image_features"]));
    assert!(d <= 1e-5, "image embeddings differ by {d}");

    let images: Vec<String> = e["images"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_string()).collect();
    let want: Vec<Vec<f32>> =
        images.iter().map(|n| io[&format!("file/{n}/max64/image_features")].flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
    for (n, c) in images.iter().zip(file_cosines(&mut m, &images, &want)) {
        assert!(c >= 0.999, "{n}: cosine {c} with transformers' embedding of the file");
    }

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    export(&m.files().unwrap(), named("Siglip2Model").unwrap(), &out, false).unwrap();
    let back = load_model(&out, &Device::Cpu).unwrap();
    assert_eq!(back.usage.image, m.usage.image);
    assert_eq!(back.tokenizer.encode_batch(&captions).unwrap().ids, batch.ids);
    assert_eq!(max_diff(&back.model.image_embeddings(&rows, &Ctx::EVAL).unwrap(), &img), 0.0);
    assert_eq!(max_diff(&back.model.text_embeddings(&want_ids, &want_ids.ones_like().unwrap()).unwrap(), &txt), 0.0);
}
